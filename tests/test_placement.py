"""Which rows and columns of a global batch each process builds: from the device -> index map, for any
device order (a TPU torus interleaves hosts along the batch axes)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import free_port, small_config, tpu_devices
from ushard.build import build
from ushard.data import local_block
from ushard.training.loop import Trainer

# fsdp=4 x sequence=2 on the devices (counted process by process) [[0, 1], [4, 5], [2, 3], [6, 7]]: the
# processes alternate along the batch axis as on a torus, so process 0 holds rows 0-3 and 8-11 (each
# split along the sequence between two of its devices).
LAYOUT = {"mesh.fsdp": 4, "mesh.sequence": 2, "model.n_layers": 1}
ORDER = [0, 1, 4, 5, 2, 3, 6, 7]


def test_two_interleaved_processes_of_four_devices_match_one_of_eight():
    port, worker = free_port(), Path(__file__).with_name("two_process_worker.py")
    env = {**os.environ, "JAX_NUM_CPU_DEVICES": "4", "JAX_PLATFORMS": "cpu"}
    procs = [subprocess.Popen([sys.executable, str(worker), str(port), str(i), json.dumps(LAYOUT), json.dumps(ORDER)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    records = Trainer(small_config(**LAYOUT)).run(log=lambda *_: None)
    one = [r["loss"] for r in records]
    outputs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(err[-3000:] for _, err in outputs)
    got = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
    assert [g["rows"] for g in got] == [[0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]]
    assert [g["columns"] for g in got] == [32, 32]
    for g in got:
        assert len(g["losses"]) == 3
        np.testing.assert_allclose(g["losses"], one, rtol=1e-5)


def held(index_map, shape) -> np.ndarray:
    """[rows, columns] of `shape`: True where any device of `index_map` holds the element."""
    mask = np.zeros(shape, bool)
    for index in index_map.values():
        mask[index] = True
    return mask


TOPOLOGY_LAYOUTS = [
    ("v5p:2x2x2", 1, {"mesh.fsdp": -1}),
    ("v5p:2x2x2", 1, {"mesh.tensor": 2, "mesh.fsdp": 4}),
    ("v5p:2x2x2", 1, {"mesh.sequence": 2, "mesh.fsdp": 4}),
    ("v5p:4x4x4", 1, {"mesh.data": 4, "mesh.fsdp": 4, "mesh.sequence": 4}),
    ("v5e:4x4", 1, {"mesh.fsdp": -1}),
    ("v6e:4x4", 1, {"mesh.data": 2, "mesh.fsdp": 8}),
    ("v4:2x2x2", 1, {"mesh.fsdp": -1}),
    ("v5p:2x2x2", 2, {"mesh.data": 2, "mesh.dcn.data": 2, "mesh.fsdp": 8}),
    ("v5p:2x2x2", 2, {"mesh.fsdp": 16, "mesh.dcn.fsdp": 2}),
]


@pytest.mark.parametrize("topology, slices, layout", TOPOLOGY_LAYOUTS)
def test_each_process_builds_the_block_its_devices_hold(topology, slices, layout):
    """Process 0 (whose devices are the compile-only client's addressable ones) against JAX's own
    `addressable_devices_indices_map`; every process against its devices' part of the global map:
    the rows x columns it builds are exactly the elements its devices hold."""
    devices = tpu_devices(topology, slices)
    shape = (16, 64)
    config = small_config(**{"train.batch_size": 16, "train.seq_len": 64, **layout})
    sharding = build(config, devices).layout.batch
    rows, columns = local_block(sharding, shape)
    addressed = held(sharding.addressable_devices_indices_map(shape), shape)
    np.testing.assert_array_equal(rows, np.flatnonzero(addressed.any(axis=1)))
    np.testing.assert_array_equal(columns, np.flatnonzero(addressed.any(axis=0)))
    covered = np.zeros(shape, int)
    for process in sorted({d.process_index for d in devices}):
        rows, columns = local_block(sharding, shape, process)
        own = held({d: i for d, i in sharding.devices_indices_map(shape).items() if d.process_index == process}, shape)
        block = np.zeros(shape, bool)
        block[np.ix_(rows, columns)] = True
        np.testing.assert_array_equal(block, own)
        covered += block
    assert covered.min() >= 1  # every element of the batch is built somewhere


def test_a_torus_interleaves_the_hosts_along_the_batch():
    """Why rows come from the device map: on v5p:2x2x2 with fsdp=8, host 0's chips hold every other
    pair of rows (a contiguous range would be 14 rows, the old code's)."""
    config = small_config(**{"train.batch_size": 16, "mesh.fsdp": -1})
    sharding = build(config, tpu_devices("v5p:2x2x2")).layout.batch
    rows, columns = local_block(sharding, (16, 32))
    assert rows.tolist() == [0, 1, 4, 5, 8, 9, 12, 13]
    assert columns.tolist() == list(range(32))
