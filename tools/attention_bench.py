"""Causal attention on one GPU: our flash kernels against cuDNN and XLA (`jax.nn.dot_product_attention`),
forward and forward + backward, in one process. `ours` is what `model.attention_impl=flash` runs (on
Hopper the Mosaic GPU kernels of ushard/kernels/flash_hopper*.py, elsewhere the Triton ones of
ushard/kernels/flash.py); `ours_triton` runs the Triton kernels both ways.

    python3 tools/attention_bench.py [--shapes hd128,hd128_gqa,hd64] [--documents none,4] [--block-sweep]
                                     [--adopt-sweep] [--no-check] [--under-load] [--windows 0,1024]
                                     [--mosaic-256]

Shapes: bench_1b's attention (B 16, T 2048, 16 heads, head dim 128), the same with 8 kv heads
(grouped-query), head dim 64 (32 heads), and llama3_8b's on one of four GPUs (SHAPES); bf16, causal.
Documents: none, or 4 equal documents a row (segment ids for ours; cuDNN and XLA get the equivalent
[B, 1, T, T] mask, and cuDNN also runs the documents as rows of their own, B*4 rows of T/4, the
least work any kernel can do).

FLOPs: 4·B·heads·T²·hd for a full forward, half of it causal, and the backward 2.5 times the forward
(fwd+bwd 3.5 times). With documents only the FLOPs of the visible pairs count (a quarter of the
causal ones for 4 documents), so a kernel that computes the masked blocks shows it in its rate; so
with a sliding window (`--windows`, 0 for none: ours, cuDNN and XLA take it), whose visible pairs
are min(i + 1, w) for query i.
Backward passes take a random cotangent through `jax.vjp` (never the gradient of a sum). Each
timing is the median over repetitions of a loop of calls dispatched back to back, each loop
synchronised at its end (inputs are larger than the L2 cache, so repeated calls do not run from it).
Before timing, ours is checked on the device against float32 attention on upcast inputs (two rows
of the batch): max abs error and relative error of out, lse and the three gradients.
`--no-check` skips that check (about 25 s a case on an H200). `--block-sweep` also times
block-size/warps/stages combinations of each of our Triton kernels, and on Hopper the Mosaic GPU
kernels' blocks and slots. `--adopt-sweep`: sweep a shape's first case only, then run the three
bests (checked against float32) in the rest of the run, beside the shipped blocks (`ours_table`).
`--mosaic-256`: instead, the Mosaic GPU forward at head dim 256 over MOSAIC_256's block shapes.

`--under-load` times forward + backward (no documents) as a training step runs it instead: after a
bf16 8192³ matmul in each call (the matmul's own time subtracted), and over 300 calls back to back
(the first and the last 50), then prints the GPU's SM clock and power draw (nvidia-smi). A step
keeps the GPU at its power limit, where a kernel's time follows its energy; back-to-back loops with
pauses between them, as above, flatter the kernel that draws more power (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import subprocess
import time

import jax
import jax.numpy as jnp
import numpy as np

from attention_check import ours_and_reference  # tools/, this script's folder
from ushard.kernels import flash, flash_hopper, flash_hopper_backward
from ushard.kernels.attention import BlockKernel, by_halves

SHAPES = {  # batch, length, heads, kv heads, head dim
    "hd128": (16, 2048, 16, 16, 128),
    "hd128_gqa": (16, 2048, 16, 8, 128),
    "hd64": (16, 2048, 32, 32, 64),
    # llama3_8b's attention on one of four GPUs at 4 sequences of 8,192 a step: under fsdp=4 (one
    # sequence, 32 heads, groups of 4 sharing a K/V head), under tensor=4 (4 sequences, 8 of the heads),
    # and the fsdp shape without grouping, to tell the groups' cost from the length's.
    "llama3_8b": (1, 8192, 32, 8, 128),
    "llama3_8b_tensor4": (4, 8192, 8, 2, 128),
    "llama3_8b_mha": (1, 8192, 32, 32, 128),
    # bench_1b's heads at 8k and 32k tokens a row (the same tokens a step as its batch of 16 x 2k).
    "bench_1b_8k": (4, 8192, 16, 16, 128),
    "bench_1b_32k": (1, 32768, 16, 16, 128),
    # Head dim 256 (Gemma's), which ours runs on the Triton kernels.
    "hd256": (4, 4096, 8, 8, 256),
    # Gemma 3 1B's attention on one GPU (configs/gemma3_1b.py: 4 sequences of 8,192, 4 heads, 1 KV head).
    "gemma3_1b": (4, 8192, 4, 1, 256),
}
IMPLS = ("cudnn", "xla", "ours", "ours_triton")
TABLE = dict(flash.TUNING)  # the blocks as shipped (`ours_table`), whatever `--adopt-sweep` does to flash.TUNING


def timed(fn, *args, calls: int = 10, repeats: int = 7) -> float:
    """Median seconds per call of `fn(*args)`: compiled and warmed up first, then `repeats` loops of
    `calls` calls dispatched back to back, each loop closed by block_until_ready."""
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            result = fn(*args)
        jax.block_until_ready(result)
        times.append((time.perf_counter() - start) / calls)
    return float(np.median(times))


def segment_ids(batch: int, length: int, documents: int):
    """[batch, length] int32: `documents` equal documents a row (None for 0)."""
    if not documents:
        return None
    return jnp.broadcast_to(jnp.repeat(jnp.arange(documents, dtype=jnp.int32), length // documents), (batch, length))


def attention_fns(impl: str, segments, documents: int, tuning=None, window: int = 0):
    """impl -> (forward(q, k, v) -> out, forward_backward(q, k, v, d_out) -> (out, dq, dk, dv)), or
    a string saying why it does not run here."""
    if impl in ("ours", "ours_triton", "ours_table"):
        def forward(q, k, v):
            # The path a model runs (`kernels.attention.by_halves`: no cotangent for lse). A tuning
            # given runs the Triton kernels; none, on Hopper, the Mosaic GPU ones.
            forced = tuning or (flash.TUNING[q.shape[-1]] if impl == "ours_triton" else None)
            if impl == "ours_table":
                forced = TABLE[q.shape[-1]]
            halves = BlockKernel(functools.partial(flash.forward, tuning=forced),
                                 functools.partial(flash.backward, tuning=forced), windows=True)
            return by_halves(halves, q, k, v, segments, window)
    elif impl == "cudnn_rows":
        if not documents or window:
            return "only with documents, without a window"

        def forward(q, k, v):
            b, t = q.shape[:2]
            as_rows = [x.reshape(b * documents, t // documents, *x.shape[2:]) for x in (q, k, v)]
            out = jax.nn.dot_product_attention(*as_rows, is_causal=True, implementation="cudnn")
            return out.reshape(q.shape)
    else:
        mask = None if segments is None else (segments[:, :, None] == segments[:, None, :])[:, None]

        local = (window - 1, 0) if window else None

        def forward(q, k, v):
            return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, local_window_size=local,
                                                implementation=impl)

    def forward_backward(q, k, v, d_out):
        out, pullback = jax.vjp(forward, q, k, v)
        return (out, *pullback(d_out))

    return jax.jit(forward), jax.jit(forward_backward)


def inputs(shape, seed: int = 0):
    b, t, heads, kv_heads, hd = shape
    keys = jax.random.split(jax.random.key(seed), 5)
    q = jax.random.normal(keys[0], (b, t, heads, hd), jnp.bfloat16)
    k = jax.random.normal(keys[1], (b, t, kv_heads, hd), jnp.bfloat16)
    v = jax.random.normal(keys[2], (b, t, kv_heads, hd), jnp.bfloat16)
    d_out = jax.random.normal(keys[3], (b, t, heads, hd), jnp.bfloat16)
    d_lse = jax.random.normal(keys[4], (b, t, heads), jnp.float32)
    return q, k, v, d_out, d_lse


def check_ours(name: str, shape, segments, rows: int = 2, window: int = 0) -> str:
    """Ours against float32 `xla_block` on upcast inputs, on the first `rows` rows (fresh inputs,
    random cotangents of out and lse): 'max abs / relative' error of out, lse, dq, dk, dv."""
    q, k, v, d_out, d_lse = (x[:rows] for x in inputs(shape, seed=1))
    seg = None if segments is None else segments[:rows]
    got, want = ours_and_reference(q, k, v, d_out, d_lse, seg, causal=True, window=window)
    parts, worst = [], 0.0
    for what, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        finite = np.isfinite(w)
        if not np.array_equal(finite, np.isfinite(g)):
            parts.append(f"{what} NON-FINITE MISMATCH")
            worst = np.inf
            continue
        g, w = g[finite], w[finite]
        rel = float(np.linalg.norm(g - w) / max(np.linalg.norm(w), 1e-30))
        worst = max(worst, rel)
        parts.append(f"{what} {np.abs(g - w).max():.2e}/{rel:.1e}")
    verdict = "ok" if worst <= 1e-2 else "CHECK: above bf16 rounding"
    print(f"  check {name}: max abs/relative error vs float32: {', '.join(parts)} -> {verdict}")
    return verdict


def flops(shape, documents: int, window: int = 0) -> float:
    """Forward FLOPs of causal attention over the visible pairs: query i of a document sees
    min(i + 1, w) keys with a window `window`, i + 1 without (the documents equal, T / documents
    tokens each). Without a window this is the causal half of 4·B·H·T²·hd over the documents."""
    b, t, heads, _, hd = shape
    documents = max(documents, 1)
    length = t // documents
    if window:
        return 4 * b * heads * hd * documents * sum(min(i + 1, window) for i in range(length))
    return 4 * b * heads * t * t * hd / 2 / documents


def bench(name: str, documents: int, impls, sweep: bool, check: bool = True, window: int = 0,
          adopt: bool = False) -> list[tuple]:
    shape = SHAPES[name]
    b, t = shape[:2]
    segments = segment_ids(b, t, documents)
    label = f"{name} docs={documents or 'none'}" + (f" window={window}" if window else "")
    print(f"{label}: B {b}, T {t}, heads {shape[2]}, kv heads {shape[3]}, hd {shape[4]}, bf16, causal")
    if check or flash.TUNING[shape[4]] != TABLE[shape[4]]:  # adopted blocks are always checked
        check_ours(label, shape, segments, rows=1, window=window)
    q, k, v, d_out, _ = inputs(shape)
    forward_flops = flops(shape, documents, window)
    table = []
    for impl in impls:
        if impl == "ours_table" and flash.TUNING[shape[4]] == TABLE[shape[4]]:
            continue  # the same kernels as `ours`
        fns = attention_fns(impl, segments, documents, window=window)
        if isinstance(fns, str):
            continue
        try:
            t_fwd = timed(fns[0], q, k, v)
            t_both = timed(fns[1], q, k, v, d_out)
        except Exception as e:  # noqa: BLE001 (a kernel that refuses these inputs is reported, not fatal)
            reason = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
            print(f"  skip {impl}: {reason}")
            continue
        table.append((label, impl, t_fwd * 1e3, forward_flops / t_fwd / 1e12, t_both * 1e3,
                      3.5 * forward_flops / t_both / 1e12))
        print("  row: {} | {} | {:.3f} | {:.0f} | {:.3f} | {:.0f}".format(*table[-1]), flush=True)  # if cut short
    if sweep:
        rows, swept = block_sweep(label, shape, segments, q, k, v, d_out, forward_flops, window)
        table += rows
        if adopt:  # the rest of this run (this row and later ones) runs the three bests
            flash.TUNING[shape[4]] = swept
            table += ours_row(label + " (swept blocks)", shape, segments, q, k, v, d_out, forward_flops, window)
    return table


def ours_row(label, shape, segments, q, k, v, d_out, forward_flops, window: int) -> list[tuple]:
    """`ours` checked against float32 and timed with flash.TUNING as it is now."""
    check_ours(label, shape, segments, rows=1, window=window)
    fns = attention_fns("ours", segments, 0, window=window)
    t_fwd, t_both = timed(fns[0], q, k, v), timed(fns[1], q, k, v, d_out)
    row = (label, "ours", t_fwd * 1e3, forward_flops / t_fwd / 1e12, t_both * 1e3, 3.5 * forward_flops / t_both / 1e12)
    print("  row: {} | {} | {:.3f} | {:.0f} | {:.3f} | {:.0f}".format(*row), flush=True)
    return [row]


# Candidates around the table's starting points: (block_q, block_k, num_warps, num_stages).
SWEEP = {
    "forward": [(128, 64, 8, 2), (128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 2), (128, 32, 4, 3),
                (64, 64, 4, 3), (64, 64, 4, 4), (128, 128, 8, 3)],
    "dkdv": [(64, 64, 4, 2), (64, 64, 4, 3), (32, 64, 4, 3), (32, 128, 4, 2), (64, 128, 8, 2), (32, 128, 8, 2),
             (16, 64, 4, 3), (64, 64, 8, 2)],
    "dq": [(64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 8, 2), (64, 32, 4, 3), (128, 32, 8, 2), (128, 64, 4, 2),
           (64, 128, 8, 2), (32, 64, 4, 3)],
}


# Head dim 256: a program's tiles are twice as wide, so the blocks around the table's halved ones
# (shared memory: Q, and K, V once per stage, at 512 bytes a row; the float32 accumulators in registers).
SWEEP_256 = {
    "forward": [(64, 64, 8, 2), (64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 8, 2), (128, 32, 8, 2), (128, 32, 8, 3),
                (64, 32, 4, 3), (64, 32, 4, 4)],
    "dkdv": [(32, 32, 4, 2), (32, 32, 4, 3), (64, 32, 4, 2), (16, 32, 4, 3), (32, 64, 8, 2), (64, 64, 8, 2),
             (16, 64, 8, 3), (32, 64, 4, 2)],
    "dq": [(64, 32, 4, 2), (64, 32, 4, 3), (64, 64, 4, 2), (64, 64, 8, 2), (128, 32, 8, 2), (128, 64, 8, 2),
           (64, 32, 8, 2), (32, 64, 4, 2)],
}
# The Mosaic GPU forward at head dim 256 (`--mosaic-256`): (query rows a warpgroup, keys a block,
# slots) whose shared memory fits 227 KiB: 2 x 2 x 64 query rows (128 KiB) and slots x block_k x (K, V).
MOSAIC_256 = [(64, 32, 2), (64, 64, 1), (64, 32, 3)]


# The Mosaic GPU backward kernels' candidates (Hopper): shared-memory slots, and dQ's keys a block.
HOPPER_SWEEP = {"forward": [{"blocks": (64, 128, 2)}, {"blocks": (64, 128, 3)}, {"blocks": (64, 64, 2)},
                            {"blocks": (64, 64, 3)}, {"blocks": (64, 64, 4)}, {"blocks": (64, 256, 2)}],
                "dkdv": [{"stages": 2}, {"stages": 3}],
                "dq": [{"stages": 2, "block_k": 64}, {"stages": 2, "block_k": 128}, {"stages": 3, "block_k": 64},
                       {"stages": 3, "block_k": 128}]}


def on_hopper(q, k) -> bool:
    """Whether `attention_impl=flash` runs the Mosaic GPU kernels for these inputs here."""
    return flash.on_hopper(q, k)


def hopper_sweep(segments, q, k, v, d_out, out, lse, forward_flops) -> None:
    """Each Mosaic GPU kernel alone over HOPPER_SWEEP's candidates (rates count its own products: the
    forward's two, dK/dV's four, twice the forward's, dQ's three)."""
    lse2 = jnp.swapaxes(lse * flash.LOG2E, 1, 2)
    delta = jnp.swapaxes(jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), -1), 1, 2)
    for kernel, candidates in HOPPER_SWEEP.items():
        if kernel == "forward":
            run, args, work = flash_hopper.forward, (q, k, v), forward_flops
        else:  # dQ takes the forward's out (it computes D), dK/dV takes D
            run = getattr(flash_hopper_backward, kernel)
            args = (q, k, v, d_out, lse2, out if kernel == "dq" else delta)
            work = (2 if kernel == "dkdv" else 1.5) * forward_flops
        for options in candidates:
            fn = jax.jit(lambda *a, options=options, run=run: run(*a, True, segments, segments, **options))
            try:
                seconds = timed(fn, *args, calls=5, repeats=5)
            except Exception as e:  # noqa: BLE001 (shared memory exceeded)
                print(f"  sweep mosaic {kernel} {options}: failed: {str(e).strip().splitlines()[0][:120]}")
                continue
            print(f"  sweep mosaic {kernel} {options}: {seconds * 1e3:.3f} ms, {work / seconds / 1e12:.0f} TFLOP/s")


def block_sweep(label, shape, segments, q, k, v, d_out, forward_flops, window: int = 0) -> tuple[list[tuple], object]:
    """Each of our Triton kernels over SWEEP's candidates (SWEEP_256's at head dim 256), the others at
    the table's values: the forward alone, the backward (both kernels, from a saved out and lse) for
    dkdv's and dq's. Prints each kernel's best; returns table rows for the best and the tuning of the
    three bests. On Hopper also the Mosaic GPU kernels' candidates (`hopper_sweep`)."""
    base = flash.TUNING[shape[4]]
    out, lse = jax.jit(lambda q, k, v: flash.forward(q, k, v, True, segments, segments, window))(q, k, v)
    if on_hopper(q, k) and not window:
        hopper_sweep(segments, q, k, v, d_out, out, lse, forward_flops)
    rows, best_tuning = [], base
    for kernel, candidates in (SWEEP_256 if shape[4] == 256 else SWEEP).items():
        results = []
        for candidate in candidates:
            tuning = base._replace(**{kernel: flash.Blocks(*candidate)})
            if kernel == "forward":
                fn = jax.jit(lambda q, k, v, tuning=tuning: flash.forward(q, k, v, True, segments, segments,
                                                                        window, tuning=tuning)[0])
                args, work = (q, k, v), forward_flops
            else:
                fn = jax.jit(lambda *a, tuning=tuning: flash.backward(*a, True, segments, segments,
                                                                      window=window, tuning=tuning))
                args, work = (q, k, v, out, lse, d_out), 2.5 * forward_flops
            try:
                seconds = timed(fn, *args, calls=5, repeats=5)
            except Exception as e:  # noqa: BLE001 (shared memory exceeded, a block the length refuses)
                print(f"  sweep {kernel} {candidate}: failed: {str(e).strip().splitlines()[0][:120]}")
                continue
            results.append((seconds, candidate))
            print(f"  sweep {kernel} {candidate}: {seconds * 1e3:.3f} ms, {work / seconds / 1e12:.0f} TFLOP/s")
        if not results:
            continue
        seconds, best = min(results)
        best_tuning = best_tuning._replace(**{kernel: flash.Blocks(*best)})
        table_value = tuple(getattr(base, kernel))
        print(f"  best {kernel}: {best} ({seconds * 1e3:.3f} ms); table has {table_value}")
        what = "forward alone" if kernel == "forward" else "backward alone"
        work = forward_flops if kernel == "forward" else 2.5 * forward_flops
        rows.append((label, f"ours, best {kernel} {best} ({what})", seconds * 1e3, work / seconds / 1e12,
                     float("nan"), float("nan")))
    print(f"  swept tuning: {best_tuning}")
    return rows, best_tuning


