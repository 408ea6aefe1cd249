"""Measure the layouts `ushard plan --recommend` picks next to what it predicted for them.

    python tools/plan_check.py --config configs/bench_1b.py [--config.a.b=v ...] [--top 3] [--hardware h200]
        [--steps 6] [--warmup 2]

On the machine whose GPUs (all visible ones) the plan is for: the planner lays the config out on as
many simulated CPU devices (ushard/planner.py), ranks the layouts that fit, and each is then timed by
tools/bench.py in its own process. The last thing printed is a table: each layout's predicted and
measured step time and peak memory per device, and the prediction's error; before it, each
prediction and each measurement as it arrives (a run cut short keeps what it measured).
`--hardware` names the planner's chip (default: from the GPUs' device kind).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def chip_of(kind: str) -> str:
    """The planner's preset for a JAX device kind, e.g. "NVIDIA H100 80GB HBM3" -> "h100"."""
    for name in ("h100", "h200"):
        if name in kind.lower():
            return name
    raise SystemExit(f"plan_check: no planner figures for {kind!r}; name a preset with --hardware")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--top", type=int, default=3)
    parser.add_argument("--hardware", help="the planner's chip preset (default: from the device kind)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    args, overrides = parser.parse_known_args()
    import jax

    devices = jax.devices()
    hardware = args.hardware or chip_of(devices[0].device_kind)
    # The planner in a process of its own: it lays the config out on simulated CPU devices.
    plan = [sys.executable, "-m", "ushard", "plan", "--config", args.config, *overrides, "--devices", str(len(devices)),
            "--hardware", hardware, "--recommend", "--top", str(args.top), "--json"]
    done = subprocess.run(plan, capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    if done.returncode:
        raise SystemExit(f"plan_check: ushard plan failed: {done.stderr.strip().splitlines()[-1:]}")
    layouts = json.loads(done.stdout)["layouts"]
    # The predictions first, and each layout's measurement as it arrives: a run cut short (a device
    # call's time limit) still shows what it measured.
    for i, layout in enumerate(layouts):
        estimate = layout["estimate"]
        print(f"predicted plan{i + 1}: {estimate['step_s']:.3f} s, {estimate['peak_bytes'] / 2**30:.1f} GiB: "
              f"{' '.join(layout['overrides'])}", flush=True)
    variants = [f"plan{i + 1}={' '.join(layout['overrides'])}" for i, layout in enumerate(layouts)]
    bench = [sys.executable, os.path.join(HERE, "bench.py"), "--config", args.config, "--steps", str(args.steps),
             "--warmup", str(args.warmup), *overrides, *(f"--variant={v}" for v in variants)]
    measured = {}
    with subprocess.Popen(bench, stdout=subprocess.PIPE, text=True) as run:
        for line in run.stdout:
            if line.startswith("{"):
                row = json.loads(line)
                measured[row["name"]] = row
                print(f"measured {row['name']}: {row.get('step_time_s')} s, {row.get('peak_mem_gib')} GiB", flush=True)
    print(f"\n{len(devices)} x {devices[0].device_kind}, planned as {hardware}")
    print(f"{'layout':<8}{'predicted s':>13}{'measured s':>12}{'error':>8}{'predicted GiB':>15}{'peak GiB':>10}"
          f"{'error':>8}  overrides")
    for i, layout in enumerate(layouts):
        r, estimate = measured.get(f"plan{i + 1}", {}), layout["estimate"]
        step, peak = r.get("step_time_s"), r.get("peak_mem_gib")
        predicted_gib = estimate["peak_bytes"] / 2**30
        step_error = f"{estimate['step_s'] / step - 1:+.1%}" if step else "-"
        peak_error = f"{predicted_gib / peak - 1:+.1%}" if peak else "-"
        print(f"plan{i + 1:<4}{estimate['step_s']:>13.3f}{step or float('nan'):>12.3f}{step_error:>8}"
              f"{predicted_gib:>15.1f}{peak or float('nan'):>10.1f}{peak_error:>8}  {' '.join(layout['overrides'])}")


if __name__ == "__main__":
    main()
