"""Where the time of a training step goes, kernel by kernel, from a JAX profiler trace.

    python tools/profile_step.py --config configs/bench_1b.py [--config.a.b=v ...] [--steps 3] [--top 25]

Traces `--steps` steps after a warm-up with `jax.profiler.trace(..., create_perfetto_trace=True)`,
then sums the device-side durations in the trace by kernel name and prints the largest, per step,
with a rough class for each (matmul, attention, other fusion).
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

from ushard.config import load_config  # noqa: E402
from ushard.train.loop import Trainer  # noqa: E402


def kernel_class(name: str) -> str:
    low = name.lower()
    if any(k in low for k in ("gemm", "cublas", "matmul", "sm90_xmma", "nvjet", "triton_gemm", "cutlass")):
        return "matmul"
    if any(k in low for k in ("fmha", "flash", "cudnn", "attention", "sdpa")):
        return "attention"
    if "memcpy" in low or "memset" in low:
        return "copy"
    return "other"


def device_kernel_times(trace_dir: str) -> collections.Counter:
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
    totals = collections.Counter()
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in gpu_pids and "dur" in e:
            totals[e["name"]] += e["dur"]  # microseconds
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="bench_1b")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--top", type=int, default=25)
    args, overrides = parser.parse_known_args()
    config = load_config(args.config, [o[len("--config."):] for o in overrides])
    trainer = Trainer(config)
    state = trainer.steps.init(config.train.seed)
    batch = trainer.global_batch(0)
    step_fn = trainer.steps.train_step.lower(state, batch).compile()
    for _ in range(2):
        state, metrics = step_fn(state, batch)
    jax.block_until_ready(state)
    trace_dir = tempfile.mkdtemp(prefix="ushard-profile-")
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        for _ in range(args.steps):
            state, metrics = step_fn(state, batch)
        jax.block_until_ready(state)
    totals = device_kernel_times(trace_dir)
    per_step_ms = {name: us / 1e3 / args.steps for name, us in totals.items()}
    by_class = collections.Counter()
    for name, ms in per_step_ms.items():
        by_class[kernel_class(name)] += ms
    print(f"device time per step: {sum(per_step_ms.values()):.1f} ms; by class: "
          + ", ".join(f"{k} {v:.1f} ms" for k, v in by_class.most_common()))
    print(f"{'ms/step':>9}  class      kernel")
    for name, ms in sorted(per_step_ms.items(), key=lambda kv: -kv[1])[: args.top]:
        print(f"{ms:9.2f}  {kernel_class(name):<9}  {name[:110]}")


if __name__ == "__main__":
    main()