def mosaic_256(name: str, documents: int, window: int) -> None:
    """The Mosaic GPU forward at head dim 256 over MOSAIC_256's blocks (which flash_hopper.BLOCKS does
    not list): each timed, its out and lse compared with the Triton forward's (checked against float32)."""
    shape = SHAPES[name]
    segments = segment_ids(shape[0], shape[1], documents)
    q, k, v, _, _ = inputs(shape)
    flops_ = flops(shape, documents, window)
    print(f"mosaic forward {name} docs={documents or 'none'} window={window}")
    triton = jax.jit(lambda q, k, v: flash.forward(q, k, v, True, segments, segments, window,
                                                   tuning=flash.TUNING[256]))
    want_out, want_lse = (np.asarray(x, np.float32) for x in triton(q, k, v))
    print(f"  triton forward: {timed(triton, q, k, v) * 1e3:.3f} ms", flush=True)
    for blocks in MOSAIC_256:
        fn = jax.jit(lambda q, k, v, blocks=blocks: flash_hopper.forward(q, k, v, True, segments, segments,
                                                                         blocks=blocks, window=window))
        try:
            out, lse = (np.asarray(x, np.float32) for x in fn(q, k, v))
            seconds = timed(fn, q, k, v, calls=5, repeats=5)
        except Exception as e:  # noqa: BLE001 (shared memory exceeded)
            print(f"  mosaic {blocks}: failed: {str(e).strip().splitlines()[0][:160] if str(e).strip() else e!r}",
                  flush=True)
            continue
        rel = float(np.linalg.norm(out - want_out) / np.linalg.norm(want_out))
        lse_rel = float(np.linalg.norm(lse - want_lse) / np.linalg.norm(want_lse))
        print(f"  mosaic {blocks}: {seconds * 1e3:.3f} ms, {flops_ / seconds / 1e12:.0f} TFLOP/s; out vs triton "
              f"{rel:.1e}, lse {lse_rel:.1e}", flush=True)


