"""Grouped-query self-attention with rotary positions and document masking for packed sequences.

What the families vary is a constructor's arguments: the head size (`model.head_dim`), QK-norm (an
RMSNorm over each head of q and k before RoPE: Qwen3, Gemma 3), a sliding window, the RoPE base and
scaling of the layer, and the scores' scale (Gemma's query_pre_attn_scalar).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ushard.kernels import attention as kernels
from ushard.models.layers import (
    BTD,
    RMSNorm,
    fan_in_init,
    param,
    project,
    rope_attention_factor,
    rope_frequencies,
    rotary,
)
from ushard.models.low_rank import LowRankAdapted
from ushard.sharding import KV_NAMES, Q_NAMES, Expansion, constrain, current_layout, gathered, split_ways


def causal_attention(q, k, v, segment_ids, impl: str, window: int = 0):
    """Causal attention on [B, T, heads, head_dim]; tokens attend only within their own segment.

    `segment_ids` ([B, T]) is None when documents may see each other. The kernel is the run's plan's
    (`ParallelPlan.attention_for`: inside a pipeline stage or not); without a plan, `impl` resolved
    for the layout's platform (ushard/kernels/attention.py; JAX's own default is always XLA, which
    materialises the [T, T] scores and runs out of memory at real sizes).

    Where the active layout splits the sequence, context parallelism (the layout's
    `seams.context_attention`) runs each device's blocks: on the kernel's block form where it has one
    that can take them (`kernels.block_kernel`), else on XLA blocks, since JAX's public kernels give
    no log-sum-exp to combine blocks with (docs/dev-notes.md).

    `window` > 0: a query sees itself and the window - 1 tokens before it (a sliding window).
    """
    layout, ways, impl = _resolved(q, segment_ids, impl, window)
    if ways > 1:
        block, _ = kernels.block_kernel(impl, q.dtype, q.shape[1], ways, segment_ids is not None, window=window)

        def ring(v):
            return layout.seams.context_attention(q, (k, v), segment_ids, kernels.xla_block, block, window=window)

        return ring(v) if block is None else kernels.values_padded(ring, q, v)
    return kernels.whole_sequence(q, k, v, segment_ids, impl, window=window)


def expanded_attention(q, kv, expansion: Expansion, segment_ids, impl: str):
    """`causal_attention` of q over the keys and values that `expansion` makes of the arrays `kv`
    (latent attention's latent and shared RoPE key, ushard/models/mla.py). Where the active layout
    splits the sequence, `kv` is what travels between the devices, and each device makes the keys and
    values of the blocks that reach it (`seams.context_attention`): for DeepSeek-V3, 576 numbers a
    token instead of 128 heads x (192 + 128). Otherwise they are made here, once."""
    layout, ways, impl = _resolved(q, segment_ids, impl)
    if ways == 1:
        k, v = expansion.expand(expansion.weights, kv)
        return causal_attention(q, constrain(k, KV_NAMES), constrain(v, KV_NAMES), segment_ids, impl)
    block, _ = kernels.block_kernel(impl, q.dtype, q.shape[1], ways, segment_ids is not None)
    width = jax.eval_shape(expansion.expand, expansion.weights, kv)[1].shape[-1]
    if block is not None and width < q.shape[-1]:  # a kernel of one head size: the values are padded
        expansion = kernels.expansion_padded(expansion, q.shape[-1])
    out = layout.seams.context_attention(q, kv, segment_ids, kernels.xla_block, block, expansion=expansion)
    return out[..., :width]


def _resolved(q, segment_ids, impl: str, window: int = 0):
    """(the active layout, how many ways it splits the sequence, the attention kernel to run)."""
    layout = current_layout()
    in_stage = bool(jax.sharding.get_abstract_mesh().manual_axes)  # inside a pipeline stage's shard_map
    ways = 1 if layout is None else layout.size("act_length")
    if layout is not None and layout.plan is not None:
        impl = layout.plan.attention_for(in_stage, window)
    else:
        platform = layout.platform if layout is not None else jax.default_backend()
        impl = kernels.resolve(impl, platform, q.dtype, q.shape[1], in_stage, head_dim=q.shape[-1], split=ways > 1,
                               documents=segment_ids is not None, window=window)
    return layout, ways, impl


def cached_attention(q, k_cache, v_cache, length, window: int = 0):
    """Attention of T new queries [B, T, heads, head_dim] over a KV cache [B, S, kv_heads, head_dim].

    The new tokens sit in cache slots [length, length + T); the query in slot length + i sees slots
    0 .. length + i (causal in cache order, as training's mask is within a document) and none of the
    empty slots after them (with a `window`, nor the slots window or more before its own). Plain XLA
    attention with an explicit mask: S is the cache size, fixed for a whole generation, so one compiled
    step serves every length.
    """
    mask = cache_visibility(length, q.shape[1], k_cache.shape[1], window)
    return jax.nn.dot_product_attention(q, k_cache, v_cache, mask=mask[None, None], implementation="xla")


def cache_visibility(length, new: int, slots: int, window: int = 0):
    """[new, slots] booleans: which cache slots each of `new` tokens in slots [length, length + new)
    sees (`cached_attention`'s rule)."""
    query_slot = length + jnp.arange(new)
    mask = jnp.arange(slots)[None, :] <= query_slot[:, None]
    if window:
        mask &= jnp.arange(slots)[None, :] > query_slot[:, None] - window
    return mask


def attention_output(out, wo, fp8: bool):
    """Attention's output projection: heads [B, T, heads, v] through `wo` [heads, v, d_model]."""
    out = constrain(out, Q_NAMES)
    return constrain(project("bthk,hkd->btd", out, wo, fp8), BTD)


def kv_head_copies(n_kv_heads: int) -> int:
    """How many tensor ranks share each KV head: tensor / n_kv_heads where the tensor axis has more ranks
    than the model has KV heads (grouped-query attention), else 1.

    Those K/V weights are not split over `tensor` (ushard.sharding.kv_heads_split): every rank holds
    them whole and uses only the copy of the one KV head its query heads attend with, so each rank
    computes one head's projection, the attention kernel sees ordinary GQA, and nothing is gathered.
    """
    return max(1, split_ways("act_kv_heads") // n_kv_heads)


def spread_kv_heads(w):
    """A K or V weight [embed, kv_heads, head_dim] with each head repeated for the ranks that share it.

    The copies are split over the tensor axis exactly like the query heads they serve (`heads`), so
    rank r computes the keys of KV head r // copies; their gradients add up in the repeat's transpose.
    """
    copies = kv_head_copies(w.shape[1])
    if copies == 1:
        return w
    if isinstance(w, LowRankAdapted):  # the base's heads and B's ([rank, kv_heads, head_dim]) alike
        return w.map_arrays(lambda a: a, base_fn=lambda base: gathered(jnp.repeat(base, copies, axis=1),
                                                                       ("embed", "heads", "head_dim")),
                            b_fn=lambda b: gathered(jnp.repeat(b, copies, axis=1), (None, "heads", "head_dim")),
                            scale_fn=lambda s: gathered(jnp.repeat(s, copies, axis=0), ("heads", "head_dim")))
    return gathered(jnp.repeat(w, copies, axis=1), ("embed", "heads", "head_dim"))


class Attention(nnx.Module):
    """Self-attention of one layer. `qk_norm`: RMSNorm over each head of q and k before RoPE, its weight
    offset by `norm_offset` (RMSNorm's `offset`); `window`: this layer's sliding window (0: none);
    `rope_theta` / `rope_scaling`: this layer's (default: the model's); scores are scaled by
    model.query_pre_attn_scalar ** -0.5 (by default head_dim ** -0.5)."""

    def __init__(self, cfg, dtype, rngs: nnx.Rngs, *, qk_norm: bool = False, norm_offset: float = 0.0,
                 window: int = 0, rope_theta: float | None = None, rope_scaling=None):
        d, h, kv, hd = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.fp8 = cfg.fp8
        self.wq = param(rngs, (d, h, hd), ("embed", "heads", "head_dim"), fan_in_init(d), dtype)
        self.wk = param(rngs, (d, kv, hd), ("embed", "kv_heads", "head_dim"), fan_in_init(d), dtype)
        self.wv = param(rngs, (d, kv, hd), ("embed", "kv_heads", "head_dim"), fan_in_init(d), dtype)
        self.wo = param(rngs, (h, hd, d), ("heads", "head_dim", "embed"), fan_in_init(h * hd), dtype)
        if qk_norm:
            self.q_norm = RMSNorm(hd, cfg.norm_eps, dtype, rngs, offset=norm_offset)
            self.k_norm = RMSNorm(hd, cfg.norm_eps, dtype, rngs, offset=norm_offset)
        self.qk_norm = qk_norm
        self.rope_theta = cfg.rope_theta if rope_theta is None else rope_theta
        self.rope_scaling = cfg.rope_scaling if rope_scaling is None else rope_scaling
        # The kernels scale scores by head_dim ** -0.5; another scale is folded into the queries.
        self.query_gain = (hd / cfg.query_pre_attn_scalar) ** 0.5 if cfg.query_pre_attn_scalar else 1.0
        self.window = window
        self.impl = cfg.attention_impl
        self.document_mask = cfg.document_mask

    def _project(self, x, positions):
        """Queries, keys and values of x, rotated to their positions."""
        q = constrain(project("btd,dhk->bthk", x, self.wq[...], self.fp8), Q_NAMES)
        k = constrain(project("btd,dhk->bthk", x, spread_kv_heads(self.wk[...]), self.fp8), KV_NAMES)
        v = constrain(project("btd,dhk->bthk", x, spread_kv_heads(self.wv[...]), self.fp8), KV_NAMES)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        freqs = rope_frequencies(q.shape[-1], self.rope_theta, self.rope_scaling)
        gain = rope_attention_factor(self.rope_scaling)
        q = rotary(q, positions, freqs, gain)
        k = rotary(k, positions, freqs, gain)
        if self.query_gain != 1.0:
            q = q * jnp.asarray(self.query_gain, q.dtype)
        return q, k, v

    def _output(self, out):
        return attention_output(out, self.wo[...], self.fp8)

    def __call__(self, x, positions, segment_ids):
        q, k, v = self._project(x, positions)
        out = causal_attention(q, k, v, segment_ids if self.document_mask else None, self.impl, self.window)
        return self._output(out)

    def decode(self, x, positions, k_cache, v_cache, length):
        """Attention for new tokens with a KV cache (inference only).

        x: [B, T, embed], the T new tokens at `positions` ([B, T]); k_cache, v_cache: [B, S, kv_heads,
        head_dim] holding the keys and values of the `length` tokens before them. Returns the output and
        the caches with the new keys and values written to slots [length, length + T); the caller keeps
        length + T <= S (a write past the end would be clamped, not refused).
        """
        q, k, v = self._project(x, positions)
        k_cache = jax.lax.dynamic_update_slice_in_dim(k_cache, k.astype(k_cache.dtype), length, axis=1)
        v_cache = jax.lax.dynamic_update_slice_in_dim(v_cache, v.astype(v_cache.dtype), length, axis=1)
        out = cached_attention(q, k_cache.astype(q.dtype), v_cache.astype(q.dtype), length, self.window)
        return self._output(out), k_cache, v_cache
