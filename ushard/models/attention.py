"""Grouped-query self-attention with rotary positions and document masking for packed sequences."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from ushard.errors import UserError
from ushard.models.cudnn_blocks import CUDNN_BLOCKS
from ushard.models.layers import BTD, fan_in_init, param, project, rope_frequencies, rotary
from ushard.parallel import context
from ushard.parallel.splash import LANES, splash_attention, splash_blocks
from ushard.sharding import KV_NAMES, Q_NAMES, constrain, current_layout, gathered, split_ways

# `model.attention_impl`: auto picks cuDNN flash attention on GPUs in 16-bit compute, splash attention
# on TPUs, XLA elsewhere.
ATTENTION_IMPLS = ("auto", "xla", "cudnn", "splash")
# The kernels that exist on one platform only.
KERNEL_PLATFORMS = {"cudnn": ("gpu", "cuDNN flash attention"), "splash": ("tpu", "Pallas splash attention")}


def resolve_impl(impl: str, platform: str, dtype, length: int, in_stage: bool = False) -> str:
    """The kernel `impl` means on `platform` for `dtype` and sequences of `length` tokens: "auto" is
    cuDNN on GPUs in 16-bit compute, except inside a pipeline stage (`check_impl`; XLA's GPU compiler
    segfaults on a pipelined step with cuDNN attention in its stages, JAX 0.11.2), splash on TPUs
    (sequences a multiple of 128 tokens), else XLA."""
    if impl != "auto":
        return impl
    if platform == "gpu" and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16) and not in_stage:
        return "cudnn"
    return "splash" if platform == "tpu" and length % LANES == 0 else "xla"


def check_impl(impl: str, platform: str, seq_len: int, pipeline_stages: int = 1) -> None:
    """UserError for a kernel asked for on a platform that lacks it, or a layout it cannot take."""
    if impl not in KERNEL_PLATFORMS:
        return
    if impl == "cudnn" and pipeline_stages > 1:  # whatever the platform: the config cannot run anywhere
        raise UserError(f"model.attention_impl='cudnn' cannot run inside pipeline stages "
                        f"(mesh.pipeline={pipeline_stages}): XLA's GPU compiler crashes on it there; use "
                        f"attention_impl='auto', which runs XLA attention in the stages.")
    needs, name = KERNEL_PLATFORMS[impl]
    if platform != needs:
        raise UserError(f"model.attention_impl={impl!r} is {name}, which runs on {needs.upper()}s only, and these "
                        f"devices are {platform}; use 'auto' (the best kernel of each platform) or 'xla'.")
    if impl == "splash" and seq_len % LANES:
        raise UserError(f"model.attention_impl='splash' needs train.seq_len to be a multiple of {LANES} (its "
                        f"blocks' size); it is {seq_len}.")


def causal_attention(q, k, v, segment_ids, impl: str):
    """Causal attention on [B, T, heads, head_dim]; tokens attend only within their own segment.

    `segment_ids` ([B, T]) is None when documents may see each other. `impl` is resolved for the
    active layout's platform (`resolve_impl`; JAX's own default is always XLA, which materialises
    the [T, T] scores and runs out of memory at real sizes).

    When the active layout splits the sequence, context parallelism (ushard/parallel/context.py) runs
    each device's blocks: on cuDNN or splash where `impl` resolves to it and they can take the blocks
    (`split_blocks`), else on `attention_block` (XLA), since JAX's public kernels give no log-sum-exp
    to combine blocks with (docs/dev-notes.md).
    """
    layout = current_layout()
    platform = layout.platform if layout is not None else jax.default_backend()
    in_stage = bool(jax.sharding.get_abstract_mesh().manual_axes)  # inside a pipeline stage's shard_map
    impl = resolve_impl(impl, platform, q.dtype, q.shape[1], in_stage)
    if context.is_split():
        fused, _ = split_blocks(impl, q.dtype, q.shape[1], context.ways(), segment_ids is not None)
        return context.attention(q, k, v, segment_ids, attention_block, fused)
    if impl == "splash":
        return splash_attention(q, k, v, segment_ids)
    mask = None
    if segment_ids is not None:
        mask = (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]  # [B, 1, T, T]
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, implementation=impl)


def split_blocks(impl: str, dtype, length: int, ways: int, documents: bool) -> tuple[context.FusedKernel | None, str]:
    """The fused kernel (`context.FusedKernel`) that runs the blocks of a `length`-token sequence split
    `ways` ways, for the resolved `impl`, or None for XLA blocks; and what runs them, in words (the
    start-up report says it, so a fallback is never silent)."""
    if impl == "cudnn":
        if jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16):
            return None, "XLA attention (cuDNN takes 16-bit inputs only)"
        if documents:
            return None, "XLA attention (cuDNN's blocks take no document mask; model.document_mask=true)"
        return CUDNN_BLOCKS, "cuDNN flash attention"
    if impl == "splash":
        if (length // (2 * ways)) % LANES:
            return None, (f"XLA attention (splash needs each device's two chunks, train.seq_len / {2 * ways}, "
                          f"to be a multiple of {LANES} tokens)")
        return splash_blocks(), "splash attention"
    return None, "XLA attention"


def attention_block(q, k, v, q_index, k_index, q_segments, k_segments):
    """Queries q [B, Tq, heads, hd] over keys and values [B, Tk, kv_heads, hd] from anywhere in the
    sequence: (out [B, Tq, heads, hd], lse [B, Tq, heads]), both float32, lse the log-sum-exp of each
    query's visible scores.

    A query sees a key whose index in the unsplit row (`q_index` [1, Tq], `k_index` [1, Tk]) is not
    after its own and, unless the segments are None, whose segment id ([B, Tq], [B, Tk]) is its own. A
    query that sees no key here gets out = 0 and lse = -inf, so combining blocks ignores it.
    """
    b, tq, h, hd = q.shape
    kv_heads = k.shape[2]
    grouped = q.reshape(b, tq, kv_heads, h // kv_heads, hd)
    scores = jnp.einsum("bqkgd,bskd->bkgqs", grouped, k, preferred_element_type=jnp.float32) / math.sqrt(hd)
    visible = q_index[:, :, None] >= k_index[:, None, :]
    if q_segments is not None:
        visible = visible & (q_segments[:, :, None] == k_segments[:, None, :])
    scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
    # The max only keeps exp() in range; it cancels out of lse, so no gradient flows through it.
    peak = jax.lax.stop_gradient(jnp.max(scores, axis=-1, keepdims=True))
    peak = jnp.where(jnp.isfinite(peak), peak, 0.0)
    weights = jnp.exp(scores - peak)
    total = jnp.sum(weights, axis=-1)
    seen = total > 0
    total = jnp.where(seen, total, 1.0)  # rows that see nothing: out 0, and no log(0) in the gradient
    out = jnp.einsum("bkgqs,bskd->bqkgd", weights.astype(v.dtype), v, preferred_element_type=jnp.float32)
    out = out / jnp.moveaxis(total, -1, 1)[..., None]
    lse = jnp.where(seen, peak[..., 0] + jnp.log(total), -jnp.inf)
    return out.reshape(b, tq, h, hd), jnp.moveaxis(lse, -1, 1).reshape(b, tq, h)


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
