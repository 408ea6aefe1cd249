"""The training state: one typed pytree that the train step takes, returns and checkpoints save."""

from __future__ import annotations

from typing import Any

import flax.struct
import jax


@flax.struct.dataclass
class TrainState:
    params: Any
    opt_state: Any
    step: jax.Array  # int32 scalar: updates applied so far
    skipped: jax.Array  # int32 scalar: steps whose update was dropped as non-finite
    # DPO's frozen reference policy (train.dpo.reference="frozen"): the initial parameters in the compute
    # dtype, sharded like them, never updated; None otherwise. Checkpoints hold it, so a resume is exact
    # whatever became of the weights the run started from (checkpoint.init_from).
    reference: Any = None

    def as_dict(self) -> dict:
        """The checkpoint's layout: a plain dict with one entry per field (the reference where there is one)."""
        d = {"params": self.params, "opt_state": self.opt_state, "step": self.step, "skipped": self.skipped}
        return d if self.reference is None else {**d, "reference": self.reference}

    @classmethod
    def from_dict(cls, d: dict) -> "TrainState":
        return cls(**d)
