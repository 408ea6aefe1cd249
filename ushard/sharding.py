"""Logical axis names -> mesh axes: the rules, and the shardings derived from them.

The rules are plain data, one `(logical name, mesh axes)` pair per name, every name present. ZeRO is
expressed here and nowhere else: a stage decides which kinds of training state map `embed` onto the
`fsdp` axis (stage 1: optimizer state; 2: + gradients; 3: + parameters). The `data` axis never shards
state, so data x fsdp is HSDP.

Model code calls `constrain(x, names)` with logical activation names; it resolves against the rules
active while the step is traced (`activation_rules`), and is a no-op outside one (plain eager use).
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

# The axes that split the batch. `expert` acts as a batch axis outside the MoE layers.
BATCH_AXES = ("data", "fsdp", "expert")

WEIGHT_NAMES = ("embed", "heads", "kv_heads", "head_dim", "mlp", "vocab", "layers", "experts", "expert_mlp", "norm")
ACTIVATION_NAMES = (
    "act_batch", "act_length", "act_embed", "act_heads", "act_kv_heads", "act_head_dim", "act_mlp", "act_vocab",
)

Rules = tuple  # tuple[tuple[str, str | tuple[str, ...] | None], ...]


def logical_rules(shard_state_over_fsdp: bool) -> Rules:
    """The full table. `shard_state_over_fsdp` is the ZeRO switch for one kind of training state."""
    return (
        # weights
        ("embed", "fsdp" if shard_state_over_fsdp else None),
        ("heads", "tensor"),
        ("kv_heads", "tensor"),
        ("head_dim", None),
        ("mlp", "tensor"),
        ("vocab", "tensor"),
        ("layers", None),
        ("experts", "expert"),
        ("expert_mlp", "tensor"),
        ("norm", None),
        # activations
        ("act_batch", BATCH_AXES),
        ("act_length", "sequence"),
        ("act_embed", None),
        ("act_heads", "tensor"),
        ("act_kv_heads", "tensor"),
        ("act_head_dim", None),
        ("act_mlp", "tensor"),
        ("act_vocab", "tensor"),
    )


@dataclass(frozen=True)
class ZeroRules:
    """One rules table per kind of training state, chosen by the ZeRO stage.

    `keep_gathered` (ZeRO-3 with `parallel.reshard_after_forward=false`): the weights a layer gathers
    for its forward pass are kept for its backward pass instead of gathered again, half the all-gather
    traffic for one extra copy of the weights in the compute dtype.
    """

    params: Rules
    grads: Rules
    opt_state: Rules
    keep_gathered: bool = False

    @classmethod
    def for_stage(cls, stage: int, reshard_after_forward: bool = True, fsdp_size: int = 1) -> "ZeroRules":
        return cls(
            params=logical_rules(stage >= 3),
            grads=logical_rules(stage >= 2),
            opt_state=logical_rules(stage >= 1),
            # With one fsdp device nothing is gathered, so there is nothing to keep either.
            keep_gathered=stage >= 3 and not reshard_after_forward and fsdp_size > 1,
        )


def mesh_spec(logical_names, rules: Rules) -> PartitionSpec:
    """PartitionSpec for one array whose dimensions carry `logical_names` (None = unnamed, unsharded)."""
    table = dict(rules)
    axes = []
    for name in logical_names:
        if name is None:
            axes.append(None)
            continue
        if name not in table:
            raise KeyError(f"logical axis {name!r} has no sharding rule; add it to ushard.sharding.logical_rules")
        axes.append(table[name])
    return PartitionSpec(*axes)


def named_shardings(logical_tree, rules: Rules, mesh: Mesh):
    """Maps a pytree of logical-name tuples to NamedShardings."""
    return jax.tree.map(
        lambda names: NamedSharding(mesh, mesh_spec(names, rules)),
        logical_tree,
        is_leaf=lambda x: isinstance(x, tuple),
    )


def format_rules(rules: Rules) -> str:
    """The table as a user reads it: one `name -> axes` line per logical name."""
    width = max(len(n) for n, _ in rules)
    return "\n".join(f"  {name:<{width}} -> {axes}" for name, axes in rules)


# --------------------------------------------------------------------------- activation constraints

_ACTIVE = contextvars.ContextVar("ushard_activation_rules", default=None)


@contextlib.contextmanager
def activation_rules(mesh: Mesh, zero: ZeroRules):
    """Makes `constrain` (and `gathered`) resolve logical names against `zero` while a step is traced."""
    token = _ACTIVE.set((mesh, zero))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def constrain(x: jax.Array, logical_names) -> jax.Array:
    """Pins an activation's layout by logical names; a no-op when no rules are active."""
    active = _ACTIVE.get()
    if active is None:
        return x
    mesh, zero = active
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, mesh_spec(logical_names, zero.params)))


def keep_gathered_weights() -> bool:
    """Whether the model should gather each layer's weights outside its remat boundary (see ZeroRules)."""
    active = _ACTIVE.get()
    return active is not None and active[1].keep_gathered


def gathered(w: jax.Array, logical_names) -> jax.Array:
    """Pins a weight to its layout without the ZeRO split over fsdp (an all-gather under ZeRO-3);
    tensor-parallel splits stay. A no-op when no rules are active."""
    active = _ACTIVE.get()
    if active is None:
        return w
    return jax.lax.with_sharding_constraint(w, NamedSharding(active[0], mesh_spec(logical_names, logical_rules(False))))
