"""Pipeline parallelism in one SPMD program: GPipe, circular and 1F1B schedules over the stage axis.

The stacked layers ([layers, ...] weights) are split into contiguous stages by sharding their `layers`
axis over the mesh axis the layout maps it to (`mesh.pipeline`): parameters keep their shapes, so
checkpoints do not depend on the layout. A batch is cut into microbatches (rows i*M + j form microbatch
j, so no row leaves its device), and a `lax.scan` over clock ticks runs, on every stage at once, the
work a static schedule assigns it. The schedule is a numpy table built at trace time (tick x stage:
which microbatch, which round, forward or backward); each device reads its own column through
`axis_index`. Activations move to the next stage with one `ppermute` per tick, gradients to the
previous one with another; both sit outside any `lax.cond` (a collective inside a branch whose
predicate differs between devices hangs), while the work of a slot runs under `lax.cond` so that idle
slots cost nothing.

- GPipe and circular (`run_stages`) run forward only: they are the pipelined implementation of the
  layer stack (`ushard.models.stack.run_layers`), with embedding, final norm, head and loss outside.
  Their backward pass is autodiff of the tick loop, which keeps every tick's residuals: activation
  memory grows with the number of microbatches. Under remat each tick's slot runs under a remat
  boundary of its own (`tick_policy`), without which the tick's chunk of weights is one of them.
  Circular runs `repeats` rounds: stage s holds chunks
  s, s + S, s + 2S, ... of the layers (virtual stages), and a microbatch goes round the ring of stages
  `repeats` times, which divides the bubble by `repeats`.
- 1F1B (`one_f_one_b`) runs forward and backward work in the same tick (stage s: the forward of
  microbatch t - s and the backward of microbatch t - 2S + 2 + s), so a stage holds at most 2S - 1
  microbatches in flight whatever their number. It keeps each in-flight microbatch's residuals (what
  `jax.vjp` of the stage saves; the model's remat policy decides how much) and pulls back through them
  in the backward slot, so a stage computes each microbatch's forward once, as a step without a
  pipeline does. Each microbatch is embedded as it enters
  the first stage and ends (final norm, head, loss, and the gradient that starts its backward pass) as
  soon as it leaves the last one, which is why 1F1B is driven from the training step with the model's
  three parts rather than from inside the model. What follows the layers but cannot run where the
  head does (a multi-token prediction module's MoE block) runs on the last stage inside its slots,
  as a `StageTail`.

Parallel code, no layer: the stage, embedding and head arrive as functions.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ushard.sharding import Layout, current_layout, merge_rows, split_rows, use_layout, varying

SCHEDULES = ("gpipe", "circular", "1f1b")
IDLE = -1


@dataclass(frozen=True)
class PipelineSchedule:
    """`parallel.pipeline_*`: the schedule's name, microbatches per step (per `train.grad_accum` part),
    and virtual stages per device (circular only)."""

    name: str = "gpipe"
    microbatches: int = 1
    repeats: int = 1
    layer_unroll: int = 1  # layers per trip of a stage's layer loop (model.scan_unroll): `keeps_layer_rows`


def bubble_fraction(schedule: str, stages: int, microbatches: int, repeats: int = 1) -> float:
    """The share of a step each device idles in fill and drain, with forward and backward work in
    their usual proportion and idle slots skipped: (S - 1) / (R·M + S - 1), R = repeats for the
    circular schedule and 1 otherwise. 1F1B has GPipe's bubble; it saves memory, not time."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; one of {SCHEDULES}")
    rounds = repeats if schedule == "circular" else 1
    return (stages - 1) / (rounds * microbatches + stages - 1)


# --------------------------------------------------------------------------- schedule tables


