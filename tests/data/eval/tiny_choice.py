"""The data of tiny_choice.yaml's task: the JSONL beside this file, wherever the task is run from."""

import os

HERE = os.path.dirname(os.path.abspath(__file__))


def beside_this_file(**_task_metadata):
    """lm-eval calls a task's `custom_dataset` with its metadata and dataset keywords; none matter here."""
    import datasets

    return datasets.load_dataset("json", data_files={"validation": os.path.join(HERE, "tiny_choice.jsonl")})
