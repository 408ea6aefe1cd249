"""The Hugging Face API: `from_hf` and `to_hf` (`ushard.from_hf` / `ushard.to_hf`), and `ushard convert`.

Built on ushard/hf.py (config.json and safetensors both ways, the families' tensor maps) and
ushard/trained.py (a workdir's model, LoRA's adapters merged into their base).
"""

from __future__ import annotations

import dataclasses
import os

import jax

from ushard import hf_tokenizer
from ushard.errors import UserError
from ushard.hf import IMPORT_SETTINGS, decided_by_hf, load_params, model_config, read_config, save_hf, stored_mtp
from ushard.models.config import ModelConfig
from ushard.models.definition import model_definition
from ushard.trained import TrainedModel, abstract_params, inference_layout, load_model


def from_hf(path: str, devices=None, **settings) -> TrainedModel:
    """The Hugging Face checkpoint in directory `path` as a model callable like `ushard.load_model`'s
    (int32 [batch, length] tokens -> float32 [batch, length, vocab] logits), on `devices` (default: the
    first device; several: parameters split over them). `settings`: other model settings, e.g.
    `compute_dtype="bfloat16"`, `fused_mlp=True` (default: float32 parameters and compute)."""
    cfg = stored_mtp(model_config(read_config(path), path, **{**IMPORT_SETTINGS, **settings}), path, settings)
    layout = inference_layout(devices)
    params = load_params(path, cfg, abstract_params(model_definition(cfg), layout))
    return TrainedModel(model_definition(cfg), params, layout, step=0, tokenizer=None, seq_len=None)


def to_hf(model_or_workdir, path: str, dtype: str | None = None, log=print) -> None:
    """Writes a model (a `TrainedModel`, or the newest checkpoint of a workdir) as a Hugging Face
    checkpoint directory `path`, which `transformers.AutoModelForCausalLM.from_pretrained` loads, with
    the tokenizer files and special-token ids of the run's tokenizer (ushard/hf_tokenizer.py).
    `dtype`: float32, bfloat16 or float16 on disk (default: the parameters' dtype)."""
    if os.path.isdir(path) and os.listdir(path):
        raise UserError(f"{path} is not empty; write the Hugging Face checkpoint into a new or empty directory.")
    if os.path.exists(path) and not os.path.isdir(path):
        raise UserError(f"{path} is a file; write the Hugging Face checkpoint into a new or empty directory.")
    trained = model_or_workdir
    if not isinstance(trained, TrainedModel):
        trained = load_model(str(model_or_workdir), devices=_host_devices(), log=log)
    cfg = trained.model.cfg
    if cfg.moe.num_experts and cfg.moe.capacity_factor:
        log(f"note: model.moe.capacity_factor={cfg.moe.capacity_factor} is not exported: transformers' Mixtral "
            f"routes every token to its experts (as ushard does with capacity_factor=0).")
    ids, files = hf_tokenizer.beside_weights(trained.tokenizer, path, log)
    save_hf(trained.params, cfg, path, dtype, max_positions=_max_positions(trained), token_ids=ids)
    if jax.process_index() == 0:
        hf_tokenizer.write_beside_weights(path, ids, files)


def _max_positions(trained: TrainedModel) -> int:
    """config.json's max_position_embeddings: the context the model is meant for, as far as known."""
    scaling = trained.model.cfg.rope_scaling
    if scaling.type in ("llama3", "yarn"):
        return int(scaling.factor * scaling.original_max_position_embeddings)
    return trained.seq_len or 2048


def _host_devices():
    """One CPU device: conversion needs the weights in host memory anyway, and an accelerator may be
    too small to hold the whole model."""
    try:
        return jax.devices("cpu")[:1]
    except RuntimeError:  # JAX_PLATFORMS without cpu
        return jax.devices()[:1]


# --------------------------------------------------------------------------- `ushard convert`


def convert_from_hf(hf_dir: str, workdir: str, log=print) -> None:
    """A Hugging Face checkpoint into `workdir`/checkpoints/0 (parameters only), which `ushard.load_model`,
    `ushard sample` and `checkpoint.init_from` read."""
    from ushard.checkpoint import Checkpoints
    from ushard.config import apply_override_dict, default_config

    if os.path.isdir(os.path.join(workdir, "checkpoints")):
        raise UserError(f"{workdir} already holds checkpoints/; convert into a new workdir.")
    cfg = stored_mtp(model_config(read_config(hf_dir), hf_dir, **IMPORT_SETTINGS), hf_dir, {})
    params = load_params(hf_dir, cfg, abstract_params(model_definition(cfg), inference_layout(_host_devices())))
    config = default_config()
    apply_override_dict(config, {"model": dataclasses.asdict(cfg)})
    checkpoints = Checkpoints(workdir)
    try:
        checkpoints.save(0, {"params": params}, {"position": 0}, config)
    finally:
        checkpoints.close()
    overrides = " ".join(f"--config.model.{k}={v}" for k, v in _hf_settings(cfg).items())
    millions = model_definition(cfg).num_params() / 1e6
    log(f"wrote {os.path.join(workdir, 'checkpoints', '0')}: {millions:.1f}M parameters "
        f"from {hf_dir}.\nTo fine-tune it, train in another workdir with --config.checkpoint.init_from={workdir} "
        f"and these model settings:\n{overrides}")


def _hf_settings(cfg: ModelConfig) -> dict:
    """The config keys of the settings a Hugging Face checkpoint decides (the scaling's numbers only
    where it is used)."""
    unscaled, dense, plain = cfg.rope_scaling.type == "none", not cfg.moe.num_experts, not cfg.mla.kv_lora_rank
    return {k: v for k, v in cfg.settings().items() if decided_by_hf(k)
            and not (unscaled and k.startswith("rope_scaling.") and k != "rope_scaling.type")
            and not (dense and k.startswith("moe.")) and not (plain and k.startswith("mla."))}


def convert_to_hf(workdir: str, hf_dir: str, dtype: str | None = None, log=print) -> None:
    to_hf(workdir, hf_dir, dtype, log)
    log(f"wrote a Hugging Face checkpoint of {workdir}'s newest checkpoint to {hf_dir}.")


def convert_to_peft(workdir: str, peft_dir: str, log=print) -> None:
    """A LoRA run's adapters (its newest checkpoint) as a PEFT adapter directory (ushard/hf_peft.py)."""
    from ushard.checkpoint import saved_model_config
    from ushard.hf_peft import save_peft
    from ushard.trained import restore_params
    from ushard.training.lora import Adapters

    if os.path.isdir(peft_dir) and os.listdir(peft_dir):
        raise UserError(f"{peft_dir} is not empty; write the PEFT adapter into a new or empty directory.")
    layout = inference_layout(_host_devices())
    step, state, saved = restore_params(workdir, layout, log)
    model_cfg = saved_model_config(saved)
    if not model_cfg.lora.rank:
        raise UserError(f"{workdir} holds a full model, not LoRA adapters (its model.lora.rank is 0); export it "
                        "with --to-hf.")
    base = saved.get("checkpoint", {}).get("init_from") or None
    save_peft(Adapters(model_definition(model_cfg), model_cfg.lora), state["params"], peft_dir, base)
    log(f"wrote the LoRA adapters of {workdir} (step {step}) to {peft_dir} as a PEFT adapter; load it with "
        f"peft.PeftModel.from_pretrained(<the base model{f' in {base}' if base else ''}>, {peft_dir!r}).")
