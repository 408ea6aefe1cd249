"""The time side of `ushard plan`: how long one training step takes on a layout, and why.

`predict(setup, hardware)` turns a built `Setup` (or a config and a mesh shape) into a `StepTime`:
- **compute**: the step's FLOPs as ushard/metrics.py counts them, plus what the remat policy
  recomputes, at an achieved matmul rate and an attention rate per kernel (cuDNN, XLA, splash, flash);
  the elementwise work (norms, rotary, SwiGLU, loss, AdamW) at memory bandwidth; the copy a scanned
  layer loop makes of its saved activations;
- **collectives**: per mesh axis and kind (all-gather, reduce-scatter, all-reduce, all-to-all,
  collective-permute), the bytes per step per device, derived from the config and layout, and their
  time at the link the axis crosses (inside a host or across hosts, `Hardware`);
- **overlap**: which of them hide behind compute and why (a reason per item);
- **the pipeline bubble** of the schedule (ushard/parallel/pipeline.py's `bubble_fraction`);
- the step's seconds, tokens/s, TFLOP/s per device and MFU.

Bytes follow the compiled program's conventions (`ushard.aot.collectives_per_step`): `result_bytes`
is what the collective returns on a device (the whole gathered array, a reduce-scatter's shard), and
`wire_bytes` what one device sends (a ring algorithm's (n-1)/n of the array for an all-gather or a
reduce-scatter, twice that for an all-reduce). The physical constants (`Efficiency`, `Hardware`) were
fitted once to the GPU rows of docs/benchmarks.md (tests/data/step_time/rows.json); each says where
it comes from, and every one can be overridden.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from ushard.kernels.grouped_matmul import padding_growth
from ushard.parallel.expert import resolved_exchange
from ushard.parallel.pipeline import bubble_fraction
from ushard.sharding import expert_width_ways

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
BATCH_AXES = ("data", "fsdp", "expert")  # axes that split the batch's rows
# Mesh axes from the slowest link to the fastest (docs/parallelism.md): the innermost axes are laid out
# on neighbouring devices, so they stay inside a host longest.
AXIS_ORDER = ("pipeline", "data", "fsdp", "expert", "sequence", "tensor")
_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


# --------------------------------------------------------------------------- hardware


@dataclass(frozen=True)
class Hardware:
    """One accelerator and its links. Bandwidths are bytes/s that one device moves: `intra_host_bw` /
    `inter_host_bw` for the ring collectives (all-gather and reduce-scatter; an all-reduce moves
    twice their bytes at `all_reduce_speedup` times the rate, NVLink SHARP's in-switch reduction on
    NVSwitch hosts), `p2p_bw` for a neighbour `collective-permute`."""

    name: str
    platform: str  # "gpu" or "tpu": which attention kernel "auto" resolves to
    peak_flops: float  # dense bf16 FLOP/s per device, datasheet (ushard/metrics.py)
    hbm_bytes: float
    hbm_bw: float  # achieved bytes/s of an elementwise pass (read + write)
    intra_host_bw: float  # NVLink / ICI
    inter_host_bw: float  # InfiniBand / DCN, per device
    p2p_bw: float  # a collective-permute to a neighbour inside a host
    devices_per_host: int
    all_reduce_speedup: float = 1.0

    def replace(self, **changes) -> "Hardware":
        return dataclasses.replace(self, **changes)

    @property
    def host(self) -> str:
        """What the fast link joins, in a plan's words: a GPU host (NVLink), a TPU slice (ICI)."""
        return "slice" if self.platform == "tpu" else "host"

    @property
    def cores(self) -> str:
        """The compute units a collective's kernels share with the matmuls, in a plan's words."""
        return "TensorCores" if self.platform == "tpu" else "SMs"


GB = 1e9
HARDWARE = {
    # H100 SXM: peak and HBM from the datasheet; the elementwise bandwidth is tools/ceilings.py's
    # measurement (docs/benchmarks.md, "Third round"); the collective rates are the H200 host's
    # below (same NVLink 4 / NVSwitch generation). Inter-host: one 400 Gb/s InfiniBand NIC per GPU.
    "h100": Hardware("h100", "gpu", 989e12, 80 * 2**30, 2.88e12, 270 * GB, 50 * GB, 160 * GB, 8, 1.3),
    # H200: same compute as the H100 (datasheet), HBM3e 141 GB at 4.8 TB/s (datasheet) scaled by the
    # H100's measured share of its datasheet bandwidth (2.88 of 3.35 TB/s); NVLink rates are
    # tools/p2p_overlap.py's on four H200s (docs/benchmarks.md: all-gather 268, ppermute 160 GB/s).
    "h200": Hardware("h200", "gpu", 989e12, 141 * GB, 4.1e12, 270 * GB, 50 * GB, 160 * GB, 8, 1.3),
    # TPUs: datasheet peak, HBM and ICI (per chip, all links one way); DCN per chip is a typical
    # multi-slice figure (25 GB/s a host of 4 chips). Not measured by this project.
    "v5p": Hardware("v5p", "tpu", 459e12, 95 * 2**30, 2.4e12, 600 * GB, 6.25 * GB, 100 * GB, 4),
    "v5e": Hardware("v5e", "tpu", 197e12, 16 * 2**30, 0.7e12, 200 * GB, 6.25 * GB, 50 * GB, 4),
    "v4": Hardware("v4", "tpu", 275e12, 32 * 2**30, 1.0e12, 270 * GB, 6.25 * GB, 45 * GB, 4),
}


