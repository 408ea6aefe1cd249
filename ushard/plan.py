"""`ParallelPlan`: how one run is laid out, decided once from the config and the devices.

Everything resolved about a run's parallelism lives here, frozen: the mesh's shape, the ZeRO stage,
sequence parallelism and the KV-head split, the pipeline's schedule and head, the context mode, the
experts' dispatch, and the kernel chosen for each operation with the reason. `build` makes the plan,
the `Layout` is made from it, the traced step reads it (through the active layout), and `describe`
prints its decisions rather than working them out again. Each subsystem validates its own settings
(`ushard.config`); the plan only resolves them ("auto", defaults that depend on the platform) and
records what was chosen.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ushard.kernels import attention as attention_kernels
from ushard.kernels import grouped_matmul as grouped_kernels
from ushard.models.registry import family
from ushard.parallel.pipeline import PipelineSchedule, bubble_fraction


@dataclass(frozen=True)
class KernelChoice:
    """The implementation that runs one operation, and why it was chosen (one phrase)."""

    name: str
    why: str


@dataclass(frozen=True)
class ParallelPlan:
    """A run's resolved layout decisions (module docstring). Pure data: no devices, no arrays."""

    mesh_shape: tuple[tuple[str, int], ...]  # every mesh axis and its size, slowest link first
    dcn_shape: tuple[tuple[str, int], ...]  # how many slices / hosts each axis spans
    platform: str  # "cpu", "gpu" or "tpu": the devices', which kernels are chosen for
    zero_stage: int
    reshard_after_forward: bool  # ZeRO-3: gather a layer's weights again for its backward pass
    sequence_parallel: bool  # Megatron SP over `tensor`
    split_kv_heads: bool  # K/V weights split over `tensor` (else each rank holds whole copies)
    pipeline: PipelineSchedule | None  # None: the layers are not split into stages
    pipeline_head_split: bool  # the vocabulary split over the stages too (parallel.pipeline_head)
    context_mode: str | None  # "ring" or "all_gather" where the sequence is split; None otherwise
    context_keep_kv: bool  # the backward pass reuses the forward's K/V blocks
    expert_dispatch: str | None  # "padded" or "ragged" for an MoE model; None for a dense one
    expert_split: str | None  # what mesh.expert splits: "experts" or "width" (MoE); None for a dense model
    expert_width_parts: int  # with the width split: the parts each device's sequences are exchanged in
    attention: KernelChoice  # attention over whole sequences (and, in a pipeline, outside the stages)
    stage_attention: KernelChoice | None  # attention inside pipeline stages; None without a pipeline
    # The same for the layers with a sliding window (model.sliding_window; None: the model has none).
    window: int
    local_attention: KernelChoice | None
    local_stage_attention: KernelChoice | None
    context_blocks: KernelChoice | None  # what runs the blocks of a split sequence; None: not split
    grouped_matmul: KernelChoice | None  # the dropless experts' grouped matmul; None for a dense model
    # The optimizer (optim.name) and, for Muon, the mesh axes its matrices' owners are spread over
    # (empty: each iteration runs on the sharded momentum, XLA's partitioner placing it) and why.
    # Decided by `ushard.training.optim.plan_optimizer` once the layout exists (`build`).
    optimizer: str = "adamw"
    muon_owners: tuple[str, ...] = ()
    optimizer_why: str = "adamw"

    @classmethod
    def create(cls, config, mesh_shape: dict[str, int], platform: str, model, device_kind: str = "") -> "ParallelPlan":
        """The plan of a validated `config` (`ushard.config.validate` gave `mesh_shape`; `model`, its
        `ModelConfig`) on `platform`, whose devices are `device_kind` (e.g. "NVIDIA H100 80GB HBM3":
        kernels exist per chip)."""
        from ushard.config import pipeline_head_split
        from ushard.sharding import expert_width_ways, kv_heads_split

        p, m, t = config.parallel, config.model, config.train
        stages, ways = mesh_shape["pipeline"], mesh_shape["sequence"]
        pipeline = None
        if stages > 1:
            pipeline = PipelineSchedule(p.pipeline_schedule, p.pipeline_microbatches, p.pipeline_repeats,
                                        m.scan_unroll)
        choose = functools.partial(_choice, m.attention_impl, platform, m.compute_dtype, t.seq_len,
                                   head_dim=family(model.family).attention_shape(model).qk_head_dim, split=ways > 1,
                                   documents=bool(m.document_mask))
        attention = choose(in_stage=False)
        stage_attention = choose(in_stage=True) if pipeline is not None else None
        window = model.sliding_window if any(family(model.family).attention_shape(model).windows) else 0
        local = local_stage = None
        if window:
            local = choose(in_stage=False, window=window)
            local_stage = choose(in_stage=True, window=window) if pipeline is not None else None
        blocks = None
        if ways > 1:
            # Inside stages attention resolves as `stage_attention` does; the blocks follow it.
            resolved = (stage_attention or attention).name
            kernel, what = attention_kernels.block_kernel(resolved, m.compute_dtype, t.seq_len, ways, m.document_mask)
            blocks = KernelChoice(resolved if kernel is not None else "xla", what)
        grouped = None
        if model.moe.num_experts:
            # The kernel runs on a device's slice of the experts' hidden width (`expert_mlp`'s axes).
            width = model.expert_d_ff // expert_width_ways(mesh_shape, p.expert_split)
            impl, features = model.moe.grouped_matmul_impl, (model.d_model, width)
            name = grouped_kernels.resolve(impl, platform, model.compute_dtype, features, device_kind)
            grouped = KernelChoice(name, grouped_kernels.why(impl, name, platform, features))
        return cls(
            mesh_shape=tuple(mesh_shape.items()),
            dcn_shape=tuple((a, int(config.mesh.dcn[a])) for a in mesh_shape),
            platform=platform,
            zero_stage=p.zero_stage,
            # On TPUs XLA turned the gradients' reduce-scatters into all-reduces without it (ushard/xla_flags.py).
            reshard_after_forward=p.reshard_after_forward or platform == "tpu",
            sequence_parallel=p.sequence_parallel,
            split_kv_heads=kv_heads_split(model.n_kv_heads, mesh_shape["tensor"]),
            pipeline=pipeline,
            pipeline_head_split=pipeline is not None and pipeline_head_split(config),
            context_mode=p.context_parallel if ways > 1 else None,
            context_keep_kv=p.context_keep_kv and ways > 1,
            expert_dispatch=m.moe.dispatch if m.moe.num_experts else None,
            expert_split=p.expert_split if m.moe.num_experts else None,
            expert_width_parts=p.expert_width_parts,
            attention=attention,
            stage_attention=stage_attention,
            window=window,
            local_attention=local,
            local_stage_attention=local_stage,
            context_blocks=blocks,
            grouped_matmul=grouped,
        )

    @property
    def shape(self) -> dict[str, int]:
        return dict(self.mesh_shape)

    def size(self, axis: str) -> int:
        return self.shape[axis]

    def attention_for(self, in_stage: bool, window: int = 0) -> str:
        """The attention kernel a layer runs: inside a pipeline stage or outside one, with a sliding
        window or without."""
        if window:
            assert window == self.window, (window, self.window)  # one window a model
            return (self.local_stage_attention if in_stage and self.local_stage_attention
                    else self.local_attention).name
        return (self.stage_attention if in_stage and self.stage_attention else self.attention).name

    def describe(self) -> str:
        """The plan's decisions, a line each, as the start-up report prints them."""
        shape = " x ".join(f"{a}={s}" for a, s in self.mesh_shape if s > 1) or "one device"
        lines = [f"mesh {shape}, ZeRO-{self.zero_stage}"
                 + (", sequence parallel" if self.sequence_parallel else "")
                 + ("" if self.split_kv_heads else ", K/V heads repeated over tensor")]
        if self.pipeline is not None:
            pipe, stages = self.pipeline, self.size("pipeline")
            rounds = f" x {pipe.repeats} rounds" if pipe.name == "circular" else ""
            bubble = bubble_fraction(pipe.name, stages, pipe.microbatches, pipe.repeats)
            head = "split over the stages" if self.pipeline_head_split else "whole on every stage"
            lines.append(f"pipeline: {pipe.name}, {stages} stages{rounds}, {pipe.microbatches} microbatches, "
                         f"bubble {bubble:.1%}, embedding and head {head}")
        if self.context_blocks is not None:
            kept = ", K/V kept for the backward pass" if self.context_keep_kv else ""
            lines.append(f"context parallelism: {self.context_mode} over {self.size('sequence')} devices, "
                         f"blocks on {self.context_blocks.why}{kept}")
        lines.append(f"attention: {self.attention.why}")
        if self.stage_attention is not None and self.stage_attention != self.attention:
            lines.append(f"attention in the pipeline's stages: {self.stage_attention.why}")
        if self.local_attention is not None:
            lines.append(f"attention in the layers with a {self.window}-token window: {self.local_attention.why}")
        if self.local_stage_attention is not None and self.local_stage_attention != self.local_attention:
            lines.append(f"windowed attention in the pipeline's stages: {self.local_stage_attention.why}")
        if self.expert_split == "width" and self.size("expert") > 1:
            parts = f", exchanged in {self.expert_width_parts} parts" if self.expert_width_parts > 1 else ""
            lines.append(f"experts: every expert's width split over {self.size('expert')} devices, each running "
                         f"its expert group's tokens{parts}; dropless grouped matmul: {self.grouped_matmul.why}")
        elif self.expert_dispatch is not None:
            lines.append(f"experts: {self.expert_dispatch} dispatch where mesh.expert splits them; "
                         f"dropless grouped matmul: {self.grouped_matmul.why}")
        lines.append(f"optimizer: {self.optimizer_why}")
        return "\n".join(lines) + "\n"


def _choice(impl: str, platform: str, dtype, length: int, in_stage: bool, head_dim: int, split: bool,
            documents: bool, window: int = 0) -> KernelChoice:
    name = attention_kernels.resolve(impl, platform, dtype, length, in_stage, head_dim, split, documents, window)
    return KernelChoice(name, attention_kernels.why(impl, name, platform, in_stage, split, documents, window,
                                                    head_dim))
