"""XLA flags derived from the config. XLA reads them once, when JAX starts its backend, so entry points
(the CLI, tools/) apply them before the first device is touched.
"""

from __future__ import annotations

import os

COMBINED_COLLECTIVES = ("all_gather", "reduce_scatter")


def flags_for(config) -> list[str]:
    """`parallel.collective_combine_mib`: XLA merges all-gathers (and reduce-scatters) of neighbouring
    weights up to this size into one collective. A whole layer per collective lets the scheduler start
    it a layer ahead instead of just before its first use (docs/benchmarks.md). 0 keeps XLA's default."""
    mib = config.parallel.collective_combine_mib
    if not mib:
        return []
    return [f"--xla_gpu_{kind}_combine_threshold_bytes={mib * 2**20}" for kind in COMBINED_COLLECTIVES]


def apply(config) -> None:
    """Puts the config's flags in front of XLA_FLAGS: a flag the user set there comes later and wins."""
    current = os.environ.get("XLA_FLAGS", "")
    flags = [f for f in flags_for(config) if f not in current.split()]  # applying twice adds nothing
    if flags:
        os.environ["XLA_FLAGS"] = " ".join(flags + [current]).strip()
