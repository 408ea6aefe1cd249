"""`checkpoint.init_from`: the parameters a new run starts from (fine-tuning), with a fresh optimizer.

The directory is a ushard workdir (its newest checkpoint: one `ushard convert --from-hf` wrote, or a
finished training run) or a Hugging Face checkpoint (config.json + safetensors), read directly. Either
way the run's model settings must describe the same model: the parameters are created straight into
the run's shardings, and a mismatch is refused in one sentence naming the settings that differ.
"""

from __future__ import annotations

import dataclasses
import os

import jax
from jax.sharding import NamedSharding, PartitionSpec

from ushard import hf
from ushard.checkpoint import Checkpoints, saved_model_config
from ushard.errors import UserError
from ushard.models.config import LoraConfig, ModelConfig
from ushard.models.definition import ModelDef, model_definition
from ushard.sharding import with_shardings
from ushard.training.lora import Adapters, base_check_shape, fingerprint, same_base

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
    """A workdir's parameters; a LoRA run's are its adapters merged into their base (the model a
    second stage, such as DPO after SFT, starts from)."""
    replicated = NamedSharding(jax.tree.leaves(target)[0].sharding.mesh, PartitionSpec())

    def restore_target(saved_config):
        saved = saved_model_config(saved_config)
        if not saved.lora.rank:
            return {"params": target}, model_cfg
        differences = dataclasses.replace(saved, lora=LoraConfig()).differences(model_cfg, function_only=True)
        if differences:
            raise UserError(f"{key} holds LoRA adapters on another model: {'; '.join(differences)}; {SAME_MODEL}.")
        adapters = Adapters(model_definition(saved), saved.lora)
        return {"params": with_shardings(adapters.shapes, jax.tree.map(lambda _: replicated, adapters.shapes)),
                "base_check": with_shardings(base_check_shape(adapters.model), replicated)}, saved

    checkpoints = Checkpoints(path, create=False, another_model=f"{SAME_MODEL} to start from it ({key})")
    try:
        restored = checkpoints.restore_newest(restore_target, log)
    finally:
        checkpoints.close()
    if restored is None:
        raise UserError(f"{key}: {checkpoints.directory} holds no complete checkpoint.")
    _, state, _, saved_config = restored
    if "base_check" not in state:
        return state["params"]
    saved = saved_model_config(saved_config)
    log(f"{key} is a LoRA run: its adapters merged into their base")
    return merged_params(saved_config, model_definition(saved), state["params"], state["base_check"], target, log)


def base_params(saved_config: dict, model: ModelDef, target, log=print):
    """The parameters a LoRA run's base was made of, by its saved config: `checkpoint.init_from`'s, else
    the seed's random ones; laid out as `target` (the model's abstract parameters with shardings)."""
    path = saved_config.get("checkpoint", {}).get("init_from")
    if path:
        return initial_params(path, dataclasses.replace(model.cfg, lora=LoraConfig()), target, log)
    shardings = jax.tree.map(lambda t: t.sharding, target)
    return jax.jit(model.init, static_argnums=0, out_shardings=shardings)(saved_config["train"]["seed"])


def merged_params(saved_config: dict, model: ModelDef, adapters, base_check, target, log=print):
    """A LoRA run's model as inference uses it: its adapters folded into the base they were trained on
    (in the parameters' dtype), refused in a sentence if the base found is another."""
    lora = Adapters(model, model.cfg.lora)
    base = base_params(saved_config, model, target, log)
    if not same_base(jax.device_get(base_check), jax.device_get(fingerprint(lora.frozen(base)))):
        source = saved_config.get("checkpoint", {}).get("init_from") or "the seed's random weights"
        raise UserError(f"the LoRA adapters were trained on another base than {source} holds now; restore the "
                        "base they were trained on.")
    return jax.jit(lora.merge, out_shardings=jax.tree.map(lambda t: t.sharding, target))(base, adapters)