def hardware(name: str, **overrides) -> Hardware:
    """A preset by name (`HARDWARE`), with any field overridden, e.g. hardware("h100", devices_per_host=4)."""
    return HARDWARE[name.lower()].replace(**overrides)


@dataclass(frozen=True)
class Efficiency:
    """What share of a peak the step's work achieves. Fitted to tests/data/step_time/rows.json (the
    GPU rows of docs/benchmarks.md, 2026-11-26/27) unless said otherwise."""

    # Achieved matmul rate over the datasheet peak: tools/ceilings.py's "every matmul of a step"
    # (docs/benchmarks.md, "Third round").
    matmul: float = 0.74
    # Attention FLOPs (metrics.py's count, the causal half) per second over the peak, per kernel, as
    # (the share a long sequence reaches, the length in tokens at which half of it is reached): a
    # kernel's per-row costs (the causal diagonal's masked tiles, loading queries, writing outputs and
    # statistics) amortise over longer rows. cuDNN: tools/ceilings.py's one-layer forward + backward at
    # 2,048 tokens (0.32 of the peak) and the long-context rows; XLA (materialised float32 scores):
    # fitted; flash (ushard's kernels, Mosaic GPU on Hopper, the GPUs here): cuDNN's curve, level with
    # it forward + backward in one call (tools/attention_bench.py, bench_1b's shape, 2026-11-28; its
    # Triton kernels ran at 0.71 of it, which the rows measured on them keep in tests/test_step_time.py);
    # splash: a guess until TPU rows exist.
    attention: dict = field(default_factory=lambda: {"cudnn": (0.50, 1500), "xla": (0.08, 3000),
                                                     "splash": (0.45, 1150), "flash": (0.50, 1500)})
    # Elementwise work runs at this share of `Hardware.hbm_bw` (the ceilings' floor against the
    # profile's "other" time, docs/benchmarks.md "Third round").
    elementwise: float = 0.6
    # Share of an overlapped collective's time that still costs compute: NCCL's kernels share the
    # SMs with the GEMMs (docs/benchmarks.md, "What each change of the second round bought").
    contention: float = 0.6
    # Tensor parallelism's cost beyond its collectives, as a share of the matmul time times (1 - 1/t):
    # the full-length activations gathered, copied and reduced around every split matmul, and the
    # split GEMMs' lower efficiency (fitted; the 8B rows of docs/benchmarks.md lose more to `tensor`
    # than their all-reduces' bytes explain).
    tensor_overhead: float = 0.1
    # Share of a collective-permute XLA hides behind compute on GPUs (tools/p2p_overlap.py, 4%).
    permute_hidden: float = 0.04
    # Seconds per pipeline tick outside the stage's work: the tick's small collectives, the copy of
    # a microbatch's kept residuals, the loop's bookkeeping (fitted).
    tick_overhead_s: float = 1.2e-3
    # Pipeline stages run microbatches of few rows at lower matmul efficiency: the tick's work grows
    # by this over a stage of the same work in one piece (docs/benchmarks.md, pipeline third round).
    tick_work_factor: float = 1.08
    # The busiest device's routed rows over an even share where `mesh.expert` splits the experts: the
    # step waits for it. bench_moe's 300-step trainings measured 1.35-1.47 on 4 GPUs (docs/benchmarks.md);
    # a router's balance depends on its training, so this is a typical value, not a property of the model.
    expert_imbalance: float = 1.4
    # A rolled layer loop (`model.scan_unroll` below the layers) without remat: the layers' work grows
    # by this share over the same loop unrolled (the stacked activations written and read through the
    # loop's buffers, fusions that cannot cross a layer). llama3_8b on 4 x H200, three layouts rolled
    # and unrolled: 10-12% of the layers' predicted work (docs/benchmarks.md, seventh session).
    rolled_loop: float = 0.11

    def replace(self, **changes) -> "Efficiency":
        return dataclasses.replace(self, **changes)


# --------------------------------------------------------------------------- results


@dataclass(frozen=True)
class Collective:
    """One kind of collective on one mesh axis, per step and per device."""

    axis: str
    kind: str
    what: str  # e.g. "layer weights (ZeRO-3)"
    count: int  # how many run per step
    result_bytes: float  # summed results per device, as collectives_per_step counts them
    wire_bytes: float  # bytes one device sends
    seconds: float  # at the link the axis crosses
    link: str  # "intra-host" or "inter-host"
    exposed_s: float  # what the step waits for
    why: str  # why that much is exposed


