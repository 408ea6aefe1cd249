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
  memory grows with the number of microbatches. Circular runs `repeats` rounds: stage s holds chunks
  s, s + S, s + 2S, ... of the layers (virtual stages), and a microbatch goes round the ring of stages
  `repeats` times, which divides the bubble by `repeats`.
- 1F1B (`one_f_one_b`) runs forward and backward work in the same tick (stage s: the forward of
  microbatch t - s and the backward of microbatch t - 2S + 2 + s), so a stage holds at most 2S - 1
  microbatches in flight whatever their number. It keeps only each in-flight microbatch's stage input
  and recomputes the stage in the backward slot (`jax.vjp`). The last stage ends each microbatch (final
  norm, head, loss) as soon as it leaves the layers and starts its backward in the same tick; the first
  stage embeds each microbatch as it enters. That is why 1F1B is driven from the training step with
  the model's three parts rather than from inside the model.

Parallel code, no layer: the stage, embedding and head arrive as functions.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from ushard.sharding import Layout, merge_rows, split_rows, use_layout

SCHEDULES = ("gpipe", "circular", "1f1b")
IDLE = -1


@dataclass(frozen=True)
class PipelineSchedule:
    """`parallel.pipeline_*`: the schedule's name, microbatches per step (per `train.grad_accum` part),
    and virtual stages per device (circular only)."""

    name: str = "gpipe"
    microbatches: int = 1
    repeats: int = 1


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
    """Stage inputs 1F1B keeps: stage 0 holds microbatch m from tick m to m + 2S - 2."""
    return 2 * stages - 1


# --------------------------------------------------------------------------- the forward schedules