def under_load(name: str, impls, matmul_size: int = 8192, calls: int = 50, rounds: int = 6) -> list[tuple]:
    """(shape, impl, ms alone, ms after a matmul, ms of the first and of the last `calls` of
    `rounds` · `calls` back to back): forward + backward without documents, as a step runs it."""
    q, k, v, d_out, _ = inputs(SHAPES[name])
    a = jax.random.normal(jax.random.key(5), (matmul_size, matmul_size), jnp.bfloat16)
    matmul_alone = timed(jax.jit(lambda a: a @ a), a)
    rows = []
    for impl in impls:
        fns = attention_fns(impl, None, 0)
        if isinstance(fns, str):
            continue
        forward_backward = fns[1]

        def after_matmul(a, q, k, v, d_out, forward_backward=forward_backward):
            product = a @ a
            product, q = jax.lax.optimization_barrier((product, q))  # the attention starts after it
            return product, forward_backward(q, k, v, d_out)

        alone = timed(forward_backward, q, k, v, d_out)
        loaded = timed(jax.jit(after_matmul), a, q, k, v, d_out) - matmul_alone
        per_round = []
        for _ in range(rounds):
            start = time.perf_counter()
            for _ in range(calls):
                result = forward_backward(q, k, v, d_out)
            jax.block_until_ready(result)
            per_round.append((time.perf_counter() - start) / calls)
        rows.append((name, impl, alone * 1e3, loaded * 1e3, per_round[0] * 1e3, per_round[-1] * 1e3))
    return rows


