"""train.dpo.reference="precomputed": every pair's reference log-probs, computed in one forward pass
over the pairs before the first step, then carried by the batches (ushard/data/preference.py), so
the step runs one model, not two.

The reference is the run's initial parameters (those of step 0, checkpoint.init_from's or the seed's)
in the compute dtype, as the frozen copy is. A resumed run no longer has them, so a fresh run writes
the table to DIR/dpo_reference.npz beside its checkpoints, with the data order it belongs to; a resume
reads it back (refused with a sentence if it is missing or belongs to other data), which keeps the
resume exact.
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np

from ushard.errors import UserError
from ushard.training import dpo

FILE = "dpo_reference.npz"


def table(trainer, state, step: int, log) -> np.ndarray:
    """[pairs, 2] float32: each pair's summed reference log-probs (chosen, rejected)."""
    batches = trainer.batches
    path = os.path.join(trainer.workdir, FILE) if trainer.workdir else None
    if step > 0:
        return _read(path, batches.order)
    values = compute(trainer, trainer.steps.reference_source(state))
    log(f"precomputed the reference log-probs of {len(values):,} pairs")
    if path and jax.process_index() == 0:
        _write(path, values, batches.order)
    return values


def compute(trainer, source) -> np.ndarray:
    """One forward pass of the reference over every pair, a global batch of train.batch_size pairs at a
    time (the last one filled up with the first pairs). `source`: the initial parameters (taken in the
    compute dtype), or with LoRA the frozen base (the reference is the base without the adapters)."""
    batches, size = trainer.batches, trainer.config.train.batch_size
    reference = source
    if trainer.setup.adapters is None:
        reference = jax.jit(dpo.frozen_copy, static_argnums=1)(source, trainer.setup.model_config.compute_dtype)
    n = len(batches.pairs)
    out = []
    for start in range(0, n, size):
        indices = np.arange(start, start + size) % n
        fields = batches.pairs.fields(indices[trainer.rows])
        out.append(jax.device_get(trainer.steps.pair_reference_logps(reference, trainer._to_device(fields))))
    return np.concatenate(out)[:n].astype(np.float32)


def _write(path: str, values: np.ndarray, order: dict) -> None:
    tmp = path + ".tmp.npz"  # then renamed: a file that is there is whole
    np.savez(tmp, values=values, order=np.array(json.dumps(order, sort_keys=True)))
    os.replace(tmp, path)


def _read(path: str | None, order: dict) -> np.ndarray:
    fresh = "start a new workdir to compute it afresh"
    if path is None or not os.path.isfile(path):
        raise UserError(f"train.dpo.reference='precomputed': the run resumes at a later step but "
                        f"{path or 'the workdir'} holds no {FILE} (the reference log-probs its first start "
                        f"computed); {fresh}.")
    with np.load(path) as saved:
        if str(saved["order"]) != json.dumps(order, sort_keys=True):
            raise UserError(f"{path} holds the reference log-probs of other preference data than this run's; {fresh}.")
        return np.asarray(saved["values"], np.float32)
