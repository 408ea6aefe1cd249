"""`checkpoint.init_from`: the parameters a new run starts from (fine-tuning), with a fresh optimizer.

The directory is a ushard workdir (its newest checkpoint: one `ushard convert --from-hf` wrote, or a
finished training run) or a Hugging Face checkpoint (config.json + safetensors), read directly. Either
way the run's model settings must describe the same model: the parameters are created straight into
the run's shardings, and a mismatch is refused in one sentence naming the settings that differ.
"""

from __future__ import annotations

import os

from ushard import hf
from ushard.checkpoint import Checkpoints
from ushard.errors import UserError
from ushard.models.config import ModelConfig

SAME_MODEL = "set the run's model.* keys to the checkpoint's values"


def initial_params(path: str, model_cfg: ModelConfig, target, log=print):
    """The parameters in `path`, laid out as `target` (the run's abstract parameters with shardings)."""
    key = f"checkpoint.init_from={path}"
    if os.path.isfile(os.path.join(path, "config.json")):
        there = hf.model_config(hf.read_config(path), path)
        differences = there.differences(model_cfg, function_only=True, only=hf.HF_SETTINGS)
        if differences:
            raise UserError(f"{key} holds another model: {'; '.join(differences)}; {SAME_MODEL} "
                            f"(`ushard convert --from-hf` prints them).")
        return hf.load_params(path, model_cfg, target)
    if os.path.isdir(os.path.join(path, "checkpoints")):
        return _from_workdir(path, model_cfg, target, key, log)
    raise UserError(f"{key} is neither a ushard workdir (with checkpoints/) nor a Hugging Face checkpoint directory "
                    f"(with config.json).")


def _from_workdir(path: str, model_cfg: ModelConfig, target, key: str, log):
    checkpoints = Checkpoints(path, create=False, another_model=f"{SAME_MODEL} to start from it ({key})")
    try:
        restored = checkpoints.restore_newest(lambda _: ({"params": target}, model_cfg), log)
    finally:
        checkpoints.close()
    if restored is None:
        raise UserError(f"{key}: {checkpoints.directory} holds no complete checkpoint.")
    return restored[1]["params"]
