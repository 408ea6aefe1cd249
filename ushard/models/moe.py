"""A mixture-of-experts feed-forward block, with single-device semantics (settings: `model.moe.*`).

A learned router scores every expert for every token (softmax or sigmoid of a projection, computed in
float32). A token goes to its `top_k` best experts, optionally only among the experts of its
`top_groups` best groups; its output is the sum of those experts' outputs (each a SwiGLU), weighted by
its gates (the chosen scores, normalised to sum 1 if `normalize_gates`, times `routed_scale`), plus the
output of the shared experts that every token goes through.

The drop rule (`capacity_factor` > 0). Capacity is counted per sequence, so the tokens dropped never
depend on how the batch is laid out on devices: in a sequence of T tokens, each expert takes at most
C = min(T, ceil(capacity_factor * T * top_k / num_experts)) assignments. A sequence's assignments are
served in order of position, and a token's own choices in order of preference (best first); an
assignment that finds its expert's C places taken is dropped: its gate counts as zero. The token keeps
its other experts, the shared experts and the residual connection. `capacity_factor = 0`: dropless.
(A sequence is what one call sees: decoding token by token with a KV cache drops nothing.)

Balancing. The load-balancing loss (Switch Transformer, GShard) is
    aux_loss_weight * E * sum_e f_e * P_e,
f_e the share of the (micro)batch's token-to-expert assignments that chose expert e (before drops),
P_e the mean over tokens of e's routing probability (the softmax, or the sigmoid scores divided by
their sum); 1 * aux_loss_weight when perfectly balanced. With `aux_loss_per_sequence`, f and P are
each sequence's own and the loss is the mean of the sequences' (DeepSeek's sequence-wise balance
loss: a batch that is balanced overall may not be within its sequences). The router z-loss (ST-MoE) is
    z_loss_weight * mean over tokens of logsumexp(router logits)^2.
Auxiliary-loss-free balancing (DeepSeek-V3): a per-expert bias, added to the scores only to choose
experts (never to the gates), is moved after every step by `bias_update_rate` against the sign of each
expert's load: up when it got fewer assignments than the mean, down when it got more. The bias is an
`ExpertBias`, not a parameter: the optimizer never changes it (ushard.models.definition).

Each MoE layer reports, as auxiliary terms summed over layers by the stack: the two losses (where
their weight is not 0), and, as figures whose gradient is stopped (they change nothing but the
metrics), the mean over MoE layers of max_e f_e / mean_e f_e ("moe_load_max_over_mean", 1 when
balanced) and of the fraction of assignments dropped ("moe_dropped_fraction", 0 when dropless); with
the ragged dispatch, the share of layers whose receive buffer (`dispatch_headroom` times an even load)
could not hold a device's rows ("moe_dispatch_overflow": the layer's output is then NaN, and the
training loop stops the run with a sentence before that step is saved), and, with the experts over
several devices, the busiest device's share of the routed rows over the mean share
("moe_busiest_device_over_mean": what sets the pace of an expert-parallel step).

Where the routed experts run (this device, or spread over the mesh with all-to-all dispatch) is
decided by the layout's `seams.routed_experts` (ushard/parallel/expert.py, wired in by `build`),
which gets the tokens, their experts and gates, and `expert_ffn`, the experts' computation on tokens
grouped by expert; on one device without a layout, ushard/models/dispatch.py runs them.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from ushard.kernels import grouped_matmul as grouped_kernels
from ushard.models import dispatch
from ushard.models.config import ModelConfig, MoEConfig
from ushard.models.layers import SwiGLU, fan_in_init, param
from ushard.models.low_rank import merged
from ushard.sharding import current_layout, sum_over_rows

# The auxiliary figure that reports a ragged dispatch whose rows did not fit its receive buffer.
DISPATCH_OVERFLOW = "moe_dispatch_overflow"
# ...and, with the ragged dispatch over several devices, the busiest device's routed rows over the mean.
BUSIEST_DEVICE = "moe_busiest_device_over_mean"


class ExpertBias(nnx.Variable):
    """A per-expert routing bias for auxiliary-loss-free balancing. It steers which experts a token
    picks, never the gates, and is not trained by the optimizer: the train step moves it against each
    expert's observed load (`ModelDef.balance_experts`), which reaches the step as the bias's gradient
    (see `load_signal`)."""


def top_k(x, k: int):
    """`jax.lax.top_k` along the last axis (ties to the lower index), as a sort: XLA's SPMD partitioner
    gathers a batch-sharded top_k's whole input onto every device (JAX 0.10), a sort stays put."""
    index = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    negated, index = jax.lax.sort((-x, index), dimension=x.ndim - 1, num_keys=2)
    return -negated[..., :k], index[..., :k]


