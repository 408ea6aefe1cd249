"""Benchmark: train a config for a fixed number of steps on whatever devices exist, print throughput.

    python tools/bench.py --config configs/bench_1b.py [--config.a.b=v ...] [--steps 10] [--warmup 3]
        [--variant LABEL="--config.a.b=v ..."]... [--peers jax,torch] [--processes N]

Each ushard variant and each peer (tools/peer_jax.py, tools/peer_torch.py) runs in its own process, so
one cannot inherit another's memory. With `--processes N` each ushard variant runs as N local
processes of one GPU each, joined by `jax.distributed`, as a cluster launcher runs them (one
process driving every GPU is the default). The last thing printed is one table: tokens/s, TFLOP/s per device,
MFU against the chip's datasheet bf16 dense peak, and peak memory of the busiest device. FLOPs are counted as in
ushard/metrics.py (6*N + causal attention), the same formula the peers use. For an MoE model the JSON result
also holds the busiest expert's load over the mean load in the timed steps (`moe_busiest_expert_over_mean`),
and with experts over devices (ragged dispatch) the busiest device's (`moe_busiest_device_over_mean`).
With `--config.checkpoint.init_from=WORKDIR` the timed run starts from those parameters: for an MoE model, the
routing of a trained router rather than of an initial one, which sends most tokens to a few experts.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time

import numpy as np

import local_processes  # tools/, this script's folder

HERE = os.path.dirname(os.path.abspath(__file__))


def run_ushard_once(config_name: str, overrides: list[str], steps: int, warmup: int, breakdown: bool = False,
                    processes: tuple[str, int, int] | None = None) -> dict:
    """Times `steps` training steps after `warmup` untimed ones, in this process.

    With `breakdown`, also times the forward + backward pass alone (`Steps.loss_and_grads`), so that
    the rest of a step (gradient norm, clipping, AdamW) is the difference. `processes`: (coordinator
    address, number of processes, this one's id) of a multi-process run this process joins.
    """
    import jax
    from jax.experimental import multihost_utils

    sys.path.insert(0, os.path.dirname(HERE))
    from ushard import xla_flags
    from ushard.config import load_config
    from ushard.models.moe import BUSIEST_DEVICE, DISPATCH_OVERFLOW
    from ushard.training.loop import Trainer

    config = load_config(config_name, overrides)
    xla_flags.apply(config)  # before the backend starts
    if processes:
        jax.distributed.initialize(*processes)
    trainer = Trainer(config)
    state, _ = trainer.initial_state()  # around checkpoint.init_from's parameters where it is set
    batches = trainer.global_batches(warmup + steps)
    # The jitted step itself, dispatched as the training loop does (not an AOT executable), so that
    # JAX's own recompilations apply, e.g. profile-guided scheduling with JAX_ENABLE_PGLE=1.
    step_fn = trainer.steps.train_step
    start = time.perf_counter()
    state, metrics = step_fn(state, batches[0])
    jax.block_until_ready(metrics)
    compile_s = time.perf_counter() - start  # compilation plus one step
    for s in range(1, warmup):
        state, metrics = step_fn(state, batches[s])
    jax.block_until_ready(metrics)
    start = time.perf_counter()
    overflows = []  # each timed step's share of MoE layers whose ragged dispatch overflowed, read after
    loads = []  # and its busiest expert's load over the mean (mean over MoE layers)
    device_loads = []  # and, experts over devices with the ragged dispatch, the busiest device's
    for s in range(warmup, warmup + steps):
        state, metrics = step_fn(state, batches[s])
        overflows.append(metrics["aux"].get(DISPATCH_OVERFLOW, 0.0))
        loads.append(metrics["aux"].get("moe_load_max_over_mean"))
        device_loads.append(metrics["aux"].get(BUSIEST_DEVICE))
    jax.block_until_ready((state, metrics))
    step_time = (time.perf_counter() - start) / steps
    overflow = max(float(x) for x in overflows)
    if overflow > 0:  # such a step sent nothing: its time is no result
        raise SystemExit(f"bench: the ragged expert dispatch overflowed its receive buffers in a timed step "
                         f"({overflow:.0%} of the MoE layers); raise model.moe.dispatch_headroom.")
    tokens_per_s = config.train.batch_size * config.train.seq_len / step_time
    tflops = trainer.setup.flops_per_token * tokens_per_s / trainer.setup.mesh.size / 1e12
    # The busiest device's peak: pipeline stages (and expert groups) do not hold the same.
    peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") or 0 for d in jax.local_devices()]
    # In GiB: gathered as int64 the bytes would wrap, because JAX without x64 makes them int32.
    peak_gib = float(np.max(multihost_utils.process_allgather(np.float32(max(peaks) / 2**30)))) or None
    extra = {}
    if loads[0] is not None:
        extra["moe_busiest_expert_over_mean"] = float(np.mean([float(x) for x in loads]))
    if device_loads[0] is not None:
        extra["moe_busiest_device_over_mean"] = float(np.mean([float(x) for x in device_loads]))
    if breakdown:
        grads_fn = trainer.steps.loss_and_grads.lower(state.params, batches[0]).compile()
        jax.block_until_ready(grads_fn(state.params, batches[0]))
        start = time.perf_counter()
        for s in range(warmup, warmup + steps):
            out = grads_fn(state.params, batches[s])
        jax.block_until_ready(out)
        extra["fwd_bwd_s"] = (time.perf_counter() - start) / steps
        extra["rest_of_step_s"] = step_time - extra["fwd_bwd_s"]
    return {
        "tokens_per_s": tokens_per_s,
        "step_time_s": step_time,
        "tflops_per_device": tflops,
        "mfu": tflops * 1e12 / trainer.peak if trainer.peak else None,
        "peak_mem_gib": peak_gib,
        "final_loss": float(metrics["loss"]),
        "compile_s": compile_s,
        "devices": f"{trainer.setup.mesh.size} x {jax.devices()[0].device_kind}",
        **extra,
    }


def _subprocess_json(label: str, cmd: list[str], env: dict | None = None, processes: int = 1) -> dict:
    """The JSON result `cmd` prints last, labelled, or an error row. With `processes` > 1, `cmd` (a
    `--one` run) runs as that many local processes of one device each, and the result is process 0's."""
    env = env or {}
    many = f"{processes} processes, " if processes > 1 else ""
    print(f"--- {label}: {many}{' '.join(f'{k}={v}' for k, v in env.items())} {shlex.join(cmd)}", flush=True)
    if processes > 1:
        children = local_processes.start(cmd, processes, env, stdout=subprocess.PIPE, text=True)
    else:
        children = [subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env={**os.environ, **env})]
    outputs = [child.communicate()[0] for child in children]
    lines = [line for line in outputs[0].splitlines() if line.startswith("{")]
    failed = next((child.returncode for child in children if child.returncode), 0)
    if failed or not lines:
        print(outputs[0][-3000:], flush=True)
        return {"name": label, "error": f"exit {failed}"}
    result = {**json.loads(lines[-1]), "name": label}
    print(json.dumps(result), flush=True)
    return result