def forward_table(stages: int, microbatches: int, repeats: int = 1) -> np.ndarray:
    """GPipe / circular: [ticks, stages, 2] of (microbatch, round) each stage runs, IDLE when none.

    Stage s starts item i = t - s at tick t: microbatch i mod M in round i // M. A microbatch leaves
    the last stage at tick rM + m + S - 1 and re-enters stage 0 at (r + 1)M + m, hence M >= S.
    """
    ticks = repeats * microbatches + stages - 1
    table = np.full((ticks, stages, 2), IDLE, np.int32)
    for t in range(ticks):
        for s in range(stages):
            item = t - s
            if 0 <= item < repeats * microbatches:
                table[t, s] = (item % microbatches, item // microbatches)
    return table


def one_f_one_b_table(stages: int, microbatches: int) -> np.ndarray:
    """1F1B: [ticks, stages, 2] of (forward microbatch, backward microbatch) per stage, IDLE when none.

    Forward of m on stage s at tick m + s; the last stage starts m's backward in the same tick, and
    each stage before it one tick later: backward of m on stage s at m + 2S - 2 - s.
    """
    ticks = microbatches + 2 * stages - 2
    table = np.full((ticks, stages, 2), IDLE, np.int32)
    for t in range(ticks):
        for s in range(stages):
            for slot, m in enumerate((t - s, t - (2 * stages - 2 - s))):
                if 0 <= m < microbatches:
                    table[t, s, slot] = m
    return table


def ring_size(stages: int) -> int:
    """Microbatches whose residuals 1F1B keeps: stage 0 holds microbatch m from tick m to m + 2S - 2."""
    return 2 * stages - 1


# --------------------------------------------------------------------------- the forward schedules


def run_stages(stage, stack, x, args, layout: Layout, tick_policy=None):
    """The pipelined layer stack: (y, aux) = stage(chunk_{V-1}, ... stage(chunk_0, x, args) ..., args).

    stage(chunk, x, args) -> (x, aux) runs consecutive layers (`chunk`: `stack` with fewer rows) on one
    microbatch; `stack` is the stacked layers' pytree, [layers, ...] leaves; x [B, ...] and `args` (a
    pytree of per-row arrays [B, ...]) are split into microbatches. Returns y [B, ...] and the aux terms
    summed over layers and averaged over microbatches. Differentiable (autodiff of the tick loop).

    `tick_policy` (a `jax.checkpoint` policy: what the stage's own remat keeps, its layers' inputs
    included), where given, puts each tick's slot, its conditional with it, under a remat boundary
    keeping only that. Without it the conditional's residuals are its outputs, the tick's chunk of
    weights among them (JAX forwards no input of a `lax.cond` to the backward pass), and autodiff of
    the tick loop keeps one chunk a tick; with it the backward pass takes its chunk again from the
    stage's weights, which the loop holds once.
    """
    pipe, axis, stages = layout.pipeline, stage_axis(layout), layout.size("layers")
    count, repeats = pipe.microbatches, pipe.repeats if pipe.name == "circular" else 1
    chunks = virtual_stages(stack, stages, repeats)
    xs, args = jax.tree.map(lambda a: split_rows(a, count, layout), (x, args))
    table = forward_table(stages, count, repeats)
    # Stage 0 keeps, at tick t, what the last stage sent at t - 1 when it goes round again.
    last = table[:, -1]
    returning = np.where(last[:, 1] < repeats - 1, last[:, 0], IDLE)
    arrivals = np.full(table.shape[:2], IDLE, np.int32)
    arrivals[1:, 0] = returning[:-1]
    schedule = jnp.asarray(np.concatenate([table, arrivals[..., None]], axis=-1))
    forward = [(s, (s + 1) % stages) for s in range(stages)]
    chained = carry_aux(stage)
    branch_free = slots_branch_free(layout)

    def slot(chunks, m, round_, start, mb):
        return when(m != IDLE, chained, take(chunks, round_), start, mb, axis=axis, branch_free=branch_free)

    if tick_policy is not None:
        slot = jax.checkpoint(slot, policy=tick_policy)

    def body(chunks, xs, args):
        index = jax.lax.axis_index(axis)
        chunks = jax.tree.map(lambda c: c[:, 0], chunks)  # this stage's chunk of each round
        xs, args = varying((xs, args), axis)
        with use_layout(layout.inside_stage()):
            aux = zeros_of(lambda *a: stage(*a)[1], take(chunks, 0), take(xs, 0), take(args, 0), axis=axis)
            slots = (xs, jax.tree.map(lambda a: jnp.zeros((count, *a.shape), a.dtype), aux))
            slots = varying(slots, axis)

            def tick(carry, row):
                slots, received = carry
                m, round_, arrived = row[index, 0], row[index, 1], row[index, 2]
                slots = put(slots, arrived, received, arrived != IDLE)
                start = jax.tree.map(lambda a, b: jnp.where(index == 0, a, b), take(slots, m), received)
                out = slot(chunks, m, round_, start, take(args, m))
                done = (index == stages - 1) & (round_ == repeats - 1)
                slots = put(slots, m, out, done & (m != IDLE))
                return (slots, jax.lax.ppermute(out, axis, forward)), None

            (slots, _), _ = jax.lax.scan(tick, (slots, take(slots, 0)), schedule)
        at_last = index == stages - 1  # the finished microbatches are on the last stage
        return jax.lax.psum(jax.tree.map(lambda v: jnp.where(at_last, v, 0), slots), axis)

    run = jax.shard_map(body, mesh=layout.mesh, in_specs=(P(None, axis), P(), P()), out_specs=P(),
                        axis_names={axis})
    ys, aux = run(chunks, xs, args)
    return merge_rows(ys), jax.tree.map(lambda a: jnp.mean(a, axis=0), aux)


# --------------------------------------------------------------------------- 1F1B


def one_f_one_b(first, stage, last, outer, stack, batch, layout: Layout, prepare=lambda stack: stack,
                tail: StageTail | None = None):
    """Sums and gradients of Σ_m objective_m by the 1F1B schedule, without autodiff of the loop.

    For microbatch m (rows of every `batch` leaf): x = first(outer, m); x, aux_i = stage(chunk_i, x, m)
    for each chunk of the prepared layers in turn; t = tail.run(tail.params, x, tail.inputs(outer, m), m)
    (`StageTail`; () without one); (objective, sums) = last(outer, x, Σ aux_i, m, t).
    `outer` are the parameters outside the stack, `stack` the stacked layers. `prepare(stack)` casts
    and places the stacked weights for compute (ZeRO-3: gathers them) and does nothing else: it runs
    once per step, before the tick loop, and the weight gradients, accumulated in float32, are
    returned in each weight's own dtype and layout. Returns (sums summed over microbatches, d outer,
    d stack, d tail.params or None) with d = gradient of Σ_m objective_m.

    Each tick has two manual regions (a shard_map over the stage axis) that run only the layers: the
    forward slot, then the backward slot. Between them, outside, `first` runs on the microbatch that
    enters stage 0 and `last` on the one that leaves the last stage, once, laid out by the layout like
    any other computation: XLA's partitioner aborts on a gather (embedding lookup, target logit) inside
    a partially manual shard_map, not outside. Where the layout splits the vocabulary over the stage
    axis too (`vocab`, `act_vocab`; parallel.pipeline_head='split'), every stage computes its share of
    the head and loss in every tick rather than the last stage all of it while the others wait; the
    price is hidden-size all-reduces over the stage axis in every tick. Where it does not ('whole',
    the default when the stages span the data-centre network), `StageHeads` runs the head on every
    stage's own output and keeps only the last stage's result, and the embedding's gradient on the
    first stage's, so that only the stages' own transfers cross the stage axis in a tick.

    Data parallelism: a microbatch's rows are split over the batch axes, one group of rows per device
    of those axes (`Groups`). The stage slots are manual over those axes too; embedding, head and loss
    run vmapped over the groups (`spmd_axis_name`). Every gradient accumulates per group, so the
    data-parallel devices reduce their gradients once per step, after the loop, rather than in every
    tick.
    """
    axis, stages, count = stage_axis(layout), layout.size("layers"), layout.pipeline.microbatches
    groups = Groups.of(layout)
    with use_layout(layout):
        weights = prepare(stack)
    chunks = virtual_stages(weights, stages, 1)
    microbatches = jax.tree.map(lambda a: groups.split(split_rows(a, count, layout), axis=1), batch)
    chained = carry_aux(stage)
    on_stages = functools.partial(groups.pin, layout=layout, before=(axis,))  # [stages, groups, ...]

    def rows(index):  # each stage's microbatch (IDLE: any, unused) -> [stages, groups, rows, ...]
        return on_stages(take(microbatches, index))

    def on_every_stage(tree):  # a copy for each stage, [stages, groups, ...] split over the stage axis
        return on_stages(jax.tree.map(lambda a: jnp.broadcast_to(a, (stages, *a.shape)), tree))

    one = jax.tree.map(lambda a: a[0], take(microbatches, 0))  # one group's rows

    def enter(outer, mb):  # the activation entering stage 0: (x, no aux yet)
        return first(outer, mb), jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), aux)

    def finish(outer, activation, mb):  # -> (sums, d outer, d activation) of the objective
        # activation: what the last stage hands over, ((x, aux), the tail's outputs)
        objective, pullback, sums = jax.vjp(lambda o, a: last(o, *a[0], mb, a[1]), outer, activation, has_aux=True)
        return sums, *pullback(jnp.ones_like(objective))

    def pulled_back(fn):  # the gradient of outer from that of fn(outer, mb)
        return lambda outer, mb, d: jax.vjp(lambda o: fn(o, mb), outer)[1](d)[0]

    # Per group of rows (one per device of the batch axes): [groups, ...] in and out.
    enter_each, finish_each, enter_grads_each = (groups.each(fn, layout, shared=1)
                                                 for fn in (enter, finish, pulled_back(enter)))
    heads = (SplitHead if axis in layout.axes("vocab") else StageHeads)(finish_each, enter_grads_each, on_every_stage,
                                                                          axis, stages)
    slots = StageSlots(chained, ring_size(stages), layout, axis, groups, tail=tail and tail.run)
    idle, some = jnp.full((stages,), IDLE), take(microbatches, 0)
    # The aux terms the layers report inside the slots, where their layout decides some of them.
    x = jax.eval_shape(lambda o, mb: on_every_stage(groups.each(first, layout, shared=1)(o, mb)), outer, some)
    aux = slots.aux_shapes(stage, chunks, idle, rows(idle), x)
    activation = jax.eval_shape(lambda o, mb: on_every_stage(enter_each(o, mb)), outer, some)
    ring = slots.ring_shapes(chunks, idle, rows(idle), activation)
    zeros = functools.partial(groups.zeros, layout=layout)
    if tail is None:
        tail_params, tail_out, d_tail = (), (), ()
    else:
        inputs_each, inputs_grads_each = (groups.each(fn, layout, shared=1)
                                          for fn in (tail.inputs, pulled_back(tail.inputs)))
        tail_params = tail.params
        with use_layout(None):  # one group's shapes, as `aux`'s
            tail_out = jax.eval_shape(lambda p, o, mb: tail.run(p, first(o, mb), tail.inputs(o, mb), mb),
                                      tail.params, outer, one)
        tail_out = jax.tree.map(lambda a: jax.ShapeDtypeStruct((stages, groups.count, *a.shape), a.dtype), tail_out)
        d_tail = zeros(jax.tree.map(lambda a: jax.ShapeDtypeStruct((stages, *a.shape), jnp.float32),
                                    groups.shapes(tail.params)), before=(axis,))
    groups_only = lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype)  # noqa: E731
    sums = jax.eval_shape(lambda o, mb: finish_each(o, (enter_each(o, mb), jax.tree.map(groups_only, tail_out)),
                                                    mb)[0], outer, some)

    def tick(carry, table_row):
        received, d_received, ring, d_chunks, d_outer, sums, d_tail = carry
        f, b = table_row[:, 0], table_row[:, 1]
        entered = on_every_stage(enter_each(outer, take(microbatches, f[0])))
        leaving = take(microbatches, f[-1])
        # The tail's inputs (the MTP modules' embedding lookups) of the microbatch the last stage runs.
        ahead = () if tail is None else on_every_stage(inputs_each(outer, leaving))
        out, received, ring, tail_out, kept = slots.forward(chunks, f, rows(f), entered, received, ring, tail_params,
                                                            ahead)
        ends, starts = f[-1] != IDLE, b[0] != IDLE
        sums_f, d_outer_head, (d_out, d_tail_out) = heads.finish(outer, (out, tail_out), leaving, ends)
        d_activation, d_received, d_chunks, d_ahead, d_tail = slots.backward(
            chunks, b, rows(b), ring, d_out, d_received, d_chunks, tail_params, kept, d_tail_out, d_tail)
        d_outer_in = heads.embedding_grads(outer, take(microbatches, b[0]), d_activation, starts)
        if tail is not None:  # the last stage's backward is of the microbatch it ran forward in this tick
            d_outer_in = add(d_outer_in, heads.input_grads(inputs_grads_each, -1, outer, take(microbatches, b[-1]),
                                                           d_ahead, b[-1] != IDLE))
        return (received, d_received, ring, d_chunks, add(d_outer, add(d_outer_head, d_outer_in)),
                add(sums, sums_f), d_tail), None

    carry = (zeros(activation, before=(axis,)), zeros(activation, before=(axis,)), zeros(ring, before=(axis, None)),
             zeros(groups.shapes(chunks, at=2, dtype=jnp.float32), before=(None, axis)),
             zeros(heads.shapes(groups.shapes(outer)), before=heads.before),
             zeros(heads.shapes(sums), before=heads.before), d_tail)
    schedule = jnp.asarray(one_f_one_b_table(stages, count))
    (_, _, _, d_chunks, d_outer, sums, d_tail), _ = jax.lax.scan(tick, carry, schedule)
    d_stack = jax.tree.map(lambda g, w: g.sum(axis=2).reshape(w.shape).astype(w.dtype), d_chunks, stack)
    if tail is not None:
        d_tail = jax.tree.map(lambda g, w: g.sum(axis=(0, 1)).astype(w.dtype), d_tail, tail.params)
    return groups.total(heads.total(sums)), groups.total(heads.total(d_outer)), d_stack, d_tail or None