def route(logits, bias, moe: MoEConfig):
    """Router logits [..., E] (float32) -> (experts int32 [..., top_k] best first, gates float32
    [..., top_k], routing probabilities float32 [..., E] for the balancing loss)."""
    scores = jax.nn.softmax(logits, axis=-1) if moe.score_func == "softmax" else jax.nn.sigmoid(logits)
    choice = scores + bias
    if moe.num_groups > 1:
        choice = limit_to_top_groups(choice, moe.num_groups, moe.top_groups, moe.group_score)
    _, experts = top_k(choice, moe.top_k)
    gates = jnp.take_along_axis(scores, experts, axis=-1)
    if moe.normalize_gates:
        gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
    probs = scores if moe.score_func == "softmax" else scores / jnp.sum(scores, axis=-1, keepdims=True)
    return experts, gates * moe.routed_scale, probs


def limit_to_top_groups(choice, num_groups: int, top_groups: int, group_score: str = "top2_sum"):
    """`choice` [..., E] with every expert outside the `top_groups` best of `num_groups` equal groups set
    to -inf; a group scores the sum of its two best experts (one, for groups of one: "top2_sum",
    DeepSeek-V3's) or its best expert ("max", DeepSeek-V2's)."""
    grouped = choice.reshape(*choice.shape[:-1], num_groups, -1)
    best_two = 1 if group_score == "max" else min(2, grouped.shape[-1])
    group_scores = jnp.sum(top_k(grouped, best_two)[0], axis=-1)
    _, best = top_k(group_scores, top_groups)
    allowed = jnp.any(best[..., :, None] == jnp.arange(num_groups), axis=-2)  # [..., num_groups]
    return jnp.where(allowed[..., None], grouped, -jnp.inf).reshape(choice.shape)


def row_capacity(moe: MoEConfig, length: int) -> int:
    """C of the drop rule: the most assignments one expert takes from a sequence of `length` tokens."""
    if not moe.capacity_factor:
        return length
    return min(length, math.ceil(moe.capacity_factor * length * moe.top_k / moe.num_experts))


def within_capacity(experts, num_experts: int, capacity: int):
    """experts int [batch, length, k] -> bool [batch, length, k]: which assignments the drop rule keeps
    (fewer than `capacity` earlier assignments of the same sequence, in position-then-preference order,
    went to the same expert)."""
    batch, length, k = experts.shape
    chosen = jax.nn.one_hot(experts.reshape(batch, length * k), num_experts, dtype=jnp.int32)
    earlier = jnp.cumsum(chosen, axis=1) - chosen
    rank = jnp.sum(earlier * chosen, axis=-1).reshape(batch, length, k)
    return rank < capacity


def batch_mean(x, axis=None):
    """The mean of x over the whole (micro)batch's tokens along `axis` (None: all of x), also where
    each device's rows run apart (`sum_over_rows`): the balancing statistics are the batch's, on
    any layout."""
    count = x.size if axis is None else x.shape[axis]
    return sum_over_rows(jnp.sum(x, axis=axis)) / sum_over_rows(jnp.float32(count))


def assignment_shares(experts, num_experts: int):
    """f_e: the share of the token-to-expert assignments (experts int [..., k]) that chose expert e."""
    chosen = jnp.bincount(experts.reshape(-1), length=num_experts).astype(jnp.float32)
    return sum_over_rows(chosen) / sum_over_rows(jnp.float32(experts.size))


def load_balancing_loss(share, probs):
    """E * sum_e f_e * P_e (see the module docstring): share [E] (f), probs [..., E]."""
    num_experts = share.shape[0]
    return num_experts * jnp.sum(share * batch_mean(probs.reshape(-1, num_experts), axis=0))


