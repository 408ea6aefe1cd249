"""Global batches onto devices: each process builds only the part of a batch its devices hold.

Which rows (and, for a sequence-split batch, which columns) a process holds follows from the sharding's
device -> index map, never from an assumed device order: on a TPU torus, and on any mesh whose device
order is not process-major, one process's devices hold rows that are not contiguous (v5p:2x2x2 with
fsdp=8 gives process 0 rows 0-1, 4-5, 8-9 and 12-13 of 16).
"""

from __future__ import annotations

import jax
import numpy as np


def local_block(sharding, global_shape, process_index: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(rows, columns) of a [batch, length] global array that one process's devices hold (default: this
    process's), each ascending: exactly the local data `jax.make_array_from_process_local_data` expects,
    which is, per dimension, the distinct shard blocks of the process's devices in index order."""
    process = jax.process_index() if process_index is None else process_index
    indices = [index for device, index in sharding.devices_indices_map(tuple(global_shape)).items()
               if device.process_index == process]
    return tuple(_held(size, [index[dim] for index in indices]) for dim, size in enumerate(global_shape[:2]))


def _held(size: int, slices) -> np.ndarray:
    """The indices of one dimension of length `size` that any of `slices` covers, ascending."""
    held = np.zeros(size, bool)
    for s in slices:
        held[s] = True
    return np.flatnonzero(held)


def place_batch(host_rows: dict[str, np.ndarray], sharding, global_shape, columns=slice(None)) -> dict:
    """Global arrays from this process's rows (all columns); `columns` picks the part its devices hold."""
    return {k: jax.make_array_from_process_local_data(sharding, v[:, columns], global_shape)
            for k, v in host_rows.items()}
