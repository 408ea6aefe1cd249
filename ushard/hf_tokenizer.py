"""What a Hugging Face export writes beside the weights, from the tokenizer the model was trained with
(`data.tokenizer` of its run): the tokenizer's files, the special-token ids that config.json and
generation_config.json carry, so that `transformers` loads a model that generates and stops as
ushard's does.

- A Hugging Face tokenizer (a tokenizer.json, or a directory holding one): its files are copied
  (tokenizer.json and those beside it that `AutoTokenizer` reads: tokenizer_config.json with its
  chat template, special_tokens_map.json, chat_template.jinja, ...). Generation stops at the token
  ushard ends documents with and at tokenizer_config.json's `eos_token` where that is another one
  (a chat model's end of turn); `bos_token_id` is tokenizer_config.json's `bos_token`, where set.
- The byte tokenizer: token i is byte i and 256 ends a document; transformers has no tokenizer file
  for it, so only the ids are written.
- Unknown (a model imported from Hugging Face, or built in Python): nothing beside the weights, and a
  note saying where to copy the files from.
"""

from __future__ import annotations

import json
import os
import shutil

from ushard.data.tokenizer import ByteTokenizer, HFTokenizer, special_token_text, tokenizer_file
from ushard.errors import UserError

# The files beside a tokenizer.json that transformers' AutoTokenizer reads, where they exist.
TOKENIZER_FILES = ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "chat_template.jinja",
                   "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt")


def beside_weights(name: str | None, directory: str, log=print) -> tuple[dict, list[str]]:
    """What an export into `directory` carries of the tokenizer `name`: ({"bos_token_id": ...,
    "eos_token_id": ...} for config.json and generation_config.json, an id or a list of ids, keys left
    out where unknown; the tokenizer files to copy there), with a note where it carries nothing."""
    if name is None:
        log("note: the model's tokenizer is unknown (it was not trained by a ushard run): copy its tokenizer files "
            f"into {directory} from where the model came from.")
        return {}, []
    if name == "byte":
        return {"eos_token_id": ByteTokenizer.eos_id}, []
    try:
        tokenizer = HFTokenizer(tokenizer_file(name))
    except UserError as e:  # the run's tokenizer moved since: the weights are exported all the same
        log(f"note: no tokenizer files or special-token ids exported: {e}")
        return {}, []
    folder = os.path.dirname(tokenizer.path)
    config = _tokenizer_config(folder)
    ids = {}
    bos = _token_id(tokenizer, config.get("bos_token"))
    if bos is not None:
        ids["bos_token_id"] = bos
    turn_end = _token_id(tokenizer, config.get("eos_token"))
    ids["eos_token_id"] = tokenizer.eos_id if turn_end in (None, tokenizer.eos_id) else [tokenizer.eos_id, turn_end]
    files = [tokenizer.path] + [os.path.join(folder, f) for f in TOKENIZER_FILES
                                if os.path.isfile(os.path.join(folder, f))]
    return ids, files


def write_beside_weights(directory: str, ids: dict, files: list[str]) -> None:
    """`beside_weights`' findings in `directory`: the tokenizer's files (tokenizer.json under that name
    whatever its own) and generation_config.json."""
    for index, source in enumerate(files):
        shutil.copyfile(source, os.path.join(directory, "tokenizer.json" if index == 0 else os.path.basename(source)))
    if ids:
        with open(os.path.join(directory, "generation_config.json"), "w") as f:
            json.dump(ids, f, indent=2)
            f.write("\n")


def _tokenizer_config(directory: str) -> dict:
    path = os.path.join(directory, "tokenizer_config.json")
    if not os.path.isfile(path):
        return {}
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return {}  # AutoTokenizer would refuse it too; the ids ushard itself uses still go out


def _token_id(tokenizer: HFTokenizer, token) -> int | None:
    """The id of a tokenizer_config.json special token, None where it names none."""
    text = special_token_text(token)
    return None if text is None else tokenizer.token_id(text)
