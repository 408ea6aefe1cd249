"""The grouped-matmul seam (ushard/kernels/grouped_matmul.py): its custom VJP against `jax.grad` of
`lax.ragged_dot` in float32, with empty groups and rows past the groups, on reference products and on
the megablox kernels in Pallas's interpreter; and the choice of kernel."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ushard.errors import UserError
from ushard.kernels import grouped_matmul as gm


def _reference_kernels(row_multiple: int = 1) -> gm.GroupedKernels:
    """The contract's three products by XLA, with rows past the groups made garbage (NaN), as a kernel
    that never writes them leaves them: the VJP must mask them, not rely on zeros."""

    def garbage_past_groups(y, group_sizes):
        return jnp.where(gm._rows_in_groups(y.shape[0], group_sizes), y, jnp.nan)

    def forward(x, w, group_sizes):
        return garbage_past_groups(jax.lax.ragged_dot(x, w, group_sizes), group_sizes)

    def rows_grad(d_y, w, group_sizes):
        return garbage_past_groups(jax.lax.ragged_dot(d_y, w.swapaxes(1, 2), group_sizes), group_sizes)

    def weights_grad(x, d_y, group_sizes):
        # x [m, k], d_y [m, n] -> [g, k, n]: each group's rows only (one-hot of each row's group).
        group_of_row = jnp.searchsorted(jnp.cumsum(group_sizes), jnp.arange(x.shape[0]), side="right")
        one_hot = jax.nn.one_hot(group_of_row, group_sizes.shape[0], dtype=x.dtype)  # past the groups: 0
        return jnp.einsum("mg,mk,mn->gkn", one_hot, x, d_y)

    return gm.GroupedKernels(forward, rows_grad, weights_grad, row_multiple=row_multiple)


def _case(rows, k, n, sizes, seed=0):
    kx, kw, kd = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (rows, k), jnp.float32)
    w = jax.random.normal(kw, (len(sizes), k, n), jnp.float32) / np.sqrt(k)
    d_y = jax.random.normal(kd, (rows, n), jnp.float32)  # a random cotangent, not the gradient of a sum
    return x, w, jnp.array(sizes, jnp.int32), d_y


def _value_and_grads(matmul, x, w, sizes, d_y):
    y, pull_back = jax.vjp(lambda x, w: matmul(x, w, sizes), x, w)
    return (y, *pull_back(d_y))


CASES = {
    "uneven, one empty, all rows used": (96, 64, 48, [40, 0, 31, 25]),
    "rows past the groups": (100, 64, 48, [10, 30, 0, 20]),
    "every group empty": (16, 32, 32, [0, 0, 0]),
    "one group": (24, 32, 16, [24]),
}


@pytest.mark.parametrize("row_buckets", [1, 4])
@pytest.mark.parametrize("row_multiple", [1, 64])
@pytest.mark.parametrize("case", list(CASES))
def test_the_custom_vjp_matches_the_gradient_of_ragged_dot(case, row_multiple, row_buckets):
    """With `row_buckets` the kernels see only the first rows that hold the groups (`_row_cuts`)."""
    x, w, sizes, d_y = _case(*CASES[case])
    kernels = _reference_kernels(row_multiple)
    got = _value_and_grads(lambda x, w, s: gm.pallas_grouped_matmul(kernels, x, w, s, row_buckets), x, w, sizes, d_y)
    want = _value_and_grads(jax.lax.ragged_dot, x, w, sizes, d_y)
    for name, a, b in zip(("value", "d_x", "d_w"), got, want):
        assert np.all(np.isfinite(a)), name
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=name)
    used = int(np.sum(sizes))
    assert not np.any(np.asarray(got[0])[used:]), "rows past the groups give zeros"
    assert not np.any(np.asarray(got[1])[used:]), "and no gradient"


@pytest.mark.parametrize("multiple", [1, 16])
def test_feature_sizes_are_padded_to_the_kernels_multiple(multiple):
    """k = 40 and n = 24 reach kernels that take multiples of 16 as 48 and 32 (zeros), and the result
    and both gradients are ragged_dot's on the sizes given."""
    seen = []

    def recording(product):
        def run(a, b, group_sizes, **kw):
            seen.append((a.shape, b.shape))
            return product(a, b, group_sizes, **kw)
        return run

    base = _reference_kernels()
    kernels = gm.GroupedKernels(recording(base.forward), recording(base.rows_grad), recording(base.weights_grad),
                                feature_multiple=multiple)
    x, w, sizes, d_y = _case(64, 40, 24, [20, 0, 30])
    got = _value_and_grads(lambda x, w, s: gm.pallas_grouped_matmul(kernels, x, w, s), x, w, sizes, d_y)
    want = _value_and_grads(jax.lax.ragged_dot, x, w, sizes, d_y)
    for name, a, b in zip(("value", "d_x", "d_w"), got, want):
        assert a.shape == b.shape, name
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=name)
    k, n = (48, 32) if multiple == 16 else (40, 24)
    assert seen[0] == ((64, k), (3, k, n)), seen  # the forward product's operands


