"""The training state: one typed pytree that the train step takes, returns and checkpoints save."""

from __future__ import annotations

from typing import Any

import flax.struct
import jax


@flax.struct.dataclass
class TrainState:
    params: Any  # what the optimizer trains: the model's parameters, or with LoRA its adapters
    opt_state: Any
    step: jax.Array  # int32 scalar: updates applied so far
    skipped: jax.Array  # int32 scalar: steps whose update was dropped as non-finite
    # With LoRA (ushard/training/lora.py): the frozen base, never saved (a run rebuilds it), and its
    # fingerprint, saved, that a resume checks the rebuilt base against.
    frozen: Any = None
    base_check: Any = None
    # DPO's frozen reference policy without LoRA (train.dpo.reference="frozen"): the initial parameters
    # in the compute dtype, sharded like them, never updated; None otherwise. Checkpoints hold it, so a
    # resume is exact whatever became of the weights the run started from (checkpoint.init_from).
    # (With LoRA the reference is the frozen base without the adapters: no copy.)
    reference: Any = None

    def as_dict(self) -> dict:
        """The checkpoint's layout: a plain dict with one entry per saved field."""
        saved = {"params": self.params, "opt_state": self.opt_state, "step": self.step, "skipped": self.skipped}
        if self.base_check is not None:
            saved["base_check"] = self.base_check
        if self.reference is not None:
            saved["reference"] = self.reference
        return saved

    @classmethod
    def from_dict(cls, d: dict) -> "TrainState":
        return cls(**d)