@dataclass(frozen=True)
class StageTail:
    """What 1F1B's last stage runs after its layers, inside its slots, on each microbatch it finishes:
    a multi-token prediction module, whose MoE block cannot run vmapped over the stages and row
    groups as `last` does (ragged_dot batches over dimension 0 only). Its residuals are kept for one
    microbatch (the last stage pulls back the microbatch it ran forward in the same tick).

    `params`: its weights (not among `outer`), replicated over the stages like `outer`;
    `inputs(outer, mb)`: what it takes besides the layers' output, computed outside the slots as
    `first` is (an embedding lookup: a gather XLA cannot partition inside them) and pulled back there;
    `run(params, x, inputs, mb)`: its outputs, which `last` takes. Where the slots run branch-free
    (a split sequence), every stage runs it and only the last stage's result counts."""

    params: object
    inputs: object
    run: object


@dataclass(frozen=True)
class SplitHead:
    """1F1B's head and embedding with the vocabulary split over the stages: every stage computes its
    share for the microbatch leaving the last stage (and the one whose gradient reached the first),
    the results summed over the stage axis by the compiler. Accumulators have no stage dimension."""

    finish_each: object  # (outer, activation, mb) -> (sums, d outer, d activation), per group
    enter_grads_each: object  # (outer, mb, d activation) -> d outer, per group
    on_every_stage: object  # a tree -> a copy for each stage, split over the stage axis
    axis: str
    stages: int
    before = ()  # the accumulators' leading dimensions on mesh axes

    def finish(self, outer, out, mb, ends):
        """(sums, d outer, d out for every stage) of the microbatch leaving the last stage."""
        sums, d_outer, d_out = self.finish_each(outer, jax.tree.map(lambda a: a[-1], out), mb)
        return keep_if(ends, sums), keep_if(ends, d_outer), self.on_every_stage(d_out)

    def embedding_grads(self, outer, mb, d_activation, starts):
        return self.input_grads(self.enter_grads_each, 0, outer, mb, d_activation, starts)

    def input_grads(self, grads_each, stage, outer, mb, d_inputs, where):
        """d outer of what stage `stage` took from outside the slots, by its pullback `grads_each`
        (per group) of the gradient `d_inputs` ([stages, groups, ...]), where `where` holds."""
        return keep_if(where, grads_each(outer, mb, jax.tree.map(lambda a: a[stage], d_inputs)))

    def shapes(self, tree):
        return tree

    @staticmethod
    def total(tree):
        return tree