def run_stages(stage, stack, x, args, layout: Layout):
    """The pipelined layer stack: (y, aux) = stage(chunk_{V-1}, ... stage(chunk_0, x, args) ..., args).

    stage(chunk, x, args) -> (x, aux) runs consecutive layers (`chunk`: `stack` with fewer rows) on one
    microbatch; `stack` is the stacked layers' pytree, [layers, ...] leaves; x [B, ...] and `args` (a
    pytree of per-row arrays [B, ...]) are split into microbatches. Returns y [B, ...] and the aux terms
    summed over layers and averaged over microbatches. Differentiable (autodiff of the tick loop).
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
                out = when(m != IDLE, chained, take(chunks, round_), start, take(args, m), axis=axis)
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


def one_f_one_b(first, stage, last, outer, stack, batch, layout: Layout):
    """Sums and gradients of Σ_m objective_m by the 1F1B schedule, without autodiff of the loop.

    For microbatch m (rows of every `batch` leaf): x = first(outer, m); x, aux_i = stage(chunk_i, x, m)
    for each chunk of layers in turn; (objective, sums) = last(outer, x, Σ aux_i, m). `outer` are the
    parameters outside the stack (replicated over the stages), `stack` the stacked layers.
    Returns (sums summed over microbatches, d outer, d stack) with d = gradient of Σ_m objective_m.
    """
    axis, stages, count = stage_axis(layout), layout.size("layers"), layout.pipeline.microbatches
    chunks = virtual_stages(stack, stages, 1)
    microbatches = jax.tree.map(lambda a: split_rows(a, count, layout), batch)
    schedule = jnp.asarray(one_f_one_b_table(stages, count))
    keep = ring_size(stages)
    forward = [(s, s + 1) for s in range(stages - 1)]
    backward = [(s + 1, s) for s in range(stages - 1)]
    chained = carry_aux(stage)

    def body(chunks, outer, microbatches):
        index = jax.lax.axis_index(axis)
        chunk = jax.tree.map(lambda c: c[0, 0], chunks)
        outer, microbatches = varying((outer, microbatches), axis)
        with use_layout(layout.inside_stage()):
            mb0 = take(microbatches, 0)
            aux = zeros_of(lambda c, o, mb: stage(c, first(o, mb), mb)[1], chunk, outer, mb0, axis=axis)

            def enter(outer, mb):  # the activation entering stage 0: (x, no aux yet)
                return first(outer, mb), aux

            def finish(outer, activation, mb):  # -> (sums, d outer, d activation) of the objective
                objective, pullback, sums = jax.vjp(lambda o, a: last(o, *a, mb), outer, activation, has_aux=True)
                return sums, *pullback(jnp.ones_like(objective))

            def stage_grads(chunk, activation, mb, d_out):  # recomputes the stage, then its backward
                return jax.vjp(lambda c, a: chained(c, a, mb), chunk, activation)[1](d_out)

            def enter_grads(outer, mb, d_activation):
                return jax.vjp(lambda o: enter(o, mb), outer)[1](d_activation)[0]

            zero_act = zeros_of(enter, outer, mb0, axis=axis)
            zero_sums = zeros_of(lambda *a: finish(*a)[0], outer, zero_act, mb0, axis=axis)
            ring = jax.tree.map(lambda a: jnp.zeros((keep, *a.shape), a.dtype), zero_act)
            grads = jax.tree.map(jnp.zeros_like, (chunk, outer))

            def tick(carry, row):
                received, d_received, ring, (d_chunk, d_outer), sums = carry
                f, b = row[index, 0], row[index, 1]
                mb_f, mb_b = take(microbatches, f), take(microbatches, b)
                # forward slot: stage 0 starts microbatch f, the others go on with what came in
                entered = when((index == 0) & (f != IDLE), enter, outer, mb_f, axis=axis)
                activation = jax.tree.map(lambda a, r: jnp.where(index == 0, a, r), entered, received)
                ring = put(ring, jnp.maximum(f, 0) % keep, activation, f != IDLE)
                out = when(f != IDLE, chained, chunk, activation, mb_f, axis=axis)
                # the last stage ends microbatch f and starts its backward in this same tick
                ended = (index == stages - 1) & (f != IDLE)
                sums_f, d_outer_head, d_out = when(ended, finish, outer, out, mb_f, axis=axis)
                d_out = jax.tree.map(lambda a, r: jnp.where(index == stages - 1, a, r), d_out, d_received)
                # backward slot: microbatch b through this stage from its kept input
                kept = take(ring, jnp.maximum(b, 0) % keep)
                d_chunk_b, d_activation = when(b != IDLE, stage_grads, chunk, kept, mb_b, d_out, axis=axis)
                d_outer_embed = when((index == 0) & (b != IDLE), enter_grads, outer, mb_b, d_activation, axis=axis)
                d_chunk, d_outer, sums = jax.tree.map(
                    jnp.add, (d_chunk, d_outer, sums), (d_chunk_b, add(d_outer_head, d_outer_embed), sums_f)
                )
                sent = jax.lax.ppermute(out, axis, forward)
                d_sent = jax.lax.ppermute(d_activation, axis, backward)
                return (sent, d_sent, ring, (d_chunk, d_outer), sums), None

            carry = (zero_act, zero_act, varying(ring, axis), varying(grads, axis), zero_sums)
            (_, _, _, (d_chunk, d_outer), sums), _ = jax.lax.scan(tick, carry, schedule)
        d_chunks = jax.tree.map(lambda g: g[None, None], d_chunk)
        return jax.lax.psum(sums, axis), jax.lax.psum(d_outer, axis), d_chunks

    run = jax.shard_map(body, mesh=layout.mesh, in_specs=(P(None, axis), P(), P()),
                        out_specs=(P(), P(), P(None, axis)), axis_names={axis})
    sums, d_outer, d_chunks = run(chunks, outer, microbatches)
    return sums, d_outer, jax.tree.map(lambda g, w: g.reshape(w.shape), d_chunks, stack)


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
    written, not the whole buffer)."""
    index = jnp.maximum(index, 0)
    return jax.tree.map(lambda buf, v: buf.at[index].set(jnp.where(where, v, buf[index])), tree, value)


def when(predicate, fn, *operands, axis):
    """fn(*operands) where `predicate` holds, zeros shaped like its result elsewhere, at no cost then.

    A `lax.cond` whose predicate differs between stages: nothing inside may communicate over the stage
    axis (the compiler's collectives over the other mesh axes are fine, every device of such a group
    takes the same branch)."""
    # The zeros are made outside the branches: zeros made inside one get a sharding of their own,
    # which the compiler refuses when it differs from the other branch's ("Inconsistent conditional
    # sharding").
    zeros = zeros_of(fn, *operands, axis=axis)
    return jax.lax.cond(predicate, lambda *ops: varying(fn(*ops), axis), lambda *_: zeros, *operands)


def varying(tree, axis, zeros: bool = False):
    """Marks values as differing between stages (shard_map's type check wants equal types in both
    branches of a cond and around a scan); with `zeros`, zeros of the given shapes."""
    def cast(x):
        if zeros:
            x = jnp.zeros(x.shape, x.dtype)
        return x if axis in _varying_axes(x) else jax.lax.pcast(x, (axis,), to="varying")

    return jax.tree.map(cast, tree)


def _varying_axes(x) -> frozenset:
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None)  # JAX 0.10: ManualAxisType; earlier: aval.vma
    return frozenset(mat.varying if mat is not None else getattr(aval, "vma", ()))
