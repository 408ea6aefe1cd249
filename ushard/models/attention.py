"""Grouped-query self-attention with rotary positions and document masking for packed sequences."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ushard.kernels import attention as kernels
from ushard.models.layers import BTD, fan_in_init, param, project, rope_frequencies, rotary
from ushard.sharding import KV_NAMES, Q_NAMES, constrain, current_layout, gathered, split_ways


def causal_attention(q, k, v, segment_ids, impl: str):
    """Causal attention on [B, T, heads, head_dim]; tokens attend only within their own segment.

    `segment_ids` ([B, T]) is None when documents may see each other. The kernel is the run's plan's
    (`ParallelPlan.attention_for`: inside a pipeline stage or not); without a plan, `impl` resolved
    for the layout's platform (ushard/kernels/attention.py; JAX's own default is always XLA, which
    materialises the [T, T] scores and runs out of memory at real sizes).

    Where the active layout splits the sequence, context parallelism (the layout's
    `seams.context_attention`) runs each device's blocks: on the kernel's block form where it has one
    that can take them (`kernels.block_kernel`), else on XLA blocks, since JAX's public kernels give
    no log-sum-exp to combine blocks with (docs/dev-notes.md).
    """
    layout = current_layout()
    in_stage = bool(jax.sharding.get_abstract_mesh().manual_axes)  # inside a pipeline stage's shard_map
    ways = 1 if layout is None else layout.size("act_length")
    if layout is not None and layout.plan is not None:
        impl = layout.plan.attention_for(in_stage)
    else:
        platform = layout.platform if layout is not None else jax.default_backend()
        impl = kernels.resolve(impl, platform, q.dtype, q.shape[1], in_stage, head_dim=q.shape[-1], split=ways > 1,
                               documents=segment_ids is not None)
    if ways > 1:
        block, _ = kernels.block_kernel(impl, q.dtype, q.shape[1], ways, segment_ids is not None)
        return layout.seams.context_attention(q, k, v, segment_ids, kernels.xla_block, block)
    return kernels.whole_sequence(q, k, v, segment_ids, impl)


def cached_attention(q, k_cache, v_cache, length):
    """Attention of T new queries [B, T, heads, head_dim] over a KV cache [B, S, kv_heads, head_dim].

    The new tokens sit in cache slots [length, length + T); the query in slot length + i sees slots
    0 .. length + i (causal in cache order, as training's mask is within a document) and none of the
    empty slots after them. Plain XLA attention with an explicit mask: S is the cache size, fixed for a
    whole generation, so one compiled step serves every length.
    """
    t, s = q.shape[1], k_cache.shape[1]
    query_slot = length + jnp.arange(t)
    mask = jnp.arange(s)[None, :] <= query_slot[:, None]  # [T, S]
    return jax.nn.dot_product_attention(q, k_cache, v_cache, mask=mask[None, None], implementation="xla")


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
    return gathered(jnp.repeat(w, copies, axis=1), ("embed", "heads", "head_dim"))


class Attention(nnx.Module):
    def __init__(self, cfg, dtype, rngs: nnx.Rngs):
        d, h, kv = cfg.d_model, cfg.n_heads, cfg.n_kv_heads
        hd = d // h
        self.fp8 = cfg.fp8
        self.wq = param(rngs, (d, h, hd), ("embed", "heads", "head_dim"), fan_in_init(d), dtype)
        self.wk = param(rngs, (d, kv, hd), ("embed", "kv_heads", "head_dim"), fan_in_init(d), dtype)
        self.wv = param(rngs, (d, kv, hd), ("embed", "kv_heads", "head_dim"), fan_in_init(d), dtype)
        self.wo = param(rngs, (h, hd, d), ("heads", "head_dim", "embed"), fan_in_init(h * hd), dtype)
        self.rope_theta, self.rope_scaling = cfg.rope_theta, cfg.rope_scaling
        self.impl = cfg.attention_impl
        self.document_mask = cfg.document_mask

    def _project(self, x, positions):
        """Queries, keys and values of x, rotated to their positions."""
        q = constrain(project("btd,dhk->bthk", x, self.wq[...], self.fp8), Q_NAMES)
        k = constrain(project("btd,dhk->bthk", x, spread_kv_heads(self.wk[...]), self.fp8), KV_NAMES)
        v = constrain(project("btd,dhk->bthk", x, spread_kv_heads(self.wv[...]), self.fp8), KV_NAMES)
        freqs = rope_frequencies(q.shape[-1], self.rope_theta, self.rope_scaling)
        q = rotary(q, positions, freqs)
        k = rotary(k, positions, freqs)
        return q, k, v

    def _output(self, out):
        out = constrain(out, Q_NAMES)
        return constrain(project("bthk,hkd->btd", out, self.wo[...], self.fp8), BTD)

    def __call__(self, x, positions, segment_ids):
        q, k, v = self._project(x, positions)
        out = causal_attention(q, k, v, segment_ids if self.document_mask else None, self.impl)
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
        out = cached_attention(q, k_cache.astype(q.dtype), v_cache.astype(q.dtype), length)
        return self._output(out), k_cache, v_cache
