"""The jitted training and eval steps, with explicit shardings and donated state.

The loss is a *sum* over target tokens (DPO: over pairs; the objective, ushard/training/objectives.py,
says which) and the gradient is divided by the count of the whole global batch at the end, so one
microbatch or many, one device or many, compute the same number.
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

from ushard.models.definition import ModelDef
from ushard.models.mtp import with_mtp_fields
from ushard.models.stack import REMAT_POLICIES
from ushard.parallel import context
from ushard.parallel.maps import nested_maps
from ushard.parallel.pipeline import StageTail, one_f_one_b
from ushard.sharding import Layout, current_layout, split_rows, use_layout, with_shardings
from ushard.training import dpo
from ushard.training.lora import Adapters, fingerprint
from ushard.training.objectives import LanguageModelling, mtp_cross_entropy, objective_terms
from ushard.training.state import TrainState


@dataclass
class StateShardings:
    params: Any  # the trained parameters' (the model's, or with LoRA its adapters')
    grads: Any
    opt_state: Any
    replicated: NamedSharding
    model_params: Any  # the model's parameters' (what `fresh_state` takes)
    frozen: Any = None  # with LoRA, the frozen base's
    reference: Any = None  # a frozen reference policy's (DPO without LoRA): the model's parameters'

    @property
    def state(self) -> TrainState:
        lora = self.frozen is not None
        return TrainState(params=self.params, opt_state=self.opt_state, step=self.replicated, skipped=self.replicated,
                          frozen=self.frozen, base_check=self.replicated if lora else None, reference=self.reference)


def state_shardings(model: ModelDef, tx: optax.GradientTransformation, layout: Layout,
                    adapters: Adapters | None = None, frozen_reference: bool = False) -> StateShardings:
    logical, shapes = (adapters.logical, adapters.shapes) if adapters else (model.logical, model.shapes)
    model_params = layout.shardings(model.logical, "params")
    frozen = layout.shardings(adapters.frozen_logical(), "params") if adapters else None
    return StateShardings(
        params=layout.shardings(logical, "params"),
        grads=layout.shardings(logical, "grads"),
        opt_state=opt_state_shardings(shapes, logical, tx, layout),
        replicated=layout.replicated,
        model_params=model_params,
        frozen=frozen,
        reference=model_params if frozen_reference else None,
    )


def opt_state_shardings(shapes, logical, tx: optax.GradientTransformation, layout: Layout):
    """Each optimizer-state leaf shaped like a parameter (Adam's moments, Muon's momentum) takes that
    parameter's ZeRO sharding; the rest (step counts, Adafactor's factored row and column
    statistics) are replicated. A leaf belongs to the parameter whose path ends its own path (optax
    nests a tree like the parameters' in every state), whichever optimizer and partition hold it."""
    abstract_opt = jax.eval_shape(tx.init, shapes)
    by_path = {tuple(path): (shape, sharding) for (path, shape), sharding in zip(
        jax.tree_util.tree_flatten_with_path(shapes)[0],
        jax.tree.leaves(layout.shardings(logical, "opt_state")))}
    longest = max(map(len, by_path), default=0)

    def sharding(path, leaf):
        for n in range(min(len(path), longest), 0, -1):
            match = by_path.get(tuple(path[-n:]))
            if match is not None:
                return match[1] if match[0].shape == leaf.shape else layout.replicated
        return layout.replicated

    return jax.tree_util.tree_map_with_path(sharding, abstract_opt)


class Steps:
    """The compiled functions of one (model, optimizer, layout). Build one per layout.

    With LoRA (`adapters`), `params` everywhere below are the adapters. `loss_and_grads` and
    `eval_step` take what the state holds besides them as a third argument (`extra_inputs`): with
    LoRA the frozen base (`TrainState.frozen`, DPO's reference too: the base without the adapters),
    or DPO's frozen reference copy (`TrainState.reference`)."""

    def __init__(self, model: ModelDef, tx, schedule, layout: Layout, grad_accum: int, skip_nonfinite: bool,
                 adapters: Adapters | None = None, objective=None):
        self.model, self.tx, self.schedule, self.layout = model, tx, schedule, layout
        self.adapters = adapters
        self.grad_accum = grad_accum
        self.skip_nonfinite = skip_nonfinite
        # What the step minimises (ushard/training/objectives.py). A frozen reference policy is the
        # base without the adapters under LoRA, else a copy the state holds.
        self.objective = objective or LanguageModelling(model.cfg.mtp.loss_weight)
        self.frozen_reference = self.objective.reference == "frozen" and adapters is None
        self.shardings = sh = state_shardings(model, tx, layout, adapters, self.frozen_reference)
        self.batch_shardings = dict.fromkeys(self.objective.fields, layout.batch)
        batch_sh = self.batch_shardings
        frozen_sh = (sh.frozen,) if adapters else (sh.reference,) if self.frozen_reference else ()
        self.init = jax.jit(self._init, static_argnums=0, out_shardings=sh.state)
        # A state at step 0 around given parameters (checkpoint.init_from): a fresh optimizer.
        self.fresh_state = jax.jit(self._fresh_state, in_shardings=(sh.model_params,), out_shardings=sh.state,
                                   donate_argnums=0)
        self.train_step = jax.jit(
            self._train_step, in_shardings=(sh.state, batch_sh), out_shardings=(sh.state, sh.replicated),
            donate_argnums=0
        )
        self.loss_and_grads = jax.jit(
            self._loss_and_grads, in_shardings=(sh.params, batch_sh, *frozen_sh),
            out_shardings=(sh.replicated, sh.grads)
        )
        self.eval_step = jax.jit(self._eval_sums, in_shardings=(sh.params, batch_sh, *frozen_sh),
                                 out_shardings=sh.replicated)
        # The model's parameters from a seed, and LoRA's frozen base of given ones (a resume rebuilds it).
        self.init_model = jax.jit(model.init, static_argnums=0, out_shardings=sh.model_params)
        if adapters:
            self.frozen_base = jax.jit(adapters.frozen, in_shardings=(sh.model_params,), out_shardings=sh.frozen)
        if self.objective.name == "dpo":  # the pass before training of train.dpo.reference="precomputed"
            pairs = dict.fromkeys(self.objective.pair_fields, layout.batch)
            source = sh.frozen if adapters else sh.params
            self.pair_reference_logps = jax.jit(self._pair_reference_logps, in_shardings=(source, pairs),
                                                out_shardings=sh.replicated)

    def extra_inputs(self, state: TrainState) -> tuple:
        """What `loss_and_grads` and `eval_step` take after (params, batch) for this state."""
        if self.adapters is not None:
            return (state.frozen,)
        return (state.reference,) if self.frozen_reference else ()

    def reference_source(self, state: TrainState):
        """What `pair_reference_logps` takes of a state at step 0: the frozen base (LoRA) or the params."""
        return state.frozen if self.adapters is not None else state.params

    def _inputs(self, extra=None):
        """(LoRA's frozen base, the reference policy's parameters) from `extra_inputs`'s argument."""
        if self.adapters is not None:
            reference = self.adapters.base_params(extra) if self.objective.reference == "frozen" else None
            return extra, reference
        return None, extra

    # ------------------------------------------------------------------ traced functions

    def _init(self, seed: int) -> TrainState:
        return self._fresh_state(self.model.init(seed), seed)

    def _fresh_state(self, params, seed: int = 0) -> TrainState:
        """A state at step 0 around the model's parameters `params`: with LoRA, frozen, with fresh adapters."""
        zero = jnp.zeros((), jnp.int32)
        if self.adapters is None:
            reference = dpo.frozen_copy(params, self.model.cfg.compute_dtype) if self.frozen_reference else None
            return TrainState(params=params, opt_state=self.tx.init(params), step=zero, skipped=zero,
                              reference=reference)
        frozen = self.adapters.frozen(params)
        adapters = self.adapters.init(seed + 1)
        return TrainState(params=adapters, opt_state=self.tx.init(adapters), step=zero, skipped=zero, frozen=frozen,
                          base_check=fingerprint(frozen))

    def model_params(self, params, frozen=None, step=None):
        """The parameters the model computes with: `params`, or with LoRA the frozen base with the
        adapters `params` attached (dropout masks drawn from `step`, none without one)."""
        return params if self.adapters is None else self.adapters.attach(frozen, params, step)

    def abstract_state(self, seed: int = 0) -> TrainState:
        """The state's shapes and dtypes, each carrying its sharding (for restoring checkpoints)."""
        return with_shardings(jax.eval_shape(lambda: self._init(seed)), self.shardings.state)

    def _objective(self, params, batch, frozen=None, step=None):
        pipeline, cfg = self.layout.pipeline, self.model.cfg
        model_params = self.model_params(params, frozen, step)
        if (cfg.mtp.depth and self.objective.name == "lm" and pipeline is not None and pipeline.name != "1f1b"
                and pipeline.microbatches > 1):
            return self._objective_mtp_by_microbatch(model_params, batch, pipeline.microbatches)
        logits, aux, mtp_logits = self.model.apply_for_training(model_params, self.objective.model_batch(batch))
        return self.objective.terms(logits, aux, batch, mtp_logits)

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

    def _with_reference(self, reference, batch):
        """The batch with the reference policy's log-probs (DPO, computed from its parameters)."""
        if reference is None:
            return batch
        logits = self.model.apply_for_training(reference, self.objective.model_batch(batch))[0]
        return {**batch, **dpo.reference_fields(jax.lax.stop_gradient(logits), batch)}

    def _pair_reference_logps(self, source, batch):
        """[pairs, 2]: each pair's summed reference log-probs (chosen, rejected), from the parameters
        (or with LoRA the frozen base) `source`."""
        reference = self.adapters.base_params(source) if self.adapters is not None else source
        with self._tracing(batch) as batch:
            fields = self._with_reference(reference, batch)
            return jnp.stack([jnp.sum(fields[f], axis=-1) for f in dpo.REFERENCE_FIELDS], axis=-1)

    def _one_f_one_b_grads(self, params, batch, frozen=None, step=None):
        """What `jax.grad(self._objective, has_aux=True)` returns, by the 1F1B pipeline schedule: the
        model's three parts run per microbatch, the loss on the last stage as each one leaves the layers.
        The MTP modules run on the last stage too, inside its slots after its layers (the schedule's
        `StageTail`), on the embeddings of their tokens looked up outside them."""
        model = self.model
        stack, others = model.split_stack(self.model_params(params, frozen, step))
        # The embedding, final norm and head, gathered for compute once per step rather than once per
        # microbatch (ZeRO-3 would gather them in every tick of the pipeline).
        compute = self.layout.shardings(model.split_stack(model.logical)[1], "compute")
        mtp, others = model.split_mtp(jax.lax.with_sharding_constraint(others, compute))
        tail = StageTail(mtp, inputs=model.mtp_embeddings, run=model.mtp_states) if mtp else None
        rows = self.objective.model_batch  # the rows the model runs on, from each microbatch's
        sums, d_others, d_stack, d_mtp = one_f_one_b(
            first=lambda others, mb: model.embed(others, rows(mb)["inputs"]),
            stage=lambda chunk, x, mb: model.layers(chunk, x, rows(mb)["positions"], rows(mb)["segment_ids"]),
            last=self._last_stage_terms,
            outer=others, stack=stack, batch=batch, layout=current_layout(), prepare=model.stack_for_compute,
            tail=tail,
        )
        grads = model.join_stack(d_stack, {**d_others, **(d_mtp or {})})
        return (grads if self.adapters is None else self.adapters.grads_of(grads)), sums

    def _last_stage_terms(self, others, x, aux, mb, mtp_states):
        """The objective of one microbatch leaving the pipeline's last stage: head, loss, and the MTP
        modules' head and loss on the states they computed there."""
        logits, mtp_logits = self.model.head_for_training(others, x, mtp_states)
        return self.objective.terms(logits, aux, mb, mtp_logits)

    @contextlib.contextmanager
    def _tracing(self, batch):
        """What a traced step runs under: the layout, context parallelism (a split sequence is reordered
        here, once per step, for its load balance) and, with a pipeline, maps nested in its stages."""
        split = self.layout.size("act_length") > 1
        batch = with_mtp_fields(batch, self.model.cfg.mtp.depth)  # before the reordering: see ushard/models/mtp.py
        with use_layout(dataclasses.replace(self.layout, zigzag=split)), nested_maps(self.layout.pipeline is not None):
            yield context.reordered(batch, self.layout)

    def _eval_sums(self, params, batch, extra=None):
        frozen, reference = self._inputs(extra)
        with self._tracing(batch) as batch:
            _, (loss, count, _) = self._objective(params, self._with_reference(reference, batch), frozen)
            return jnp.stack([loss, count])

    def _grad_sums(self, params, batch, frozen=None, step=None, reference=None):
        """(loss sum, count, weighted aux sums) and summed gradients over the global batch, microbatch by
        microbatch (with a reference policy's parameters, its log-probs computed microbatch by microbatch)."""
        pipeline = self.layout.pipeline
        if pipeline is not None and pipeline.name == "1f1b":
            policy_grads = self._one_f_one_b_grads
        else:
            policy_grads = jax.grad(self._objective, has_aux=True)

        def grad_fn(params, micro, frozen, step):
            return policy_grads(params, self._with_reference(reference, micro), frozen, step)

        pin = lambda g: jax.lax.with_sharding_constraint(g, self.shardings.grads)  # noqa: E731
        if self.grad_accum == 1:
            grads, sums = grad_fn(params, batch, frozen, step)
            return sums, pin(grads)

        def one_microbatch(carry, micro):
            sums_acc, grad_acc = carry
            grads, sums = grad_fn(params, micro, frozen, step)
            return (jax.tree.map(jnp.add, sums_acc, sums), pin(jax.tree.map(jnp.add, grad_acc, grads))), None

        micro_batches = jax.tree.map(lambda x: split_rows(x, self.grad_accum, self.layout), batch)
        first = jax.tree.map(lambda x: x[0], micro_batches)
        sums_shape = jax.eval_shape(lambda: grad_fn(params, first, frozen, step)[1])
        zero_sums = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), sums_shape)
        zero_grads = pin(jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params))
        (sums, grads), _ = jax.lax.scan(one_microbatch, (zero_sums, zero_grads), micro_batches)
        return sums, grads

    def _mean_loss_and_grads(self, params, batch, frozen=None, step=None, reference=None):
        """(mean loss, mean aux terms, mean gradients, count: target tokens, or pairs) over the global batch."""
        with self._tracing(batch) as batch:
            (loss, count, weighted_aux), grads = self._grad_sums(params, batch, frozen, step, reference)
            divisor = jnp.maximum(count, 1.0)
            aux = {name: term / divisor for name, term in weighted_aux.items()}
            return loss / divisor, aux, jax.tree.map(lambda g: g / divisor, grads), count

    def _loss_and_grads(self, params, batch, extra=None):
        frozen, reference = self._inputs(extra)
        loss, _, grads, _ = self._mean_loss_and_grads(params, batch, frozen, reference=reference)
        return loss, grads

    def _train_step(self, state: TrainState, batch):
        frozen, reference = self._inputs(*self.extra_inputs(state))
        loss, aux, grads_and_loads, count = self._mean_loss_and_grads(state.params, batch, frozen, state.step,
                                                                      reference)
        grads = grads_and_loads if self.adapters else self.model.without_expert_loads(grads_and_loads)
        grad_norm = optax.tree.norm(grads)
        # The update, the balancing and the skip: tools/profile_step.py --scope optimizer sums their kernels.
        with jax.named_scope("optimizer"):
            updates, opt_state = self.tx.update(grads, state.opt_state, state.params)
            params = optax.apply_updates(state.params, updates)
            if self.adapters is None:  # with LoRA the routing biases are frozen with the rest
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
        return state.replace(params=params, opt_state=opt_state, step=state.step + 1, skipped=skipped), metrics