def test_megablox_in_pallas_interpreter_matches_the_gradient_of_ragged_dot():
    """The TPU kernels themselves (interpreted on the CPU), with an empty group and rows past the
    groups, which megablox leaves unwritten (NaN in the interpreter) and the seam masks."""
    x, w, sizes, d_y = _case(200, 128, 256, [90, 0, 50, 40])
    kernels = gm.megablox_kernels(interpret=True)
    got = _value_and_grads(lambda x, w, s: gm.pallas_grouped_matmul(kernels, x, w, s, 2), x, w, sizes, d_y)
    want = _value_and_grads(jax.lax.ragged_dot, x, w, sizes, d_y)
    for name, a, b in zip(("value", "d_x", "d_w"), got, want):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5, err_msg=name)


def test_row_cuts_are_whole_multiples_up_to_the_rows():
    assert gm._row_cuts(100, 4, 1) == [25, 50, 75, 100]
    assert gm._row_cuts(100, 4, 64) == [64, 128]
    assert gm._row_cuts(1000, 1, 512) == [1024]


def test_the_kernels_get_the_fewest_cut_rows_that_hold_the_groups():
    """A kernel that writes how many rows it was given: with 4 buckets of a 100-row buffer, groups of 60
    rows run on 75 (each cut compiled, one run per call)."""
    def rows_given(x, w, group_sizes):
        return jnp.full((x.shape[0], w.shape[2]), x.shape[0], x.dtype)

    def no_weights_grad(x, d_y, group_sizes):
        return jnp.zeros((group_sizes.shape[0], x.shape[1], d_y.shape[1]), x.dtype)

    kernels = gm.GroupedKernels(rows_given, rows_given, no_weights_grad)
    x, w, _, _ = _case(100, 8, 4, [10, 20, 30])
    for sizes, rows in (([10, 20, 30], 75), ([50, 50, 0], 100), ([25, 0, 0], 25), ([1, 0, 0], 25)):
        y = jax.jit(gm.pallas_grouped_matmul, static_argnums=(0, 4))(kernels, x, w, jnp.array(sizes, jnp.int32), 4)
        assert float(y[0, 0]) == rows, sizes


def test_auto_picks_the_kernel_each_platform_has():
    hopper = "NVIDIA H100 80GB HBM3"
    assert gm.resolve("auto", "gpu", jnp.bfloat16, (2048, 5632), hopper) == "mosaic_gpu"
    assert gm.resolve("auto", "gpu", jnp.float32, (2048, 5632), hopper) == "xla"
    assert gm.resolve("auto", "gpu", jnp.bfloat16, (2048, 5632), "NVIDIA A100-SXM4-80GB") == "xla"
    assert gm.resolve("auto", "gpu", jnp.bfloat16, (2048, 1000), hopper) == "mosaic_gpu"  # padded to 1024
    assert gm.resolve("auto", "gpu", jnp.bfloat16, (2048, 704), hopper) == "mosaic_gpu"  # to 768: 9% more
    assert gm.resolve("auto", "gpu", jnp.bfloat16, (2048, 96), hopper) == "xla"  # to 128: a third more
    assert gm.resolve("auto", "tpu", jnp.bfloat16, (2048, 5632)) == "megablox"
    assert gm.resolve("auto", "tpu", jnp.float32, (2048, 5632)) == "megablox"
    assert gm.resolve("auto", "tpu", jnp.bfloat16, (2048, 96)) == "xla"
    assert gm.resolve("auto", "cpu", jnp.bfloat16, (2048, 5632)) == "xla"
    assert "multiples of 128" in gm.why("auto", "xla", "gpu", (2048, 96))


def test_a_kernel_the_platform_lacks_is_refused_in_one_sentence():
    with pytest.raises(UserError, match="runs on GPUs only"):
        gm.check("mosaic_gpu", "cpu")
    with pytest.raises(UserError, match="runs on TPUs only"):
        gm.check("megablox", "gpu")
    gm.check("xla", "cpu")
    gm.check("megablox", "tpu")
    gm.check("mosaic_gpu", "gpu")