@dataclass(frozen=True)
class StageHeads(SplitHead):
    """1F1B's head and embedding where every stage holds the whole vocabulary: each stage runs the
    head on its own output and the embedding's pullback on its own input gradient, and only the last
    stage's head and the first stage's embedding count. The stages' results never meet within a
    tick (no transfer over the stage axis); accumulators carry a stage dimension, summed once a step."""

    before = property(lambda self: (self.axis,))

    def _on_stages(self, fn, in_axes):
        return jax.vmap(fn, in_axes=in_axes, spmd_axis_name=self.axis)

    def _only(self, stage, where, tree):
        return jax.tree.map(lambda a: jnp.where(_stage_mask(stage, self.stages, a.ndim) & where, a, 0), tree)

    def finish(self, outer, out, mb, ends):
        sums, d_outer, d_out = self._on_stages(self.finish_each, (None, 0, None))(outer, out, mb)
        return self._only(-1, ends, sums), self._only(-1, ends, d_outer), d_out  # d_out: only the last stage reads it

    def input_grads(self, grads_each, stage, outer, mb, d_inputs, where):
        return self._only(stage, where, self._on_stages(grads_each, (None, None, 0))(outer, mb, d_inputs))

    def shapes(self, tree):
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct((self.stages, *a.shape), a.dtype), tree)

    @staticmethod
    def total(tree):
        return jax.tree.map(lambda a: a.sum(axis=0), tree)


def _stage_mask(stage: int, stages: int, ndim: int):
    """[stages, 1, ...] true at `stage` (negative: from the end), to broadcast against [stages, ...]."""
    return (jnp.arange(stages) == stage % stages).reshape(stages, *(1,) * (ndim - 1))


