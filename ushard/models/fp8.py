"""FP8 matmuls for training on Hopper GPUs: plain JAX whose dots take FP8 operands, so XLA emits FP8 GEMMs.

Used by the transformer blocks' projections when `model.fp8=true`: `fp8_einsum(spec, x, w)` replaces
`jnp.einsum(spec, x, w)` for an activation `x` and a weight `w`, both already in the compute dtype.

Scaling recipe: current (dynamic) per-tensor scaling. Each matmul operand is divided by a scale
amax/fp8_max, computed from the tensor itself at that step, so its largest value lands on the top
of the FP8 range, then cast to FP8:
  - forward: activations and weights in float8_e4m3fn (max 448: one more mantissa bit);
  - backward: the output gradient in float8_e5m2 (max 57344: more exponent range for gradients).
The GEMM multiplies the FP8 operands, accumulating in float32, and writes the compute dtype; the
product of the two scales multiplies its output. Only the FP8 operands and their scalar scales are saved for the
backward pass: half the residual bytes of bf16.

Cost: each quantisation is an extra pass over its tensor, a max-|x| reduction and then the
scale-and-cast, and the cast has to wait for the reduction; per step that is x, w (forward) and the
output gradient (backward). With sharded operands each amax is a global max, one scalar all-reduce.
Hopper's FP8 GEMMs need M, N, K multiples of 16 (XLA pads otherwise) and both operands K-major,
so XLA transposes some FP8 operands (see `_fp8_matmul`). Delayed scaling (amax from earlier steps)
would overlap the reduction with the matmul but needs amax history state; this recipe needs none.

On other platforms (CPU, tests) the same graph runs as written: XLA widens the FP8 operands and
computes an ordinary dot, which matches the GPU's FP8 GEMM up to accumulation order.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

E4M3 = jnp.float8_e4m3fn  # activations and weights
E5M2 = jnp.float8_e5m2  # gradients


def _quantise(t: jax.Array, fp8_dtype, dequant_dtype) -> tuple[jax.Array, jax.Array]:
    """`t` as FP8 and its float32 scale, with t ~= fp8.astype(float32) * scale."""
    fp8_max = float(jnp.finfo(fp8_dtype).max)
    amax = jax.lax.stop_gradient(jnp.max(jnp.abs(t)).astype(jnp.float32))
    # Round the scale to the dtype it is applied in (see _scaled_dot), so that quantising and
    # dequantising use the very same number; the floor keeps an all-zero tensor away from 0/0.
    scale = (amax / fp8_max).astype(dequant_dtype)
    scale = jnp.maximum(scale, jnp.finfo(dequant_dtype).tiny).astype(jnp.float32)
    # Clip: the rounded scale may push the largest value a hair past fp8_max, and the cast of an
    # out-of-range value gives NaN (e4m3fn has no inf), not the largest finite value.
    scaled = jnp.clip(t.astype(jnp.float32) / scale, -fp8_max, fp8_max)
    return scaled.astype(fp8_dtype), scale


def _scaled_dot(a_q, a_scale, b_q, b_scale, contract: tuple[int, int], out_dtype) -> jax.Array:
    """(a_q * a_scale) . (b_q * b_scale) contracting one dimension of each, in `out_dtype`.

    The FP8 operands go straight into dot_general, so XLA's GPU compiler must emit an FP8 GEMM
    (float32 accumulation); the product of the two scalar scales multiplies its output. Written as
    dequantise-then-dot instead, XLA folds the FP8 round trip away and runs a 16-bit GEMM (seen with
    JAX 0.11 on an H100). One contracting dimension per operand and no batch dimensions.
    """
    y = jax.lax.dot_general(a_q, b_q, (((contract[0],), (contract[1],)), ((), ())), preferred_element_type=out_dtype)
    return y * (a_scale * b_scale).astype(out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _fp8_matmul(x: jax.Array, w: jax.Array, w_dtype) -> jax.Array:
    """[M, K] @ [K, N] -> [M, N] in x's dtype, both operands quantised to e4m3 with per-tensor scales."""
    return _fp8_matmul_fwd(x, w, w_dtype)[0]


def _fp8_matmul_fwd(x, w, w_dtype):
    dt = x.dtype
    x_q, x_scale = _quantise(x, E4M3, dt)
    w_q, w_scale = _quantise(w, E4M3, dt)
    # Hopper's FP8 GEMMs want K the minor dimension of both operands. x [M, K] already is; w [K, N] is
    # not, so XLA transposes w_q (K*N bytes of FP8).
    y = _scaled_dot(x_q, x_scale, w_q, w_scale, (1, 0), dt)
    return y, (x_q, x_scale, w_q, w_scale)


def _fp8_matmul_bwd(w_dtype, residuals, dy):
    x_q, x_scale, w_q, w_scale = residuals
    x_dtype = dy.dtype  # the cotangent has the output's dtype, which is x's
    dy_q, dy_scale = _quantise(dy, E5M2, x_dtype)
    # dx [M, K] = dy [M, N] . w_q^T: N is already the minor dimension of both, no transpose.
    dx = _scaled_dot(dy_q, dy_scale, w_q, w_scale, (1, 1), x_dtype)
    # dw [K, N] = x_q^T . dy: the contraction is over M, the major dimension of both, so XLA
    # transposes x_q and dy_q (M*K + M*N bytes of FP8, the largest transposes of the step).
    dw = _scaled_dot(x_q, x_scale, dy_q, dy_scale, (0, 0), w_dtype)
    return dx, dw


_fp8_matmul.defvjp(_fp8_matmul_fwd, _fp8_matmul_bwd)


def fp8_einsum(spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """`jnp.einsum(spec, x, w)` through one FP8 GEMM: same output layout, in x's dtype.

    `x` is the activation, `w` the weight; the spec has no batch letters shared by both operands
    and the output. Contracted dimensions are flattened into K, x's remaining ones into M and w's
    into N, transposing first if they are not already grouped that way.
    """
    inputs, out = spec.replace(" ", "").split("->")
    xs, ws = inputs.split(",")
    for name, letters, t in (("x", xs, x), ("w", ws, w)):
        if len(set(letters)) != len(letters) or len(letters) != t.ndim:
            raise ValueError(f"fp8_einsum: bad {name} subscripts {letters!r} for shape {t.shape} in {spec!r}")
    contracted = [c for c in xs if c in ws]
    x_free = [c for c in xs if c not in ws]
    w_free = [c for c in ws if c not in xs]
    if any(c in out for c in contracted) or sorted(out) != sorted(x_free + w_free):
        raise ValueError(f"fp8_einsum: spec {spec!r} is not an activation-by-weight contraction")

    size = dict(zip(xs, x.shape)) | dict(zip(ws, w.shape))
    for c in contracted:
        if x.shape[xs.index(c)] != w.shape[ws.index(c)]:
            raise ValueError(f"fp8_einsum: dimension {c!r} differs between x {x.shape} and w {w.shape}")

    def prod(letters):
        return math.prod(size[c] for c in letters)

    # [M, K] and [K, N]; the transposes are no-ops for all the model's specs.
    x2 = jnp.transpose(x, [xs.index(c) for c in x_free + contracted]).reshape(prod(x_free), prod(contracted))
    w2 = jnp.transpose(w, [ws.index(c) for c in contracted + w_free]).reshape(prod(contracted), prod(w_free))
    y = _fp8_matmul(x2, w2, w.dtype).reshape([size[c] for c in x_free + w_free])
    return jnp.transpose(y, [(x_free + w_free).index(c) for c in out])
