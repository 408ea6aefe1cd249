"""The docs that are checked against the code: docs/config.md documents every config key (tools/config_reference.py)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))

import config_reference  # noqa: E402
from ushard import config as ushard_config  # noqa: E402


def test_config_reference_is_current():
    with open(config_reference.OUTPUT, encoding="utf-8") as f:
        checked_in = f.read()
    assert checked_in == config_reference.reference(), "docs/config.md is stale; run python tools/config_reference.py"
    assert "| `model.moe.top_k` | `2` |" in checked_in
    assert "| `mesh.dcn.tensor` | `1` |" in checked_in


def test_config_reference_refuses_an_undocumented_key(monkeypatch):
    original = ushard_config.default_config

    def with_new_key():
        config = original()
        config.unlock()
        config.train.brand_new_key = 7
        return config

    monkeypatch.setattr(ushard_config, "default_config", with_new_key)
    with pytest.raises(SystemExit, match="train.brand_new_key has no entry in DESCRIPTIONS"):
        config_reference.reference()


def test_config_reference_refuses_a_description_of_a_removed_key(monkeypatch):
    monkeypatch.setitem(config_reference.DESCRIPTIONS, "train.gone", "a key that no longer exists")
    with pytest.raises(SystemExit, match="DESCRIPTIONS has train.gone"):
        config_reference.reference()
