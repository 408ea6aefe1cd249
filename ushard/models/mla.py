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

Decoding caches the expanded keys and values, like the other families' attention; caching the latent
(kv_lora_rank + qk_rope_head_dim numbers a token instead of heads x (192 + 128)) is the known saving.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ushard.errors import UserError
from ushard.models.attention import cached_attention, causal_attention
from ushard.models.config import MLAConfig, ModelConfig
from ushard.models.layers import (
    BTD,
    RMSNorm,
    fan_in_init,
    param,
    project,
    rope_attention_factor,
    rope_frequencies,
    rotary,
    yarn_mscale,
)
from ushard.sharding import KV_NAMES, Q_NAMES, constrain

# The latents' norms: DeepSeek's (and transformers') take RMSNorm's default epsilon, not rms_norm_eps.
LATENT_NORM_EPS = 1e-6
LATENT_NAMES = ("act_batch", "act_length", None)  # a latent [batch, length, rank]: small, not split


def softmax_gain(scaling) -> float:
    """What DeepSeek multiplies the softmax scale by: mscale(factor, mscale_all_dim) ** 2 with YaRN
    where mscale_all_dim is set, else 1 (ushard/models/config.py's RopeScaling)."""
    if scaling.type != "yarn" or not scaling.mscale_all_dim:
        return 1.0
    return yarn_mscale(scaling.factor, scaling.mscale_all_dim) ** 2


class LatentAttention(nnx.Module):
    """One layer's multi-head latent attention (module docstring); called as `Attention` is.

    The down-projections' latent outputs are unnamed, as they share their weight with `embed` (which
    ZeRO-3 splits); the up-projections' latent inputs are `latent`, split as `embed` is.
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
        self.wkv_b = param(rngs, (mla.kv_lora_rank, h, self.nope + self.v_dim), ("latent", "heads", "head_dim"),
                           fan_in_init(mla.kv_lora_rank), dtype)
        self.wo = param(rngs, (h, self.v_dim, d), ("heads", "head_dim", "embed"), fan_in_init(h * self.v_dim), dtype)
        self.rope_theta, self.rope_scaling = cfg.rope_theta, cfg.rope_scaling
        # The kernels scale scores by qk_head_dim ** -0.5; DeepSeek's correction is folded into the queries.
        self.query_gain = softmax_gain(cfg.rope_scaling)
        self.impl, self.document_mask = cfg.attention_impl, cfg.document_mask

    def _project(self, x, positions):
        """Queries [B, T, heads, qk], keys [B, T, heads, qk] and values [B, T, heads, v] of x."""
        if self.q_lora:
            latent = constrain(project("btd,dr->btr", x, self.wq_a[...], self.fp8), LATENT_NAMES)
            q = project("btr,rhk->bthk", self.q_norm(latent), self.wq_b[...], self.fp8)
        else:
            q = project("btd,dhk->bthk", x, self.wq[...], self.fp8)
        q = constrain(q, Q_NAMES)
        kv_a = constrain(project("btd,dr->btr", x, self.wkv_a[...], self.fp8), LATENT_NAMES)
        latent, k_rot = kv_a[..., :self.kv_rank], kv_a[..., self.kv_rank:]
        kv = constrain(project("btr,rhk->bthk", self.kv_norm(latent), self.wkv_b[...], self.fp8), KV_NAMES)
        k_nope, v = kv[..., :self.nope], kv[..., self.nope:]
        freqs = rope_frequencies(self.rope, self.rope_theta, self.rope_scaling)
        gain = rope_attention_factor(self.rope_scaling)
        q_rot = rotary(q[..., self.nope:], positions, freqs, gain)
        k_rot = rotary(k_rot[:, :, None, :], positions, freqs, gain)  # one key for every head
        q = jnp.concatenate([q[..., :self.nope], q_rot], axis=-1)
        if self.query_gain != 1.0:
            q = q * jnp.asarray(self.query_gain, q.dtype)
        k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rot, (*k_nope.shape[:-1], self.rope))], axis=-1)
        return q, constrain(k, KV_NAMES), constrain(v, KV_NAMES)

    def _output(self, out):
        out = constrain(out, Q_NAMES)
        return constrain(project("bthk,hkd->btd", out, self.wo[...], self.fp8), BTD)

    def __call__(self, x, positions, segment_ids):
        q, k, v = self._project(x, positions)
        return self._output(causal_attention(q, k, v, segment_ids if self.document_mask else None, self.impl))

    def decode(self, x, positions, k_cache, v_cache, length):
        """As `Attention.decode`: caches [B, S, heads, qk] and [B, S, heads, v]."""
        q, k, v = self._project(x, positions)
        k_cache = jax.lax.dynamic_update_slice_in_dim(k_cache, k.astype(k_cache.dtype), length, axis=1)
        v_cache = jax.lax.dynamic_update_slice_in_dim(v_cache, v.astype(v_cache.dtype), length, axis=1)
        out = cached_attention(q, k_cache.astype(q.dtype), v_cache.astype(q.dtype), length)
        return self._output(out), k_cache, v_cache


def refuse_latent_attention(cfg: ModelConfig, family: str) -> None:
    """Refuses `model.mla` settings in a family whose attention is not latent, naming the first one set."""
    if cfg.mla == MLAConfig():
        return
    key = next(k for k, v in vars(cfg.mla).items() if v != getattr(MLAConfig(), k))
    raise UserError(f"model.mla.{key}={getattr(cfg.mla, key)!r} is not used by model.family={family!r}, whose "
                    "attention projects keys and values per head; model.family='deepseek' has multi-head latent "
                    "attention.")