def test_inside_a_shard_map_the_kernels_outputs_carry_the_operands_varying_axes():
    """JAX's Pallas kernels return outputs typed as the same on every device of a `shard_map`; the
    seam types them as varying like their operands, or autodiff refuses the weights' gradient."""
    mesh = jax.make_mesh((2,), ("expert",), devices=jax.devices()[:2])
    x, w, sizes, d_y = _case(256, 128, 128, [60, 0, 40, 20])
    kernels = gm.megablox_kernels(interpret=True)

    def per_device(x, w, sizes, d_y):
        return _value_and_grads(lambda x, w, s: gm.pallas_grouped_matmul(kernels, x, w, s), x, w, sizes, d_y)

    def reference(x, w, sizes, d_y):
        return _value_and_grads(jax.lax.ragged_dot, x, w, sizes, d_y)

    spec = jax.P("expert")
    specs = dict(mesh=mesh, in_specs=(spec, spec, jax.P(), spec), out_specs=(spec, spec, spec))
    stacked = [jax.device_put(a, jax.NamedSharding(mesh, s)) for a, s in zip(
        (jnp.concatenate([x, x[::-1]]), jnp.concatenate([w, w[::-1]]), sizes, jnp.concatenate([d_y, d_y])),
        specs["in_specs"])]
    got = jax.jit(jax.shard_map(per_device, **specs))(*stacked)
    want = jax.jit(jax.shard_map(reference, **specs))(*stacked)
    for name, a, b in zip(("value", "d_x", "d_w"), got, want):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5, err_msg=name)


def test_megablox_inside_a_checked_shard_map_under_remat_and_scan_matches_ragged_dot():
    """What the model does with the kernel: group sizes that differ per device, the layer under
    `jax.checkpoint` in a `lax.scan`, all inside a `shard_map` that checks types. Megablox's metadata
    mixes constants with the group sizes, which the check refuses wherever the remat re-traces the
    kernel's operations; sealed (ushard/kernels/sealed.py), they are never re-traced."""
    mesh = jax.make_mesh((2,), ("expert",), devices=jax.devices()[:2])
    kernels = gm.megablox_kernels(interpret=True)
    x = jax.random.normal(jax.random.key(0), (2 * 192, 128))
    w = jax.random.normal(jax.random.key(1), (2 * 4, 128, 128)) / 10
    sizes = jnp.array([60, 0, 40, 20, 10, 90, 30, 50], jnp.int32)  # per device: 120 and 180 rows of 192

    def loss(matmul, x, w, sizes):
        def per_device(x, w, sizes):
            def layer(h, _):
                return jax.checkpoint(matmul)(h, w, sizes).astype(h.dtype), None

            out, _ = jax.lax.scan(layer, x, None, length=2)
            return jnp.sum(jnp.sin(out))[None]

        spec = jax.P("expert")
        return jax.shard_map(per_device, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)(x, w, sizes).sum()

    on_mesh = [jax.device_put(a, jax.NamedSharding(mesh, jax.P("expert"))) for a in (x, w, sizes)]
    kernel = lambda x, w, s: gm.pallas_grouped_matmul(kernels, x, w, s)  # noqa: E731
    got = jax.jit(jax.grad(functools.partial(loss, kernel), argnums=(0, 1)))(*on_mesh)
    want = jax.jit(jax.grad(functools.partial(loss, jax.lax.ragged_dot), argnums=(0, 1)))(*on_mesh)
    for name, a, b in zip(("d_x", "d_w"), got, want):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4, err_msg=name)


def test_under_vmap_the_sealed_kernel_runs_once_per_element():
    """The pipeline's per-group maps vmap the experts: each element with its own group sizes."""
    kernels = gm.megablox_kernels(interpret=True)
    cases = [_case(96, 128, 128, sizes, seed) for seed, sizes in enumerate(([40, 0, 31, 25], [10, 50, 0, 20]))]
    x, w, sizes, d_y = (jnp.stack(parts) for parts in zip(*cases))

    def batched(matmul):
        return jax.vmap(lambda x, w, s, d: _value_and_grads(matmul, x, w, s, d))(x, w, sizes, d_y)

    got = batched(lambda x, w, s: gm.pallas_grouped_matmul(kernels, x, w, s))
    want = batched(jax.lax.ragged_dot)
    for name, a, b in zip(("value", "d_x", "d_w"), got, want):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5, err_msg=name)


def test_the_mosaic_forward_kernel_is_rebuilt_to_skip_idle_row_blocks():
    """The installed JAX's `ragged_dot_mgpu` source takes the guard (kernels/grouped_matmul.py,
    `_skip_idle_blocks`): the rebuilt module differs from JAX's by the guard and the block body's
    indentation only. A JAX whose source no longer fits falls back to its own kernel, and this test
    says so (the row buckets then come back into play)."""
    import difflib
    import inspect

    module = gm._mosaic_module("ragged_dot_mgpu")
    assert gm._skip_idle_blocks(module) is not None and gm._mosaic_ragged_dot()[1]
    diff = list(difflib.ndiff(inspect.getsource(module).splitlines(), gm._skip_idle_source(module).splitlines()))
    added = [line for line in diff if line.startswith("+ ")]
    removed = [line for line in diff if line.startswith("- ")]
    guard = [line for line in added if "pl.when(group_info.actual_size > 0)" in line or "def _rows_in_block" in line]
    assert len(guard) == 2
    # Every other change re-indents a line of the block body by two spaces.
    assert sorted(line[2:].strip() for line in added if line not in guard) == \
        sorted(line[2:].strip() for line in removed)
