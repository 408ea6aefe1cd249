"""What the train step minimises, side by side: `lm` (next-token cross-entropy) and `dpo` (direct
preference optimisation, ushard/training/dpo.py). `train.objective` picks one (`objective_for`).

An objective tells the step
- `fields`: the batch's fields (each [rows, seq_len], sharded as the batch);
- `model_batch(batch)`: the rows the model runs on (DPO: each pair's chosen and rejected rows side by
  side, so a pair's two sequences are always in one microbatch and on one device);
- `terms(logits, aux, batch, mtp_logits)`: (what to differentiate, (loss sum, count, weighted sums)), the
  sums adding up over microbatches; the step divides them by the global count at the end (lm: target
  tokens; dpo: pairs), so every microbatching and layout gives the same mean;
- `reference`: where the reference policy comes from (None: the objective needs none).
"""

from __future__ import annotations

import jax.numpy as jnp

from ushard.data.packing import FIELDS
from ushard.errors import UserError
from ushard.training.loss import cross_entropy_sums


def objective_terms(logits, aux, batch, mtp_logits=(), mtp_weight: float = 0.0, mtp_summed=None):
    """(cross-entropy sum + token-weighted aux terms, (cross-entropy sum, token count, weighted aux)).

    With multi-token prediction (`mtp_logits`, one per depth; ushard/models/mtp.py), aux gains
    "mtp_loss": `mtp_weight` times the mean over depths of each depth's cross-entropy summed over its
    counted positions and divided by the main loss's token count (DeepSeek-V3's 1/T), so that it adds
    up over microbatches as the main loss does. `mtp_summed` = (that sum over depths, the depth), where
    the caller summed it (`mtp_cross_entropy`) instead of passing the logits."""
    loss, count = cross_entropy_sums(logits, batch["targets"], batch["loss_mask"])
    if mtp_logits:
        mtp_summed = mtp_cross_entropy(mtp_logits, batch), len(mtp_logits)
    if mtp_summed is not None:
        summed, depth = mtp_summed
        aux = {**aux, "mtp_loss": mtp_weight * summed / depth / jnp.maximum(count, 1.0)}
    weighted_aux = {name: term * count for name, term in aux.items()}
    return loss + sum(weighted_aux.values(), 0.0), (loss, count, weighted_aux)


def mtp_cross_entropy(mtp_logits, batch):
    """Each MTP depth's cross-entropy summed over its counted positions, summed over the depths."""
    return sum(cross_entropy_sums(lg, batch[f"mtp_targets_{k}"], batch[f"mtp_mask_{k}"])[0]
               for k, lg in enumerate(mtp_logits, 1))


class LanguageModelling:
    """Next-token cross-entropy over the counted targets (pre-training, SFT)."""

    name = "lm"
    fields = FIELDS
    reference = None

    def __init__(self, mtp_weight: float = 0.0):
        self.mtp_weight = mtp_weight

    def model_batch(self, batch):
        return batch

    def terms(self, logits, aux, batch, mtp_logits=()):
        return objective_terms(logits, aux, batch, mtp_logits, self.mtp_weight)


def objective_for(train_cfg, model_cfg):
    """The objective `train.objective` names."""
    if train_cfg.objective == "dpo":
        from ushard.training.dpo import DPO

        return DPO(train_cfg.dpo)
    return LanguageModelling(model_cfg.mtp.loss_weight)


def state_kind(train_cfg) -> str:
    """What a checkpoint's state holds besides parameters and optimizer state, in words."""
    if train_cfg.get("objective", "lm") != "dpo":
        return "train.objective='lm'"
    return f"train.objective='dpo' with train.dpo.reference={train_cfg.get('dpo', {}).get('reference', 'frozen')!r}"


def check_same_objective(saved_config: dict, config, where: str) -> None:
    """A checkpoint holds a frozen reference exactly when its run had one: a resume under another
    objective or reference is refused (another workdir can start from its parameters)."""
    saved, now = state_kind(saved_config.get("train") or {}), state_kind(config.train)
    if saved != now:
        raise UserError(f"the checkpoints in {where} were trained with {saved}, not {now}; resume with the "
                        f"checkpoints' settings, or start a new run from these parameters: another workdir and "
                        f"--config.checkpoint.init_from=<this workdir>.")
