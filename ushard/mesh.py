"""Devices -> a named `jax.sharding.Mesh`, ordered by the physical topology.

Axis order is slowest link first (see DESIGN.md), so the innermost axes (`tensor`, `sequence`) land on
the closest devices. `mesh.dcn.<axis>` says how many slices / hosts an axis spans; those axes are laid
across the data-centre network and the rest stay inside a slice / host.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from ushard.config import MESH_AXES
from ushard.errors import UserError


def device_array(shape: dict[str, int], dcn: dict[str, int], devices=None) -> np.ndarray:
    """Devices arranged in `MESH_AXES` order, following TPU torus coordinates or GPU hosts."""
    devices = list(jax.devices() if devices is None else devices)
    ici = tuple(shape[a] // dcn[a] for a in MESH_AXES)
    dcn_shape = tuple(dcn[a] for a in MESH_AXES)
    if devices[0].platform == "cpu":
        return np.array(devices).reshape(tuple(shape[a] for a in MESH_AXES))
    # TPU slices carry `slice_index`; GPUs and other multi-process setups are grouped by process.
    by_process = not hasattr(devices[0], "slice_index")
    granules = len({d.process_index if by_process else d.slice_index for d in devices})
    spans = int(np.prod(dcn_shape))
    if spans != granules and (spans > 1 or not by_process):
        what = "hosts" if by_process else "TPU slices"
        raise UserError(f"the mesh.dcn.* sizes multiply to {spans} but the devices are on {granules} {what}; make "
                        f"them multiply to {granules} (e.g. mesh.dcn.data={granules} with mesh.data a multiple of it).")
    if spans > 1:
        return mesh_utils.create_hybrid_device_mesh(
            ici, dcn_shape, devices=devices, process_is_granule=by_process, allow_split_physical_axes=True
        )
    return mesh_utils.create_device_mesh(ici, devices=devices, allow_split_physical_axes=True)


def build_mesh(shape: dict[str, int], dcn: dict[str, int] | None = None, devices=None) -> Mesh:
    """A mesh with every axis of MESH_AXES (size 1 where unused), compiler-propagated (Auto) sharding."""
    dcn = dcn or {a: 1 for a in MESH_AXES}
    return Mesh(device_array(shape, dcn, devices), MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))
