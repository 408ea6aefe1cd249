"""Multi-head latent attention (MLA: DeepSeek-V2 and V3), settings `model.mla.*` (`MLAConfig`).

Each token's keys and values come from one small latent: x is projected to kv_lora_rank numbers plus
qk_rope_head_dim more, the latent is normalised (RMSNorm) and expanded per head into a key part
without positions (qk_nope_head_dim) and the values (v_head_dim); the extra numbers are one RoPE key
that every head shares. Queries come from x through their own normalised bottleneck of q_lora_rank
(or, with q_lora_rank 0, one projection), per head qk_nope_head_dim without positions and
qk_rope_head_dim rotated. A head's q·k is over both parts (DeepSeek-V3: 128 + 64 = 192), its values
are v_head_dim wide (128): the kernels take values narrower than q·k (ushard/kernels/attention.py).

RoPE is ushard's rotate-half `rotary` on the rotated parts. DeepSeek's checkpoints rotate interleaved
pairs instead; the import reorders those columns of the projections (hf_names.rope_pairs_to_halves),
which leaves the function as it was. With YaRN (`model.rope_scaling.type="yarn"`) the rotated parts
carry YaRN's attention factor, as in every family, and the softmax scale qk_head_dim ** -0.5 is
multiplied by mscale(factor, mscale_all_dim) ** 2, DeepSeek's own correction (`softmax_gain`).

Decoding caches the latent and the RoPE key, kv_lora_rank + qk_rope_head_dim numbers a token
(DeepSeek-V3: 576, against 128 heads x (192 + 128) expanded), with the expansion absorbed into the
queries and the output (`LatentAttention.decode`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from ushard.errors import UserError
from ushard.models.attention import attention_output, cache_visibility, expanded_attention
from ushard.models.config import MLAConfig, ModelConfig
from ushard.models.layers import (
    RMSNorm,
    fan_in_init,
    param,
    project,
    rope_attention_factor,
    rope_frequencies,
    rotary,
    yarn_mscale,
)
from ushard.models.low_rank import merged
from ushard.sharding import Q_NAMES, Expansion, constrain

# The latents' norms: DeepSeek's (and transformers') take RMSNorm's default epsilon, not rms_norm_eps.
LATENT_NORM_EPS = 1e-6
LATENT_NAMES = ("act_batch", "act_length", None)  # a latent [batch, length, rank]: small, not split
WKV_B_NAMES = ("latent", "heads", "head_dim")  # the keys' and values' up-projection


def softmax_gain(scaling) -> float:
    """What DeepSeek multiplies the softmax scale by: mscale(factor, mscale_all_dim) ** 2 with YaRN
    where mscale_all_dim is set, else 1 (ushard/models/config.py's RopeScaling)."""
    if scaling.type != "yarn" or not scaling.mscale_all_dim:
        return 1.0
    return yarn_mscale(scaling.factor, scaling.mscale_all_dim) ** 2


class LatentAttention(nnx.Module):
    """One layer's multi-head latent attention (module docstring); called as `Attention` is.

    A weight can name a mesh axis once: the down-projections' latent outputs are unnamed, their
    `embed` input carrying ZeRO-3's split, and the up-projections' latent inputs are `latent`, split
    as `embed` is, so that ZeRO-3 splits every weight of the layer.
    """

    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
        mla, d, h = cfg.mla, cfg.d_model, cfg.n_heads
        self.nope, self.rope, self.v_dim = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim
        self.kv_rank, self.fp8 = mla.kv_lora_rank, cfg.fp8
        if mla.q_lora_rank:
            self.wq_a = param(rngs, (d, mla.q_lora_rank), ("embed", None), fan_in_init(d), dtype)
            self.q_norm = RMSNorm(mla.q_lora_rank, LATENT_NORM_EPS, dtype, rngs)
            self.wq_b = param(rngs, (mla.q_lora_rank, h, mla.qk_head_dim), ("latent", "heads", "head_dim"),
                              fan_in_init(mla.q_lora_rank), dtype)
        else:
            self.wq = param(rngs, (d, h, mla.qk_head_dim), ("embed", "heads", "head_dim"), fan_in_init(d), dtype)
        self.q_lora = bool(mla.q_lora_rank)
        self.wkv_a = param(rngs, (d, mla.kv_lora_rank + self.rope), ("embed", None), fan_in_init(d), dtype)
        self.kv_norm = RMSNorm(mla.kv_lora_rank, LATENT_NORM_EPS, dtype, rngs)
        self.wkv_b = param(rngs, (mla.kv_lora_rank, h, self.nope + self.v_dim), WKV_B_NAMES,
                           fan_in_init(mla.kv_lora_rank), dtype)
        self.wo = param(rngs, (h, self.v_dim, d), ("heads", "head_dim", "embed"), fan_in_init(h * self.v_dim), dtype)
        self.rope_theta, self.rope_scaling = cfg.rope_theta, cfg.rope_scaling
        # The kernels scale scores by qk_head_dim ** -0.5; DeepSeek's correction is folded into the queries.
        self.query_gain = softmax_gain(cfg.rope_scaling)
        self.impl, self.document_mask = cfg.attention_impl, cfg.document_mask

    def _queries(self, x, positions):
        """Queries [B, T, heads, qk] of x: the nope part, then the rotated part; DeepSeek's softmax
        correction folded in."""
        if self.q_lora:
            latent = constrain(project("btd,dr->btr", x, self.wq_a[...], self.fp8), LATENT_NAMES)
            q = project("btr,rhk->bthk", self.q_norm(latent), self.wq_b[...], self.fp8)
        else:
            q = project("btd,dhk->bthk", x, self.wq[...], self.fp8)
        q = constrain(q, Q_NAMES)
        q_rot = rotary(q[..., self.nope:], positions, *self._rope())
        q = jnp.concatenate([q[..., :self.nope], q_rot], axis=-1)
        return q * jnp.asarray(self.query_gain, q.dtype) if self.query_gain != 1.0 else q

    def _rope(self):
        return rope_frequencies(self.rope, self.rope_theta, self.rope_scaling), rope_attention_factor(self.rope_scaling)

    def _latent(self, x, positions):
        """The normalised latent [B, T, kv_lora_rank] of x and its rotated key [B, T, qk_rope_head_dim],
        one for every head: all that a token's keys and values are made of."""
        kv_a = constrain(project("btd,dr->btr", x, self.wkv_a[...], self.fp8), LATENT_NAMES)
        latent, k_rot = kv_a[..., :self.kv_rank], kv_a[..., self.kv_rank:]
        return self.kv_norm(latent), rotary(k_rot[:, :, None, :], positions, *self._rope())[:, :, 0]

    def _travelling(self, x, positions):
        """What a token's keys and values are made of, as one array [B, T, kv_lora_rank +
        qk_rope_head_dim] (its normalised latent, then its rotated key), and how they are made
        (`expand_latent`): under context parallelism this travels between the devices, not the keys
        and values (ushard/parallel/context.py)."""
        latent = constrain(jnp.concatenate(self._latent(x, positions), axis=-1), LATENT_NAMES)
        expand = functools.partial(expand_latent, self.nope, self.fp8)
        return latent, Expansion(expand, merged(self.wkv_b[...]), WKV_B_NAMES, (LATENT_NAMES,))

    def _output(self, out):
        return attention_output(out, self.wo[...], self.fp8)

    def __call__(self, x, positions, segment_ids):
        q = self._queries(x, positions)
        latent, expansion = self._travelling(x, positions)
        segment_ids = segment_ids if self.document_mask else None
        return self._output(expanded_attention(q, (latent,), expansion, segment_ids, self.impl))

    def decode(self, x, positions, k_cache, v_cache, length):
        """Attention for new tokens with a cache of latents (inference only; see `Attention.decode`).

        The cache holds each token's latent (k_cache [B, S, 1, kv_lora_rank]) and rotated key (v_cache
        [B, S, 1, qk_rope_head_dim]), not its keys and values: 576 numbers a token and layer for
        DeepSeek-V3 instead of 128 x (192 + 128). The expansion is absorbed into the queries and the
        output instead of applied to every cached token: a head's score is q_nope · (W_k c) + q_rot ·
        k_rot = (W_k^T q_nope) · c + q_rot · k_rot, and its output W_v (sum_s p_s c_s). The same
        function as the expanded keys and values, summed in another order.
        """
        q = self._queries(x, positions)
        latent, k_rot = self._latent(x, positions)
        k_cache = jax.lax.dynamic_update_slice_in_dim(k_cache, latent[:, :, None].astype(k_cache.dtype), length, axis=1)
        v_cache = jax.lax.dynamic_update_slice_in_dim(v_cache, k_rot[:, :, None].astype(v_cache.dtype), length, axis=1)
        latents, rot_keys = k_cache[:, :, 0].astype(q.dtype), v_cache[:, :, 0].astype(q.dtype)
        w_kv = merged(self.wkv_b[...]).astype(q.dtype)  # [kv_lora_rank, heads, nope + v]
        q_latent = jnp.einsum("bthn,rhn->bthr", q[..., :self.nope], w_kv[..., :self.nope])
        scores = (jnp.einsum("bthr,bsr->bhts", q_latent, latents, preferred_element_type=jnp.float32)
                  + jnp.einsum("bthk,bsk->bhts", q[..., self.nope:], rot_keys, preferred_element_type=jnp.float32))
        scores = scores / jnp.sqrt(jnp.float32(q.shape[-1]))
        visible = cache_visibility(length, q.shape[1], k_cache.shape[1])
        weights = jax.nn.softmax(jnp.where(visible, scores, -jnp.inf), axis=-1)
        out_latent = jnp.einsum("bhts,bsr->bthr", weights.astype(q.dtype), latents)
        out = jnp.einsum("bthr,rhv->bthv", out_latent, w_kv[..., self.nope:])
        return self._output(out), k_cache, v_cache


def expand_latent(nope: int, fp8: bool, w_kv, kv):
    """Keys [B, t, heads, nope + rope] and values [B, t, heads, v] of a block of tokens, made from
    their latents and rotated keys `kv` = ([B, t, kv_lora_rank + rope],) by the up-projection `w_kv`
    [kv_lora_rank, heads, nope + v] (however many heads a device holds): the keys' nope part and the
    values per head, the rotated key shared by every head."""
    (latent,) = kv
    rank = w_kv.shape[0]
    kv = project("btr,rhk->bthk", latent[..., :rank], w_kv, fp8)
    k_nope, v = kv[..., :nope], kv[..., nope:]
    k_rot = jnp.broadcast_to(latent[:, :, None, rank:], (*k_nope.shape[:-1], latent.shape[-1] - rank))
    return jnp.concatenate([k_nope, k_rot], axis=-1), v


def refuse_latent_attention(cfg: ModelConfig, family: str) -> None:
    """Refuses `model.mla` settings in a family whose attention is not latent, naming the first one set."""
    if cfg.mla == MLAConfig():
        return
    key = next(k for k, v in vars(cfg.mla).items() if v != getattr(MLAConfig(), k))
    raise UserError(f"model.mla.{key}={getattr(cfg.mla, key)!r} is not used by model.family={family!r}, whose "
                    "attention projects keys and values per head; model.family='deepseek' has multi-head latent "
                    "attention.")
