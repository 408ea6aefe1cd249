"""A trained model from a workdir's newest checkpoint, callable on tokens: `ushard.load_model(workdir)`.

The settings come from the config saved with the checkpoint; only the parameters are read (not the
optimizer state), through the same restore path as training (`Checkpoints.restore_newest`), onto one
device or laid out ZeRO-3 over several (the `fsdp` axis spanning them).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from ushard.checkpoint import Checkpoints, saved_model_config
from ushard.config import MESH_AXES
from ushard.errors import UserError
from ushard.mesh import build_mesh
from ushard.models.config import LoraConfig
from ushard.models.definition import ModelDef, model_definition
from ushard.sharding import Layout, check_divisible, use_layout, with_shardings
from ushard.training import init_from, lora


@dataclass
class TrainedModel:
    """`model(tokens)`: int32 [batch, length] token ids -> float32 [batch, length, vocab] logits, each row
    one document starting at position 0."""

    model: ModelDef
    params: dict
    layout: Layout
    step: int  # the training step of the checkpoint (0 for an imported one)
    tokenizer: str | None  # data.tokenizer of its training run: a name or a tokenizer.json path; None: unknown
    seq_len: int | None  # the length of its training windows; None: unknown

    def __post_init__(self):
        def logits(params, tokens):
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
            with use_layout(self.layout):
                return self.model.apply(params, tokens, positions)[0].astype(jnp.float32)

        self._logits = jax.jit(logits)

    def __call__(self, tokens) -> jax.Array:
        tokens = jnp.asarray(tokens)
        if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise UserError(f"the model takes int32 token ids of shape [batch, length]; "
                            f"got {tokens.dtype} {tokens.shape}.")
        if self.layout.mesh.size > 1 and tokens.shape[0] % self.layout.mesh.size:
            raise UserError(f"a batch of {tokens.shape[0]} rows does not split over {self.layout.mesh.size} devices; "
                            f"use a multiple of {self.layout.mesh.size} rows, or load the model onto one device.")
        return self._logits(self.params, tokens.astype(jnp.int32))


def inference_layout(devices=None) -> Layout:
    """A layout for using a model on `devices` (default: the first device): parameters split ZeRO-3
    style over an `fsdp` axis spanning them, nothing else split."""
    devices = jax.devices()[:1] if devices is None else list(devices)
    mesh_shape = {axis: len(devices) if axis == "fsdp" else 1 for axis in MESH_AXES}
    return Layout.create(build_mesh(mesh_shape, devices=devices), zero_stage=3)


def abstract_params(model: ModelDef, layout: Layout):
    """The model's parameters as ShapeDtypeStructs carrying their shardings in `layout` (UserError
    when a dimension does not split over the mesh)."""
    check_divisible(model.named_shapes(), layout.zero.params, dict(layout.mesh.shape))
    return with_shardings(model.shapes, layout.shardings(model.logical, "params"))


def load_model(workdir: str, devices=None, log=print) -> TrainedModel:
    """The model in `workdir`'s newest readable checkpoint, on `devices` (default: the first device);
    a LoRA run's adapters merged into their base."""
    layout = inference_layout(devices)
    step, state, saved = restore_params(workdir, layout, log)
    tokenizer = saved.get("data", {}).get("tokenizer", "byte")  # a name or a tokenizer.json's path: sample checks it
    model_cfg = saved_model_config(saved)
    params = state["params"]
    if model_cfg.lora.rank:  # a LoRA run: its adapters merged into the base, a plain model from here on
        params = init_from.merged_params(saved, model_definition(model_cfg), params, state["base_check"],
                                    abstract_params(model_definition(model_cfg), layout), log)
        model_cfg = dataclasses.replace(model_cfg, lora=LoraConfig())
    return TrainedModel(model_definition(model_cfg), params, layout, step, tokenizer,
                        saved.get("train", {}).get("seq_len"))


def restore_params(workdir: str, layout: Layout, log=print) -> tuple[int, dict, dict]:
    """(step, {"params": ...}, saved config) of `workdir`'s newest readable checkpoint, laid out in
    `layout`; a LoRA run's "params" are its adapters, beside its base's fingerprint ("base_check")."""

    def target(saved_config):
        model_cfg = saved_model_config(saved_config)
        model = model_definition(model_cfg)
        if model_cfg.lora.rank:  # the adapters and their base's fingerprint (ushard/training/lora.py)
            adapters = lora.Adapters(model, model_cfg.lora)
            check = with_shardings(lora.base_check_shape(model), layout.replicated)
            return {"params": with_shardings(adapters.shapes, layout.shardings(adapters.logical, "params")),
                    "base_check": check}, model_cfg
        return {"params": abstract_params(model, layout)}, model_cfg

    checkpoints = Checkpoints(workdir, create=False)
    try:
        restored = checkpoints.restore_newest(target, log)
    finally:
        checkpoints.close()
    if restored is None:
        raise UserError(f"{checkpoints.directory} holds no complete checkpoint; train a model first with "
                        f"`ushard train --workdir {workdir}`.")
    step, state, _, saved = restored
    return step, state, saved
