"""Building blocks of a Llama-style decoder: parameters with logical names, RMSNorm, RoPE, SwiGLU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from ushard.sharding import constrain

BTD = ("act_batch", "act_length", "act_embed")


def fan_in_init(fan_in: int):
    """Truncated normal with std 1/sqrt(fan_in): activations keep unit scale through each matmul."""
    return jax.nn.initializers.truncated_normal(stddev=fan_in**-0.5)


def param(rngs: nnx.Rngs, shape, names, init, dtype) -> nnx.Param:
    """A weight whose every dimension carries a logical axis name."""
    assert len(shape) == len(names), (shape, names)
    return nnx.Param(init(rngs.params(), shape, dtype), out_sharding=tuple(names))


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype, rngs: nnx.Rngs):
        self.scale = param(rngs, (dim,), ("norm",), jax.nn.initializers.ones, dtype)
        self.eps = eps

    def __call__(self, x):
        # Statistics in float32 whatever the compute dtype: bf16 mean-of-squares loses too much.
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        out = (normed * self.scale[...].astype(jnp.float32)).astype(x.dtype)
        return checkpoint_name(out, "norm_out")  # a remat policy may keep it (models/llama.py)


def rotary(x, positions, theta: float):
    """Rotary position embedding on [batch, length, heads, head_dim], rotating the two halves of head_dim."""
    half = x.shape[-1] // 2
    freqs = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions.astype(jnp.float32)[:, :, None, None] * freqs  # [B, T, 1, half]
    sin, cos = jnp.sin(angles), jnp.cos(angles)
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class SwiGLU(nnx.Module):
    def __init__(self, d_model: int, d_ff: int, dtype, rngs: nnx.Rngs):
        self.w_gate = param(rngs, (d_model, d_ff), ("embed", "mlp"), fan_in_init(d_model), dtype)
        self.w_up = param(rngs, (d_model, d_ff), ("embed", "mlp"), fan_in_init(d_model), dtype)
        self.w_down = param(rngs, (d_ff, d_model), ("mlp", "embed"), fan_in_init(d_ff), dtype)

    def __call__(self, x):
        dt = x.dtype
        gate = jnp.einsum("btd,df->btf", x, self.w_gate[...].astype(dt))
        up = jnp.einsum("btd,df->btf", x, self.w_up[...].astype(dt))
        hidden = constrain(jax.nn.silu(gate) * up, ("act_batch", "act_length", "act_mlp"))
        hidden = checkpoint_name(hidden, "mlp_hidden")
        return constrain(jnp.einsum("btf,fd->btd", hidden, self.w_down[...].astype(dt)), BTD)
