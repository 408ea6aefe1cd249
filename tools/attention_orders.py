"""Our Mosaic GPU kernels in each tile order against cuDNN, in one process: the persistent forward's
(`flash_hopper.ORDER`) and the backward grids' (`flash_hopper_backward.GRID_ORDER`), forward and
forward + backward, and the two backward kernels alone in each grid order; every order's out and
gradients compared bit for bit with the first's (each tile is computed alone, so they must match).

    python3 tools/attention_orders.py [--shapes llama3_8b,bench_1b_32k] [--orders heads/heads,tiles/heads]
                                      [--documents 0] [--window 0] [--check "hd128,grouped 2:1"]

`--orders`: comma-separated forward/backward pairs of "tiles", "heads" or "auto". `--check`: first,
tools/attention_check.py's cases whose names hold one of these words (tiles orders), against float32.
Shapes are tools/attention_bench.py's; its timing (median of loops of calls back to back).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from attention_bench import SHAPES, attention_fns, inputs, segment_ids, timed  # tools/, this script's folder
from attention_check import CASES, errors
from ushard.kernels import flash, flash_hopper, flash_hopper_backward


def set_order(forward: str, backward: str) -> None:
    flash_hopper.ORDER, flash_hopper_backward.GRID_ORDER = forward, backward


def kernels_alone(q, k, v, d_out):
    """(dq, its arguments, dkdv, its arguments), from the forward's out and lse."""
    out, lse = jax.jit(lambda q, k, v: flash.forward(q, k, v, True))(q, k, v)
    lse2 = jnp.swapaxes(lse * flash.LOG2E, 1, 2)
    dq = jax.jit(lambda *a: flash_hopper_backward.dq(*a, True))
    _, delta = dq(q, k, v, d_out, lse2, out)
    dkdv = jax.jit(lambda *a: flash_hopper_backward.dkdv(*a, True))
    return dq, (q, k, v, d_out, lse2, out), dkdv, (q, k, v, d_out, lse2, delta)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--shapes", default="llama3_8b,bench_1b_32k")
    parser.add_argument("--orders", default="heads/heads,tiles/heads,heads/tiles,tiles/tiles")
    parser.add_argument("--documents", type=int, default=0)
    parser.add_argument("--window", type=int, default=0)
    parser.add_argument("--check", default="")
    args = parser.parse_args()
    print(f"device: {jax.devices()[0].device_kind}, JAX {jax.__version__}", flush=True)
    set_order("tiles", "tiles")
    for name, case in CASES.items():
        if any(word and word in name for word in args.check.split(",")):
            result = errors(case)
            verdict = "ok" if max(result.values()) <= 1e-2 else "OFF"
            print(f"check {name}: " + " ".join(f"{k} {e:.1e}" for k, e in result.items()) + f" {verdict}", flush=True)
    orders = [tuple(pair.split("/")) for pair in args.orders.split(",")]
    table = []

    def row(*values):
        table.append(values)
        print("row: " + " | ".join(v if isinstance(v, str) else f"{v:.3f}" for v in values), flush=True)

    for name in args.shapes.split(","):
        shape = SHAPES[name]
        q, k, v, d_out, _ = inputs(shape)
        segments = segment_ids(shape[0], shape[1], args.documents)
        label = name + (f" docs={args.documents}" if args.documents else "") + (
            f" window={args.window}" if args.window else "")
        for impl, pairs in (("cudnn", [None]), ("ours", orders), ("cudnn", [None])):
            for pair in pairs:
                if pair:
                    set_order(*pair)
                fwd, both = attention_fns(impl, segments, args.documents, window=args.window)
                row(label, impl if pair is None else f"ours fwd={pair[0]} bwd={pair[1]}", timed(fwd, q, k, v) * 1e3,
                    timed(both, q, k, v, d_out) * 1e3)
                if pair == orders[0]:
                    first = [np.asarray(x) for x in both(q, k, v, d_out)]
                elif pair:
                    same = all(np.array_equal(a, np.asarray(b)) for a, b in zip(first, both(q, k, v, d_out)))
                    print(f"  the same bits as fwd={orders[0][0]} bwd={orders[0][1]}: {same}", flush=True)
        if not (args.documents or args.window):
            for backward in ("heads", "tiles"):
                set_order("tiles", backward)
                dq, dq_args, dkdv, dkdv_args = kernels_alone(q, k, v, d_out)
                row(label, f"alone, bwd={backward}: dq | dkdv", timed(dq, *dq_args) * 1e3,
                    timed(dkdv, *dkdv_args) * 1e3)
    set_order("auto", "auto")
    print("\n| shape | kernel | forward ms | fwd+bwd ms (alone: dq ms, dkdv ms) |\n|---|---|---|---|")
    for values in table:
        print("| " + " | ".join(v if isinstance(v, str) else f"{v:.3f}" for v in values) + " |")


if __name__ == "__main__":
    main()
