"""One process of a two-process CPU run (tests/test_placement.py): trains a small layout whose mesh
takes the devices in a given order, and prints the losses and the rows it built as one JSON line.

    python tests/two_process_worker.py PORT PROCESS_ID '{"mesh.fsdp": 8}' '[0, 4, 1, 5, 2, 6, 3, 7]'

Device i of the order is the i-th device counted process by process (process 0's first), so an order
like [0, 4, 1, 5, ...] alternates the processes along the mesh, as a TPU torus does.
"""

import json
import sys

import jax

port, process_id, overrides, order = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]), json.loads(sys.argv[4])
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id)

from conftest import small_config  # noqa: E402  (after initialize, which must come before any device use)
from ushard.training.loop import Trainer  # noqa: E402

by_process = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
trainer = Trainer(small_config(**overrides), devices=[by_process[i] for i in order])
records = trainer.run(log=lambda *_: None)
losses = [r["loss"] for r in records]
print(json.dumps({"losses": losses, "rows": trainer.rows.tolist(), "columns": len(trainer.columns)}))
