"""The jitted training and eval steps, with explicit shardings and donated state.

The loss is a *sum* over target tokens and the gradient is divided by the token count of the whole
global batch at the end, so one microbatch or many, one device or many, compute the same number.
Gradient accumulation runs microbatches in a `lax.scan`; the accumulator carries the gradient
sharding (replicated below ZeRO-2, sharded over fsdp from ZeRO-2 on).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from ushard.sharding import BATCH_AXES, ZeroRules, activation_rules, named_shardings
from ushard.train.loss import cross_entropy_sums
from ushard.train.state import ModelDef


@dataclass
class StateShardings:
    params: Any
    grads: Any
    opt_state: Any
    batch: NamedSharding
    replicated: NamedSharding

    @property
    def state(self):
        return {"params": self.params, "opt_state": self.opt_state, "step": self.replicated, "skipped": self.replicated}


def state_shardings(model: ModelDef, tx: optax.GradientTransformation, zero: ZeroRules, mesh) -> StateShardings:
    replicated = NamedSharding(mesh, PartitionSpec())
    params = named_shardings(model.logical, zero.params, mesh)
    opt_like_params = named_shardings(model.logical, zero.opt_state, mesh)
    abstract_opt = jax.eval_shape(tx.init, model.shapes)
    # Optimizer leaves shaped like a parameter (Adam's moments) take that parameter's ZeRO sharding;
    # the rest (step counts) are replicated scalars.
    opt_state = optax.tree_map_params(
        tx, lambda _, sharding: sharding, abstract_opt, opt_like_params, transform_non_params=lambda _: replicated
    )
    return StateShardings(
        params=params,
        grads=named_shardings(model.logical, zero.grads, mesh),
        opt_state=opt_state,
        batch=NamedSharding(mesh, PartitionSpec(BATCH_AXES)),
        replicated=replicated,
    )


class Steps:
    """The compiled functions of one (model, optimizer, mesh, ZeRO stage). Build one per layout."""

    def __init__(self, model: ModelDef, tx, schedule, zero: ZeroRules, mesh, grad_accum: int, skip_nonfinite: bool):
        self.model, self.tx, self.schedule, self.zero, self.mesh = model, tx, schedule, zero, mesh
        self.grad_accum = grad_accum
        self.skip_nonfinite = skip_nonfinite
        self.shardings = state_shardings(model, tx, zero, mesh)
        sh = self.shardings
        batch_sh = jax.tree.map(lambda _: sh.batch, dict.fromkeys(("inputs", "targets", "segment_ids", "positions", "loss_mask")))
        self.batch_shardings = batch_sh
        self.init = jax.jit(self._init, static_argnums=0, out_shardings=sh.state)
        self.train_step = jax.jit(
            self._train_step, in_shardings=(sh.state, batch_sh), out_shardings=(sh.state, sh.replicated), donate_argnums=0
        )
        self.loss_and_grads = jax.jit(
            self._loss_and_grads, in_shardings=(sh.params, batch_sh), out_shardings=(sh.replicated, sh.grads)
        )
        self.eval_step = jax.jit(self._eval_sums, in_shardings=(sh.params, batch_sh), out_shardings=sh.replicated)

    # ------------------------------------------------------------------ traced functions

    def _init(self, seed: int):
        params = self.model.init(seed)
        zero = jnp.zeros((), jnp.int32)
        return {"params": params, "opt_state": self.tx.init(params), "step": zero, "skipped": zero}

    def abstract_state(self, seed: int = 0):
        """The state's shapes and dtypes, each carrying its sharding (for restoring checkpoints)."""
        shapes = jax.eval_shape(lambda: self._init(seed))
        return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, self.shardings.state)

    def _sums(self, params, batch):
        logits = self.model.apply(params, batch["inputs"], batch["positions"], batch["segment_ids"])
        return cross_entropy_sums(logits, batch["targets"], batch["loss_mask"])

    def _eval_sums(self, params, batch):
        with activation_rules(self.mesh, self.zero):
            return jnp.stack(self._sums(params, batch))

    def _grad_sums(self, params, batch):
        """Summed loss, token count and summed gradients over the global batch, microbatch by microbatch."""
        grad_fn = jax.value_and_grad(self._sums, has_aux=True)
        pin = lambda g: jax.lax.with_sharding_constraint(g, self.shardings.grads)  # noqa: E731
        if self.grad_accum == 1:
            (loss, count), grads = grad_fn(params, batch)
            return loss, count, pin(grads)

        a = self.grad_accum
        micro_sharding = NamedSharding(self.mesh, PartitionSpec(None, BATCH_AXES))

        def split(x):
            # Row i*a + j goes to microbatch j: every device keeps its own rows, nothing moves.
            x = x.reshape(x.shape[0] // a, a, *x.shape[1:]).swapaxes(0, 1)
            return jax.lax.with_sharding_constraint(x, micro_sharding)

        def one_microbatch(carry, micro):
            loss_acc, count_acc, grad_acc = carry
            (loss, count), grads = grad_fn(params, micro)
            return (loss_acc + loss, count_acc + count, pin(jax.tree.map(jnp.add, grad_acc, grads))), None

        zeros = pin(jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params))
        init = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32), zeros)
        (loss, count, grads), _ = jax.lax.scan(one_microbatch, init, jax.tree.map(split, batch))
        return loss, count, grads

    def _loss_and_grads(self, params, batch):
        with activation_rules(self.mesh, self.zero):
            loss, count, grads = self._grad_sums(params, batch)
            count = jnp.maximum(count, 1.0)
            return loss / count, jax.tree.map(lambda g: g / count, grads)

    def _train_step(self, state, batch):
        loss, grads = self._loss_and_grads(state["params"], batch)
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = self.tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        skipped = state["skipped"]
        if self.skip_nonfinite:  # keep the old state where this step's numbers are not finite
            keep_old = lambda new, old: jnp.where(finite, new, old)  # noqa: E731
            params = jax.tree.map(keep_old, params, state["params"])
            opt_state = jax.tree.map(keep_old, opt_state, state["opt_state"])
            skipped = skipped + (~finite).astype(jnp.int32)
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": self.schedule(state["step"]), "finite": finite,
                   "skipped": skipped}
        new_state = {"params": params, "opt_state": opt_state, "step": state["step"] + 1, "skipped": skipped}
        return new_state, metrics
