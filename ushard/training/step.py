"""The jitted training and eval steps, with explicit shardings and donated state.

The loss is a *sum* over target tokens and the gradient is divided by the token count of the whole
global batch at the end, so one microbatch or many, one device or many, compute the same number.
The model's auxiliary terms (`aux`, scalars such as an MoE load-balancing loss) are added to the
objective weighted by each microbatch's token count, so they too average over the global batch, and
are reported beside the loss (a term whose gradient is stopped, such as an MoE layer's expert load,
is a figure that is only reported). MoE routing biases are not trained: the optimizer sees a zero
gradient for them, and `ModelDef.balance_experts` moves them by the loads their gradient entries
carry. Gradient accumulation runs microbatches in a `lax.scan`; the
accumulator carries the gradient sharding (replicated below ZeRO-2, sharded over fsdp from ZeRO-2 on).
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding

from ushard.data.packing import FIELDS as BATCH_FIELDS
from ushard.models.definition import ModelDef
from ushard.models.mtp import with_mtp_fields
from ushard.models.stack import REMAT_POLICIES
from ushard.parallel import context
from ushard.parallel.maps import nested_maps
from ushard.parallel.pipeline import StageTail, one_f_one_b
from ushard.sharding import Layout, current_layout, split_rows, use_layout, with_shardings
from ushard.training.loss import cross_entropy_sums
from ushard.training.state import TrainState


@dataclass
class StateShardings:
    params: Any
    grads: Any
    opt_state: Any
    replicated: NamedSharding

    @property
    def state(self) -> TrainState:
        return TrainState(params=self.params, opt_state=self.opt_state, step=self.replicated, skipped=self.replicated)


def state_shardings(model: ModelDef, tx: optax.GradientTransformation, layout: Layout) -> StateShardings:
    replicated = layout.replicated
    return StateShardings(
        params=layout.shardings(model.logical, "params"),
        grads=layout.shardings(model.logical, "grads"),
        opt_state=opt_state_shardings(model, tx, layout),
        replicated=replicated,
    )


def opt_state_shardings(model: ModelDef, tx: optax.GradientTransformation, layout: Layout):
    """Each optimizer-state leaf shaped like a parameter (Adam's moments, Muon's momentum) takes that
    parameter's ZeRO sharding; the rest (step counts, Adafactor's factored row and column
    statistics) are replicated. A leaf belongs to the parameter whose path ends its own path (optax
    nests a tree like the parameters' in every state), whichever optimizer and partition hold it."""
    abstract_opt = jax.eval_shape(tx.init, model.shapes)
    by_path = {tuple(path): (shape, sharding) for (path, shape), sharding in zip(
        jax.tree_util.tree_flatten_with_path(model.shapes)[0],
        jax.tree.leaves(layout.shardings(model.logical, "opt_state")))}
    longest = max(map(len, by_path), default=0)

    def sharding(path, leaf):
        for n in range(min(len(path), longest), 0, -1):
            match = by_path.get(tuple(path[-n:]))
            if match is not None:
                return match[1] if match[0].shape == leaf.shape else layout.replicated
        return layout.replicated

    return jax.tree_util.tree_map_with_path(sharding, abstract_opt)


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


class Steps:
    """The compiled functions of one (model, optimizer, layout). Build one per layout."""

    def __init__(self, model: ModelDef, tx, schedule, layout: Layout, grad_accum: int, skip_nonfinite: bool):
        self.model, self.tx, self.schedule, self.layout = model, tx, schedule, layout
        self.grad_accum = grad_accum
        self.skip_nonfinite = skip_nonfinite
        self.shardings = sh = state_shardings(model, tx, layout)
        self.batch_shardings = dict.fromkeys(BATCH_FIELDS, layout.batch)
        batch_sh = self.batch_shardings
        self.init = jax.jit(self._init, static_argnums=0, out_shardings=sh.state)
        # A state at step 0 around given parameters (checkpoint.init_from): a fresh optimizer.
        self.fresh_state = jax.jit(self._fresh_state, in_shardings=(sh.params,), out_shardings=sh.state,
                                   donate_argnums=0)
        self.train_step = jax.jit(
            self._train_step, in_shardings=(sh.state, batch_sh), out_shardings=(sh.state, sh.replicated),
            donate_argnums=0
        )
        self.loss_and_grads = jax.jit(
            self._loss_and_grads, in_shardings=(sh.params, batch_sh), out_shardings=(sh.replicated, sh.grads)
        )
        self.eval_step = jax.jit(self._eval_sums, in_shardings=(sh.params, batch_sh), out_shardings=sh.replicated)

    # ------------------------------------------------------------------ traced functions

    def _init(self, seed: int) -> TrainState:
        return self._fresh_state(self.model.init(seed))

    def _fresh_state(self, params) -> TrainState:
        zero = jnp.zeros((), jnp.int32)
        return TrainState(params=params, opt_state=self.tx.init(params), step=zero, skipped=zero)

    def abstract_state(self, seed: int = 0) -> TrainState:
        """The state's shapes and dtypes, each carrying its sharding (for restoring checkpoints)."""
        return with_shardings(jax.eval_shape(lambda: self._init(seed)), self.shardings.state)

    def _objective(self, params, batch):
        pipeline, cfg = self.layout.pipeline, self.model.cfg
        if cfg.mtp.depth and pipeline is not None and pipeline.name != "1f1b" and pipeline.microbatches > 1:
            return self._objective_mtp_by_microbatch(params, batch, pipeline.microbatches)
        logits, aux, mtp_logits = self.model.apply_for_training(params, batch)
        return objective_terms(logits, aux, batch, mtp_logits, cfg.mtp.loss_weight)

    def _objective_mtp_by_microbatch(self, params, batch, count: int):
        """`_objective` under GPipe or circular, whose stages return the whole accumulation part: the MTP
        modules, their head and loss then run on the pipeline's microbatches one after another (a
        `lax.scan`, each under the model's remat), not on the whole part at once, where their block's
        activations and expert buffers were a part's (docs/dev-notes.md). 1F1B runs them inside the last
        stage's slots (`StageTail`)."""
        model, cfg = self.model, self.model.cfg
        logits, aux, x = model.apply_before_mtp(params, batch)
        mtp, others = model.split_mtp(params)
        fields = [f for f in batch if f.startswith("mtp_") or f in ("positions", "segment_ids")]
        parts = jax.tree.map(lambda a: split_rows(a, count, self.layout), (x, {f: batch[f] for f in fields}))

        def one(total, part):
            x, mb = part
            states = model.mtp_states(mtp, x, model.mtp_embeddings(others, mb), mb)
            return total + mtp_cross_entropy(model.mtp_head(others, states), mb), None

        if cfg.remat != "none":
            one = jax.checkpoint(one, policy=REMAT_POLICIES[cfg.remat])
        summed, _ = jax.lax.scan(one, jnp.zeros((), jnp.float32), parts)
        return objective_terms(logits, aux, batch, mtp_weight=cfg.mtp.loss_weight, mtp_summed=(summed, cfg.mtp.depth))

    def _one_f_one_b_grads(self, params, batch):
        """What `jax.grad(self._objective, has_aux=True)` returns, by the 1F1B pipeline schedule: the
        model's three parts run per microbatch, the loss on the last stage as each one leaves the layers.
        The MTP modules run on the last stage too, inside its slots after its layers (the schedule's
        `StageTail`), on the embeddings of their tokens looked up outside them."""
        model = self.model
        stack, others = model.split_stack(params)
        # The embedding, final norm and head, gathered for compute once per step rather than once per
        # microbatch (ZeRO-3 would gather them in every tick of the pipeline).
        compute = self.layout.shardings(model.split_stack(model.logical)[1], "compute")
        mtp, others = model.split_mtp(jax.lax.with_sharding_constraint(others, compute))
        tail = StageTail(mtp, inputs=model.mtp_embeddings, run=model.mtp_states) if mtp else None
        sums, d_others, d_stack, d_mtp = one_f_one_b(
            first=lambda others, mb: model.embed(others, mb["inputs"]),
            stage=lambda chunk, x, mb: model.layers(chunk, x, mb["positions"], mb["segment_ids"]),
            last=self._last_stage_terms,
            outer=others, stack=stack, batch=batch, layout=current_layout(), prepare=model.stack_for_compute,
            tail=tail,
        )
        return model.join_stack(d_stack, {**d_others, **(d_mtp or {})}), sums

    def _last_stage_terms(self, others, x, aux, mb, mtp_states):
        """The objective of one microbatch leaving the pipeline's last stage: head, loss, and the MTP
        modules' head and loss on the states they computed there."""
        logits, mtp_logits = self.model.head_for_training(others, x, mtp_states)
        return objective_terms(logits, aux, mb, mtp_logits, self.model.cfg.mtp.loss_weight)

    @contextlib.contextmanager
    def _tracing(self, batch):
        """What a traced step runs under: the layout, context parallelism (a split sequence is reordered
        here, once per step, for its load balance) and, with a pipeline, maps nested in its stages."""
        split = self.layout.size("act_length") > 1
        batch = with_mtp_fields(batch, self.model.cfg.mtp.depth)  # before the reordering: see ushard/models/mtp.py
        with use_layout(dataclasses.replace(self.layout, zigzag=split)), nested_maps(self.layout.pipeline is not None):
            yield context.reordered(batch, self.layout)

    def _eval_sums(self, params, batch):
        with self._tracing(batch) as batch:
            _, (loss, count, _) = self._objective(params, batch)
            return jnp.stack([loss, count])

    def _grad_sums(self, params, batch):
        """(loss sum, token count, weighted aux sums) and summed gradients over the global batch,
        microbatch by microbatch."""
        pipeline = self.layout.pipeline
        if pipeline is not None and pipeline.name == "1f1b":
            grad_fn = self._one_f_one_b_grads
        else:
            grad_fn = jax.grad(self._objective, has_aux=True)
        pin = lambda g: jax.lax.with_sharding_constraint(g, self.shardings.grads)  # noqa: E731
        if self.grad_accum == 1:
            grads, sums = grad_fn(params, batch)
            return sums, pin(grads)

        def one_microbatch(carry, micro):
            sums_acc, grad_acc = carry
            grads, sums = grad_fn(params, micro)
            return (jax.tree.map(jnp.add, sums_acc, sums), pin(jax.tree.map(jnp.add, grad_acc, grads))), None

        micro_batches = jax.tree.map(lambda x: split_rows(x, self.grad_accum, self.layout), batch)
        first = jax.tree.map(lambda x: x[0], micro_batches)
        sums_shape = jax.eval_shape(lambda: grad_fn(params, first)[1])
        zero_sums = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), sums_shape)
        zero_grads = pin(jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params))
        (sums, grads), _ = jax.lax.scan(one_microbatch, (zero_sums, zero_grads), micro_batches)
        return sums, grads

    def _mean_loss_and_grads(self, params, batch):
        """(mean loss, mean aux terms, mean gradients, target tokens counted) over the global batch."""
        with self._tracing(batch) as batch:
            (loss, count, weighted_aux), grads = self._grad_sums(params, batch)
            divisor = jnp.maximum(count, 1.0)
            aux = {name: term / divisor for name, term in weighted_aux.items()}
            return loss / divisor, aux, jax.tree.map(lambda g: g / divisor, grads), count

    def _loss_and_grads(self, params, batch):
        loss, _, grads, _ = self._mean_loss_and_grads(params, batch)
        return loss, grads

    def _train_step(self, state: TrainState, batch):
        loss, aux, grads_and_loads, count = self._mean_loss_and_grads(state.params, batch)
        grads = self.model.without_expert_loads(grads_and_loads)
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = self.tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        params = self.model.balance_experts(params, state.params, grads_and_loads)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        skipped = state.skipped
        if self.skip_nonfinite:  # keep the old state where this step's numbers are not finite
            keep_old = lambda new, old: jnp.where(finite, new, old)  # noqa: E731
            params = jax.tree.map(keep_old, params, state.params)
            opt_state = jax.tree.map(keep_old, opt_state, state.opt_state)
            skipped = skipped + (~finite).astype(jnp.int32)
        metrics = {"loss": loss, "aux": aux, "grad_norm": grad_norm, "lr": self.schedule(state.step),
                   "finite": finite, "skipped": skipped, "loss_tokens": count}
        return TrainState(params=params, opt_state=opt_state, step=state.step + 1, skipped=skipped), metrics
