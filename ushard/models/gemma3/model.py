"""Gemma 3's decoder layers.

A block normalises before and after both attention and the MLP: x + post_norm(attn(pre_norm(x))),
then the same around a GeGLU MLP (tanh-approximated GELU). Every norm is Gemma's RMSNorm, whose
weight is stored as the scale minus one; queries and keys get one too (QK-norm) before RoPE. Layer i
attends globally where (i + 1) is a multiple of `model.sliding_window_pattern`, else within
`model.sliding_window` tokens, with RoPE base `model.local_rope_theta` and no scaling; global layers
use `model.rope_theta` and `model.rope_scaling`. Scores are scaled by query_pre_attn_scalar ** -0.5
and the embedding by sqrt(d_model).

The layers are stacked as periods (`blocks`: each item sliding_window_pattern layers, the last one
global), then `tail_blocks`, the local layers left over when n_layers is not a whole number of periods
(Gemma 3 1B's 26 layers: 4 periods and 2 more).
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from ushard.errors import UserError
from ushard.models.attention import Attention
from ushard.models.config import ModelConfig, RopeScaling
from ushard.models.decoder import Decoder, Period, Stack
from ushard.models.family import AttentionShape
from ushard.models.layers import BTD, RMSNorm, SwiGLU
from ushard.models.mla import refuse_latent_attention
from ushard.sharding import constrain

GEMMA_NORM = 1.0  # RMSNorm's offset: Gemma stores scale - 1


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, local: bool):
        dtype = jnp.dtype(cfg.param_dtype)
        norm = lambda dim: RMSNorm(dim, cfg.norm_eps, dtype, rngs, offset=GEMMA_NORM)  # noqa: E731
        self.attn_norm = norm(cfg.d_model)
        if local:
            self.attn = Attention(cfg, dtype, rngs, qk_norm=True, norm_offset=GEMMA_NORM, window=cfg.sliding_window,
                                  rope_theta=cfg.local_rope_theta or cfg.rope_theta, rope_scaling=RopeScaling())
        else:
            self.attn = Attention(cfg, dtype, rngs, qk_norm=True, norm_offset=GEMMA_NORM)
        self.post_attn_norm = norm(cfg.d_model)
        self.mlp_norm = norm(cfg.d_model)
        self.mlp = SwiGLU(cfg.d_model, cfg.d_ff, dtype, rngs, fused=cfg.fused_mlp, fp8=cfg.fp8, activation="gelu_tanh")
        self.post_mlp_norm = norm(cfg.d_model)

    def _feed_forward(self, x):
        return constrain(x + self.post_mlp_norm(self.mlp(self.mlp_norm(x))), BTD)

    def __call__(self, x, positions, segment_ids):
        """-> (x, aux): Gemma's layers add no aux terms."""
        x = constrain(x + self.post_attn_norm(self.attn(self.attn_norm(x), positions, segment_ids)), BTD)
        return self._feed_forward(x), {}

    def decode(self, x, positions, k_cache, v_cache, length):
        attn, k_cache, v_cache = self.attn.decode(self.attn_norm(x), positions, k_cache, v_cache, length)
        x = constrain(x + self.post_attn_norm(attn), BTD)
        return self._feed_forward(x), k_cache, v_cache


def is_local(cfg: ModelConfig, layer: int) -> bool:
    """Whether layer `layer` attends within the sliding window (module docstring)."""
    pattern = cfg.sliding_window_pattern
    return bool(cfg.sliding_window) and not (pattern and (layer + 1) % pattern == 0)


def period(cfg: ModelConfig) -> int:
    """Layers one item of the `blocks` stack holds: a whole pattern, or 1 where every layer is alike."""
    every_local = not cfg.sliding_window_pattern
    return 1 if not cfg.sliding_window or every_local or cfg.sliding_window_pattern == 1 else cfg.sliding_window_pattern


def stacks(cfg: ModelConfig) -> list[Stack]:
    p = period(cfg)
    makers = [lambda r, local=is_local(cfg, j): Block(cfg, r, local) for j in range(p)]
    items, rest = divmod(cfg.n_layers, p)
    out = []
    if items:
        make = makers[0] if p == 1 else (lambda r: Period(makers, r))
        out.append(Stack("blocks", items, p, make))
    if rest:
        out.append(Stack("tail_blocks", rest, 1, lambda r: Block(cfg, r, local=True)))
    return out


def build(cfg: ModelConfig, rngs: nnx.Rngs) -> Decoder:
    return Decoder(cfg, rngs, stacks(cfg), norm_offset=GEMMA_NORM, embed_scale=True)


def attention_shape(cfg: ModelConfig) -> AttentionShape:
    windows = tuple(cfg.sliding_window if is_local(cfg, i) else 0 for i in range(cfg.n_layers))
    return AttentionShape(cfg.n_heads, cfg.head_dim, cfg.head_dim, windows)


def check(cfg: ModelConfig) -> None:
    refuse_latent_attention(cfg, "gemma3")
    if cfg.moe.num_experts:
        raise UserError(f"model.moe.num_experts={cfg.moe.num_experts}: Gemma 3 has no mixture-of-experts layers; "
                        f"use model.family='qwen3' or 'llama' for an MoE model.")
