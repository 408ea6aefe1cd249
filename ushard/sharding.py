"""Logical axis names -> mesh axes: the rules, the Layout that applies them, and the divisibility check.

The rules are plain data, one `(logical name, mesh axes)` pair per name, every name present. ZeRO is
expressed here and nowhere else: a stage decides which kinds of training state map `embed` onto the
`fsdp` axis (stage 1: optimizer state; 2: + gradients; 3: + parameters). The `data` axis never shards
state, so data x fsdp is HSDP.

Tensor parallelism is Megatron's layout written as rules: q/k/v and the MLP's input projections split
by columns (`heads`, `kv_heads`, `mlp` -> tensor), the attention and MLP output projections by rows (the
same names on their input dimension), the embedding table and LM head by `vocab`. With sequence
parallelism the residual stream between the blocks (`act_residual_length`) is also split along its
length over `tensor`, so each block's all-reduce becomes a reduce-scatter into the residual stream and
an all-gather out of it, and the norms and residual adds run on 1/tensor of the tokens.

A `Layout` is a mesh plus those tables. Model code calls `constrain(x, names)` and `gathered(w, names)`
with logical names only; they resolve against the layout active while a step is traced (`use_layout`)
and are no-ops outside one (plain eager use). Parallel code (shard_map) asks the layout which mesh axes
a logical name maps to (`current_layout().axes(name)`), never a hard-coded axis.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ushard.errors import UserError

if TYPE_CHECKING:
    from ushard.parallel.pipeline import PipelineSchedule
    from ushard.plan import ParallelPlan

WEIGHT_NAMES = ("embed", "heads", "kv_heads", "head_dim", "mlp", "vocab", "layers", "experts", "expert_mlp", "norm",
                "latent")
ACTIVATION_NAMES = (
    "act_batch", "act_length", "act_residual_length", "act_embed", "act_heads", "act_kv_heads", "act_head_dim",
    "act_mlp", "act_vocab",
)
# The logical names of a global batch of token ids [batch, length]: its sharding follows their rules.
BATCH_NAMES = ("act_batch", "act_length")
# The dimensions of any activation [batch, length, ...] that index its tokens: the batch's own names.
TOKEN_NAMES = BATCH_NAMES
# Attention's queries [batch, length, heads, head_dim] and keys / values [batch, length, kv_heads, head_dim].
Q_NAMES = ("act_batch", "act_length", "act_heads", "act_head_dim")
KV_NAMES = ("act_batch", "act_length", "act_kv_heads", "act_head_dim")
# The LM head's logits [batch, length, vocab].
LOGITS_NAMES = ("act_batch", "act_length", "act_vocab")
# The same [batch, length] as the residual stream between the blocks lays it out (sequence parallelism).
RESIDUAL_NAMES = ("act_batch", "act_residual_length")
# The kinds of arrays a layout places. "compute": weights as the matmuls use them (gathered: no ZeRO
# split over fsdp, tensor-parallel splits kept) and every activation.
KINDS = ("params", "grads", "opt_state", "compute")

Rules = tuple  # tuple[tuple[str, str | tuple[str, ...] | None], ...]


def expert_width_ways(mesh_shape: dict[str, int], expert_split: str) -> int:
    """How many ways the rules below split the experts' hidden width (`expert_mlp`): over `tensor`, and
    with parallel.expert_split="width" over `expert` too."""
    return mesh_shape.get("tensor", 1) * (mesh_shape.get("expert", 1) if expert_split == "width" else 1)


def logical_rules(shard_state_over_fsdp: bool, sequence_parallel: bool = False, split_kv_heads: bool = True,
                  pipeline_stages: bool = False, split_head: bool = True, expert_width: bool = False) -> Rules:
    """The full table. `shard_state_over_fsdp` is the ZeRO switch for one kind of training state;
    `sequence_parallel` splits the residual stream's length over `tensor` too; `split_kv_heads` is false
    when there are fewer KV heads than tensor ranks (see `kv_heads_split`); `pipeline_stages` splits the
    stacked layers into contiguous stages over the `pipeline` axis, and with `split_head` the
    vocabulary over it too (parallel.pipeline_head); `expert_width` (parallel.expert_split="width"):
    the `expert` axis splits every expert's hidden width instead of the experts."""
    vocab = ("pipeline", "tensor") if pipeline_stages and split_head else "tensor"
    return (
        # weights
        ("embed", "fsdp" if shard_state_over_fsdp else None),
        ("heads", "tensor"),
        ("kv_heads", "tensor" if split_kv_heads else None),
        ("head_dim", None),
        ("mlp", "tensor"),
        # With a pipeline, the vocabulary may be split over the stages too: every stage computes its
        # share of the embedding lookup, head and loss (ushard/parallel/pipeline.py).
        ("vocab", vocab),
        ("layers", "pipeline" if pipeline_stages else None),
        ("experts", None if expert_width else "expert"),
        ("expert_mlp", ("expert", "tensor") if expert_width else "tensor"),
        ("norm", None),
        # Latent attention's up-projections' input (ushard/models/mla.py): split like `embed`, the
        # other weights' input, so that ZeRO-3 splits those weights too.
        ("latent", "fsdp" if shard_state_over_fsdp else None),
        # activations; `expert` acts as a batch axis outside the MoE layers
        ("act_batch", ("data", "fsdp", "expert")),
        ("act_length", "sequence"),  # inside attention and the MLP
        ("act_residual_length", ("sequence", "tensor") if sequence_parallel else "sequence"),  # between them
        ("act_embed", None),
        ("act_heads", "tensor"),
        ("act_kv_heads", "tensor"),
        ("act_head_dim", None),
        ("act_mlp", "tensor"),
        ("act_vocab", vocab),
    )


