"""Building blocks every family shares: parameters with logical names, RMSNorm, RoPE, gated MLPs."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from ushard.models.fp8 import fp8_einsum
from ushard.models.low_rank import LowRankAdapted
from ushard.sharding import constrain

# The residual stream between (and out of) attention and the MLP: with sequence parallelism its length
# is split over the tensor axis as well (ushard/sharding.py).
BTD = ("act_batch", "act_residual_length", "act_embed")
MLP_NAMES = ("act_batch", "act_length", "act_mlp")  # the MLP's hidden activations


def project(spec: str, x, w, fp8: bool = False):
    """`einsum(spec, x, w)` of an activation by a weight, in x's dtype; with `fp8`, one FP8 GEMM. A
    LoRA-adapted weight adds its low-rank update (ushard/models/low_rank.py)."""
    if isinstance(w, LowRankAdapted):
        return w.project(spec, x, lambda spec, x, base: project(spec, x, base, fp8))
    w = w.astype(x.dtype)
    return fp8_einsum(spec, x, w) if fp8 else jnp.einsum(spec, x, w)


def fan_in_init(fan_in: int):
    """Truncated normal with std 1/sqrt(fan_in): activations keep unit scale through each matmul."""
    return jax.nn.initializers.truncated_normal(stddev=fan_in**-0.5)


def param(rngs: nnx.Rngs, shape, names, init, dtype) -> nnx.Param:
    """A weight whose every dimension carries a logical axis name."""
    assert len(shape) == len(names), (shape, names)
    return nnx.Param(init(rngs.params(), shape, dtype), out_sharding=tuple(names))


class RMSNorm(nnx.Module):
    """x / rms(x) times a learned scale. With `offset` 1 (Gemma's), the stored weight is the scale minus
    one (zeros at initialisation), as Gemma's checkpoints store it."""

    def __init__(self, dim: int, eps: float, dtype, rngs: nnx.Rngs, offset: float = 0.0):
        init = jax.nn.initializers.zeros if offset else jax.nn.initializers.ones
        self.scale = param(rngs, (dim,), ("norm",), init, dtype)
        self.eps, self.offset = eps, offset

    def __call__(self, x):
        # Statistics in float32 whatever the compute dtype: bf16 mean-of-squares loses too much.
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        out = (normed * (self.offset + self.scale[...].astype(jnp.float32))).astype(x.dtype)
        return checkpoint_name(out, "norm_out")  # a remat policy may keep it (models/llama.py)


@jax.custom_vjp
def embed_lookup(table, tokens):
    """Rows of `table` (already in the compute dtype) for `tokens`; the gradient is summed in float32.

    Casting the table before the lookup lets a sharded table be gathered in the 16-bit compute dtype
    (half the bytes of float32), while the plain autodiff of a 16-bit lookup would sum the gradients of
    repeated tokens in 16 bits: here they are summed in float32 and rounded once, like a matmul's.
    """
    return jnp.take(table, tokens, axis=0)


def _embed_lookup_fwd(table, tokens):
    return embed_lookup(table, tokens), (tokens, jax.ShapeDtypeStruct(table.shape, table.dtype))


def _embed_lookup_bwd(residuals, grad):
    tokens, table = residuals
    summed = jnp.zeros(table.shape, jnp.float32).at[tokens].add(grad.astype(jnp.float32))
    return summed.astype(table.dtype), None


embed_lookup.defvjp(_embed_lookup_fwd, _embed_lookup_bwd)


def rope_frequencies(head_dim: int, theta: float, scaling) -> jax.Array:
    """RoPE's angular frequencies [head_dim / 2] (float32), stretched as `scaling` (a RopeScaling) says.

    "llama3" (Llama 3.1): frequencies whose wavelength is longer than the original context divided by
    low_freq_factor turn `factor` times slower, those shorter than it divided by high_freq_factor stay,
    and the ones between are a linear blend of both by where the context falls in that range.
    "yarn": see `yarn_frequencies`.
    """
    half = head_dim // 2
    freqs = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    if scaling.type == "none":
        return freqs
    if scaling.type == "linear":
        return freqs / scaling.factor
    if scaling.type == "yarn":
        return yarn_frequencies(freqs, head_dim, theta, scaling)
    context = scaling.original_max_position_embeddings
    wavelength = 2 * jnp.pi / freqs
    blend = (context / wavelength - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - blend) * freqs / scaling.factor + blend * freqs
    slow = jnp.where(wavelength > context / scaling.low_freq_factor, freqs / scaling.factor, blended)
    return jnp.where(wavelength < context / scaling.high_freq_factor, freqs, slow)


def yarn_frequencies(freqs, head_dim: int, theta: float, scaling) -> jax.Array:
    """YaRN's frequencies (transformers' `rope_type: yarn`, its default `truncate`): frequency i is
    divided by `factor` by a ramp that is 0 up to index `low` and 1 from index `high`, where low and
    high (rounded down and up) are the indices whose frequency turns beta_fast and beta_slow times over
    the original context: the fast ones keep their resolution, the slow ones are interpolated."""

    def index_turning(turns):  # where theta ** (-2i / d) * context = turns * 2 pi
        context = scaling.original_max_position_embeddings
        return head_dim * math.log(context / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(index_turning(scaling.beta_fast)), 0)
    high = min(math.ceil(index_turning(scaling.beta_slow)), head_dim - 1)
    if low == high:
        high += 0.001  # as transformers does: the ramp is a step there
    ramp = jnp.clip((jnp.arange(freqs.shape[0], dtype=jnp.float32) - low) / (high - low), 0, 1)
    return freqs / scaling.factor * ramp + freqs * (1 - ramp)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched `factor` times: 0.1 * mscale * ln(factor) + 1."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_attention_factor(scaling) -> float:
    """What RoPE's rotated queries and keys are each multiplied by: 1, but for YaRN the ratio of its two
    magnitude corrections where both are set, else the plain one (RopeScaling's docstring)."""
    if scaling.type != "yarn":
        return 1.0
    if scaling.mscale and scaling.mscale_all_dim:
        return yarn_mscale(scaling.factor, scaling.mscale) / yarn_mscale(scaling.factor, scaling.mscale_all_dim)
    return yarn_mscale(scaling.factor)


def rotary(x, positions, freqs, scale: float = 1.0):
    """Rotary position embedding on [batch, length, heads, head_dim], rotating the two halves of head_dim
    by `freqs` [head_dim / 2] (`rope_frequencies`) times each position, the result times `scale`
    (`rope_attention_factor`)."""
    angles = positions.astype(jnp.float32)[:, :, None, None] * freqs  # [B, T, 1, half]
    sin, cos = jnp.sin(angles), jnp.cos(angles)
    if scale != 1.0:
        sin, cos = sin * scale, cos * scale
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


@jax.custom_vjp
def gated_silu_pair(gate_up):
    """silu(gate) * up of a fused [..., 2, mlp] tensor (gate, then up, on axis -2).

    Written by hand so that the backward pass is one elementwise pass over the [..., 2, mlp] layout:
    each element finds its partner (gate for up, up for gate) by reversing axis -2, so every output
    element reads its inputs once. Autodiff of the slices instead sums two zero-padded halves, which
    XLA runs at two thirds of the memory bandwidth (docs/benchmarks.md). Reverse mode only (a custom
    VJP): `jax.jvp` through it is refused.
    """
    assert gate_up.shape[-2] == 2, gate_up.shape
    return jax.nn.silu(gate_up[..., 0, :]) * gate_up[..., 1, :]


def _gated_silu_pair_fwd(gate_up):
    return gated_silu_pair(gate_up), gate_up


def _gated_silu_pair_bwd(gate_up, d_hidden):
    is_gate = jax.lax.broadcasted_iota(jnp.int32, gate_up.shape, gate_up.ndim - 2) == 0
    x = gate_up.astype(jnp.float32)
    partner = jnp.flip(x, axis=-2)
    g, u = jnp.where(is_gate, x, partner), jnp.where(is_gate, partner, x)
    d = jnp.expand_dims(d_hidden.astype(jnp.float32), -2)
    s = jax.nn.sigmoid(g)
    d_gate_up = jnp.where(is_gate, d * u * s * (1 + g * (1 - s)), d * g * s)
    return (d_gate_up.astype(gate_up.dtype),)


gated_silu_pair.defvjp(_gated_silu_pair_fwd, _gated_silu_pair_bwd)


# The gated MLPs' activations: SwiGLU's silu, GeGLU's tanh-approximated GELU (Gemma's gelu_pytorch_tanh).
ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True)}


