"""notebooks/: each notebook's code cells run in order, as a kernel would run them, and what they print
and compute is checked. (Executed in this process: its 8 simulated CPU devices are the notebooks'.)"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil

import numpy as np
import pytest

NOTEBOOKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "notebooks")


def run_notebook(name: str) -> tuple[dict, list[str]]:
    """(the namespace after the last cell, what each code cell printed)."""
    with open(os.path.join(NOTEBOOKS, name), encoding="utf-8") as f:
        notebook = json.load(f)
    namespace, printed = {"__name__": "__main__"}, []
    for index, cell in enumerate(notebook["cells"]):
        if cell["cell_type"] != "code":
            continue
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile("".join(cell["source"]), f"{name} cell {index}", "exec"), namespace)  # noqa: S102
        printed.append(out.getvalue())
    return namespace, printed


def test_sharding_tour():
    ns, printed = run_notebook("sharding_tour.ipynb")
    text = "\n".join(printed)
    assert "8 devices: cpu" in printed[0]
    assert "mesh fsdp=4 x tensor=2, ZeRO-3" in text
    assert "('vocab', 'embed')" in text and "-> P('tensor', 'fsdp')" in text
    assert "embed (params) -> ('fsdp',)    embed (compute) -> ()" in text
    assert "│ CPU 0 │ CPU 2 │ CPU 4 │ CPU 6 │" in text  # the embedding's eight blocks
    memory = ns["memory"]
    # Each ZeRO stage divides one more term by about the fsdp size (8); norm scales stay whole.
    assert memory[0]["opt_state"] == pytest.approx(2 * memory[0]["params"], rel=1e-3)  # AdamW's two moments
    assert memory[1]["opt_state"] < memory[0]["opt_state"] / 7 and memory[1]["grads"] == memory[0]["grads"]
    assert memory[2]["grads"] < memory[1]["grads"] / 7 and memory[2]["params"] == memory[0]["params"]
    assert memory[3]["params"] < memory[2]["params"] / 7
    losses = [row["loss"] for row in ns["rows"]]
    assert len(losses) == 5 and np.isfinite(losses).all() and losses[-1] < losses[0] - 1.0


def test_finetune_from_hf():
    pytest.importorskip("transformers")  # the `hf` extra
    pytest.importorskip("lm_eval")  # the `eval` extra
    ns, printed = run_notebook("finetune_from_hf.ipynb")
    try:
        assert "'model.safetensors', 'tokenizer.json'" in printed[1]
        # imported: transformers' logits; fine-tuned: trained, and transformers' logits after the export
        assert np.abs(ns["ours"] - ns["theirs"]).max() <= 1e-4 * np.abs(ns["theirs"]).max()
        imported = np.asarray(ns["imported"](ns["tokens"]))
        assert np.abs(ns["ours"] - imported).max() > 1e-3
        losses = [row["loss"] for row in ns["rows"]]
        assert len(losses) == 6 and losses[-1] < losses[0] - 0.3
        # chat fine-tuning: the assistant's tokens only, a minority of each batch's targets
        assert "conversations used" in printed[4] and "training windows of 129 tokens" in printed[4]
        assert all(0 < row["loss_tokens"] < 16 * 128 / 2 for row in ns["rows"])
        # evaluation: perplexity on the held-out conversations, and the local lm-eval task
        assert "perplexity" in printed[5] and "from the run's held-out split" in printed[5]
        assert "|stdlib_modules|" in printed[5] and "|acc " in printed[5]
        assert "fine-tuned logits, ushard vs transformers: max relative difference" in printed[-1]
        # the export carries the run's tokenizer and stops generating at the chat turn's end
        assert "'tokenizer.json', 'tokenizer_config.json'" in printed[-1] and "generation stops at [" in printed[-1]
    finally:
        shutil.rmtree(ns["work"], ignore_errors=True)