def peer_command(name: str, config_name: str, overrides: list[str], steps: int, warmup: int) -> list[str]:
    sys.path.insert(0, os.path.dirname(HERE))
    from ushard.config import load_config

    c = load_config(config_name, overrides)
    m, t = c.model, c.train
    return [
        sys.executable, os.path.join(HERE, f"peer_{name}.py"),
        "--vocab", str(m.vocab_size), "--d_model", str(m.d_model), "--n_layers", str(m.n_layers),
        "--n_heads", str(m.n_heads), "--n_kv_heads", str(m.n_kv_heads), "--d_ff", str(m.d_ff),
        "--seq_len", str(t.seq_len), "--batch", str(t.batch_size), "--steps", str(steps), "--warmup", str(warmup),
    ]


def print_table(results: list[dict]) -> None:
    cols = ("tokens_per_s", "tflops_per_device", "mfu", "peak_mem_gib", "step_time_s")
    cols += tuple(c for c in ("fwd_bwd_s", "rest_of_step_s") if any(c in r for r in results))
    width = max(len(r["name"]) for r in results) + 2
    print("\n" + "name".ljust(width) + "".join(c.rjust(19) for c in cols))
    for r in results:
        cells = []
        for c in cols:
            v = r.get(c)
            if v is None:
                cell = r.get("error", "-") if c == cols[0] else "-"
            else:
                cell = f"{100 * v:.1f}%" if c == "mfu" else f"{v:,.3f}" if v < 100 else f"{v:,.0f}"
            cells.append(cell.rjust(19))
        print(r["name"].ljust(width) + "".join(cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=os.path.join(os.path.dirname(HERE), "configs", "bench_1b.py"))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--variant", action="append", default=[],
                        help='LABEL="[ENV=value ...] --config.a=b ..." (repeatable; ENV: environment for that run)')
    parser.add_argument("--peers", default="", help="comma-separated: jax,torch")
    parser.add_argument("--breakdown", action="store_true", help="also time forward+backward alone")
    parser.add_argument("--processes", type=int, default=1, help="run each variant as N local processes, one GPU each")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # run in this process
    parser.add_argument("--coordinator", help=argparse.SUPPRESS)  # with --one: the multi-process run it joins
    parser.add_argument("--process-id", type=int, help=argparse.SUPPRESS)
    args, overrides = parser.parse_known_args()
    bad = [o for o in overrides if not o.startswith("--config.")]
    if bad:
        parser.error(f"unknown arguments {bad}; overrides look like --config.a.b=value")
    overrides = [o[len("--config."):] for o in overrides]

    if args.one:
        processes = (args.coordinator, args.processes, args.process_id) if args.coordinator else None
        result = run_ushard_once(args.config, overrides, args.steps, args.warmup, args.breakdown, processes)
        if not processes or args.process_id == 0:
            print(json.dumps(result), flush=True)
        return
    if args.processes < 1:
        parser.error(f"--processes must be 1 or more; it is {args.processes}")

    unnamed = [v for v in args.variant if "=" not in v or not v.split("=", 1)[0]]
    if unnamed:
        parser.error(f"--variant {unnamed[0]!r} has no label: write LABEL=\"--config.a=b ...\" "
                     "(LABEL= alone for no overrides)")
    variants = [v.split("=", 1) for v in args.variant] or [["ushard", ""]]
    results = []
    for label, extra in variants:
        cmd = [sys.executable, os.path.abspath(__file__), "--one", "--config", args.config,
               "--steps", str(args.steps), "--warmup", str(args.warmup)] + (["--breakdown"] if args.breakdown else [])
        words = shlex.split(extra)
        env = dict(w.split("=", 1) for w in words if not w.startswith("--"))
        cmd += ["--config." + o for o in overrides] + [w for w in words if w.startswith("--")]
        results.append(_subprocess_json(label, cmd, env, args.processes))
    for peer in filter(None, args.peers.split(",")):
        command = peer_command(peer, args.config, overrides, args.steps, args.warmup)
        results.append(_subprocess_json(f"peer_{peer}", command))
    print_table(results)


if __name__ == "__main__":
    main()
