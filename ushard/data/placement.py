"""Global batches onto devices: each process builds only the part of a batch its devices hold."""

from __future__ import annotations

import jax
import numpy as np


def local_block(sharding, global_shape) -> tuple[range, slice]:
    """(rows, columns) of a [batch, length] global array that this process's devices hold between them."""
    indices = sharding.addressable_devices_indices_map(global_shape).values()
    bounds = []
    for dim, size in enumerate(global_shape[:2]):
        slices = [idx[dim] for idx in indices]
        starts = [s.start or 0 for s in slices]
        stops = [size if s.stop is None else s.stop for s in slices]
        bounds.append((min(starts), max(stops)))
    (row_start, row_stop), (col_start, col_stop) = bounds
    return range(row_start, row_stop), slice(col_start, col_stop)


def place_batch(host_rows: dict[str, np.ndarray], sharding, global_shape, columns: slice = slice(None)) -> dict:
    """Global arrays from this process's rows (all columns); `columns` picks the part its devices hold."""
    return {k: jax.make_array_from_process_local_data(sharding, v[:, columns], global_shape)
            for k, v in host_rows.items()}