@dataclass(frozen=True)
class ZeroRules:
    """One rules table per kind of array, chosen by the ZeRO stage (pure data: no devices needed).

    `keep_gathered` (ZeRO-3 with `parallel.reshard_after_forward=false`): the weights a layer gathers
    for its forward pass are kept for its backward pass instead of gathered again, half the all-gather
    traffic for one extra copy of the weights in the compute dtype.
    """

    params: Rules
    grads: Rules
    opt_state: Rules
    compute: Rules
    keep_gathered: bool = False

    @classmethod
    def for_stage(cls, stage: int, reshard_after_forward: bool = True, fsdp_size: int = 1,
                  sequence_parallel: bool = False, split_kv_heads: bool = True,
                  pipeline_size: int = 1, split_head: bool = True, expert_width: bool = False) -> "ZeroRules":
        def rules(shard_state_over_fsdp):
            return logical_rules(shard_state_over_fsdp, sequence_parallel, split_kv_heads, pipeline_size > 1,
                                 split_head, expert_width)

        return cls(
            params=rules(stage >= 3),
            grads=rules(stage >= 2),
            opt_state=rules(stage >= 1),
            compute=rules(False),
            # With one fsdp device nothing is gathered, so there is nothing to keep either.
            keep_gathered=stage >= 3 and not reshard_after_forward and fsdp_size > 1,
        )

    def table(self, kind: str) -> Rules:
        if kind not in KINDS:
            raise ValueError(f"kind {kind!r} is not one of {KINDS}")
        return getattr(self, kind)

    def with_rule(self, name: str, axes) -> "ZeroRules":
        """The same tables with `name` mapped to `axes` in each."""
        replace = lambda rules: tuple((n, axes if n == name else a) for n, a in rules)  # noqa: E731
        return dataclasses.replace(self, **{kind: replace(self.table(kind)) for kind in KINDS})

    def without_axes(self, axes) -> "ZeroRules":
        """The same tables with the mesh `axes` taken out of every rule."""
        def drop(rules):
            kept = {n: tuple(a for a in mesh_axes(n, rules) if a not in axes) for n, _ in rules}
            return tuple((n, kept[n] or None) for n, _ in rules)

        return dataclasses.replace(self, **{kind: drop(self.table(kind)) for kind in KINDS})


def mesh_axes(name: str | None, rules: Rules) -> tuple[str, ...]:
    """The mesh axes one logical name maps to, as a tuple (empty: not sharded)."""
    if name is None:
        return ()
    table = dict(rules)
    if name not in table:
        raise KeyError(f"logical axis {name!r} has no sharding rule; add it to ushard.sharding.logical_rules")
    axes = table[name]
    return () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)


def mesh_spec(logical_names, rules: Rules) -> PartitionSpec:
    """PartitionSpec for one array whose dimensions carry `logical_names` (None = unnamed, unsharded)."""
    entries = []
    for name in logical_names:
        axes = mesh_axes(name, rules)
        entries.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return PartitionSpec(*entries)


