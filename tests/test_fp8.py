"""FP8 einsum (ushard/models/fp8.py): close to float32 but really quantised, for every spec the model uses."""

import jax
import jax.numpy as jnp
import pytest

from ushard.models.fp8 import fp8_einsum

# Every spec the model's blocks route through fp8_einsum, and the LM head's, with small shapes (x, w).
SPECS = {
    "btd,dhk->bthk": ((2, 8, 32), (32, 4, 8)),
    "btd,df->btf": ((2, 8, 32), (32, 48)),
    "btf,fd->btd": ((2, 8, 48), (48, 32)),
    "bthk,hkd->btd": ((2, 8, 4, 8), (4, 8, 32)),
    "btd,dv->btv": ((2, 8, 32), (32, 40)),
    "btd,dcf->btcf": ((2, 8, 32), (32, 2, 24)),
    "btd,dkgh->btkgh": ((2, 8, 32), (32, 3, 2, 8)),
}
# e4m3 keeps 3 mantissa bits, e5m2 2: the outputs come out ~0.04 off float32, the gradients (e5m2 dy)
# ~0.06. Above the cap something is worse than FP8 rounding; below the floor nothing was quantised.
MAX_ERR, MIN_ERR = 0.08, 1e-4


def relative_error(out, ref):
    out, ref = out.astype(jnp.float32), ref.astype(jnp.float32)
    return float(jnp.linalg.norm((out - ref).ravel()) / jnp.linalg.norm(ref.ravel()))


def draw(spec, seed, dtype=jnp.float32):
    """Fresh normal x, w and output cotangent for `spec` (normal draws: no zeros)."""
    x_shape, w_shape = SPECS[spec]
    kx, kw, kc = jax.random.split(jax.random.key(seed), 3)
    out_shape = jax.eval_shape(lambda x, w: jnp.einsum(spec, x, w), jnp.zeros(x_shape), jnp.zeros(w_shape)).shape
    shapes = ((kx, x_shape), (kw, w_shape), (kc, out_shape))
    return tuple(jax.random.normal(k, shape).astype(dtype) for k, shape in shapes)


def value_and_grads(einsum, spec, x, w, cotangent):
    def loss(x, w):
        out = einsum(spec, x, w)
        return jnp.sum(out.astype(jnp.float32) * cotangent.astype(jnp.float32)), out

    (_, out), (dx, dw) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(x, w)
    return out, dx, dw


def assert_close_but_quantised(x, w, cotangent, spec):
    got = value_and_grads(fp8_einsum, spec, x, w, cotangent)
    ref = value_and_grads(jnp.einsum, spec, x, w, cotangent)
    for name, g, r in zip(("output", "dx", "dw"), got, ref):
        assert g.shape == r.shape, (name, g.shape, r.shape)
        err = relative_error(g, r)
        assert MIN_ERR < err < MAX_ERR, f"{spec} {name}: relative error {err:.2e}"


@pytest.mark.parametrize("spec", SPECS)
def test_matches_float32_einsum_with_fp8_error(spec):
    x, w, cotangent = draw(spec, seed=list(SPECS).index(spec))
    assert_close_but_quantised(x, w, cotangent, spec)


@pytest.mark.parametrize("x_scale, cotangent_scale", [(1e-3, 1.0), (1e3, 1.0), (1.0, 1e-6), (1e3, 1e4)])
def test_dynamic_scaling_covers_any_magnitude(x_scale, cotangent_scale):
    # Without per-tensor scales, 1e-3 * N(0,1) would be mostly e4m3 subnormals/zeros and 1e3 * N(0,1)
    # would overflow (max 448); a 1e-6 gradient would underflow e5m2.
    spec = "btd,df->btf"
    x, w, cotangent = draw(spec, seed=11)
    assert_close_but_quantised(x * x_scale, w, cotangent * cotangent_scale, spec)