@dataclass(frozen=True)
class Groups:
    """The rows of a microbatch in groups, one per device of the batch's mesh axes, each group's work
    vmapped with the group dimension on those axes: what is computed per group stays on its devices
    until `total` adds the groups up."""

    axes: tuple  # the batch's mesh axes
    count: int  # devices over them

    @classmethod
    def of(cls, layout: Layout) -> "Groups":
        """The batch axes that do not also hold experts: an MoE layer inside a stage sends its tokens
        to the experts over those (ushard/parallel/expert.py, a map of its own), so the stage's map
        leaves them to the compiler."""
        experts = set(layout.axes("experts"))
        axes = tuple(a for a in layout.axes("act_batch") if a not in experts)
        return cls(axes, math.prod(layout.mesh.shape[a] for a in axes))

    def split(self, a, axis):
        """[..., rows, ...] -> [..., groups, rows / groups, ...] at `axis`: each device's rows a group."""
        return a.reshape(*a.shape[:axis], self.count, a.shape[axis] // self.count, *a.shape[axis + 1:])

    def each(self, fn, layout: Layout, shared: int):
        """fn vmapped over groups: its first `shared` arguments are the same for every group, the
        others carry a leading group dimension, as do its results."""
        def run(*args):
            in_axes = (None,) * shared + (0,) * (len(args) - shared)
            with use_layout(layout.per_group(self.axes)):
                return jax.vmap(fn, in_axes=in_axes, spmd_axis_name=self.axes or None)(*args)

        return run

    def shapes(self, tree, at: int = 0, dtype=None):
        """Shapes of one copy of `tree` per group (e.g. a gradient accumulator), the group dimension
        at `at`, in `dtype` (None: each leaf's own)."""
        def one_per_group(a):
            return jax.ShapeDtypeStruct((*a.shape[:at], self.count, *a.shape[at:]), dtype or a.dtype)

        return jax.tree.map(one_per_group,
                            tree)

    def pin(self, tree, layout: Layout, before=()):
        """Every leaf's group dimension, after the dimensions `before` places on mesh axes (or None),
        split over the batch axes; the rest left to the compiler."""
        def constrain(a):
            spec = P(*before, self.axes or None, *[P.UNCONSTRAINED] * (a.ndim - len(before) - 1))
            return jax.lax.with_sharding_constraint(a, NamedSharding(layout.mesh, spec))

        return jax.tree.map(constrain, tree)

    def zeros(self, shapes, layout: Layout, before=()):
        return self.pin(jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes), layout, before)

    @staticmethod
    def total(tree):
        return jax.tree.map(lambda a: a.sum(axis=0), tree)