@dataclass(frozen=True)
class StepTime:
    """A predicted training step, per device (see the module docstring)."""

    hardware: str
    compute_s: float  # matmuls, attention, elementwise and remat, at their achieved rates
    compute_parts: dict  # name -> seconds
    collectives: tuple[Collective, ...]
    bubble_fraction: float
    bubble_s: float
    exposed_s: float  # the collectives' exposed seconds, summed
    step_s: float
    tokens_per_step: int
    flops_per_step: float  # metrics.py's count (no recomputation), all devices
    devices: int
    peak_flops: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_s

    @property
    def tflops_per_device(self) -> float:
        return self.flops_per_step / self.devices / self.step_s / 1e12

    @property
    def mfu(self) -> float:
        return self.flops_per_step / self.devices / self.step_s / self.peak_flops

    def bytes_by_kind(self) -> dict[str, float]:
        """{kind: result bytes per device per step}, summed over the axes."""
        out: dict[str, float] = {}
        for c in self.collectives:
            out[c.kind] = out.get(c.kind, 0.0) + c.result_bytes
        return out

    def describe(self) -> str:
        lines = [f"step {self.step_s * 1e3:.1f} ms on {self.hardware}: {self.tokens_per_s:,.0f} tokens/s, "
                 f"{self.tflops_per_device:.0f} TFLOP/s per device, MFU {self.mfu:.1%}",
                 "  compute: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in self.compute_parts.items())]
        if self.bubble_fraction:
            lines.append(f"  pipeline bubble {self.bubble_fraction:.1%} ({self.bubble_s * 1e3:.1f} ms)")
        for c in self.collectives:
            lines.append(f"  {c.axis:<9} {c.kind:<18} {c.count:>5} x {c.result_bytes / 2**20:>10.1f} MiB, "
                         f"{c.seconds * 1e3:7.1f} ms {c.link}, exposed {c.exposed_s * 1e3:6.1f} ms: {c.what}; {c.why}")
        return "\n".join(lines)


# --------------------------------------------------------------------------- the layout, as numbers


@dataclass(frozen=True)
class Shape:
    """What the prediction needs from a config and a mesh, read once."""

    mesh: dict
    batch: int
    seq: int
    layers: int
    d_model: int
    heads: int
    kv_heads: int
    head_dim: int
    d_ff: int
    vocab: int
    remat: str
    scan_unroll: int
    compute_bytes: int
    param_bytes: int
    layer_params: int  # matmul parameters of one layer
    embed_params: int
    head_params: int
    other_params: int  # norm scales and the like
    zero_stage: int
    reshard_after_forward: bool
    sequence_parallel: bool
    pipeline: str | None
    microbatches: int
    repeats: int
    head_split: bool
    context_mode: str | None
    keep_kv: bool
    attention_impl: str
    document_mask: bool
    flops_per_token: float
    attention_flops_per_token: float  # attention's share of flops_per_token (the family's shape)
    context_numbers: int  # what context parallelism moves of a token, per device (AttentionShape.context_numbers)
    dcn: dict
    # Mixture of experts (0 experts: dense). Routed expert weights in the whole model, all experts and
    # the share a token uses (`layer_params` counts the latter, as FLOPs do).
    experts: int = 0
    top_k: int = 0
    moe_layers: int = 0
    routed_params: int = 0
    routed_active_params: int = 0
    dispatch: str = "padded"
    exchange: str = "auto"
    headroom: float = 2.0
    expert_split: str = "experts"  # parallel.expert_split: what the expert axis splits
    expert_d_ff: int = 0
    # The optimizer (ushard/training/optim.py's registry entry): float32 words it reads and writes per
    # parameter per step (AdamW: p, g, m, v in; p, m, v out), and Muon's Newton-Schulz FLOPs per step
    # over the whole model, split over `newton_schulz_ways` devices (its owners; 1: every device
    # iterates whole matrices it holds whole, or XLA splits the products as the momentum is split).
    optimizer: str = "adamw"
    optimizer_words: float = 7
    newton_schulz_flops: float = 0.0
    newton_schulz_ways: int = 1
    # Muon's owners: the momenta of its matrices (`muon_matrix_params`, in the iteration's dtype) go
    # to their owners over these axes and back, an all-to-all each way ("": none, gspmd or unsplit).
    muon_owner_axes: tuple = ()
    muon_matrix_params: int = 0
    newton_schulz_bytes: int = 2

    @property
    def devices(self) -> int:
        n = 1
        for size in self.mesh.values():
            n *= size
        return n

    def size(self, axis: str) -> int:
        return self.mesh.get(axis, 1)

    @property
    def batch_ways(self) -> int:
        return self.size("data") * self.size("fsdp") * self.size("expert")

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + self.embed_params + self.head_params + self.other_params


def shape_of(config, mesh_shape: dict | None = None, model=None) -> Shape:
    """The `Shape` of a config on `mesh_shape` ({axis: size}, absent axes 1). Parameters and FLOPs are
    counted from the model's own shapes (`model`, a ModelDef; by default the config's) and its
    family's attention (ushard/models/family.py)."""
    from ushard.config import pipeline_head_split
    from ushard.models.config import ModelConfig
    from ushard.models.definition import model_definition

    m = ModelConfig.from_config(config.model)
    model = model or model_definition(m)
    p, t = config.parallel, config.train
    if mesh_shape is None:
        raise ValueError("shape_of needs the mesh's shape, e.g. {'fsdp': 4} (a Setup has it)")
    mesh = {a: int(mesh_shape.get(a, 1)) for a in AXIS_ORDER}
    embed, head = m.vocab_size * m.d_model, (0 if m.tie_embeddings else m.vocab_size * m.d_model)
    matmul, total = model.num_matmul_params(), model.num_params()
    layer = (matmul - head) // m.n_layers
    other = max(0, total - m.n_layers * layer - embed - head)
    stages = mesh.get("pipeline", 1)
    routed = _routed_params(model) if m.moe.num_experts else 0
    return Shape(
        mesh=mesh, batch=t.batch_size, seq=t.seq_len, layers=m.n_layers, d_model=m.d_model, heads=m.n_heads,
        kv_heads=m.n_kv_heads, head_dim=m.head_dim, d_ff=m.d_ff, vocab=m.vocab_size, remat=m.remat,
        scan_unroll=m.scan_unroll, compute_bytes=_BYTES[str(m.compute_dtype)], param_bytes=_BYTES[str(m.param_dtype)],
        layer_params=layer, embed_params=embed, head_params=head, other_params=other,
        zero_stage=p.zero_stage, reshard_after_forward=bool(p.reshard_after_forward),
        sequence_parallel=bool(p.sequence_parallel) and mesh.get("tensor", 1) > 1,
        pipeline=p.pipeline_schedule if stages > 1 else None, microbatches=p.pipeline_microbatches,
        repeats=p.pipeline_repeats if p.pipeline_schedule == "circular" else 1,
        head_split=stages > 1 and pipeline_head_split(config),
        context_mode=p.context_parallel if mesh.get("sequence", 1) > 1 else None,
        keep_kv=bool(p.context_keep_kv), attention_impl=m.attention_impl, document_mask=bool(m.document_mask),
        flops_per_token=model.flops_per_token(t.seq_len),
        attention_flops_per_token=model.attention_flops_per_token(t.seq_len),
        context_numbers=model.family.attention_shape(m).context_numbers(m.n_kv_heads, mesh.get("tensor", 1)),
        dcn={a: int(config.mesh.dcn[a]) for a in AXIS_ORDER if a in config.mesh.dcn},
        experts=m.moe.num_experts, top_k=m.moe.top_k, moe_layers=m.moe_layers if m.moe.num_experts else 0,
        routed_params=routed, routed_active_params=routed // max(1, m.moe.num_experts) * m.moe.top_k,
        dispatch=m.moe.dispatch, exchange=m.moe.exchange, headroom=m.moe.dispatch_headroom,
        expert_split=p.expert_split, expert_d_ff=m.expert_d_ff if m.moe.num_experts else 0,
        **_optimizer_fields(config, model, mesh),
    )


def _optimizer_fields(config, model, mesh: dict[str, int]) -> dict:
    """The Shape's optimizer fields: the registry entry's words per parameter (AdamW's for the
    parameters Muon does not take) and Muon's iteration FLOPs, spread over its owners: the devices
    that split the optimizer state (ZeRO >= 1 over fsdp, tensor, pipeline, expert) unless
    optim.muon.layout='gspmd' (then XLA splits the products as the momentum is: the same share, at a
    matmul efficiency the model does not know; counted alike)."""
    import jax

    from ushard.training import muon
    from ushard.training.optim import OPTIMIZERS

    o = config.optim
    entry = OPTIMIZERS[o.name]
    if o.name != "muon":
        return {"optimizer": o.name, "optimizer_words": entry.update_words}
    names = jax.tree.leaves(model.logical, is_leaf=lambda x: isinstance(x, tuple))
    sizes = [x.size for x in jax.tree.leaves(model.shapes)]
    taken = sum(n for n, logical in zip(sizes, names) if entry.takes(logical))
    words = (entry.update_words * taken + OPTIMIZERS["adamw"].update_words * (sum(sizes) - taken)) / max(sum(sizes), 1)
    axes = [a for a in ("pipeline", "fsdp", "expert", "tensor") if mesh.get(a, 1) > 1
            and (a != "fsdp" or config.parallel.zero_stage >= 1)]
    owners = () if o.muon.layout == "gspmd" else tuple(axes)
    return {"optimizer": "muon", "optimizer_words": words,
            "newton_schulz_flops": muon.newton_schulz_flops(model.shapes, muon.matrix_layouts(model.logical),
                                                            o.muon.ns_steps),
            "newton_schulz_ways": math.prod(mesh[a] for a in axes), "muon_owner_axes": owners,
            "muon_matrix_params": taken, "newton_schulz_bytes": 2 if o.muon.ns_dtype == "bfloat16" else 4}


def _routed_params(model) -> int:
    """The routed experts' weights (logical axis `experts`) in the whole model."""
    import jax

    names = jax.tree.leaves(model.logical, is_leaf=lambda x: isinstance(x, tuple))
    return sum(s.size for n, s in zip(names, jax.tree.leaves(model.shapes)) if "experts" in n)


def _attention_kernel(s: Shape, platform: str) -> str:
    """The kernel attention runs on `platform` (ushard/kernels/attention.py's rules), and the blocks of
    a split sequence XLA's where the fused kernel cannot run them."""
    from ushard.kernels import attention as kernels

    dtype = {2: "bfloat16", 4: "float32"}[s.compute_bytes]
    name = kernels.resolve(s.attention_impl, platform, dtype, s.seq, in_stage=s.pipeline is not None,
                           head_dim=s.head_dim, split=bool(s.context_mode), documents=s.document_mask)
    if s.context_mode and name != "xla":
        blocks, _ = kernels.block_kernel(name, dtype, s.seq, s.size("sequence"), s.document_mask)
        name = name if blocks is not None else "xla"
    return name


# --------------------------------------------------------------------------- compute


def _recompute(remat: str) -> tuple[float, float, float]:
    """Shares of the forward pass the backward pass recomputes, under `remat`: (matmuls, attention,
    elementwise). "dots*" keep the weight matmuls' outputs; "dots_attention" the attention kernel's
    too; everything else in a layer is recomputed where a policy is set."""
    return {"none": (0.0, 0.0, 0.0), "full": (1.0, 1.0, 1.0), "dots": (0.0, 1.0, 1.0),
            "dots_no_batch": (0.0, 1.0, 1.0)}.get(remat, (0.0, 0.0, 1.0))


def _elementwise_bytes(s: Shape, tokens: float) -> tuple[float, float]:
    """(forward, backward) bytes the layers' work outside matmuls and attention moves for `tokens`
    tokens (tools/ceilings.py's `elementwise_bytes`, the same count): norms with their residual adds,
    rotary, SwiGLU; plus the loss (3 passes over the logits) in the backward share."""
    row, mlp_row = s.compute_bytes * tokens * s.d_model, s.compute_bytes * tokens * s.d_ff
    qk_rows = s.compute_bytes * tokens * (s.heads + s.kv_heads) * s.head_dim
    forward = s.layers * (8 * row + 2 * qk_rows + 3 * mlp_row)
    backward = s.layers * (12 * row + 2 * qk_rows + 5 * mlp_row) + 3 * s.compute_bytes * tokens * s.vocab
    return forward, backward


def _saved_bytes_per_token_layer(s: Shape) -> float:
    """What a layer keeps for its backward pass per token under a remat policy: the matmul outputs for
    the "dots" policies, only the layer's input for "full"."""
    if s.remat == "full":
        return s.compute_bytes * s.d_model
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    return s.compute_bytes * (3 * s.d_model + q + 2 * kv + 2 * s.d_ff)


def compute_parts(s: Shape, hw: Hardware, eff: Efficiency) -> dict[str, float]:
    """Seconds of one device's work per step, by part (all devices do equal work: the batch, heads,
    sequence and stages split it evenly; the pipeline head is split over the stages)."""
    n = s.devices
    tokens = s.tokens / n  # one device's share of the work, in tokens
    mm_re, attn_re, elem_re = _recompute(s.remat)
    matmul_flops = 6 * (s.layers * s.layer_params + s.head_params) * tokens
    matmul_flops += 2 * s.layers * s.layer_params * tokens * mm_re
    attention_flops = s.attention_flops_per_token * tokens * (1 + attn_re / 3)
    kernel = _attention_kernel(s, hw.platform)
    if kernel == "cudnn" and s.document_mask:
        # cuDNN takes documents only as a dense [T, T] mask and computes every block, the causal
        # half's work twice over (llama3_8b on 4 x H200: 2.2 times the kernel's time without the mask,
        # docs/benchmarks.md).
        attention_flops *= 2
    rate = attention_rate(kernel, s.seq, hw, eff)
    forward, backward = _elementwise_bytes(s, tokens)
    optimizer = s.optimizer_words * 4 * s.params / _state_ways(s)
    parts = {
        "matmul": matmul_flops / (eff.matmul * hw.peak_flops),
        f"attention ({kernel})": attention_flops / rate,
        "elementwise": (forward * (1 + elem_re) + backward) / (eff.elementwise * hw.hbm_bw),
        "optimizer": optimizer / (eff.elementwise * hw.hbm_bw),
    }
    if s.newton_schulz_flops:
        parts["optimizer"] += s.newton_schulz_flops / s.newton_schulz_ways / (eff.matmul * hw.peak_flops)
    expert_flops = (6 + 2 * mm_re) * s.routed_active_params * tokens
    if s.experts and s.size("expert") > 1 and s.expert_split == "experts":
        parts["busiest expert device"] = (eff.expert_imbalance - 1) * expert_flops / (eff.matmul * hw.peak_flops)
    if s.experts and s.expert_split == "width":
        # The Pallas kernels run each device's slice of the experts padded to their column multiple.
        grown = padding_growth((s.expert_d_ff // expert_width_ways(s.mesh, s.expert_split),)) - 1
        if grown:
            parts["expert width padding"] = grown * expert_flops / (eff.matmul * hw.peak_flops)
    stages = s.size("pipeline")
    if stages > 1 and not s.head_split:
        # The head whole on every stage (parallel.pipeline_head="whole"): one stage computes it for every
        # microbatch while the others wait, not a 1/stages share of it each.
        parts["head on one stage"] = (stages - 1) * 6 * s.head_params * tokens / (eff.matmul * hw.peak_flops)
    tensor = s.size("tensor")
    if tensor > 1:
        parts["tensor-parallel overhead"] = parts["matmul"] * eff.tensor_overhead * (1 - 1 / tensor)
    if s.scan_unroll < s.layers and s.remat != "none":
        # A scanned loop copies its stacked saved activations once more (docs/benchmarks.md,
        # "unrolling the layer loop"): read and write.
        saved = _saved_bytes_per_token_layer(s) * tokens * s.layers
        parts["scan copies"] = 2 * saved / hw.hbm_bw
    elif s.scan_unroll < s.layers:  # without remat (`Efficiency.rolled_loop`)
        layers = sum(t for name, t in parts.items() if name != "optimizer")
        parts["rolled layer loop"] = eff.rolled_loop * layers
    return parts


def attention_rate(kernel: str, length: int, hw: Hardware, eff: Efficiency) -> float:
    """Attention FLOP/s (metrics.py's count) of `kernel` on sequences of `length` tokens."""
    share, half = eff.attention.get(kernel, eff.attention["xla"])
    return share * length / (length + half) * hw.peak_flops


def _state_ways(s: Shape) -> int:
    """How many ways the optimizer state is split: ZeRO >= 1 over fsdp, and tensor and pipeline."""
    return (s.size("fsdp") if s.zero_stage >= 1 else 1) * s.size("tensor") * s.size("pipeline")


# --------------------------------------------------------------------------- collectives


def hosts_of(s: Shape, devices_per_host: int, hosts_of_axes: dict | None = None) -> dict[str, int]:
    """How many hosts each mesh axis spans: as given, else config.mesh.dcn where set, else the devices
    laid out innermost axis first (tensor, sequence, expert, fsdp, data, pipeline) on hosts of
    `devices_per_host`."""
    out, inner = {}, 1
    for axis in reversed(AXIS_ORDER):
        size = s.size(axis)
        outer = inner * size
        out[axis] = max(1, min(size, -(-outer // devices_per_host) // max(1, -(-inner // devices_per_host))))
        inner = outer
    for axis, hosts in (s.dcn or {}).items():
        if hosts > 1:
            out[axis] = hosts
    out.update(hosts_of_axes or {})
    return out


def _ring(kind: str, size: float, ways: int) -> tuple[float, float]:
    """(result bytes, wire bytes) of one collective over `ways` devices on an array of `size` bytes
    (the whole array: gathered, or before it is reduced)."""
    share = (ways - 1) / ways
    if kind == "all-gather":
        return size, share * size
    if kind == "reduce-scatter":
        return size / ways, share * size
    if kind == "all-reduce":
        return size, 2 * share * size
    return size, size  # all-to-all, collective-permute: what is sent


@dataclass
class _Item:
    axis: str
    kind: str
    what: str
    count: int
    size: float  # bytes of one collective's whole array (see _ring): the step moves count x that
    overlap: str  # "prefetch", "backward", "exposed", "permute", "pipeline"
    why: str


def collective_items(s: Shape) -> list[_Item]:
    """Every collective of a step, per axis, from the layout (one device's view)."""
    items: list[_Item] = []
    stages = s.size("pipeline")
    layers = s.layers // stages  # one device's layers
    tensor = s.size("tensor")
    # Weights as one tensor rank holds them (the layer matmuls, embedding and head split over tensor;
    # of the routed experts, all of them, split over `expert`, not a token's share).
    routed = (s.routed_params / s.size("expert") - s.routed_active_params) / stages
    rank_params = (layers * s.layer_params + routed + (s.embed_params + s.head_params) / stages) / tensor
    items += _weight_items(s, rank_params, layers)
    items += _tensor_items(s, layers)
    items += _context_items(s, layers)
    items += _pipeline_items(s)
    items += _expert_items(s)
    items += _optimizer_items(s)
    return items


def _optimizer_items(s: Shape) -> list[_Item]:
    """Muon's matrices moved whole onto their owners and back (ushard/training/muon.py, `Owners`):
    two all-to-alls of one device's share of them, after the backward pass, before the update. Put
    on the widest owner axis (the links of a multi-axis group are the model's simplification)."""
    if not s.muon_owner_axes:
        return []
    axis = max(s.muon_owner_axes, key=s.size)
    share = s.muon_matrix_params * s.newton_schulz_bytes / s.newton_schulz_ways
    return [_Item(axis, "all-to-all", "Muon's matrices to their owners and back", 2, share, "exposed",
                  "between the backward pass and the update: nothing to hide behind")]


def _expert_items(s: Shape) -> list[_Item]:
    """Routed rows to the devices holding their experts and back (ushard/parallel/expert.py), in the
    forward pass and again transposed in the backward pass (the exchanged rows are kept under remat):
    per MoE layer four all-to-alls of buffers, or with `exchange="all_gather"` or the experts' width
    split (parallel.expert_split) the expert group's tokens gathered and the outputs reduce-scattered
    (and their transposes). The busiest device's extra rows (an uneven router) are compute, charged
    in `compute_parts` ("busiest expert device"), not here."""
    ways = s.size("expert")
    if not s.experts or ways == 1:
        return []
    layers = s.moe_layers // s.size("pipeline")
    tokens = _rows_per_device(s) * s.seq / s.size("sequence")
    row = s.d_model * s.compute_bytes
    why = "the experts wait for their rows, and the layer's output for the experts: nothing to hide behind"
    if s.expert_split == "width" or (s.dispatch == "ragged" and s.exchange == "all_gather"):
        size = tokens * ways * row
        return [_Item("expert", "all-gather", "the expert group's tokens (and output gradients)", 2 * layers, size,
                      "exposed", why),
                _Item("expert", "reduce-scatter", "the experts' outputs (and token gradients)", 2 * layers, size,
                      "exposed", why)]
    if s.dispatch == "ragged":  # a buffer per pair of devices, headroom times an even share
        size = s.headroom * tokens * s.top_k * row
    else:  # fixed capacity: every local token's slot for every expert (dropless)
        size = s.experts * tokens * row
    return [_Item("expert", "all-to-all", "routed rows there and back", 4 * layers, size, "exposed", why)]


def _weight_items(s: Shape, rank_params: float, layers: int) -> list[_Item]:
    """ZeRO over fsdp, replicas over data, and the gradient sum over sequence (a batch axis to the weights)."""
    out: list[_Item] = []
    fsdp, grads = s.size("fsdp"), rank_params * s.param_bytes
    if fsdp > 1 and s.zero_stage >= 3:
        gathers = 1
        if s.reshard_after_forward and s.remat != "none":
            gathers = 2  # again for the backward pass (without remat XLA merges it with the forward's)
        if s.pipeline in ("gpipe", "circular"):
            gathers *= s.microbatches * s.repeats  # a stage's weights are gathered each tick; 1F1B once a step
        out.append(_Item("fsdp", "all-gather", "layer weights (ZeRO-3)", gathers * layers,
                         rank_params * s.compute_bytes / layers, "prefetch",
                         "prefetched a layer ahead; hidden where a layer's compute outlasts its gather"))
    if fsdp > 1 and s.zero_stage >= 1:
        out.append(_Item("fsdp", "reduce-scatter", "gradients", layers, grads / layers, "backward",
                         "issued as each layer's gradients are ready, under the backward pass"))
        if s.zero_stage < 3:
            out.append(_Item("fsdp", "all-gather", "updated weights (ZeRO-1/2)", layers, grads / layers, "exposed",
                             "after the optimizer update, nothing left to hide behind"))
    elif fsdp > 1:
        out.append(_Item("fsdp", "all-reduce", "gradients (ZeRO-0)", layers, grads / layers, "backward",
                         "issued as each layer's gradients are ready, under the backward pass"))
    for axis in ("data", "sequence", "expert"):
        if s.size(axis) > 1:
            shard = grads / (fsdp if s.zero_stage >= 2 else 1)
            if axis == "expert":  # the routed experts are not replicas over it: each device holds its own
                shard -= s.routed_params / s.size("expert") / s.size("tensor") * s.param_bytes / (
                    fsdp if s.zero_stage >= 2 else 1)
            out.append(_Item(axis, "all-reduce", "gradients (replicas)", layers, shard / layers, "backward",
                             "issued as each layer's gradients are ready, under the backward pass"))
    return out


def _rows_per_device(s: Shape) -> float:
    return s.batch / s.batch_ways


def _tensor_items(s: Shape, layers: int) -> list[_Item]:
    """Megatron: two activation reductions a layer forward and two backward (and the forward's again
    under remat "full"); with SP each is an all-gather before and a reduce-scatter after."""
    tensor = s.size("tensor")
    if tensor == 1:
        return []
    act = _rows_per_device(s) * s.seq / s.size("sequence") * s.d_model * s.compute_bytes
    # Under any remat policy the backward pass runs the forward's two again: the policies keep the split
    # matmuls' outputs, which are partial sums before the reduction (docs/benchmarks.md, two H100s).
    per_layer = 4 + (2 if s.remat != "none" else 0)
    count = per_layer * layers + 2 * (1 if s.pipeline is None else 0)  # embedding lookup, head's input gradient
    why = "on the critical path: the next matmul needs the reduced activations"
    if s.sequence_parallel:
        return [_Item("tensor", "all-gather", "activations (SP)", count, act, "exposed", why),
                _Item("tensor", "reduce-scatter", "activations (SP)", count, act, "exposed", why)]
    return [_Item("tensor", "all-reduce", "activations", count, act, "exposed", why)]


def _context_items(s: Shape, layers: int) -> list[_Item]:
    """The sequence axis: K and V around the ring (and dK, dV back) or gathered (dK, dV reduce-scattered);
    for latent attention its latents instead (`Shape.context_numbers`)."""
    ways = s.size("sequence")
    if ways == 1:
        return []
    rows = _rows_per_device(s)
    kv = rows * s.seq / ways * s.context_numbers * s.compute_bytes
    forwards = 2 if s.remat == "full" else 1
    if s.context_mode == "ring":
        hops = ways - 1
        sends = layers * hops * (forwards + (0 if s.keep_kv else 1) + 1)
        return [_Item("sequence", "collective-permute", "K/V blocks and their gradients (ring)", sends, kv, "permute",
                      "XLA's transfers on GPUs hide only a few % behind the blocks' compute")]
    gathers = layers * (forwards + (0 if s.keep_kv else 1))
    return [_Item("sequence", "all-gather", "K/V (all-gather context)", gathers, kv * ways, "prefetch",
                  "issued before the attention that needs it; hides behind the layer's other work"),
            _Item("sequence", "reduce-scatter", "dK/dV (all-gather context)", layers, kv * ways, "backward",
                  "under the rest of the backward pass")]


def _pipeline_items(s: Shape) -> list[_Item]:
    """A microbatch's activations to the next stage and its gradient back, once a tick each."""
    stages = s.size("pipeline")
    if stages == 1:
        return []
    mb_act = _rows_per_device(s) / s.microbatches * s.seq / s.size("sequence") * s.d_model * s.compute_bytes
    ticks = _ticks(s)
    out = [_Item("pipeline", "collective-permute", "activations and their gradients between stages", 2 * ticks,
                 mb_act / s.size("tensor") if s.sequence_parallel else mb_act, "pipeline",
                 "point-to-point sends do not overlap compute in XLA on GPUs")]
    if s.head_split:
        out.append(_Item("pipeline", "all-reduce", "the vocabulary-split head's input and its gradient",
                         2 * s.microbatches, mb_act, "exposed", "each tick's head waits for it"))
    return out


def _ticks(s: Shape) -> int:
    stages = s.size("pipeline")
    if s.pipeline == "1f1b":
        return s.microbatches + 2 * stages - 2
    return s.repeats * s.microbatches + stages - 1


# --------------------------------------------------------------------------- putting it together


def _link_seconds(item: _Item, ways: int, hosts: int, hw: Hardware) -> tuple[float, float, float, str]:
    result, wire = _ring(item.kind, item.size, ways)
    inter = hosts > 1
    if item.kind == "collective-permute":
        bw = hw.inter_host_bw if inter else hw.p2p_bw
    else:
        bw = hw.inter_host_bw if inter else hw.intra_host_bw
        if item.kind == "all-reduce" and not inter:
            bw *= hw.all_reduce_speedup
    return item.count * result, item.count * wire, item.count * wire / bw, "inter-host" if inter else "intra-host"


def _exposed(item: _Item, seconds: float, layer_compute_s: float, layers: int, eff: Efficiency,
             cores: str = "SMs") -> tuple[float, str]:
    """The seconds of `item` the step waits for, and why."""
    if item.overlap == "exposed":
        return seconds, item.why
    if item.overlap == "pipeline":
        return seconds, item.why
    if item.overlap == "permute":
        return seconds * (1 - eff.permute_hidden), item.why
    per_layer = seconds / max(1, layers)
    # The first layer's has nothing before it; the others hide behind the layer before, up to its compute.
    waiting = per_layer + max(0.0, per_layer - layer_compute_s) * (layers - 1)
    hidden = seconds - waiting
    exposed = waiting + eff.contention * hidden
    verdict = "hidden" if per_layer <= layer_compute_s else "exposed: a layer's transfer outlasts its compute"
    return exposed, f"{item.why} ({verdict}; {eff.contention:.0%} of the hidden time still costs shared {cores})"


def predict(setup_or_config, hw: Hardware | str = "h100", *, mesh_shape: dict | None = None,
            hosts_of_axes: dict | None = None, efficiency: Efficiency | None = None) -> StepTime:
    """The predicted step of a `Setup` (ushard.build's) or of a config on `mesh_shape`, on `hw` (a
    `Hardware` or a preset's name). `hosts_of_axes` says how many hosts an axis spans where the default
    (innermost axes inside a host, config.mesh.dcn) is not the machine's."""
    hw = hardware(hw) if isinstance(hw, str) else hw
    eff = efficiency or Efficiency()
    s = _shape(setup_or_config, mesh_shape)
    parts = compute_parts(s, hw, eff)
    compute = sum(parts.values())
    stages = s.size("pipeline")
    bubble = 0.0
    if stages > 1:
        bubble = bubble_fraction(s.pipeline, stages, s.microbatches, s.repeats)
        ticks = _ticks(s) if s.pipeline != "1f1b" else s.microbatches + stages - 1
        parts["pipeline ticks"] = compute * (eff.tick_work_factor - 1) + ticks * eff.tick_overhead_s
        compute = sum(parts.values())
    layers = max(1, s.layers // stages)
    layer_compute = compute / layers
    hosts = hosts_of(s, hw.devices_per_host, hosts_of_axes)
    collectives = []
    s = dataclasses.replace(s, exchange=resolved_exchange(s.exchange, hw.platform))
    for item in collective_items(s):
        result, wire, seconds, link = _link_seconds(item, s.size(item.axis), hosts[item.axis], hw)
        exposed, why = _exposed(item, seconds, layer_compute, layers, eff, hw.cores)
        collectives.append(Collective(item.axis, item.kind, item.what, item.count, result, wire, seconds, link,
                                      exposed, why))
    exposed = sum(c.exposed_s for c in collectives)
    busy = compute + exposed
    bubble_s = busy * bubble / (1 - bubble) if bubble else 0.0
    return StepTime(hw.name, compute, parts, tuple(collectives), bubble, bubble_s, exposed, busy + bubble_s,
                    s.tokens, s.flops_per_token * s.tokens, s.devices, hw.peak_flops)


def _shape(setup_or_config, mesh_shape: dict | None) -> Shape:
    if hasattr(setup_or_config, "layout"):  # a Setup
        setup = setup_or_config
        return shape_of(setup.config, dict(setup.layout.mesh.shape), setup.model)
    return shape_of(setup_or_config, mesh_shape)