def gpu_clock_and_power() -> str:
    """The first GPU's SM clock and power draw now, as nvidia-smi reports them ("" without it)."""
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,power.draw,power.limit", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30).stdout.strip().splitlines()[0]
    except (OSError, IndexError, subprocess.SubprocessError):
        return ""


def matmul_ceiling() -> float:
    """bf16 8192³ matrix product through XLA, TFLOP/s on random data: the rate to compare with."""
    a = jax.random.normal(jax.random.key(2), (8192, 8192), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(3), (8192, 8192), jnp.bfloat16)
    return 2 * 8192**3 / timed(jax.jit(jnp.matmul), a, b) / 1e12


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--documents", default="none,4", help="comma-separated: none, or documents per row")
    parser.add_argument("--impls", default=",".join(IMPLS), help=f"comma-separated, of {', '.join(IMPLS)}")
    parser.add_argument("--block-sweep", action="store_true", help="time block/warps/stages candidates of ours")
    parser.add_argument("--adopt-sweep", action="store_true",
                        help="with --block-sweep: sweep a shape's first case only, then run the three bests "
                             "(checked and timed as a row of their own) in the rest of the run")
    parser.add_argument("--mosaic-256", action="store_true",
                        help="instead: the Mosaic GPU forward at head dim 256 over MOSAIC_256's blocks, timed and "
                             "compared with the Triton forward")
    parser.add_argument("--no-check", action="store_true", help="skip checking ours against float32 first")
    parser.add_argument("--windows", default="0", help="comma-separated sliding windows, 0 for none")
    parser.add_argument("--under-load", action="store_true",
                        help="instead: forward + backward after a matmul and sustained, as a step runs them")
    args = parser.parse_args()
    if jax.default_backend() != "gpu":
        parser.exit(1, f"needs a GPU (JAX's backend here is {jax.default_backend()}): ours would run in Pallas's "
                       f"interpreter and cuDNN not at all.\n")
    print(f"device: {jax.devices()[0].device_kind}, JAX {jax.__version__}")
    print(f"bf16 matmul 8192^3 through XLA: {matmul_ceiling():.0f} TFLOP/s (the ceiling to compare with)")
    impls = args.impls.split(",")
    if args.under_load:
        rows = [row for name in args.shapes.split(",") for row in under_load(name, impls)]
        print(f"GPU now (SM clock, power, limit): {gpu_clock_and_power()}")
        print("| shape | kernel | fwd+bwd ms alone | after an 8192³ matmul | first 50 of 300 | last 50 of 300 |")
        print("|---|---|---|---|---|---|")
        for row in rows:
            print("| {} | {} | {:.3f} | {:.3f} | {:.3f} | {:.3f} |".format(*row))
        return
    if "cudnn" in impls:
        impls.insert(impls.index("cudnn") + 1, "cudnn_rows")
    if args.mosaic_256:
        for name, documents, window in itertools.product(args.shapes.split(","), args.documents.split(","),
                                                         args.windows.split(",")):
            mosaic_256(name, 0 if documents == "none" else int(documents), int(window))
        return
    table, swept = [], set()
    for name, documents, window in itertools.product(args.shapes.split(","), args.documents.split(","),
                                                     args.windows.split(",")):
        sweep = args.block_sweep and not (args.adopt_sweep and name in swept)
        swept.add(name)
        table += bench(name, 0 if documents == "none" else int(documents), impls, sweep,
                       check=not args.no_check, window=int(window), adopt=args.adopt_sweep)
    print("\nTFLOP/s: causal FLOPs (half of 4·B·H·T²·hd), of the visible pairs only with documents; "
          "fwd+bwd 3.5x the forward")
    print("| shape | kernel | forward ms | forward TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s |")
    print("|---|---|---|---|---|---|")
    for label, impl, fwd_ms, fwd_rate, both_ms, both_rate in table:
        print(f"| {label} | {impl} | {fwd_ms:.3f} | {fwd_rate:.0f} | {both_ms:.3f} | {both_rate:.0f} |")


if __name__ == "__main__":
    main()
