"""Direct preference optimisation (Rafailov et al. 2023) on pairs of a chosen and a rejected
completion (data.source="preference", ushard/data/preference.py).

Per pair, with π and ref the summed log-probabilities of a sequence's completion tokens under the
policy and the reference policy, and Δ = (π_chosen - ref_chosen) - (π_rejected - ref_rejected):
- `sigmoid` (train.dpo.loss_type, the default): -(1 - ε) log σ(βΔ) - ε log σ(-βΔ), ε =
  train.dpo.label_smoothing (0: DPO; > 0: conservative DPO, cDPO, as TRL's `sigmoid` loss computed it
  with label smoothing before TRL 1.x dropped the term from it);
- `robust`: (-(1 - ε) log σ(βΔ) + ε log σ(-βΔ)) / (1 - 2ε), TRL's `robust` (rDPO);
- `ipo`: (Δ' - 1/(2β))², Δ' the same difference with each log-ratio divided by its completion's
  token count (TRL's `ipo`, length-normalised).
The step's loss is the mean over the pairs of the global batch: each microbatch adds its pairs'
losses, the step divides by the global pair count (so accumulation and every layout agree, as long as
a pair's two rows are in one microbatch: the batch holds them at the same row of two sets of fields).

Reported beside the loss (as metrics named `dpo/...`, means over the pairs): `rewards_chosen` and
`rewards_rejected` (β(π - ref)), `margin` (their difference) and `accuracy` (the share of pairs whose
chosen reward is above the rejected one).

The reference log-probs come in the batch (`ref_logps`, `rejected_ref_logps`: float32 [pairs,
seq_len] whose row sums are the values): computed by the step from the reference parameters
(a frozen copy the train state holds, or with LoRA the frozen base without the adapters:
`Steps._inputs`), or once before training
(train.dpo.reference="precomputed", the batches carry them and the step needs no second model).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ushard.data.packing import FIELDS
from ushard.data.preference import REFERENCE_FIELDS, REJECTED, batch_fields
from ushard.training.loss import token_cross_entropy

METRICS = ("rewards_chosen", "rewards_rejected", "margin", "accuracy")  # logged as dpo/<name>


def frozen_copy(params, compute_dtype):
    """The reference: the parameters in the compute dtype, never trained (no gradient, no optimizer)."""
    dtype = jnp.dtype(compute_dtype)
    return jax.tree.map(lambda p: p.astype(dtype) if jnp.issubdtype(p.dtype, jnp.floating) else p,
                        jax.lax.stop_gradient(params))


def pair_rows(batch) -> dict:
    """The rows the model runs on: [2 * pairs, seq_len] per field, row 2k pair k's chosen and row 2k + 1
    its rejected sequence. Interleaved (not one half after the other), so that a device's rows stay its
    own: its pairs' chosen and rejected rows are both among them."""
    return {f: jnp.stack([batch[f], batch[REJECTED + f]], axis=1).reshape(-1, *batch[f].shape[1:]) for f in FIELDS}


def token_logps(logits, batch):
    """Log-probabilities of the counted targets (0 elsewhere), float32 [rows, length], of `pair_rows`."""
    return -token_cross_entropy(logits, batch["targets"]) * batch["loss_mask"].astype(jnp.float32)


def unpaired(x):
    """(chosen, rejected) halves of a `pair_rows`-ordered array."""
    x = x.reshape(-1, 2, *x.shape[1:])
    return x[:, 0], x[:, 1]


def reference_fields(logits, batch) -> dict:
    """The batch's reference fields from the reference policy's logits of `pair_rows(batch)`."""
    chosen, rejected = unpaired(jax.lax.stop_gradient(token_logps(logits, pair_rows(batch))))
    return dict(zip(REFERENCE_FIELDS, (chosen, rejected)))


def pair_losses(policy, reference, counts, cfg):
    """Per-pair losses from (chosen, rejected) summed log-probs of the policy and the reference, and
    the completions' token counts (see the module docstring)."""
    (pc, pr), (rc, rr), (nc, nr) = policy, reference, counts
    beta, eps = cfg.beta, cfg.label_smoothing
    chosen, rejected = pc - rc, pr - rr
    if cfg.loss_type == "ipo":
        delta = chosen / jnp.maximum(nc, 1.0) - rejected / jnp.maximum(nr, 1.0)
        return (delta - 1 / (2 * beta)) ** 2
    delta = chosen - rejected
    if cfg.loss_type == "robust":
        return (-(1 - eps) * jax.nn.log_sigmoid(beta * delta) + eps * jax.nn.log_sigmoid(-beta * delta)) / (1 - 2 * eps)
    return -(1 - eps) * jax.nn.log_sigmoid(beta * delta) - eps * jax.nn.log_sigmoid(-beta * delta)


class DPO:
    """The DPO objective (ushard/training/objectives.py's interface)."""

    name = "dpo"

    def __init__(self, cfg):
        self.cfg = cfg
        self.reference = cfg.reference
        self.fields = batch_fields(cfg.reference == "precomputed")
        self.pair_fields = batch_fields(False)

    def model_batch(self, batch):
        return pair_rows(batch)

    def terms(self, logits, aux, batch, mtp_logits=()):
        """(pair losses summed + pair-weighted aux terms, (pair losses summed, pairs, weighted sums of aux
        and the `dpo/` metrics))."""
        rows = pair_rows(batch)
        policy = unpaired(jnp.sum(token_logps(logits, rows), axis=-1))
        reference = tuple(jnp.sum(batch[f], axis=-1) for f in REFERENCE_FIELDS)
        counts = unpaired(jnp.sum(rows["loss_mask"].astype(jnp.float32), axis=-1))
        losses = pair_losses(policy, reference, counts, self.cfg)
        loss, pairs = jnp.sum(losses), jnp.float32(losses.shape[0])
        rewards = [jax.lax.stop_gradient(self.cfg.beta * (p - r)) for p, r in zip(policy, reference)]
        metrics = {"dpo/rewards_chosen": jnp.sum(rewards[0]), "dpo/rewards_rejected": jnp.sum(rewards[1]),
                   "dpo/margin": jnp.sum(rewards[0] - rewards[1]),
                   "dpo/accuracy": jnp.sum((rewards[0] > rewards[1]).astype(jnp.float32))}
        weighted_aux = {name: term * pairs for name, term in aux.items()}
        return loss + sum(weighted_aux.values(), 0.0), (loss, pairs, {**weighted_aux, **metrics})