class StageSlots:
    """The two manual regions of a 1F1B tick, over arrays with a leading stage dimension and a group
    dimension (`Groups`) after it. The regions are manual over the batch axes too, so each device runs
    the layers on its own rows and keeps its own gradients.

    forward(chunks, f, mb, entered, received, ring, tail_params, ahead) -> (out, sent, ring, tail_out, kept):
    stage s runs its forward of microbatch f[s] on what entered (stage 0) or what it received, and
    keeps the residuals its backward pass needs (what `jax.vjp` saves: which of them the model's remat
    policy decides) in slot f[s] mod `keep` of the ring; the last stage then runs the tail
    (`StageTail`, `tail`: its run function, or None) on its output and `ahead`, and returns its
    outputs and residuals (`kept`, one microbatch's: the last stage pulls back in the same tick).
    backward(chunks, b, mb, ring, d_out, d_received, d_chunks, tail_params, kept, d_tail_out, d_tail)
    -> (d_in, d_sent, d_chunks, d_ahead, d_tail): stage s pulls back d_out (last stage: the head's
    gradient of this tick, and the tail's pulled back through `kept`) or what it received through
    microbatch b[s]'s kept residuals; weight gradients accumulate per group in d_chunks and d_tail
    (float32). Without a tail, its operands and results are ().
    """

    def __init__(self, chained, keep: int, layout: Layout, axis: str, groups: Groups, tail=None):
        self.chained, self.keep, self.layout, self.axis, self.tail = chained, keep, layout, axis, tail
        self.manual, self.groups = (axis, *groups.axes), groups
        self.branch_free = slots_branch_free(layout)
        self.layers_pullback, self.tail_pullback = KeptPullback(), KeptPullback()
        stages = layout.size("layers")
        self.stages = stages
        forward_pairs = [(s, s + 1) for s in range(stages - 1)]
        self.forward_pairs, self.backward_pairs = forward_pairs, [(t, s) for s, t in forward_pairs]
        on_groups = groups.axes or None
        # [repeats, stages, ...] weights; [stages] microbatch indices; [stages, groups, ...] activations
        # and microbatches; [stages, keep, groups, ...] the ring; [repeats, stages, groups, ...] gradients.
        chunk, index, grouped = P(None, axis), P(axis), P(axis, on_groups)
        ring, grads = P(axis, None, on_groups), P(None, axis, on_groups)
        mapped = functools.partial(jax.shard_map, mesh=layout.mesh, axis_names=set(self.manual))
        # The tail's weights, as `outer`, are the same on every stage and group.
        self.forward = mapped(self._forward_body,
                              in_specs=(chunk, index, grouped, grouped, grouped, ring, P(), grouped),
                              out_specs=(grouped, grouped, ring, grouped, grouped))
        self.backward = mapped(self._backward_body,
                               in_specs=(chunk, index, grouped, ring, grouped, grouped, grads, P(), grouped, grouped,
                                         grouped),
                               out_specs=(grouped, grouped, grads, grouped, grouped))
        self._residuals_only = mapped(self._residuals_body, in_specs=(chunk, index, grouped, grouped),
                                      out_specs=grouped)

    def aux_shapes(self, stage, chunks, f, mb, x):
        """Shapes of one group's aux terms of stage(chunk, x, mb) -> (x, aux), traced inside the slots:
        an MoE layer reports its busiest device only where its experts are over devices, which the
        slots' layout says, not the model alone."""
        def body(chunks, f, mb, x):
            chunk, f, mb, x = self._local(chunks, f, (mb, x))
            with self._inside():
                aux = zeros_of(lambda *a: stage(*a)[1], chunk, x, mb, axis=self.manual)
            return jax.tree.map(lambda a: a[None, None], aux)

        grouped = P(self.axis, self.groups.axes or None)
        mapped = jax.shard_map(body, mesh=self.layout.mesh, axis_names=set(self.manual),
                               in_specs=(P(None, self.axis), P(self.axis), grouped, grouped), out_specs=grouped)
        shapes = jax.eval_shape(mapped, chunks, f, mb, x)
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[2:], a.dtype), shapes)

    def ring_shapes(self, chunks, f, mb, activation):
        """Shapes of the ring: `keep` slots of one microbatch's residuals per stage, [stages, keep, groups, ...]."""
        residuals = jax.eval_shape(self._residuals_only, chunks, f, mb, activation)
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct((a.shape[0], self.keep, *a.shape[1:]), a.dtype), residuals)

    def _forward_with_residuals(self, weights, activation, mb):
        """(the stage's output, the residuals of its pullback that are not the weights)."""
        # Typed as differing between the groups, which it does for every row's activation; a
        # statistic of the whole microbatch (`sum_over_rows`) is the same on every group, and its
        # gradient then adds every group's cotangent, as it must.
        return self.layers_pullback.forward(lambda w, a: varying(self.chained(w, a, mb), self.manual),
                                            weights, activation)

    def _tail_with_residuals(self, params, x, ahead, mb):
        """(the tail's outputs, the residuals of its pullback that are not its weights)."""
        return self.tail_pullback.forward(lambda p, x, a: varying(self.tail(p, x, a, mb), self.manual),
                                          params, x, ahead)

    def _row_layers(self, chunk) -> int:
        """The layers whose rows the ring keeps apart (`layer_rows`); 0: residuals kept stacked."""
        layers = layers_of(chunk)
        return layers if keeps_layer_rows(self.layout, layers) else 0

    def _grads(self, weights, residuals, d_out):
        """(d weights, d activation) from a microbatch's kept residuals."""
        return self.layers_pullback.grads(weights, residuals, d_out)

    def _inside(self):
        """The layout of a stage's own rows: its layers unsplit, nothing over the manual axes, the
        other groups' rows apart (what sums over a microbatch's tokens must add them from)."""
        inside = self.layout.inside_stage(weights_prepared=True).per_group(self.manual)
        return use_layout(dataclasses.replace(inside, rows_apart=self.groups.axes))

    def _local(self, chunks, index, grouped):
        """This device's chunk of weights, microbatch index, and rows of each grouped tree, all typed as
        varying over every manual axis. For the weights this is what keeps their gradient on the
        device: differentiating through the implicit cast instead would sum it over the batch axes."""
        return (varying(jax.tree.map(lambda c: c[0, 0], chunks), self.manual), index[0],
                *[varying(jax.tree.map(lambda a: a[0, 0], tree), self.manual) for tree in grouped])

    def _residuals_body(self, chunks, f, mb, activation):
        chunk, f, mb, activation = self._local(chunks, f, (mb, activation))
        with self._inside():
            residuals = zeros_of(lambda *a: self._forward_with_residuals(*a)[1], chunk, activation, mb,
                                 axis=self.manual)
            residuals = layer_rows(residuals, self._row_layers(chunk))
        return jax.tree.map(lambda a: a[None, None], residuals)

    def _forward_body(self, chunks, f, mb, entered, received, ring, tail_params, ahead):
        index = jax.lax.axis_index(self.axis)
        chunk, f, mb, entered, received, ahead = self._local(chunks, f, (mb, entered, received, ahead))
        ring = jax.tree.map(lambda a: a[0, :, 0], ring)
        slot = jnp.maximum(f, 0) % self.keep

        def run(works, ring, chunk, activation, mb):  # the residuals go straight into their slot
            out, residuals = self._forward_with_residuals(chunk, activation, mb)
            return out, put(ring, slot, layer_rows(residuals, self._row_layers(chunk)), works)

        with self._inside():
            activation = jax.tree.map(lambda a, r: jnp.where(index == 0, a, r), entered, received)
            out, ring = when_updating(f != IDLE, run, ring, chunk, activation, mb, axis=self.manual,
                                      branch_free=self.branch_free)
            tail_out, kept = (), ()
            if self.tail is not None:
                ends = (index == self.stages - 1) & (f != IDLE)
                tail_out, kept = when(ends, self._tail_with_residuals, varying(tail_params, self.manual), out[0],
                                      ahead, mb, axis=self.manual, branch_free=self.branch_free)
        sent = jax.lax.ppermute(out, self.axis, self.forward_pairs)
        grouped = jax.tree.map(lambda a: a[None, None], (out, sent, tail_out, kept))
        return *grouped[:2], jax.tree.map(lambda a: a[None, :, None], ring), *grouped[2:]

    def _backward_body(self, chunks, b, mb, ring, d_out, d_received, d_chunks, tail_params, kept, d_tail_out,
                       d_tail):
        index = jax.lax.axis_index(self.axis)
        chunk, b, mb, d_out, d_received, kept, d_tail_out = self._local(chunks, b, (mb, d_out, d_received, kept,
                                                                                    d_tail_out))
        d_tail = jax.tree.map(lambda a: a[0, 0], d_tail)
        ring = jax.tree.map(lambda a: a[0, :, 0], ring)
        slot = jnp.maximum(b, 0) % self.keep

        def pull(works, d_chunks, chunk, ring, d_out):  # the residuals read, the gradients added, in place
            d_chunk, d_in = self._grads(chunk, stacked(take(ring, slot)), d_out)
            add = functools.partial(accumulate, works=works, layers=self._row_layers(chunk))
            return d_in, jax.tree.map(add, d_chunks, d_chunk)

        def pull_tail(works, d_tail, params, kept, d_tail_out):  # -> (d x, d ahead), d_tail added to
            d_params, d_x, d_ahead = self.tail_pullback.grads(params, kept, d_tail_out)
            masked = (lambda g: g) if works is True else (lambda g: jnp.where(works, g, 0))
            return (d_x, d_ahead), jax.tree.map(lambda acc, g: acc + masked(g.astype(acc.dtype)), d_tail, d_params)

        with self._inside():
            d_ahead = ()
            if self.tail is not None:  # the tail's gradient, then the layers' (the tail took their output)
                ends = (index == self.stages - 1) & (b != IDLE)
                (d_x, d_ahead), d_tail = when_updating(ends, pull_tail, d_tail, varying(tail_params, self.manual),
                                                       kept, d_tail_out, axis=self.manual,
                                                       branch_free=self.branch_free)
                d_out = (d_out[0] + d_x, *d_out[1:])
            d_out = jax.tree.map(lambda h, r: jnp.where(index == self.stages - 1, h, r), d_out, d_received)
            d_in, d_chunks = when_updating(b != IDLE, pull, d_chunks, chunk, ring, d_out, axis=self.manual,
                                           branch_free=self.branch_free)
        d_sent = jax.lax.ppermute(d_in, self.axis, self.backward_pairs)
        grouped = jax.tree.map(lambda a: a[None, None], (d_in, d_sent, d_ahead, d_tail))
        return *grouped[:2], d_chunks, *grouped[2:]


