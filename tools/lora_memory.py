"""LoRA's memory and speed on this machine's devices: the planner's estimate against the compiled step
and the measured peak, for the full fine-tune and the LoRA run of each config given.

    python tools/lora_memory.py --config configs/bench_1b.py [--config.a.b=v ...] [--rank 16] [--steps 6]

For each of "full" and "lora": the planner's per-device estimate (`ushard plan`'s), the compiled step's
memory analysis (arguments + temporaries - aliased), the measured peak (the allocator's
peak_bytes_in_use after the steps) and tokens/s; a run whose state does not fit says so (the
planner's refusal) instead. Run each config in its own process: the peaks are the process's.
"""

from __future__ import annotations

import argparse
import json
import time

import jax

from ushard import estimate, planner
from ushard.config import load_config
from ushard.errors import UserError
from ushard.training.loop import Trainer

GIB = 2**30


def measure(config, steps: int) -> dict:
    trainer = Trainer(config)
    setup = trainer.setup
    row = {"estimate_gib": estimate.estimate(setup).peak / GIB}
    try:
        planner.check_state_fits(setup)
    except UserError as e:
        return {**row, "fits": False, "why": str(e)}
    try:
        return {**row, **run(trainer, config, steps)}
    except Exception as e:  # the device's own out-of-memory error: the run does not fit
        if "RESOURCE_EXHAUSTED" not in str(e) and "out of memory" not in str(e).lower():
            raise
        return {**row, "fits": False, "why": str(e).splitlines()[0][:300]}


def run(trainer, config, steps: int) -> dict:
    row = {}
    state = trainer.steps.init(config.train.seed)
    batches = trainer.global_batches(2)
    compiled = trainer.steps.train_step.lower(state, batches[0]).compile()
    m = compiled.memory_analysis()
    row["compiled_gib"] = (m.argument_size_in_bytes + m.temp_size_in_bytes + m.output_size_in_bytes
                           - m.alias_size_in_bytes) / GIB
    state, metrics = compiled(state, batches[0])
    jax.block_until_ready(metrics["loss"])
    start = time.perf_counter()
    for i in range(steps):
        state, metrics = compiled(state, batches[i % 2])
    jax.block_until_ready(metrics["loss"])
    seconds = (time.perf_counter() - start) / steps
    t = config.train
    row.update(fits=True, step_s=seconds, tokens_per_s=t.batch_size * t.seq_len / seconds,
               peak_gib=max((d.memory_stats() or {}).get("peak_bytes_in_use", 0) for d in jax.local_devices()) / GIB,
               loss=float(metrics["loss"]))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--variant", choices=("full", "lora"), required=True)
    args, overrides = parser.parse_known_args()
    overrides = [o[len("--config."):] for o in overrides]
    if args.variant == "lora":
        overrides.append(f"model.lora.rank={args.rank}")
    row = measure(load_config(args.config, overrides), args.steps)
    print(json.dumps({"config": args.config, "variant": args.variant, **row}))


if __name__ == "__main__":
    main()
