"""Grouped matmul: rows sorted by group, each group times its own weight matrix (the routed experts' matmul).

Contract: `grouped_matmul(x, w, group_sizes)` with x [rows, k] sorted by group, w [groups, k, n] and
group_sizes int32 [groups] (group g owns the next group_sizes[g] rows; rows past the last group give
zeros) returns [rows, n] in x's dtype, differentiable in x and w. `IMPLS` lists the implementations;
"xla" (`jax.lax.ragged_dot`, every platform) is the one ushard runs today. JAX's Pallas grouped
matmuls (Mosaic GPU's `ragged_dot_mgpu` on Hopper, megablox's `gmm` on TPUs) fit the same contract
and are measured in ../shared/JAX-NOTES.md; choosing them is the grouped-matmul kernel issue's work.
"""

from __future__ import annotations

import jax

IMPLS = ("xla",)


def grouped_matmul(x, w, group_sizes, impl: str = "xla"):
    """x [rows, k] (sorted by group) @ w[group] for each row's group -> [rows, n] (module docstring)."""
    if impl != "xla":
        raise ValueError(f"grouped matmul implementation {impl!r} is not one of {IMPLS}")
    return jax.lax.ragged_dot(x, w, group_sizes)
