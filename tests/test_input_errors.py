"""User mistakes in config files, override keys, override dicts and JSONL data: one sentence, no traceback."""

from __future__ import annotations

import json

import numpy as np
import pytest

from helpers import source_documents
from ushard.config import apply_override_dict, apply_overrides, default_config, load_config
from ushard.errors import UserError


def _one_sentence(excinfo) -> str:
    """The message of a raised UserError, checked to be one line ending in a full stop."""
    message = str(excinfo.value)
    assert "\n" not in message, f"not one line: {message!r}"
    assert message.rstrip().endswith("."), f"not a sentence: {message!r}"
    return message


# --------------------------------------------------------------------------- get_config()

HEADER = "from ushard.config import default_config\n"


@pytest.mark.parametrize("body, expected", [
    ("def get_config():\n    raise ValueError('no such size')\n",
     "get_config() failed with ValueError: no such size."),
    ("def get_config():\n    return {}['missing']\n",
     "get_config() failed with KeyError: 'missing'."),
    ("def get_config():\n    raise RuntimeError('two\\nlines.')\n",
     "get_config() failed with RuntimeError: two lines."),
    ("def get_config():\n    c = default_config()\n",
     "get_config() returned NoneType, not a ConfigDict; start from ushard.config.default_config() and return it."),
    ("def get_config():\n    return {'train': {'steps': 5}}\n",
     "get_config() returned dict, not a ConfigDict; start from ushard.config.default_config() and return it."),
])
def test_get_config_that_fails_or_returns_no_config(tmp_path, body, expected):
    path = tmp_path / "cfg.py"
    path.write_text(HEADER + body)
    with pytest.raises(UserError) as excinfo:
        load_config(str(path))
    assert _one_sentence(excinfo) == f"config file {path}: {expected}"


def test_config_file_returning_a_config_still_loads(tmp_path):
    path = tmp_path / "cfg.py"
    path.write_text(HEADER + "def get_config():\n    c = default_config()\n    c.train.steps = 7\n    return c\n")
    assert load_config(str(path), {"train.seq_len": 64}).train.steps == 7


# --------------------------------------------------------------------------- near-miss keys


@pytest.mark.parametrize("override, expected", [
    ("train.step=5",
     "unknown config key 'train.step': train has no 'step' (did you mean 'steps'?); valid keys there: "),
    ("modle.d_model=3", "unknown config key 'modle.d_model': the config has no 'modle' (did you mean 'model'?); "
                        "valid keys there: checkpoint, data, mesh, metrics, model, optim, parallel, train."),
    ("model.remmat=full", "model has no 'remmat' (did you mean 'remat'?); valid keys there: attention_impl, "),
])
def test_near_miss_key_suggests_the_close_one(override, expected):
    with pytest.raises(UserError) as excinfo:
        apply_overrides(default_config(), [override])
    message = _one_sentence(excinfo)
    assert expected in message
    assert message.count("did you mean") == 1


def test_far_miss_key_lists_the_valid_keys_without_a_guess():
    with pytest.raises(UserError) as excinfo:
        apply_overrides(default_config(), ["train.xyzzy=5"])
    message = _one_sentence(excinfo)
    assert "did you mean" not in message
    assert message.startswith("unknown config key 'train.xyzzy': train has no 'xyzzy'; valid keys there: batch_size, ")
    assert ", steps, " in message and message.endswith(", wsd_decay.")


# --------------------------------------------------------------------------- override dicts


def test_dict_overrides_take_python_values_and_strings():
    c = default_config()
    apply_overrides(c, {"train.steps": 50, "model.remat": "full", "train.lr": 1, "model.tie_embeddings": True,
                        "train.warmup_steps": "7", "model.fused_mlp": "true", "optim.b1": np.float32(0.5),
                        "mesh.data": np.int64(2), "--config.train.seed": 3})
    assert (c.train.steps, type(c.train.steps)) == (50, int)
    assert c.model.remat == "full"
    assert (c.train.lr, type(c.train.lr)) == (1.0, float)  # an int for a float key
    assert c.model.tie_embeddings is True and c.model.fused_mlp is True
    assert c.train.warmup_steps == 7  # a string parses as on the command line
    assert (c.optim.b1, type(c.optim.b1)) == (0.5, float) and (c.mesh.data, type(c.mesh.data)) == (2, int)
    assert c.train.seed == 3


def test_nested_dicts_set_groups():
    c = default_config()
    apply_override_dict(c, {"train": {"steps": 9}, "mesh": {"dcn": {"data": 2}}})
    assert c.train.steps == 9 and c.mesh.dcn.data == 2


@pytest.mark.parametrize("overrides, expected", [
    ({"train.steps": 2.5}, "override train.steps=2.5 is not a valid int (current value 1000)."),
    ({"train.steps": True}, "override train.steps=True is not a valid int (current value 1000)."),
    ({"train.lr": "fast"}, "--config.train.lr='fast' is not a valid float (current value 0.0003)."),
    ({"train.lr": None}, "override train.lr=None is not a valid float (current value 0.0003)."),
    ({"train.lr": False}, "override train.lr=False is not a valid float (current value 0.0003)."),
    ({"model.tie_embeddings": 1}, "override model.tie_embeddings=1 is not a valid bool (current value False)."),
    ({"model.remat": 3}, "override model.remat=3 is not a valid str (current value 'none')."),
    ({"mesh": 3}, "override mesh is a group of settings, not a value; set one of its keys instead."),
    ({"train.step": 5}, "unknown config key 'train.step': train has no 'step' (did you mean 'steps'?); valid keys"),
    ({5: 1}, "override key 5 is not a string; write keys like 'train.steps'."),
])
def test_bad_dict_override(overrides, expected):
    with pytest.raises(UserError) as excinfo:
        apply_overrides(default_config(), overrides)
    assert expected in _one_sentence(excinfo)


def test_load_config_takes_a_dict_or_strings_with_or_without_the_prefix():
    assert load_config("tiny", {"train.steps": 50}).train.steps == 50
    assert load_config("tiny", ["--config.train.steps=51", "train.seq_len=64"]).train.steps == 51
    assert load_config("tiny", "train.steps=52").train.steps == 52  # one string: one override
    assert load_config("tiny", None).train.steps == load_config("tiny").train.steps
    with pytest.raises(UserError) as excinfo:
        load_config("tiny", [("train.steps", 5)])
    assert _one_sentence(excinfo) == (
        "override ('train.steps', 5) is not a string; write overrides like 'train.steps=50', or pass a dict."
    )


# --------------------------------------------------------------------------- JSONL


def _jsonl(path):
    c = default_config().data
    c.source, c.paths = "jsonl", str(path)
    return source_documents(c)


def test_jsonl_with_a_byte_order_mark(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + b'{"text": "first"}\r\n{"text": "second"}\r\n')
    assert _jsonl(path) == [(f"{path}:1", "first"), (f"{path}:2", "second")]


def test_jsonl_string_holding_a_line_separator_is_one_record(tmp_path):
    path = tmp_path / "ls.jsonl"
    text = "one\u2028two\u2029three\x85four"  # raw inside a JSON string, yet str.splitlines() splits at each
    path.write_text(json.dumps({"text": text}, ensure_ascii=False) + "\n", encoding="utf-8")
    assert _jsonl(path) == [(f"{path}:1", text)]