class KeptPullback:
    """A function's pullback (`jax.vjp`'s, a pytree) as the residuals to keep, without the weights it
    closes over: those are passed again when it is pulled back. The pullback's structure, and which
    of its leaves are weights, are recorded while `forward` is traced (the same for every microbatch)."""

    def __init__(self):
        self.tree = None
        self.weight_at = None  # for each leaf of the pullback, the weight it is (or None)

    def forward(self, fn, weights, *args):
        """(fn(weights, *args), the residuals of its pullback that are not the weights)."""
        out, pullback = jax.vjp(fn, weights, *args)
        leaves, self.tree = jax.tree.flatten(pullback)
        weight_leaves = jax.tree.leaves(weights)
        self.weight_at = [next((i for i, w in enumerate(weight_leaves) if leaf is w), None) for leaf in leaves]
        return out, [leaf for leaf, at in zip(leaves, self.weight_at) if at is None]

    def grads(self, weights, residuals, d_out):
        """(d weights, d args) from kept residuals."""
        weight_leaves, kept = jax.tree.leaves(weights), iter(residuals)
        leaves = [next(kept) if at is None else weight_leaves[at] for at in self.weight_at]
        return jax.tree.unflatten(self.tree, leaves)(d_out)


def keeps_layer_rows(layout: Layout, layers: int) -> bool:
    """Whether 1F1B's ring holds each residual stacked over a stage's `layers` as its layers' rows
    (`layer_rows`), and its accumulators add layer by layer: where the stage's layer loop is unrolled
    (`PipelineSchedule.layer_unroll` covers them).

    Unrolled, a stacked residual is a concatenate of the layers' outputs, built every tick, that the
    rows never build. A loop writes its stack in place, and rows would only add copies (the stack the
    pullback takes)."""
    return layout.pipeline is not None and layout.pipeline.layer_unroll >= layers


def layers_of(chunk) -> int:
    """How many layers a stage's chunk of stacked weights holds (their leading axis)."""
    return jax.tree.leaves(chunk)[0].shape[0]


def layer_rows(residuals, layers: int) -> list:
    """The ring's layout of a slot's residuals: each one stacked over the stage's layers (what
    `jax.vjp` of the layers' scan keeps, [layers, ...]) as a list of its layers' rows.

    Written and read row by row, the stack is never built: XLA forwards a slice of a concatenation to
    the operand it came from. Stored whole with the layers unrolled, every tick concatenated each
    residual's layers into the ring (a slow many-operand fusion) and the backward pass sliced them out
    again."""
    if not layers:
        return residuals
    layout = current_layout()

    def rows(a):
        # Each device holds every layer's row. Left to itself the compiler may split the layers over an
        # auto axis (`expert`) and then fetch each row by a collective-permute inside the slot's
        # conditional, which names devices of stages that took the other branch: a deadlock.
        if layout is not None:
            unsplit = P(None, *[P.UNCONSTRAINED] * (a.ndim - 1))
            a = jax.lax.with_sharding_constraint(a, NamedSharding(layout.mesh, unsplit))
        return [a[i] for i in range(layers)]

    return [rows(a) if a.ndim and a.shape[0] == layers else a for a in residuals]