def format_rules(rules: Rules) -> str:
    """The table as a user reads it: one `name -> axes` line per logical name."""
    width = max(len(n) for n, _ in rules)
    return "\n".join(f"  {name:<{width}} -> {axes}" for name, axes in rules)


class Expansion(NamedTuple):
    """Keys and values that each device makes from the arrays that travel between the devices (the
    context-parallel seam's `kv`), where that is less than the keys and values: latent attention's
    latent and shared RoPE key (ushard/models/mla.py). `expand(weights, kv) -> (k, v)` makes the keys
    and values of any block of tokens [B, t, ...] of those arrays, on one device's shards (no
    sharding constraints: it runs inside the seam's shard_map); `weights` is the pytree of the
    layer's arrays it uses, passed explicitly so that their gradient comes out too, `weight_names`
    their logical names (the same pytree of tuples; laid out as compute lays them out), `names` each
    travelling array's logical names."""

    expand: Callable
    weights: Any
    weight_names: Any
    names: tuple


@dataclass(frozen=True)
class Seams:
    """The parallel code a model reaches through the active layout, wired in by `build` from
    ushard/parallel (the model imports none of it): None where the layout needs none.

    run_stack(stage, stack, x, args, layout, tick_policy=None) -> (x, aux): the layer stack split into
    pipeline stages (`tick_policy`: the remat policy of a tick, ushard.models.stack.tick_policy).
    context_attention(q, kv, segment_ids, xla_block, block_kernel, window=0, expansion=None) -> out:
    attention over a sequence split over the devices, what travels between them `kv`: the keys and
    values (k, v), or with an `Expansion` the arrays each device makes them from.
    routed_experts(x, experts, gates, keep, weights, weight_names, expert_fn, row_capacity, dispatch,
    headroom) -> (y, overflow): an MoE layer's routed experts, wherever the layout puts them.
    """

    run_stack: Callable | None = None
    context_attention: Callable | None = None
    routed_experts: Callable | None = None