def sequence_balancing_loss(experts, probs):
    """The load-balancing loss of each sequence, E * sum_e f_e * P_e with f and P of its own tokens,
    averaged over the (micro)batch's sequences: DeepSeek's sequence-wise balance loss ("seq_aux";
    DeepSeek-V2 paper's alpha_1 * N' * sum_i f_i P_i, whose f_i counts a sequence's choices over
    K' T / N', N' times the share f_e here). experts int [batch, length, k], probs [batch, length, E]."""
    num_experts = probs.shape[-1]
    counts = jax.vmap(lambda row: jnp.bincount(row.reshape(-1), length=num_experts))(experts)  # [B, E]
    share = counts.astype(jnp.float32) / (experts.shape[1] * experts.shape[2])
    per_sequence = num_experts * jnp.sum(share * jnp.mean(probs, axis=1), axis=-1)  # [B]
    return batch_mean(per_sequence)


def router_z_loss(logits):
    """The mean over tokens of logsumexp(logits)^2: keeps router logits small (ST-MoE)."""
    return batch_mean(jax.nn.logsumexp(logits, axis=-1) ** 2)


def load_signal(bias, share):
    """Zero in value; its gradient with respect to `bias` is each expert's share of the assignments
    minus the mean share. The gradient is the one per-layer result that leaves a scanned (or
    pipelined) layer stack and is summed over microbatches and devices the way loads must be: this is
    how the train step learns the loads it balances (`ModelDef.balance_experts`)."""
    term = jnp.sum(bias * jax.lax.stop_gradient(share - jnp.mean(share)))
    return term - jax.lax.stop_gradient(term)


EXPERT_MATMUL = "expert_matmul"


def expert_ffn(weights: dict, x, group_sizes=None, impl: str = "xla", row_buckets: int = 1):
    """SwiGLU of each expert on its own tokens: x [experts, tokens, d] (group_sizes None: a batched
    matmul), or x [tokens, d] sorted by expert with group_sizes[e] rows for expert e (a grouped matmul
    by the resolved kernel `impl`; rows past the groups give zeros; `row_buckets`: see
    `grouped_matmul`). Weights [experts, ...] in x's dtype."""
    if group_sizes is None:
        product = lambda a, w: jnp.einsum("ecd,edf->ecf", a, w)  # noqa: E731
    else:
        product = lambda a, w: grouped_kernels.grouped_matmul(a, w, group_sizes, impl, row_buckets)  # noqa: E731

    def matmul(a, w):
        # Named for the remat policies that keep matmul outputs ("dots*", models/stack.py): they know
        # XLA's unbatched dots, and these are batched or a kernel's.
        return checkpoint_name(product(a, w), EXPERT_MATMUL)

    hidden = jax.nn.silu(matmul(x, weights["w_gate"])) * matmul(x, weights["w_up"])
    return matmul(hidden, weights["w_down"])


class RoutedExperts(nnx.Module):
    """The routed experts' weights, one SwiGLU per expert along the leading `experts` axis."""

    NAMES = {"w_gate": ("experts", "embed", "expert_mlp"), "w_up": ("experts", "embed", "expert_mlp"),
             "w_down": ("experts", "expert_mlp", "embed")}

    def __init__(self, num_experts: int, d_model: int, d_ff: int, dtype, rngs: nnx.Rngs):
        into, out = fan_in_init(d_model), fan_in_init(d_ff)
        self.w_gate = param(rngs, (num_experts, d_model, d_ff), self.NAMES["w_gate"], into, dtype)
        self.w_up = param(rngs, (num_experts, d_model, d_ff), self.NAMES["w_up"], into, dtype)
        self.w_down = param(rngs, (num_experts, d_ff, d_model), self.NAMES["w_down"], out, dtype)

    def weights(self, dtype) -> dict:
        """The weights in the compute dtype, still laid out as stored (expert.py gathers them: after
        the cast, a gather moves fewer bytes)."""
        # LoRA on the experts (ushard/training/lora.py) is applied merged: the seam moves arrays.
        return {name: merged(getattr(self, name)[...]).astype(dtype) for name in self.NAMES}