def stacked(rows: list) -> list:
    """`layer_rows` undone: the residuals as the pullback takes them."""
    return [jnp.stack(r) if isinstance(r, list) else r for r in rows]


def accumulate(acc, grad, works, layers: int):
    """acc [1, 1, 1, ...] + grad where `works` holds (True, or a traced scalar: a branch-free slot
    masks its own update); layer by layer where `layers` is set and grad is stacked over them
    ([layers, ...]; in place, never building the stack, as `layer_rows`)."""
    def add(acc, grad):
        grad = grad.astype(acc.dtype)[None, None, None]
        return acc + (grad if works is True else jnp.where(works, grad, 0))

    if not (layers and grad.ndim and grad.shape[0] == layers):
        return add(acc, grad)
    for i in range(layers):
        row = add(jax.lax.index_in_dim(acc, i, axis=3, keepdims=False), grad[i])
        acc = jax.lax.dynamic_update_index_in_dim(acc, row, i, axis=3)
    return acc


def keep_if(condition, tree):
    """The tree where `condition` (a scalar) holds, zeros otherwise."""
    return jax.tree.map(lambda a: jnp.where(condition, a, 0), tree)


# --------------------------------------------------------------------------- helpers


def stage_axis(layout: Layout) -> str:
    """The mesh axis the stacked `layers` are split over (the layout's rules say which)."""
    axes = layout.axes("layers")
    if len(axes) != 1:
        raise ValueError(f"a pipeline needs `layers` mapped to one mesh axis, not {axes}")
    return axes[0]


def virtual_stages(stack, stages: int, repeats: int):
    """[layers, ...] -> [repeats, stages, layers per chunk, ...]: chunk (r, s) holds layers
    (r·S + s)·n ... (r·S + s + 1)·n - 1, run by stage s in round r. With one round this is the stored
    layout (stage s holds a contiguous block); with more, XLA moves the chunks to their stages."""
    def split(w):
        return w.reshape(repeats, stages, w.shape[0] // (repeats * stages), *w.shape[1:])

    return jax.tree.map(split, stack)


def carry_aux(stage):
    """stage(chunk, x, mb) -> (x, aux) as a map of activations (x, aux so far) -> (x, aux so far + aux)."""
    def chained(chunk, activation, mb):
        x, aux = activation
        x, more = stage(chunk, x, mb)
        return x, add(aux, more)

    return chained


def zeros_of(fn, *operands, axis):
    """Zeros shaped like fn(*operands), which is traced but not run."""
    return varying(jax.eval_shape(fn, *operands), axis, zeros=True)


def add(a, b):
    return jax.tree.map(jnp.add, a, b)


def take(tree, index):
    """Row `index` of every [n, ...] leaf (IDLE reads row 0: the caller ignores it)."""
    index = jnp.maximum(index, 0)
    return jax.tree.map(lambda a: a[index], tree)


def put(tree, index, value, where):
    """Row `index` of every [n, ...] leaf set to `value` where `where` holds (one row read and
    written, not the whole buffer; `where` True: written, not read)."""
    index = jnp.maximum(index, 0)
    return jax.tree.map(lambda buf, v: buf.at[index].set(v if where is True else jnp.where(where, v, buf[index])),
                        tree, value)


def when(predicate, fn, *operands, axis, branch_free: bool = False):
    """fn(*operands) where `predicate` holds, zeros shaped like its result elsewhere, at no cost then
    (`when_updating` without a state).

    A `lax.cond` whose predicate differs between stages: nothing inside may communicate over the stage
    axis (the compiler's collectives over the other mesh axes are fine, every device of such a group
    takes the same branch). `branch_free`: fn runs either way and its result is selected, for layers
    whose own transfers XLA cannot compile inside a conditional (`slots_branch_free`); an idle slot
    then costs its work."""
    return when_updating(predicate, lambda works, state, *ops: (fn(*ops), state), (), *operands, axis=axis,
                         branch_free=branch_free)[0]


def when_updating(predicate, fn, state, *operands, axis, branch_free: bool = False):
    """(result, state) = fn(works, state, *operands) where `predicate` holds; elsewhere zeros shaped
    like the result and `state` as it came, at no cost then (`when`'s conditional and its limits).

    `state` (1F1B's ring of kept residuals, its gradient accumulators) goes through the conditional,
    so the branch writes into it in place. A result returned from the branch and written into the
    state outside was a copy of every residual and gradient in every tick, and the idle branch's zeros
    another. `works` is True inside the conditional; `branch_free`, fn always runs and `works` is the
    predicate, with which fn masks its own update (one row of the ring rather than all of it)."""
    # The zeros are made outside the branches: zeros made inside one get a sharding of their own,
    # which the compiler refuses when it differs from the other branch's ("Inconsistent conditional
    # sharding").
    zeros = zeros_of(lambda *ops: fn(True, *ops)[0], state, *operands, axis=axis)
    if branch_free:
        result, state = fn(predicate, state, *operands)
        return jax.tree.map(lambda a, z: jnp.where(predicate, a, z), varying(result, axis), zeros), state

    def works(state, *ops):
        result, state = fn(True, state, *ops)
        return varying(result, axis), varying(state, axis)

    return jax.lax.cond(predicate, works, lambda state, *_: (zeros, state), state, *operands)


def slots_branch_free(layout: Layout) -> bool:
    """Whether the stages run their slots branch-free (`when`): where the sequence is split, context
    parallelism's transfers run inside the slot, and inside a conditional XLA's compiler crashes on
    the ring's (SIGSEGV on CPU, JAX 0.10.2; docs/dev-notes.md)."""
    return layout.size("act_length") > 1