@dataclass(frozen=True)
class Layout:
    """A mesh and the rules for each kind of array: the one object every sharding is derived from.

    `pipeline` (ushard/parallel/pipeline.py) is the schedule that runs the layer stack when its
    `layers` axis is split into stages (mesh.pipeline > 1); None otherwise. `platform` is the devices'
    ("cpu", "gpu", "tpu"): kernels are chosen by it, not by JAX's default backend, which is the host's
    when a step is compiled ahead of time for TPU devices.
    """

    mesh: Mesh
    zero: ZeroRules
    pipeline: PipelineSchedule | None = None
    platform: str = "cpu"
    # Manual mesh axes over which other devices hold other rows of the same batch, in code that runs
    # each device's rows apart (a 1F1B stage slot): what `sum_over_rows` adds over.
    rows_apart: tuple[str, ...] = ()
    plan: ParallelPlan | None = None  # the run's decisions (None: a layout made without one, in tests)
    seams: Seams | None = None  # None: ushard's own parallel code (ushard.parallel.SEAMS)
    # Whether a split sequence's tokens are in zig-zag order (the train step reorders them once for
    # context parallelism's load balance; a model applied directly sees them in their own order).
    zigzag: bool = False

    def __post_init__(self):
        if self.seams is None:  # imported here: ushard.parallel builds on this module
            from ushard.parallel import SEAMS

            object.__setattr__(self, "seams", SEAMS)

    @classmethod
    def from_plan(cls, mesh: Mesh, plan: ParallelPlan, seams: Seams | None = None) -> "Layout":
        """The layout a `ParallelPlan` decides, reaching the parallel code through `seams`."""
        layout = cls.create(mesh, plan.zero_stage, plan.reshard_after_forward, plan.sequence_parallel,
                            split_kv=plan.split_kv_heads, pipeline=plan.pipeline, split_head=plan.pipeline_head_split,
                            expert_width=plan.expert_split == "width")
        # The plan's platform, not the devices': the planner traces another platform's kernels on stand-ins.
        return dataclasses.replace(layout, plan=plan, seams=seams, platform=plan.platform)

    @classmethod
    def create(cls, mesh: Mesh, zero_stage: int = 3, reshard_after_forward: bool = True,
               sequence_parallel: bool = False, n_kv_heads: int | None = None,
               pipeline: PipelineSchedule | None = None, split_head: bool = True,
               split_kv: bool | None = None, expert_width: bool = False) -> "Layout":
        """`n_kv_heads`: the model's, to decide whether its K/V weights split over `tensor` (None: they do)
        unless `split_kv` says; `split_head`: whether a pipeline's stages split the vocabulary
        (parallel.pipeline_head); `expert_width`: whether `expert` splits the experts' width
        (parallel.expert_split)."""
        if split_kv is None:
            split_kv = n_kv_heads is None or kv_heads_split(n_kv_heads, mesh.shape["tensor"])
        stages = mesh.shape["pipeline"]
        zero = ZeroRules.for_stage(zero_stage, reshard_after_forward, mesh.shape["fsdp"], sequence_parallel, split_kv,
                                   stages, split_head, expert_width)
        return cls(mesh, zero, pipeline if stages > 1 else None, mesh.devices.flat[0].platform)

    def inside_stage(self, weights_prepared: bool = False) -> "Layout":
        """The layout for code that runs inside one pipeline stage (a shard_map manual over the stage
        axis): the stage sees its own layers, unsplit, and shardings name the map's abstract mesh.
        `weights_prepared`: the schedule has gathered the stage's weights for compute already, so
        the layer stack does not gather (and keep) them again."""
        mesh = jax.sharding.get_abstract_mesh()
        zero = self.zero.with_rule("layers", None)
        if weights_prepared:
            zero = dataclasses.replace(zero, keep_gathered=False)
        return dataclasses.replace(self, mesh=mesh, zero=zero, pipeline=None)

    def per_group(self, axes) -> "Layout":
        """The layout for code vmapped over groups of rows, one group per device of the mesh `axes`
        (`jax.vmap(..., spmd_axis_name=axes)` places the group dimension on them, so the rules inside
        must not use them again)."""
        return dataclasses.replace(self, zero=self.zero.without_axes(axes))

    def axes(self, name: str | None, kind: str = "compute") -> tuple[str, ...]:
        """Which mesh axes the logical `name` maps to, for arrays of `kind` (KINDS)."""
        return mesh_axes(name, self.zero.table(kind))

    def size(self, name: str | None, kind: str = "compute") -> int:
        """How many ways the dimension named `name` is split."""
        return math.prod(self.mesh.shape[a] for a in self.axes(name, kind))

    def spec(self, names, kind: str = "compute") -> PartitionSpec:
        return mesh_spec(names, self.zero.table(kind))

    def sharding(self, names, kind: str = "compute") -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(names, kind))

    def shardings(self, logical_tree, kind: str):
        """A pytree of logical-name tuples -> the same pytree of NamedShardings."""
        return jax.tree.map(lambda names: self.sharding(names, kind), logical_tree,
                            is_leaf=lambda x: isinstance(x, tuple))

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())

    @property
    def batch(self) -> NamedSharding:
        """Where a global batch of token ids [batch, length] lives."""
        return self.sharding(BATCH_NAMES)


def kv_heads_split(n_kv_heads: int, tensor_size: int) -> bool:
    """Whether K/V weights split over the tensor axis by head: only when every rank gets whole KV heads.

    With fewer KV heads than tensor ranks (grouped-query attention, e.g. 8 KV heads on 16 ranks) the
    K/V weights stay whole on every rank and attention repeats each KV head for the tensor/n_kv_heads
    ranks whose query heads use it (`kv_head_copies`), so each rank computes only its own copy's
    projection and nothing is gathered. That needs tensor_size to be a multiple of n_kv_heads
    (checked in `ushard.config.validate`).
    """
    return n_kv_heads % tensor_size == 0


def with_shardings(shapes, shardings):
    """Abstract arrays (ShapeDtypeStructs) that carry the shardings to create or restore them with."""
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)


# --------------------------------------------------------------------------- the active layout

_ACTIVE = contextvars.ContextVar("ushard_layout", default=None)


@contextlib.contextmanager
def use_layout(layout: Layout | None):
    """Makes `constrain`, `gathered` and `current_layout` resolve against `layout` while a step is
    traced (None: no layout, as in plain eager use)."""
    token = _ACTIVE.set(layout)
    try:
        yield layout
    finally:
        _ACTIVE.reset(token)


def current_layout() -> Layout | None:
    """The layout of the step being traced; None in plain eager use (one device, nothing to place)."""
    return _ACTIVE.get()


def split_ways(logical_name: str) -> int:
    """How many ways the active layout splits the dimension called `logical_name` (1 outside a layout)."""
    layout = current_layout()
    return 1 if layout is None else layout.size(logical_name)


