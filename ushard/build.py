"""`build(config)`: the mesh, layout, model definition, optimizer and step functions of a config, and no data.

Everything that trains, measures or inspects a model starts here: the Trainer, `tools/`, tests,
notebooks and the planner. Nothing is compiled until a step function is first called or lowered.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import optax

from ushard.config import pipeline_head_split, validate
from ushard.mesh import build_mesh
from ushard.metrics import flops_per_token
from ushard.models.attention import check_impl, resolve_impl, split_blocks
from ushard.models.config import ModelConfig
from ushard.models.definition import ModelDef, model_definition
from ushard.parallel.pipeline import PipelineSchedule, bubble_fraction
from ushard.sharding import Layout, format_rules
from ushard.training.optim import make_optimizer
from ushard.training.step import Steps
from ushard.xla_flags import ignored_settings


@dataclass
class Setup:
    """A validated config laid out on devices: what `build` returns."""

    config: object  # the ml_collections ConfigDict it was built from
    model_config: ModelConfig
    mesh_shape: dict[str, int]
    layout: Layout
    model: ModelDef
    tx: optax.GradientTransformation
    schedule: optax.Schedule
    steps: Steps  # jitted init / train_step / loss_and_grads / eval_step for this layout
    notes: tuple[str, ...] = ()  # settings this platform ignores, one line each (printed by describe)

    @property
    def mesh(self) -> jax.sharding.Mesh:
        return self.layout.mesh

    @property
    def flops_per_token(self) -> float:
        """Training FLOPs per token as ushard/metrics.py counts them."""
        return flops_per_token(self.model_config, self.model.num_matmul_params(), self.config.train.seq_len)

    def describe(self) -> str:
        shape = " x ".join(f"{a}={s}" for a, s in self.mesh_shape.items() if s > 1) or "one device"
        platform = self.mesh.devices.flat[0].platform
        size = f"{self.model.num_params() / 1e6:.1f}M params"
        if self.model_config.moe.num_experts:  # what FLOPs and MFU count: a token's share of the experts
            size += f" ({self.model.num_matmul_params() / 1e6:.1f}M active in a token's matmuls)"
        return (
            f"ushard: {size} on {self.mesh.size} {platform} "
            f"device(s), mesh {shape}, ZeRO-{self.config.parallel.zero_stage}\n{self._describe_pipeline()}"
            f"{self._describe_context()}"
            f"parameter layout (logical axis -> mesh axes):\n{format_rules(self.layout.zero.params)}"
            + "".join(f"\nnote: {line}" for line in self.notes)
        )

    def _describe_context(self) -> str:
        ways = self.layout.size("act_length")
        platform = self.mesh.devices.flat[0].platform
        _, blocks = context_blocks(self.model_config, self.config.train.seq_len, platform, ways)
        if not blocks:
            return ""
        kept = ", K/V kept for the backward pass" if self.config.parallel.context_keep_kv else ""
        mode = self.config.parallel.context_parallel
        return f"context parallelism: {mode} over {ways} devices, blocks on {blocks}{kept}\n"

    def _describe_pipeline(self) -> str:
        pipe = self.layout.pipeline
        if pipe is None:
            return ""
        stages = self.mesh_shape["pipeline"]
        rounds = f" x {pipe.repeats} rounds" if pipe.name == "circular" else ""
        bubble = bubble_fraction(pipe.name, stages, pipe.microbatches, pipe.repeats)
        head = "split over the stages" if "pipeline" in self.layout.axes("vocab") else "whole on every stage"
        line = (f"pipeline: {pipe.name}, {stages} stages{rounds}, {pipe.microbatches} microbatches, "
                f"bubble {bubble:.1%}, embedding and head {head}\n")
        if self.mesh.devices.flat[0].platform == "gpu":
            line += "note: attention runs as XLA attention in the pipeline's stages, not cuDNN (docs/dev-notes.md)\n"
        return line


def context_blocks(model_cfg, length: int, platform: str, ways: int):
    """`split_blocks` for a sequence split `ways` ways: (the fused kernel or None, what runs the blocks in
    words); (None, "") when it is not split."""
    if ways == 1:
        return None, ""
    impl = resolve_impl(model_cfg.attention_impl, platform, model_cfg.compute_dtype, length)
    return split_blocks(impl, model_cfg.compute_dtype, length, ways, model_cfg.document_mask)


def build(config, devices=None) -> Setup:
    """Validates `config` for `devices` (default: all) and composes its parts; raises UserError if invalid."""
    devices = jax.devices() if devices is None else list(devices)
    mesh_shape = validate(config, len(devices))
    model_cfg = ModelConfig.from_config(config.model)
    model = model_definition(model_cfg)
    p, t = config.parallel, config.train
    pipeline = PipelineSchedule(p.pipeline_schedule, p.pipeline_microbatches, p.pipeline_repeats)
    platform = devices[0].platform
    check_impl(model_cfg.attention_impl, platform, t.seq_len, mesh_shape["pipeline"])
    notes = tuple(ignored_settings(config, platform))
    reshard_after_forward = p.reshard_after_forward or platform == "tpu"  # see ignored_settings
    mesh = build_mesh(mesh_shape, dict(config.mesh.dcn), devices)
    layout = Layout.create(mesh, p.zero_stage, reshard_after_forward, p.sequence_parallel, model_cfg.n_kv_heads,
                           pipeline, pipeline_head_split(config))
    tx, schedule = make_optimizer(t, model.logical)
    steps = Steps(model, tx, schedule, layout, t.grad_accum, skip_nonfinite=t.on_nonfinite == "skip",
                  context_parallel=p.context_parallel, context_keep_kv=p.context_keep_kv)
    return Setup(config, model_cfg, mesh_shape, layout, model, tx, schedule, steps, notes)
