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

    def as_dict(self) -> dict:
        """The checkpoint's layout: a plain dict with one entry per field."""
        return {"params": self.params, "opt_state": self.opt_state, "step": self.step, "skipped": self.skipped}

    @classmethod
    def from_dict(cls, d: dict) -> "TrainState":
        return cls(**d)
