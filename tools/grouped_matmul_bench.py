"""Grouped matmul on one GPU: ushard's seam (ushard/kernels/grouped_matmul.py) against XLA's
`ragged_dot` and a dense matmul of the same FLOPs, forward and forward + backward, in one process.

    python3 tools/grouped_matmul_bench.py [--shapes bench_moe,fine_grained] [--sweep]

Shapes: `bench_moe`'s expert matmul (65,536 routed rows, 2,048 -> 5,632, 8 experts) and a DeepSeek-style
fine-grained one (64 experts, 2,048 -> 1,408). Groups are uneven (random cut points) with one empty.
Backward passes take a random cotangent: against the gradient of a sum XLA turns a dense matmul's
backward into reductions. Each implementation is first checked against a float32 `ragged_dot` on the
same inputs (relative error of the value and both gradients). `--sweep` also times the Mosaic-GPU
block configurations around the table's (`MOSAIC_BLOCKS`) for each of the three products.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import time

import jax
import jax.numpy as jnp
import numpy as np

from ushard.kernels import grouped_matmul as gm

SHAPES = {"bench_moe": (65536, 2048, 5632, 8), "fine_grained": (65536, 2048, 1408, 64)}


def uneven_sizes(key, rows: int, groups: int):
    """Random cut points, one group left empty."""
    cuts = jnp.sort(jax.random.randint(key, (groups - 1,), 0, rows))
    sizes = jnp.diff(jnp.concatenate([jnp.zeros(1, jnp.int32), cuts, jnp.full(1, rows, jnp.int32)]))
    return sizes.at[1].add(sizes[0]).at[0].set(0).astype(jnp.int32)


def timed(fn, *args, repeats: int = 20) -> float:
    """Median seconds of `fn(*args)` (compiled, warmed up, synchronised)."""
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def rel_error(a, b) -> float:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def fwd_bwd(matmul):
    """x, w, sizes, d_y -> (y, d_x, d_w) through the matmul's VJP."""

    def run(x, w, sizes, d_y):
        y, pull_back = jax.vjp(lambda x, w: matmul(x, w, sizes), x, w)
        return (y, *pull_back(d_y))

    return jax.jit(run)


def bench_shape(name: str, sweep: bool) -> list[tuple]:
    rows, k, n, groups = SHAPES[name]
    kx, kw, kd, ks = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(kx, (rows, k), jnp.bfloat16)
    w = (jax.random.normal(kw, (groups, k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
    d_y = jax.random.normal(kd, (rows, n), jnp.bfloat16)
    sizes = uneven_sizes(ks, rows, groups)
    flops = 2 * rows * k * n
    table = []

    reference = fwd_bwd(jax.lax.ragged_dot)(x.astype(jnp.float32), w.astype(jnp.float32), sizes,
                                            d_y.astype(jnp.float32))
    dense = lambda x, w, sizes: x @ w  # noqa: E731
    t_fwd = timed(jax.jit(lambda x, w: x @ w), x, w[0])
    t_both = timed(fwd_bwd(dense), x, w[0], sizes, d_y)
    table.append((name, "dense matmul", flops / t_fwd / 1e12, 3 * flops / t_both / 1e12, "", 1.0))
    dense_both_tflops = 3 * flops / t_both / 1e12

    for impl in ("xla", "mosaic_gpu"):
        matmul = lambda x, w, s, impl=impl: gm.grouped_matmul(x, w, s, impl)  # noqa: E731
        got = fwd_bwd(matmul)(x, w, sizes, d_y)
        errors = "/".join(f"{rel_error(a, b):.1e}" for a, b in zip(got, reference))
        forward = jax.jit(lambda x, w, s, matmul=matmul: matmul(x, w, s))
        t_fwd = timed(forward, x, w, sizes)
        t_both = timed(fwd_bwd(matmul), x, w, sizes, d_y)
        both = 3 * flops / t_both / 1e12
        table.append((name, impl, flops / t_fwd / 1e12, both, errors, both / dense_both_tflops))

    if sweep:
        table += sweep_blocks(name, x, w, sizes, d_y, flops)
    return table


def sweep_blocks(name, x, w, sizes, d_y, flops) -> list[tuple]:
    """Each Mosaic product alone over block configurations near the table's, best first per product."""
    fwd_mod = gm._mosaic_module("ragged_dot_mgpu")
    t_mod = gm._mosaic_module("transposed_ragged_dot_mgpu")
    products = {  # product: (blocks -> its jitted kernel, its operands)
        "forward": (lambda b: jax.jit(lambda x, w, s: fwd_mod.ragged_dot(x, w, group_sizes=s, **b.kwargs())),
                    (x, w, sizes)),
        "rows_grad": (lambda b: jax.jit(lambda d, w, s: fwd_mod.ragged_dot(d, w, group_sizes=s, transpose_rhs=True,
                                                                           **b.kwargs())), (d_y, w, sizes)),
        "weights": (lambda b: jax.jit(lambda x, d, s: t_mod.transposed_ragged_dot(x, d, group_sizes=s,
                                                                                  **b.kwargs())), (x, d_y, sizes)),
    }
    rows = []
    cls = gm.shape_class(w.shape[0])
    for product, (kernel, operands) in products.items():
        base = gm.MOSAIC_BLOCKS[(product, cls)]
        results = []
        for bm, bn, steps, gbn in itertools.product((64, 128, 192), (128,), (4, 5), (1, 4, 8)):
            blocks = dataclasses.replace(base, block_m=bm, block_n=bn, steps=steps, grid_block_n=gbn)
            try:
                t = timed(kernel(blocks), *operands, repeats=5)
            except Exception as e:  # shared memory exceeded, a size the kernel refuses
                del e
                continue
            results.append((flops / t / 1e12, blocks))
        results.sort(key=lambda r: -r[0])
        for tflops, blocks in results[:3]:
            rows.append((name, f"sweep {product} {blocks}", tflops, float("nan"), "", float("nan")))
        rows.append((name, f"table {product} {base}", next((r[0] for r in results if r[1] == base), float("nan")),
                     float("nan"), "", float("nan")))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--sweep", action="store_true")
    args = parser.parse_args()
    print(f"device: {jax.devices()[0].device_kind}, JAX {jax.__version__}")
    table = []
    for name in args.shapes.split(","):
        table += bench_shape(name, args.sweep)
    print("\n| shape | implementation | forward TFLOP/s | fwd+bwd TFLOP/s | rel. error y/dx/dw vs f32 "
          "| fwd+bwd vs dense |")
    print("|---|---|---|---|---|---|")
    for shape, impl, fwd, both, errors, ratio in table:
        print(f"| {shape} | {impl} | {fwd:.0f} | {both:.0f} | {errors} | {ratio:.1%} |")


if __name__ == "__main__":
    main()