def sum_over_rows(x: jax.Array) -> jax.Array:
    """x summed over the batch's rows that other devices run apart from this one's (`Layout.rows_apart`):
    how a layer computes a statistic of the whole (micro)batch, such as an MoE layer's expert shares,
    where a map runs each device's rows on their own. x itself elsewhere (the compiler sums there)."""
    layout = current_layout()
    if layout is None or not layout.rows_apart:
        return x
    # Typed as differing between the devices again, as everything computed from the rows is: the
    # gradient of each device's use of the sum then adds over all of them (the cast's transpose).
    return varying(jax.lax.psum(x, layout.rows_apart), layout.rows_apart)


def constrain(x: jax.Array, logical_names) -> jax.Array:
    """Pins an activation's layout by logical names; a no-op when no layout is active."""
    layout = current_layout()
    return x if layout is None else jax.lax.with_sharding_constraint(x, layout.sharding(logical_names))


def gathered(w: jax.Array, logical_names) -> jax.Array:
    """Pins a weight to its compute layout: without the ZeRO split over fsdp (an all-gather under
    ZeRO-3), tensor-parallel splits kept. A no-op when no layout is active."""
    return constrain(w, logical_names)


# --------------------------------------------------------------------------- validation


def check_divisible(named_shapes: dict, rules: Rules, mesh_shape: dict[str, int]) -> None:
    """Raises UserError unless every dimension divides by the mesh axes its logical name maps to.

    `named_shapes`: {what: (logical names, shape)} for abstract arrays, `what` naming each for the
    message (e.g. "parameter blocks.mlp.w_up"). Works on shapes and the mesh's axis sizes alone, so it
    runs before any device exists (the planner reuses it).
    """
    for what, (names, shape) in named_shapes.items():
        for name, dim in zip(names, shape):
            axes = [a for a in mesh_axes(name, rules) if mesh_shape[a] > 1]
            ways = math.prod(mesh_shape[a] for a in axes)
            if dim % ways:
                split = " x ".join(f"mesh.{a}={mesh_shape[a]}" for a in axes)
                raise UserError(
                    f"{what} has a {name!r} dimension of {dim}, which does not split over {split}; "
                    f"make {dim} a multiple of {ways}, or shrink those mesh axes."
                )


# --------------------------------------------------------------------------- microbatches


def split_rows(x: jax.Array, count: int, layout: Layout | None) -> jax.Array:
    """[B, ...] -> [count, B/count, ...], microbatch j holding rows i*count + j: every device keeps its
    own rows, nothing moves. The rows stay split over the batch's mesh axes; other dimensions keep
    whatever layout they had."""
    x = x.reshape(x.shape[0] // count, count, *x.shape[1:]).swapaxes(0, 1)
    if layout is None:
        return x
    batch_axes = layout.axes("act_batch") or None
    spec = PartitionSpec(None, batch_axes, *[PartitionSpec.UNCONSTRAINED] * (x.ndim - 2))
    return jax.lax.with_sharding_constraint(x, NamedSharding(layout.mesh, spec))


def merge_rows(x: jax.Array) -> jax.Array:
    """The inverse of `split_rows`: [count, B/count, ...] -> [B, ...]."""
    return x.swapaxes(0, 1).reshape(x.shape[0] * x.shape[1], *x.shape[2:])


# --------------------------------------------------------------------------- shard_map types


def varying(tree, axis, zeros: bool = False):
    """Marks values as differing between the devices of a shard_map's manual axis or axes `axis` (its
    type check wants equal types in both branches of a cond and around a scan, and a Pallas kernel's
    outputs carry none); with `zeros`, zeros of the given shapes."""
    axes = (axis,) if isinstance(axis, str) else tuple(axis)

    def cast(x):
        if zeros:
            x = jnp.zeros(x.shape, x.dtype)
        missing = tuple(a for a in axes if a not in varying_axes(x))
        return jax.lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(cast, tree)


def varying_alike(*arrays) -> tuple:
    """`arrays`, each typed as varying over every manual axis any of them varies over, as JAX's own ops
    broadcast their operands inside a shard_map (for a kernel's operands, which JAX does not broadcast)."""
    return varying(arrays, frozenset().union(*(varying_axes(a) for a in arrays)))


def varying_axes(x) -> frozenset:
    """The manual mesh axes over which `x` is typed as differing between devices (empty outside shard_map)."""
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None)  # JAX 0.10: ManualAxisType; earlier: aval.vma
    return frozenset(mat.varying if mat is not None else getattr(aval, "vma", ()))