def test_bf16_output_and_gradients_keep_einsum_shapes_and_dtypes():
    for spec in SPECS:
        x, w, cotangent = draw(spec, seed=21, dtype=jnp.bfloat16)
        out, dx, dw = value_and_grads(fp8_einsum, spec, x, w, cotangent)
        ref = jax.eval_shape(lambda x, w: jnp.einsum(spec, x, w), x, w)
        assert (out.shape, out.dtype) == (ref.shape, ref.dtype), spec
        assert (dx.shape, dx.dtype) == (x.shape, x.dtype), spec
        assert (dw.shape, dw.dtype) == (w.shape, w.dtype), spec
        assert relative_error(out, jnp.einsum(spec, x.astype(jnp.float32), w.astype(jnp.float32))) < MAX_ERR


def test_residuals_are_fp8_and_jitted_grad_compiles():
    spec = "btd,dcf->btcf"
    x, w, _ = draw(spec, seed=31, dtype=jnp.bfloat16)
    f = lambda x, w: fp8_einsum(spec, x, w)  # noqa: E731

    # What the forward keeps for the backward: two FP8 operands and two float32 scalar scales, no bf16.
    _, vjp = jax.vjp(f, x, w)
    saved = sorted((str(leaf.dtype), leaf.shape) for leaf in jax.tree_util.tree_leaves(vjp))
    assert saved == [("float32", ()), ("float32", ()), ("float8_e4m3fn", (16, 32)), ("float8_e4m3fn", (32, 48))]
    # The plain einsum saves its bf16 inputs: twice the bytes.
    _, plain_vjp = jax.vjp(lambda x, w: jnp.einsum(spec, x, w), x, w)
    assert {str(leaf.dtype) for leaf in jax.tree_util.tree_leaves(plain_vjp)} == {"bfloat16"}

    loss = lambda x, w: jnp.sum(f(x, w).astype(jnp.float32) ** 2)  # noqa: E731
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, w).compile()
    hlo = compiled.as_text()
    assert "f8e4m3fn" in hlo and "f8e5m2" in hlo  # forward operands e4m3, output gradient e5m2
    dx, dw = compiled(x, w)
    assert bool(jnp.all(jnp.isfinite(dx.astype(jnp.float32)))) and bool(jnp.all(jnp.isfinite(dw.astype(jnp.float32))))


def test_all_zero_input_gives_zeros_not_nans():
    spec = "btd,df->btf"
    x, w, cotangent = draw(spec, seed=41)
    out, dx, dw = value_and_grads(fp8_einsum, spec, jnp.zeros_like(x), w, cotangent)
    assert not bool(jnp.any(out)) and not bool(jnp.any(dw))
    assert bool(jnp.all(jnp.isfinite(dx))) and relative_error(dx, cotangent @ w.T) < MAX_ERR


@pytest.mark.parametrize("spec", ["btd,btd->bt", "btd,df->bt", "btd,df->btfd"])
def test_rejects_specs_that_are_not_activation_by_weight(spec):
    x = jnp.ones((2, 3, 4))
    w = jnp.ones((2, 3, 4)) if spec.startswith("btd,btd") else jnp.ones((4, 5))
    with pytest.raises(ValueError):
        fp8_einsum(spec, x, w)


@pytest.mark.skipif(
    jax.devices()[0].platform != "gpu" or float(getattr(jax.devices()[0], "compute_capability", 0)) < 8.9,
    reason="needs an FP8 GPU (Ada/Hopper or later); run with JAX_PLATFORMS=cuda",
)
def test_gpu_compiles_each_matmul_into_one_fp8_gemm():
    spec = "btd,df->btf"
    x = jax.random.normal(jax.random.key(0), (4, 64, 128), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), (128, 256), jnp.bfloat16)
    loss = lambda x, w: jnp.sum(fp8_einsum(spec, x, w).astype(jnp.float32) ** 2)  # noqa: E731
    hlo = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, w).compile().as_text()
    # forward, dx and dw: each a GEMM whose operands are FP8, either a cuBLASLt FP8 call or a fused
    # computation (XLA's Triton emitter) around a dot of FP8 parameters; no 16-bit GEMM is left.
    cublas = [line for line in hlo.splitlines() if "custom_call_target=\"__cublas$lt$matmul" in line]
    fused = [c for c in hlo.split("\n\n") if " dot(" in c and "ENTRY" not in c]
    assert all("$f8" in line for line in cublas), cublas
    assert all("f8e" in c for c in fused), fused
    assert len(cublas) + len(fused) == 3
