"""The Llama decoder's layers (Llama 2/3, Mistral without a window, Mixtral; Qwen3's with QK-norm).

A pre-norm block: x + attention(norm(x)), then x + MLP(norm(x)). With `model.moe.num_experts` > 0,
MoE blocks (ushard/models/moe.py) take the dense MLP's place on the layers `model.moe` names:
`dense_blocks` stacks the `first_dense_layers` leading dense layers, `blocks` the rest, each item one
period of `every` layers (an MoE layer, then every-1 dense ones).
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from ushard.errors import UserError
from ushard.models.attention import Attention
from ushard.models.config import ModelConfig
from ushard.models.decoder import Decoder, Period, Stack
from ushard.models.layers import BTD, RMSNorm, SwiGLU
from ushard.models.mla import refuse_latent_attention
from ushard.models.moe import MoE
from ushard.sharding import constrain


class Block(nnx.Module):
    """`attention(cfg, dtype, rngs)` makes the layer's attention (default: grouped-query `Attention`,
    with QK-norm where `qk_norm`; DeepSeek's: latent attention)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, moe: bool = False, qk_norm: bool = False, attention=None):
        dtype = jnp.dtype(cfg.param_dtype)
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, dtype, rngs)
        if attention is None:
            self.attn = Attention(cfg, dtype, rngs, qk_norm=qk_norm)
        else:
            self.attn = attention(cfg, dtype, rngs)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, dtype, rngs)
        if moe:
            self.mlp = MoE(cfg, dtype, rngs)
        else:
            self.mlp = SwiGLU(cfg.d_model, cfg.d_ff, dtype, rngs, fused=cfg.fused_mlp, fp8=cfg.fp8)

    def _feed_forward(self, x):
        """x + the MLP's output, and the MLP's aux terms (an MoE block's; a dense MLP adds none)."""
        out = self.mlp(self.mlp_norm(x))
        y, aux = out if isinstance(out, tuple) else (out, {})
        return constrain(x + y, BTD), aux

    def __call__(self, x, positions, segment_ids):
        """-> (x, aux)."""
        x = constrain(x + self.attn(self.attn_norm(x), positions, segment_ids), BTD)
        return self._feed_forward(x)

    def decode(self, x, positions, k_cache, v_cache, length):
        """The block for new tokens with this layer's KV cache (see `Attention.decode`)."""
        attn, k_cache, v_cache = self.attn.decode(self.attn_norm(x), positions, k_cache, v_cache, length)
        x = constrain(x + attn, BTD)
        return self._feed_forward(x)[0], k_cache, v_cache


def is_moe_layer(cfg: ModelConfig, layer: int) -> bool:
    """Whether layer `layer` holds an MoE block (module docstring)."""
    moe, first = cfg.moe, cfg.moe.first_dense_layers
    return bool(moe.num_experts) and layer >= first and (layer - first) % moe.every == 0


def stacks(cfg: ModelConfig, qk_norm: bool = False, attention=None) -> list[Stack]:
    """The layer stacks of a Llama-style model of `cfg`, dense or MoE (module docstring), each layer's
    attention made by `attention` (`Block`)."""
    block = lambda moe: lambda r: Block(cfg, r, moe=moe, qk_norm=qk_norm, attention=attention)  # noqa: E731
    moe = cfg.moe
    if not moe.num_experts:
        return [Stack("blocks", cfg.n_layers, 1, block(False))]
    dense = [Stack("dense_blocks", moe.first_dense_layers, 1, block(False))] if moe.first_dense_layers else []
    if moe.every == 1:
        return [*dense, Stack("blocks", cfg.moe_layers, 1, block(True))]
    makers = [block(is_moe_layer(cfg, moe.first_dense_layers + j)) for j in range(moe.every)]
    return [*dense, Stack("blocks", cfg.moe_layers, moe.every, lambda r: Period(makers, r))]


def mtp_block(cfg: ModelConfig, qk_norm: bool = False, attention=None):
    """The block of a multi-token prediction module: the kind layer n_layers would be (MoE or dense)."""
    return lambda r: Block(cfg, r, moe=is_moe_layer(cfg, cfg.n_layers), qk_norm=qk_norm, attention=attention)


def build(cfg: ModelConfig, rngs: nnx.Rngs) -> Decoder:
    return Decoder(cfg, rngs, stacks(cfg), mtp_block=mtp_block(cfg))


def check(cfg: ModelConfig, family: str = "llama") -> None:
    """Refuses the settings of other families' layers."""
    refuse_windows(cfg, family)
    refuse_latent_attention(cfg, family)


def refuse_windows(cfg: ModelConfig, family: str) -> None:
    for key in ("sliding_window", "local_rope_theta"):
        if getattr(cfg, key):
            raise UserError(f"model.{key}={getattr(cfg, key)!r} is not used by model.family={family!r}, whose "
                            f"layers all attend to the whole context; model.family='gemma3' has sliding windows.")
