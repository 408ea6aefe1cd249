"""Draws a pipeline schedule: which microbatch each stage runs at each tick, forward or backward.

    python tools/pipeline_schedule.py --schedule 1f1b --stages 4 --microbatches 8 [--out schedule.png]
    python tools/pipeline_schedule.py --config tiny --config.mesh.pipeline=4 \\
        --config.parallel.pipeline_schedule=circular --config.parallel.pipeline_repeats=2

The tables are the ones the training step runs (ushard/parallel/pipeline.py). GPipe and circular show
their forward loop and then the backward pass autodiff makes of it (the same ticks in reverse);
circular labels a microbatch m in round r as "m.r". 1F1B runs a forward and a backward slot in each
tick. The title gives the theoretical bubble (`bubble_fraction`) and how many microbatches' inputs a
stage keeps at most. Writes a PNG with matplotlib (the `plot` extra, `pip install -e '.[plot]'` in a
clone); prints the grid as
text without it.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ushard.config import load_config  # noqa: E402
from ushard.parallel.pipeline import (  # noqa: E402
    IDLE,
    SCHEDULES,
    bubble_fraction,
    forward_table,
    one_f_one_b_table,
    ring_size,
)

FORWARD, BACKWARD = "F", "B"


def schedule_cells(schedule: str, stages: int, microbatches: int, repeats: int = 1) -> list[list[list[str]]]:
    """cells[stage][tick]: the work of that slot, e.g. ["F3", "B1"] (1F1B), ["F2.1"] (circular), []."""
    if schedule == "1f1b":
        table = one_f_one_b_table(stages, microbatches)
        return [[[f"{kind}{m}" for kind, m in zip((FORWARD, BACKWARD), table[t, s]) if m != IDLE]
                 for t in range(table.shape[0])] for s in range(stages)]
    rounds = repeats if schedule == "circular" else 1
    table = forward_table(stages, microbatches, rounds)

    def label(kind, m, r):
        return [] if m == IDLE else [f"{kind}{m}.{r}" if rounds > 1 else f"{kind}{m}"]

    forward = [[label(FORWARD, *table[t, s]) for t in range(len(table))] for s in range(stages)]
    backward = [[label(BACKWARD, *table[t, s]) for t in reversed(range(len(table)))] for s in range(stages)]
    return [f + b for f, b in zip(forward, backward)]


def kept_inputs(schedule: str, stages: int, microbatches: int, repeats: int) -> int:
    """Microbatches whose activations one stage holds at most (autodiff keeps every one)."""
    if schedule == "1f1b":
        return min(ring_size(stages), microbatches)
    return microbatches * (repeats if schedule == "circular" else 1)


def title(schedule: str, stages: int, microbatches: int, repeats: int) -> str:
    rounds = f", {repeats} rounds" if schedule == "circular" else ""
    bubble = bubble_fraction(schedule, stages, microbatches, repeats)
    kept = kept_inputs(schedule, stages, microbatches, repeats)
    return (f"{schedule}: {stages} stages, {microbatches} microbatches{rounds}\n"
            f"bubble {bubble:.1%}; a stage holds up to {kept} microbatches' activations")


def as_text(cells) -> str:
    width = max(len(" ".join(c)) for row in cells for c in row) or 1
    return "\n".join(f"stage {s}: " + "|".join(" ".join(c).ljust(width) for c in row) for s, row in enumerate(cells))


def draw(cells, heading: str, path: str, microbatches: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stages, ticks = len(cells), len(cells[0])
    fig, ax = plt.subplots(figsize=(max(6.0, 0.45 * ticks), 0.6 * stages + 1.4))
    colours = {FORWARD: plt.get_cmap("Blues"), BACKWARD: plt.get_cmap("Oranges")}
    for s, row in enumerate(cells):
        for t, slot in enumerate(row):
            for i, work in enumerate(slot):  # two slots in a tick: forward above, backward below
                height = 1.0 / len(slot)
                m = int(work[1:].split(".")[0])
                shade = colours[work[0]](0.35 + 0.5 * m / max(microbatches - 1, 1))
                y = s + i * height
                ax.add_patch(plt.Rectangle((t, y), 1, height, facecolor=shade, edgecolor="white"))
                ax.text(t + 0.5, y + height / 2, work, ha="center", va="center", fontsize=6)
    ax.set_xlim(0, ticks)
    ax.set_xticks(range(0, ticks + 1, max(1, ticks // 20)))
    ax.set_ylim(stages, 0)
    ax.set_yticks(np.arange(stages) + 0.5, [f"stage {s}" for s in range(stages)])
    ax.set_xlabel("tick")
    ax.set_title(heading, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", help="take the schedule from this config (overridden by the flags below)")
    parser.add_argument("--schedule", choices=SCHEDULES)
    parser.add_argument("--stages", type=int)
    parser.add_argument("--microbatches", type=int)
    parser.add_argument("--repeats", type=int)
    parser.add_argument("--out", default="pipeline_schedule.png")
    args, overrides = parser.parse_known_args(argv)
    chosen = {"schedule": "gpipe", "stages": 4, "microbatches": 8, "repeats": 1}
    if args.config:
        config = load_config(args.config, overrides)
        p = config.parallel
        chosen = {"schedule": p.pipeline_schedule, "stages": config.mesh.pipeline,
                  "microbatches": p.pipeline_microbatches, "repeats": p.pipeline_repeats}
    chosen |= {k: v for k, v in vars(args).items() if k in chosen and v is not None}
    if min(chosen["stages"], chosen["microbatches"], chosen["repeats"]) < 1:
        parser.error(f"stages, microbatches and repeats must be at least 1, not {chosen} "
                     f"(mesh.pipeline=-1 depends on the device count: give --stages)")
    cells = schedule_cells(**chosen)
    heading = title(**chosen)
    try:
        draw(cells, heading, args.out, chosen["microbatches"])
        print(f"{heading}\nwrote {args.out}")
    except ImportError:
        print(f"{heading}\n{as_text(cells)}\n(install matplotlib, `pip install -e '.[plot]'` in a clone, for a PNG)")


if __name__ == "__main__":
    main()
