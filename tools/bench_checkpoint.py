"""How long a checkpoint save blocks the training loop, asynchronous vs synchronous.

    python tools/bench_checkpoint.py --config configs/bench_1b.py [--repeats 3]

For each mode the state of a config (params + AdamW state, float32) is saved `--repeats` times after
a few real training steps. "blocked" is the time the loop waits in `save()`: for async saves the
device->host copy, for sync saves the whole write. "complete" is until the files are committed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import jax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ushard import xla_flags  # noqa: E402
from ushard.config import apply_overrides, load_config  # noqa: E402
from ushard.training.loop import Trainer  # noqa: E402


def measure(config_name: str, async_save: bool, repeats: int, root: str) -> dict:
    config = load_config(config_name)
    apply_overrides(config, [f"checkpoint.async_save={async_save}", f"checkpoint.keep={repeats + 1}"])
    workdir = os.path.join(root, f"async_{async_save}")
    trainer = Trainer(config, workdir=workdir)
    state = trainer.steps.init(config.train.seed)
    batches = trainer.global_batches(2)
    step_fn = trainer.steps.train_step.lower(state, batches[0]).compile()
    for batch in batches:
        state, metrics = step_fn(state, batch)
    jax.block_until_ready(state)
    blocked, complete = [], []
    for r in range(repeats):
        start = time.perf_counter()
        trainer.checkpoints.save(10 + r, state.as_dict(), trainer.batches.initial_state(), config)
        blocked.append(time.perf_counter() - start)
        trainer.checkpoints.wait()
        complete.append(time.perf_counter() - start)
    trainer.checkpoints.close()
    shutil.rmtree(workdir)  # a bench_1b checkpoint is 11 GiB
    state_bytes = sum(x.nbytes for x in jax.tree.leaves(state))
    return {"async": async_save, "state_gib": state_bytes / 2**30, "blocked_s": sorted(blocked)[len(blocked) // 2],
            "complete_s": sorted(complete)[len(complete) // 2], "device": jax.devices()[0].device_kind}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="bench_1b")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args()
    xla_flags.apply(load_config(args.config))  # before the backend starts, as training does
    root = args.dir or tempfile.mkdtemp(prefix="ushard-ckpt-bench-")
    results = [measure(args.config, mode, args.repeats, root) for mode in (True, False)]
    for r in results:
        print(json.dumps(r))
    print("\nmode    state GiB   blocked s (median)   complete s (median)")
    for r in results:
        mode = "async" if r["async"] else "sync"
        print(f"{mode:<8}{r['state_gib']:>9.2f}{r['blocked_s']:>21.3f}{r['complete_s']:>22.3f}")


if __name__ == "__main__":
    main()
