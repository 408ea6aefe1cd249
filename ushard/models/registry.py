"""Every model family, by the name `model.family` gives it. A new family is its folder and one line here."""

from __future__ import annotations

import json

from ushard.errors import UserError
from ushard.models import deepseek, gemma3, llama, qwen3
from ushard.models.family import Family

FAMILIES: dict[str, Family] = {f.name: f for f in (llama.FAMILY, qwen3.FAMILY, gemma3.FAMILY, deepseek.FAMILY)}


def family(name: str) -> Family:
    if name not in FAMILIES:
        raise UserError(f"model.family={name!r} is not a model family ushard has; choose one of: "
                        f"{', '.join(FAMILIES)}.")
    return FAMILIES[name]


def family_for_model_type(model_type, directory: str) -> Family:
    """The family that reads Hugging Face config.json's `model_type`."""
    for f in FAMILIES.values():
        if model_type in f.hf.model_types:
            return f
    known = ", ".join(t for f in FAMILIES.values() for t in f.hf.model_types)
    raise UserError(f"{directory}: config.json's model_type={json.dumps(model_type)} is not supported: ushard imports "
                    f"{known}.")