class SwiGLU(nnx.Module):
    """act(x W_gate) * (x W_up), projected back by W_down; act is silu (SwiGLU) or `activation`'s.

    With `fused`, gate and up are one weight [embed, 2, mlp] and one matmul twice as wide: fewer,
    larger GEMMs, and one weight-gradient GEMM instead of two. With `fp8`, all three are FP8 GEMMs.
    """

    def __init__(self, d_model: int, d_ff: int, dtype, rngs: nnx.Rngs, fused: bool = False, fp8: bool = False,
                 activation: str = "silu"):
        init = fan_in_init(d_model)
        if fused:
            self.w_gate_up = param(rngs, (d_model, 2, d_ff), ("embed", None, "mlp"), init, dtype)
        else:
            self.w_gate = param(rngs, (d_model, d_ff), ("embed", "mlp"), init, dtype)
            self.w_up = param(rngs, (d_model, d_ff), ("embed", "mlp"), init, dtype)
        self.w_down = param(rngs, (d_ff, d_model), ("mlp", "embed"), fan_in_init(d_ff), dtype)
        self.fused, self.fp8, self.activation = fused, fp8, activation

    def __call__(self, x):
        # Each column-parallel output pinned split over `mlp` at full length: left to XLA under
        # sequence parallelism, the fused gate/up GEMM ran on the local tokens with the weight
        # gathered over `tensor`, then moved the result with an all-to-all.
        if self.fused:
            gate_up = project("btd,dcf->btcf", x, self.w_gate_up[...], self.fp8)
            gate_up = constrain(gate_up, ("act_batch", "act_length", None, "act_mlp"))
            if self.activation == "silu":
                hidden = gated_silu_pair(gate_up)
            else:
                hidden = ACTIVATIONS[self.activation](gate_up[..., 0, :]) * gate_up[..., 1, :]
        else:
            gate = constrain(project("btd,df->btf", x, self.w_gate[...], self.fp8), MLP_NAMES)
            up = constrain(project("btd,df->btf", x, self.w_up[...], self.fp8), MLP_NAMES)
            hidden = ACTIVATIONS[self.activation](gate) * up
        hidden = constrain(hidden, MLP_NAMES)
        hidden = checkpoint_name(hidden, "mlp_hidden")
        return constrain(project("btf,fd->btd", hidden, self.w_down[...], self.fp8), BTD)
