"""Where the time of a training step goes, kernel by kernel, from a JAX profiler trace.

    python tools/profile_step.py --config configs/bench_1b.py [--config.a.b=v ...] [--steps 3] [--top 25]

Traces `--steps` steps after a warm-up with `jax.profiler.trace(..., create_perfetto_trace=True)`,
then sums the device-side durations in the trace by kernel name and prints the largest, per step,
with a rough class for each (matmul, attention, our Pallas kernels, other fusion), then the same time by HLO operation
(tools/hlo_ops.py), with the FLOP rate of each group of matmuls.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import sys
import tempfile

import jax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hlo_ops import HloOps, kernel_class  # noqa: E402  (tools/ is this script's folder)
from ushard import xla_flags  # noqa: E402
from ushard.config import load_config  # noqa: E402
from ushard.training.loop import Trainer  # noqa: E402


def _merged(intervals) -> list[tuple[float, float]]:
    """A set of (start, end) intervals as the sorted, disjoint intervals covering the same time."""
    merged = []
    for lo, hi in sorted(intervals):
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return merged


def _covered(intervals) -> float:
    return sum(hi - lo for lo, hi in _merged(intervals))


def _compute_spans(kernels: list[dict]) -> list[tuple[float, float]]:
    return [(e["ts"], e["ts"] + e["dur"]) for e in kernels if kernel_class(e["name"]) != "collective"]


def device_kernel_events(trace_dir: str) -> list[dict]:
    """The kernel events ("X" events with a duration) of the first GPU in the trace."""
    files = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)
    if not files:
        raise SystemExit(f"no perfetto trace under {trace_dir}")
    with gzip.open(files[0], "rt") as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    gpu_pids = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
                and "/device:GPU" in str(e.get("args", {}).get("name", ""))}
    if not gpu_pids:  # a CPU run: the host's own ops are the device work
        gpu_pids = {e.get("pid") for e in events if e.get("ph") == "X"}
    first_gpu = min(gpu_pids, key=str)
    return [e for e in events if e.get("ph") == "X" and e.get("pid") == first_gpu and "dur" in e]


def exposed_gaps(kernels: list[dict], top: int = 10) -> list[str]:
    """The longest stretches with no compute kernel on the device, where they fall (ms from the start
    of the trace) and which collectives run during them: the communication nothing hides."""
    compute = _merged(_compute_spans(kernels))
    collectives = [e for e in kernels if kernel_class(e["name"]) == "collective"]
    gaps = [(end, start) for (_, end), (start, _) in zip(compute, compute[1:])]
    origin = compute[0][0]
    lines = []
    for lo, hi in sorted(gaps, key=lambda g: g[0] - g[1])[:top]:
        during = {e["name"].split("(")[0] for e in collectives if e["ts"] < hi and e["ts"] + e["dur"] > lo}
        running = ", ".join(sorted(during)) or "idle"
        lines.append(f"  gap {(hi - lo) / 1e3:6.2f} ms at {(lo - origin) / 1e3:8.1f} ms: {running}")
    return lines


def overlap_report(kernels: list[dict], steps: int) -> str:
    """How much of the traced span the first device computes, only communicates, or idles (ms per step)."""
    spans = [(e["ts"], e["ts"] + e["dur"]) for e in kernels]
    wall = max(hi for _, hi in spans) - min(lo for lo, _ in spans)
    busy, computing = _covered(spans), _covered(_compute_spans(kernels))
    ms = lambda us: us / 1e3 / steps  # noqa: E731
    return (f"first device, per step: span {ms(wall):.1f} ms = computing {ms(computing):.1f} + only communicating "
            f"{ms(busy - computing):.1f} + idle {ms(wall - busy):.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="bench_1b")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--dump", help="write the compiled HLO and the per-kernel times (JSON) into this folder")
    parser.add_argument("--scope", help="also print the time of the kernels traced under jax.named_scope(SCOPE), "
                        "e.g. optimizer (ushard/training/step.py)")
    args, overrides = parser.parse_known_args()
    config = load_config(args.config, [o[len("--config."):] for o in overrides])
    xla_flags.apply(config)  # before the backend starts
    trainer = Trainer(config)
    state = trainer.steps.init(config.train.seed)
    batch = trainer.global_batches(1)[0]
    step_fn = trainer.steps.train_step.lower(state, batch).compile()
    for _ in range(2):
        state, metrics = step_fn(state, batch)
    jax.block_until_ready(state)
    trace_dir = tempfile.mkdtemp(prefix="ushard-profile-")
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        for _ in range(args.steps):
            state, metrics = step_fn(state, batch)
        jax.block_until_ready(state)
    kernels = device_kernel_events(trace_dir)
    totals = collections.Counter()
    for e in kernels:
        totals[e["name"]] += e["dur"]  # microseconds
    per_step_ms = {name: us / 1e3 / args.steps for name, us in totals.items()}
    if args.dump:
        os.makedirs(args.dump, exist_ok=True)
        with open(os.path.join(args.dump, "step.hlo.txt"), "w") as f:
            f.write(step_fn.as_text())
        with open(os.path.join(args.dump, "kernels_ms_per_step.json"), "w") as f:
            json.dump(dict(sorted(per_step_ms.items(), key=lambda kv: -kv[1])), f, indent=0)
        with gzip.open(os.path.join(args.dump, "kernel_events.json.gz"), "wt") as f:
            json.dump(kernels, f)
    by_class = collections.Counter()
    for name, ms in per_step_ms.items():
        by_class[kernel_class(name)] += ms
    print(f"device time per step: {sum(per_step_ms.values()):.1f} ms; by class: "
          + ", ".join(f"{k} {v:.1f} ms" for k, v in by_class.most_common()))
    print(overlap_report(kernels, args.steps))
    print("\n".join(exposed_gaps(kernels)))
    print(f"{'ms/step':>9}  class      kernel")
    for name, ms in sorted(per_step_ms.items(), key=lambda kv: -kv[1])[: args.top]:
        print(f"{ms:9.2f}  {kernel_class(name):<9}  {name[:110]}")
    ops = HloOps(step_fn.as_text())
    print("\nby HLO operation (bwd = transpose(jvp())):")
    print("\n".join(ops.table(kernels, args.steps, args.top)))
    if args.scope:
        inside, total = ops.scoped_ms(kernels, args.steps, args.scope)
        print(f"under jax.named_scope({args.scope!r}): {inside:.1f} of {total:.1f} ms a step ({inside / total:.1%})")


if __name__ == "__main__":
    main()