class MoE(nnx.Module):
    """The MoE feed-forward block: x [batch, length, d] -> (y [batch, length, d], aux terms)."""

    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
        moe = self.moe = cfg.moe
        self.moe_layers = cfg.moe_layers
        self.router = param(rngs, (cfg.d_model, moe.num_experts), ("embed", None), fan_in_init(cfg.d_model), dtype)
        self.bias = ExpertBias(jnp.zeros((moe.num_experts,), jnp.float32), out_sharding=(None,))
        self.experts = RoutedExperts(moe.num_experts, cfg.d_model, cfg.expert_d_ff, dtype, rngs)
        if moe.num_shared_experts:
            self.shared = SwiGLU(cfg.d_model, moe.num_shared_experts * cfg.expert_d_ff, dtype, rngs,
                                 fused=cfg.fused_mlp, fp8=cfg.fp8)

    def __call__(self, x):
        moe, length = self.moe, x.shape[1]
        logits = jnp.einsum("btd,de->bte", x.astype(jnp.float32), self.router[...].astype(jnp.float32))
        bias = self.bias[...].astype(jnp.float32)
        experts, gates, probs = route(logits, bias, moe)
        capacity = row_capacity(moe, length)
        if capacity < length:
            keep = within_capacity(experts, moe.num_experts, capacity)
            gates = jnp.where(keep, gates, 0.0)
        else:
            keep = jnp.ones(experts.shape, bool)
        weights, layout = self.experts.weights(x.dtype), current_layout()
        ffn = functools.partial(expert_ffn, impl=self._grouped_matmul(layout, x.dtype))
        overflow = jnp.float32(0)
        if layout is None:  # one device, as the module docstring describes
            y = dispatch.on_device(x, experts, gates, keep, weights, ffn, capacity)
        else:  # wherever the layout puts the experts (the layout's seam: ushard/parallel/expert.py)
            y, overflow = layout.seams.routed_experts(x, experts, gates, keep, weights, RoutedExperts.NAMES, ffn,
                                                      capacity, moe.dispatch, moe.dispatch_headroom,
                                                      moe.exchange)
        if moe.num_shared_experts:
            y = y + self.shared(x)
        groups = layout.size("experts") if layout is not None and moe.dispatch == "ragged" else 1
        return y, self._aux(logits, probs, experts, keep, bias, overflow, groups)

    def _grouped_matmul(self, layout, dtype) -> str:
        """The grouped-matmul kernel: the run's plan's (`ParallelPlan.grouped_matmul`), or without a
        plan `model.moe.grouped_matmul_impl` resolved for this platform."""
        if layout is not None and layout.plan is not None and layout.plan.grouped_matmul is not None:
            return layout.plan.grouped_matmul.name
        device = layout.mesh.devices.flat[0] if layout is not None else jax.devices()[0]
        features = (self.experts.w_gate.shape[1], self.experts.w_gate.shape[2])
        return grouped_kernels.resolve(self.moe.grouped_matmul_impl, device.platform, dtype, features,
                                       device.device_kind)

    def _aux(self, logits, probs, experts, keep, bias, overflow, groups: int = 1) -> dict:
        moe, per_layer = self.moe, 1.0 / self.moe_layers  # the stack sums over layers: figures as means
        share = assignment_shares(experts, moe.num_experts)
        aux = {
            "moe_load_max_over_mean": jax.lax.stop_gradient(jnp.max(share) * moe.num_experts) * per_layer,
            "moe_dropped_fraction": jax.lax.stop_gradient(1.0 - batch_mean(keep.astype(jnp.float32))) * per_layer,
        }
        if moe.dispatch == "ragged":  # the share of MoE layers whose ragged dispatch overflowed (module docstring)
            aux[DISPATCH_OVERFLOW] = jax.lax.stop_gradient(overflow) * per_layer
        if groups > 1:  # experts over `groups` devices (in blocks, ushard/parallel/expert.py): the busiest's rows
            device_share = jnp.sum(share.reshape(groups, -1), axis=1)
            aux[BUSIEST_DEVICE] = jax.lax.stop_gradient(jnp.max(device_share) * groups) * per_layer
        if moe.bias_update_rate:
            aux["moe_load_max_over_mean"] += load_signal(bias, share)
        if moe.aux_loss_weight:
            balance = sequence_balancing_loss(experts, probs) if moe.aux_loss_per_sequence else (
                load_balancing_loss(share, probs))
            aux["moe_balance_loss"] = moe.aux_loss_weight * balance
        if moe.z_loss_weight:
            aux["moe_z_loss"] = moe.z_loss_weight * router_z_loss(logits)
        return aux
