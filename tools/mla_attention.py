"""Latent attention's kernels on one GPU: q·k over 192 a head and values of 128 (DeepSeek-V2/V3's
heads), each kernel checked against float32 and timed forward and forward + backward, in one process.

    python3 tools/mla_attention.py [--shapes bench_mla,v3_heads16] [--impls cudnn,cudnn_padded,ours,xla]
        [--documents 4] [--sweep]

Kernels, all through `kernels.attention` as a layer runs them:
- `cudnn`: `whole_sequence(..., "cudnn")`, which runs cuDNN's own 192 / 128 kernels where its version
  takes two head sizes (`cudnn_takes_value_widths`);
- `cudnn_padded`: cuDNN at one head size, the values zero-padded to 192 (`values_padded`);
- `ours`: `whole_sequence(..., "flash")`, ushard's flash kernel (ushard/kernels/flash*.py: on Hopper
  the Mosaic GPU kernels, which take 192 / 128 as they are);
- `xla`: XLA's attention (the einsum form `whole_sequence` runs for two head sizes).
The check runs each on the first row of the batch against `xla_block` in float32 on the upcast
inputs, pulled back along a random cotangent: relative error of out, dq, dk, dv. FLOPs: causal,
2·B·H·T²·(192 + 128) / 2 forward, 2.5 times that backward (as tools/attention_bench.py counts).
`--documents N`: N equal documents a row (a document mask; FLOPs still counted as one causal row).
`--sweep`: each Mosaic GPU kernel alone over SWEEP's launch shapes at each shape first (Hopper only).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from attention_bench import timed  # tools/, this script's folder
from ushard.kernels import attention

SHAPES = {  # batch, length, heads, q·k head dim, value head dim
    "bench_mla": (8, 4096, 16, 192, 128),  # configs/bench_mla.py's attention on one GPU
    "v3_heads16": (1, 8192, 16, 192, 128),  # DeepSeek-V3's 128 heads over tensor=8, one 8k row
}
IMPLS = ("cudnn", "cudnn_padded", "ours", "xla")
# Per Mosaic GPU kernel, the launch options `--sweep` times at 192 / 128 (shared memory: the forward's
# (query rows, keys, slots) that fit beside two query buffers and the output's; dK/dV's 32- or
# 64-query blocks and slots; dQ's 64-key blocks, the most that fit).
SWEEP = {"forward": [{"blocks": (64, 64, 2)}, {"blocks": (64, 128, 1)}],
         "dkdv": [{"block_q": 32}, {"block_q": 32, "stages": 3}, {"block_q": 64}],
         "dq": [{"block_k": 64}]}


def attend_fn(impl: str, ids=None):
    if impl == "cudnn_padded":
        def attend(q, k, v):
            return attention.values_padded(lambda v: attention.whole_sequence(q, k, v, ids, "cudnn"), q, v)
    else:
        name = "flash" if impl == "ours" else impl

        def attend(q, k, v):
            return attention.whole_sequence(q, k, v, ids, name)
    return attend


def segment_ids(batch: int, length: int, documents: int):
    if not documents:
        return None
    return jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32) // (length // documents), (batch, length))


def sweep(q, k, v, d_out, forward_flops: float) -> None:
    """Each Mosaic GPU kernel alone over SWEEP's options (rates count its own products: the
    forward's two, dK/dV's four, dQ's three)."""
    from ushard.kernels import flash, flash_hopper, flash_hopper_backward

    out, lse = jax.jit(lambda q, k, v: flash_hopper.forward(q, k, v, True))(q, k, v)
    lse2 = jnp.swapaxes(lse * flash.LOG2E, 1, 2)
    delta = jnp.swapaxes(jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), -1), 1, 2)
    for kernel, candidates in SWEEP.items():
        if kernel == "forward":
            run, args, work = flash_hopper.forward, (q, k, v), forward_flops
        else:
            run = getattr(flash_hopper_backward, kernel)
            args = (q, k, v, d_out, lse2, out if kernel == "dq" else delta)
            # dK/dV: S, dP, dV, dK (dV's and dP's over the values' 128, the others over 192)
            work = forward_flops * (2 if kernel == "dkdv" else (192 + 128 + 192) / (192 + 128))
        for options in candidates:
            fn = jax.jit(lambda *a, options=options, run=run: run(*a, True, None, None, **options))
            try:
                seconds = timed(fn, *args, calls=5, repeats=5)
            except Exception as e:  # noqa: BLE001 (shared memory exceeded, say)
                print(f"  sweep {kernel} {options}: failed: {str(e).strip().splitlines()[0][:160]}", flush=True)
                continue
            print(f"  sweep {kernel} {options}: {seconds * 1e3:.3f} ms, {work / seconds / 1e12:.0f} TFLOP/s",
                  flush=True)


def inputs(shape, seed: int = 0):
    b, t, heads, hd, vd = shape
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (b, t, heads, hd), jnp.bfloat16)
    k = jax.random.normal(keys[1], (b, t, heads, hd), jnp.bfloat16)
    v = jax.random.normal(keys[2], (b, t, heads, vd), jnp.bfloat16)
    d_out = jax.random.normal(keys[3], (b, t, heads, vd), jnp.bfloat16)
    return q, k, v, d_out


def forward_backward(attend):
    def run(q, k, v, d_out):
        out, pullback = jax.vjp(attend, q, k, v)
        return (out, *pullback(d_out.astype(out.dtype)))

    return jax.jit(run)


def check(impl: str, shape, documents: int = 0) -> float:
    """The largest relative error of out, dq, dk, dv against float32 (first row of the batch)."""
    q, k, v, d_out = (x[:1] for x in inputs(shape, seed=1))
    positions = jnp.arange(q.shape[1])[None]
    ids = segment_ids(1, q.shape[1], documents)

    def reference(q, k, v):
        return attention.xla_block(q, k, v, positions, positions, ids, ids)[0]

    got = forward_backward(attend_fn(impl, ids))(q, k, v, d_out)
    want = forward_backward(reference)(*(x.astype(jnp.float32) for x in (q, k, v)), d_out)
    errors = []
    for g, w in zip(got, want):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        errors.append(float(np.linalg.norm(g - w) / np.linalg.norm(w)))
    print(f"  check {impl}: relative error of out, dq, dk, dv: " + ", ".join(f"{e:.1e}" for e in errors))
    return max(errors)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--impls", default=",".join(IMPLS))
    parser.add_argument("--documents", type=int, default=0)
    parser.add_argument("--sweep", action="store_true")
    args = parser.parse_args()
    from ushard.kernels.cudnn import cudnn_version

    print(f"JAX {jax.__version__}, cuDNN {cudnn_version()}, {jax.devices()[0].device_kind}")
    rows = []
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        b, t, heads, hd, vd = shape
        print(f"{name}: B {b}, T {t}, heads {heads}, q·k {hd}, values {vd}, bf16, causal, documents "
              f"{args.documents or 'none'}")
        q, k, v, d_out = inputs(shape)
        if args.sweep:
            sweep(q, k, v, d_out, 2 * b * heads * t * t * (hd + vd) / 2)
        ids = segment_ids(b, t, args.documents)
        for impl in args.impls.split(","):
            try:
                error = check(impl, shape, args.documents)
                fwd = timed(jax.jit(attend_fn(impl, ids)), q, k, v)
                both = timed(forward_backward(attend_fn(impl, ids)), q, k, v, d_out)
            except Exception as e:  # a kernel that does not take the shape is a row saying so
                print(f"  {impl}: {type(e).__name__}: {str(e)[:300]}")
                rows.append((name, impl, None, None, None))
                continue
            rows.append((name, impl, error, fwd, both))
            print(f"  {impl}: fwd {fwd * 1e3:.3f} ms, fwd+bwd {both * 1e3:.3f} ms")
    print("\n| shape | kernel | error vs f32 | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s |")
    print("|---|---|---|---|---|---|---|")
    for name, impl, error, fwd, both in rows:
        b, t, heads, hd, vd = SHAPES[name]
        forward_flops = 2 * b * heads * t * t * (hd + vd) / 2
        if error is None:
            print(f"| {name} | {impl} | fails | | | | |")
            continue
        print(f"| {name} | {impl} | {error:.1e} | {fwd * 1e3:.3f} | {forward_flops / fwd / 1e12:.0f} | "
              f"{both * 1e3:.3f} | {3.5 * forward_flops / both / 1e12:.0f} |")


if __name__ == "__main__":
    main()
