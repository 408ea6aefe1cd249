"""Pipeline parallelism (ushard/parallel/pipeline.py): the schedule tables and their bubbles, each
schedule against a plain jnp reference, the model's training against one device, and memory.

The model cases cover every schedule with 2 and 4 stages, 4 and 8 microbatches, alone and with fsdp,
tensor, sequence (ring and all-gather) and expert parallelism; the full cross product, the rows that
others cover and the model-level memory check without a split sequence are `slow`
(`python -m pytest -m slow tests/test_pipeline.py`).
"""

import dataclasses
import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import SMALL_MOE, small_config
from helpers import (
    assert_same_training,
    collectives_in_branches,
    per_device_bytes,
    run_config,
    tree_relative_difference,
)
from ushard import build
from ushard.config import MESH_AXES
from ushard.data.packing import FIELDS as BATCH_FIELDS
from ushard.mesh import build_mesh
from ushard.parallel.pipeline import (
    IDLE,
    PipelineSchedule,
    StageTail,
    accumulate,
    bubble_fraction,
    forward_table,
    keeps_layer_rows,
    layer_rows,
    one_f_one_b,
    one_f_one_b_table,
    ring_size,
    run_stages,
    stacked,
    when_updating,
)
from ushard.sharding import Layout, use_layout

# --------------------------------------------------------------------------- the schedule tables

SHAPES = [(2, 4, 1), (2, 3, 2), (4, 4, 2), (4, 9, 3), (3, 7, 1)]  # (stages, microbatches, repeats)


@pytest.mark.parametrize("stages, microbatches, repeats", SHAPES)
def test_forward_table_runs_each_microbatch_through_every_virtual_stage_in_order(stages, microbatches, repeats):
    table = forward_table(stages, microbatches, repeats)
    assert table.shape == (repeats * microbatches + stages - 1, stages, 2)
    tick = {}  # (stage, microbatch, round) -> tick
    for t, s in itertools.product(range(table.shape[0]), range(stages)):
        m, r = table[t, s]
        if m != IDLE:
            assert (s, m, r) not in tick
            tick[s, m, r] = t
    assert len(tick) == stages * microbatches * repeats
    for s, m, r in tick:
        if s > 0:  # handed over by the stage before, one tick earlier
            assert tick[s, m, r] == tick[s - 1, m, r] + 1
        elif r > 0:  # came back from the last stage: sent at tick t, taken in at t + 1 or later
            assert tick[0, m, r] > tick[stages - 1, m, r - 1]


@pytest.mark.parametrize("stages, microbatches", [(2, 4), (4, 2), (4, 8), (3, 5)])
def test_one_f_one_b_table_keeps_few_microbatches_in_flight(stages, microbatches):
    table = one_f_one_b_table(stages, microbatches)
    forward, backward = {}, {}
    for t, s in itertools.product(range(table.shape[0]), range(stages)):
        f, b = table[t, s]
        if f != IDLE:
            forward[s, f] = t
        if b != IDLE:
            backward[s, b] = t
    assert len(forward) == len(backward) == stages * microbatches
    keep = ring_size(stages)
    for s, m in forward:
        if s > 0:
            assert forward[s, m] == forward[s - 1, m] + 1
        # the last stage turns a microbatch round in its own tick; the others one tick after their successor
        assert backward[s, m] == (forward[s, m] if s == stages - 1 else backward[s + 1, m] + 1)
        # its input slot (m mod keep) is not reused by a later microbatch before its backward
        later = [n for n in range(m + 1, microbatches) if n % keep == m % keep]
        assert all(forward[s, n] > backward[s, m] for n in later)
    in_flight = max(sum(forward[s, m] <= t <= backward[s, m] for m in range(microbatches))
                    for s in range(stages) for t in range(table.shape[0]))
    assert in_flight == min(keep, microbatches)  # bounded by the stages, not the microbatches


def simulated_bubble(schedule, stages, microbatches, repeats):
    """Idle share of a step from the tables: ticks in lock-step, each as long as its busiest stage
    (forward 1, backward 2), idle slots free. GPipe's backward is the mirrored forward loop."""
    if schedule == "1f1b":
        table = one_f_one_b_table(stages, microbatches)
        busy = (table[..., 0] != IDLE) * 1.0 + (table[..., 1] != IDLE) * 2.0
        return 1 - microbatches * 3.0 / busy.max(axis=1).sum()
    rounds = repeats if schedule == "circular" else 1
    table = forward_table(stages, microbatches, rounds)
    return 1 - rounds * microbatches / table.shape[0]


@pytest.mark.parametrize("schedule", ["gpipe", "circular", "1f1b"])
@pytest.mark.parametrize("stages, microbatches, repeats", SHAPES)
def test_bubble_fraction_is_what_the_tables_leave_idle(schedule, stages, microbatches, repeats):
    expected = simulated_bubble(schedule, stages, microbatches, repeats)
    assert bubble_fraction(schedule, stages, microbatches, repeats) == pytest.approx(expected)


def test_bubble_fraction_examples():
    assert bubble_fraction("1f1b", 4, 32) == pytest.approx(3 / 35)
    assert bubble_fraction("gpipe", 2, 32) == pytest.approx(1 / 33)
    assert bubble_fraction("circular", 4, 8, repeats=2) == pytest.approx(3 / 19)
    assert bubble_fraction("gpipe", 4, 8, repeats=2) == bubble_fraction("gpipe", 4, 8)  # repeats are circular's
    with pytest.raises(ValueError, match="zigzag"):
        bubble_fraction("zigzag", 4, 8)


# --------------------------------------------------------------------------- against plain jnp

TOY_LAYERS, TOY_DIM, TOY_ROWS, TOY_VOCAB = 8, 8, 16, 11


def toy_stage(chunk, x, mb):
    """A chunk of layers x -> tanh(x W + b) * row scale, each reporting sum(W^2) as an aux term."""
    def layer(x, w):
        return jnp.tanh(x @ w["w"] + w["b"]) * mb["scale"][:, None], {"l2": jnp.sum(w["w"] ** 2)}

    x, aux = jax.lax.scan(layer, x, chunk)
    return x, {"l2": jnp.sum(aux["l2"])}


def toy_first(outer, mb):
    return outer["embedding"][mb["tokens"]]


def toy_last(outer, x, aux, mb, tail=()):
    """(squared error + 0.01 * rows * aux, sums): a sum over rows, like the training objective."""
    error = jnp.sum((x @ outer["head"] - mb["targets"]) ** 2)
    rows = jnp.float32(x.shape[0])
    return error + 0.01 * rows * aux["l2"], {"error": error, "rows": rows}


def toy_reference(outer, stack, batch):
    x, aux = toy_stage(stack, toy_first(outer, batch), batch)
    return toy_last(outer, x, aux, batch)


@pytest.fixture(scope="module")
def toy():
    keys = jax.random.split(jax.random.key(0), 6)
    stack = {"w": jax.random.normal(keys[0], (TOY_LAYERS, TOY_DIM, TOY_DIM)) / np.sqrt(TOY_DIM),
             "b": 0.1 * jax.random.normal(keys[1], (TOY_LAYERS, TOY_DIM))}
    outer = {"embedding": jax.random.normal(keys[2], (TOY_VOCAB, TOY_DIM)),
             "head": jax.random.normal(keys[3], (TOY_DIM, 3))}
    batch = {"tokens": jax.random.randint(keys[4], (TOY_ROWS,), 0, TOY_VOCAB),
             "targets": jax.random.normal(keys[5], (TOY_ROWS, 3)), "scale": jnp.linspace(0.5, 1.5, TOY_ROWS)}
    reference = jax.jit(jax.value_and_grad(toy_reference, argnums=(0, 1), has_aux=True))
    (objective, sums), grads = reference(outer, stack, batch)
    return outer, stack, batch, objective, sums, grads


def pipeline_layout(schedule, stages, microbatches, repeats=1) -> Layout:
    shape = {axis: 1 for axis in MESH_AXES} | {"pipeline": stages}
    mesh = build_mesh(shape, devices=jax.devices()[:stages])
    return Layout.create(mesh, pipeline=PipelineSchedule(schedule, microbatches, repeats))


def test_circular_forward_loop_and_its_autodiff_match_the_plain_stack(toy):
    """4 stages x 2 rounds of one layer each; the aux terms travel with the activations."""
    outer, stack, batch, objective, _, grads = toy
    layout = pipeline_layout("circular", 4, 4, repeats=2)

    def pipelined(outer, stack, batch):
        with use_layout(layout):
            x, aux = run_stages(toy_stage, stack, toy_first(outer, batch), {"scale": batch["scale"]}, layout)
        return toy_last(outer, x, aux, batch)[0]

    got, got_grads = jax.jit(jax.value_and_grad(pipelined, argnums=(0, 1)))(outer, stack, batch)
    np.testing.assert_allclose(got, objective, rtol=1e-6)
    assert tree_relative_difference(got_grads, grads) < 1e-6


def test_one_f_one_b_matches_autodiff_of_the_plain_stack(toy):
    """4 stages, fewer microbatches than stages: sums and gradients of every parameter."""
    outer, stack, batch, _, sums, grads = toy
    layout = pipeline_layout("1f1b", 4, 2)

    def pipelined(outer, stack, batch):
        with use_layout(layout):
            return one_f_one_b(toy_first, toy_stage, toy_last, outer, stack, batch, layout)

    got_sums, d_outer, d_stack, _ = jax.jit(pipelined)(outer, stack, batch)
    np.testing.assert_allclose(got_sums["error"], sums["error"], rtol=1e-6)
    assert float(got_sums["rows"]) == TOY_ROWS
    assert tree_relative_difference((d_outer, d_stack), grads) < 1e-6


def toy_tail(params, x, ahead, mb):
    """A multi-token-prediction-like module: the layers' output and an embedding looked up outside."""
    return jnp.tanh(x @ params["w"] + ahead) * mb["scale"][:, None]


def toy_ahead(outer, mb):
    return outer["embedding"][mb["ahead"]]  # the embedding shared with `toy_first`


def toy_last_with_tail(outer, x, aux, mb, tail):
    objective, sums = toy_last(outer, x, aux, mb)
    tail_error = jnp.sum((tail @ outer["head"] - mb["targets"]) ** 2)
    return objective + 0.5 * tail_error, {**sums, "tail_error": tail_error}


@pytest.mark.parametrize("split_head", [True, False])
def test_one_f_one_b_runs_a_tail_on_the_last_stage_as_autodiff_of_the_plain_stack(toy, split_head):
    """A `StageTail` after the last stage's layers: sums and gradients of every parameter, the
    embedding's from both of its uses (the first stage's input, the tail's), with the vocabulary split
    over the stages and whole on each."""
    outer, stack, batch, _, _, _ = toy
    params = {"w": jax.random.normal(jax.random.key(7), (TOY_DIM, TOY_DIM)) / np.sqrt(TOY_DIM)}
    batch = {**batch, "ahead": (batch["tokens"] * 3 + 1) % TOY_VOCAB}

    def reference(outer, stack, params, tail_embeds=True):
        x, aux = toy_stage(stack, toy_first(outer, batch), batch)
        ahead = toy_ahead(outer if tail_embeds else jax.lax.stop_gradient(outer), batch)
        return toy_last_with_tail(outer, x, aux, batch, toy_tail(params, x, ahead, batch))

    (_, sums), grads = jax.jit(jax.value_and_grad(reference, argnums=(0, 1, 2), has_aux=True))(outer, stack, params)
    stages = 4
    mesh = build_mesh({axis: 1 for axis in MESH_AXES} | {"pipeline": stages}, devices=jax.devices()[:stages])
    layout = Layout.create(mesh, pipeline=PipelineSchedule("1f1b", 2), split_head=split_head)

    def pipelined(outer, stack, params, batch):
        with use_layout(layout):
            return one_f_one_b(toy_first, toy_stage, toy_last_with_tail, outer, stack, batch, layout,
                               tail=StageTail(params, inputs=toy_ahead, run=toy_tail))

    got_sums, d_outer, d_stack, d_params = jax.jit(pipelined)(outer, stack, params, batch)
    np.testing.assert_allclose(got_sums["tail_error"], sums["tail_error"], rtol=1e-6)
    np.testing.assert_allclose(got_sums["error"], sums["error"], rtol=1e-6)
    assert tree_relative_difference((d_outer, d_stack, d_params), grads) < 1e-6
    # The tail's share of the embedding's gradient is not small: the first stage's use alone fails.
    first_use_only = jax.grad(lambda o: reference(o, stack, params, tail_embeds=False)[0])(outer)
    assert tree_relative_difference(first_use_only["embedding"], grads[0]["embedding"]) > 0.01


def test_when_updating_writes_the_state_inside_the_conditional_only_where_the_slot_works():
    """1F1B's ring and gradient accumulators go through the slot's conditional: on the stage whose
    slot works, fn's result and its update of one row; on the idle one, zeros and the state as it
    came. Compiled, nothing selects between row-shaped arrays outside it (that select, and the zeros
    the idle branch returned for a row, were copies of every residual in every tick); branch-free,
    the predicate masks the same update."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("stage",))
    state = jnp.arange(2 * 7 * 13 * 5, dtype=jnp.float32).reshape(2, 7, 13, 5)  # [stage, rows, 13, 5]

    def fn(works, state, x):
        row = jnp.sin(x) * 3  # [13, 5]
        new = state.at[4].set(row if works is True else jnp.where(works, row, state[4]))
        return x.sum(axis=1), new  # [13]

    def body(state, branch_free):
        works = jax.lax.axis_index("stage") == 0
        x = jnp.full((13, 5), 0.5)
        result, state = when_updating(works, fn, state[0], x, axis="stage", branch_free=branch_free)
        return result[None], state[None]

    for branch_free in (False, True):
        run = jax.jit(jax.shard_map(lambda s, b=branch_free: body(s, b), mesh=mesh, in_specs=jax.P("stage"),
                                    out_specs=jax.P("stage")))
        result, new = run(state)
        np.testing.assert_array_equal(result[0], np.full(13, 2.5, np.float32))
        np.testing.assert_array_equal(result[1], np.zeros(13, np.float32))
        expected = np.array(state)
        expected[0, 4] = np.sin(0.5) * 3
        np.testing.assert_allclose(new, expected, rtol=1e-6)
        if not branch_free:
            hlo = run.lower(state).compile().as_text()
            assert "conditional(" in hlo
            assert not re.findall(r"= \w+\[13,5\]\S* select\(", hlo)


# --------------------------------------------------------------------------- the model against one device

DEEP = {"model.n_layers": 8}  # 8 layers: 4 stages x 2 rounds of one layer


def pipelined(schedule, stages, microbatches, settings=None, **axes):
    """The overrides of a pipelined layout: `axes` are mesh sizes, `settings` any other keys."""
    overrides = {**DEEP, "mesh.pipeline": stages, "parallel.pipeline_schedule": schedule,
                 "parallel.pipeline_microbatches": microbatches}
    if schedule == "circular":
        overrides["parallel.pipeline_repeats"] = 2
    return overrides | {f"mesh.{axis}": size for axis, size in axes.items()} | (settings or {})


def devices_for(settings):
    return jax.devices()[: int(np.prod([v for k, v in settings.items() if k.startswith("mesh.")]))]


# Each schedule: 2 and 4 stages, 4 and 8 microbatches, alone and with fsdp=2 (1F1B's with tensor=2 too);
# on the way, what the pipeline composes with: train.grad_accum (its parts run one after another, each
# cut into the pipeline's microbatches), remat, ZeRO-3 with the gathered weights kept.
ACCUM, REMAT = {"train.grad_accum": 2}, {"model.remat": "full"}
KEEP_GATHERED = {"parallel.reshard_after_forward": False}
WHOLE_HEAD = {"parallel.pipeline_head": "whole"}  # every stage holds the whole vocabulary (as across slices)
ALL_GATHER, RING = {"parallel.context_parallel": "all_gather"}, {"parallel.context_parallel": "ring"}
LAYOUTS = {
    "gpipe_2x8_accum2": pipelined("gpipe", 2, 8, ACCUM),
    "gpipe_4x4_fsdp2_remat": pipelined("gpipe", 4, 4, REMAT, fsdp=2),
    "circular_2x4": pipelined("circular", 2, 4),
    "circular_4x8_fsdp2_keep_gathered": pipelined("circular", 4, 8, KEEP_GATHERED, fsdp=2),
    "1f1b_4x8_remat": pipelined("1f1b", 4, 8, REMAT),
    "1f1b_2x4_tensor2_fsdp2_accum2": pipelined("1f1b", 2, 4, ACCUM, tensor=2, fsdp=2),
    "1f1b_4x4_fsdp2_whole_head": pipelined("1f1b", 4, 4, WHOLE_HEAD, fsdp=2),
    "gpipe_2x4_whole_head": pipelined("gpipe", 2, 4, WHOLE_HEAD),
    # Context parallelism inside the stages (a map nested in the stage's map; the ring's slots branch-free).
    "gpipe_2x4_sequence2_fsdp2": pipelined("gpipe", 2, 4, ALL_GATHER, sequence=2, fsdp=2),
    "1f1b_2x4_sequence2_tensor2_ring": pipelined("1f1b", 2, 4, RING, sequence=2, tensor=2),
}
SWEEP = {
    f"{schedule}_{stages}x{count}{'_fsdp2' if fsdp > 1 else ''}": pipelined(schedule, stages, count, fsdp=fsdp)
    for schedule, stages, count, fsdp in itertools.product(("gpipe", "circular", "1f1b"), (2, 4), (4, 8), (1, 2))
}


@pytest.fixture(scope="module")
def one_device(stdlib_batches):
    return run_config(small_config(**DEEP), jax.devices()[:1], stdlib_batches)


def check_layout(settings, reference, batches):
    got = run_config(small_config(**settings), devices_for(settings), batches)
    assert_same_training(got, reference)
    # The stages are a sharding of the `layers` axis: the same parameter shapes (checkpoints do not
    # depend on the layout), each device holding its stage's layers, activations sent stage to stage.
    assert jax.tree.map(np.shape, got["params"]) == jax.tree.map(np.shape, reference["params"])
    w_up = ("blocks", "mlp", "w_up")
    for shardings in (got["init_shardings"].params, got["grad_shardings"]):
        assert spec_at(shardings, w_up)[0] == "pipeline"
    # The vocabulary is split over the stages unless every stage holds the whole head.
    vocab = spec_at(got["init_shardings"].params, ("embedding",))[0]
    split_head = settings.get("parallel.pipeline_head", "auto") != "whole"
    assert ("pipeline" in (vocab if isinstance(vocab, tuple) else (vocab,))) == split_head
    assert re.search(r"= \S+ collective-permute(?:-start)?\(", got["hlo"])


def spec_at(tree, path):
    for key in path:
        tree = tree[key]
    return tree.spec


# In the slow tier with the sweep, for the default suite's time: the default rows keep each schedule
# (GPipe and 1F1B with a split sequence, circular with ZeRO-3's kept weights, 1F1B with experts below);
# the whole head, grad_accum and remat inside a pipeline are checked in the slow tier (`-m slow`).
# 1F1B and GPipe with a split sequence too: the layer-rows test below runs 1F1B's over sequence=2 x
# tensor=2, and the split sequence inside GPipe's stages runs the same stage code.
SLOW_LAYOUTS = ("gpipe_2x8_accum2", "circular_2x4", "gpipe_2x4_whole_head", "1f1b_4x8_remat",
                "1f1b_2x4_tensor2_fsdp2_accum2", "1f1b_4x4_fsdp2_whole_head", "gpipe_4x4_fsdp2_remat",
                "1f1b_2x4_sequence2_tensor2_ring", "gpipe_2x4_sequence2_fsdp2")


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_LAYOUTS else n
                                  for n in LAYOUTS])
def test_pipeline_matches_one_device(one_device, stdlib_batches, name):
    check_layout(LAYOUTS[name], one_device, stdlib_batches)


@pytest.mark.slow
@pytest.mark.parametrize("name", SWEEP)
def test_pipeline_sweep_matches_one_device(one_device, stdlib_batches, name):
    check_layout(SWEEP[name], one_device, stdlib_batches)


def tick_weights(hlo: str, ticks: int) -> list[str]:
    """Arrays of `ticks` rows of the small model's MLP weights ([ticks, layers a chunk, 64, 128] or
    transposed): a copy of a chunk's weights for each tick."""
    return sorted(set(re.findall(rf"\w+\[{ticks},\d+,(?:64,128|128,64)\]", hlo)))


def test_a_circular_tick_under_remat_keeps_no_chunk_of_weights(one_device, stdlib_batches):
    """Under remat each GPipe or circular tick runs under a remat boundary keeping what the layers'
    remat keeps (`models.stack.tick_policy`), so the backward pass takes its chunk of weights again
    from the stage's: the same training as one device, and no [ticks, ...] copy of a chunk's weights
    in the step. Without remat the tick keeps them (three: the MLP's weights), as it did under remat
    before (the conditional's residuals are its outputs)."""
    settings = pipelined("circular", 2, 4, REMAT)
    got = run_config(small_config(**settings), devices_for(settings), stdlib_batches)
    assert_same_training(got, one_device)
    ticks = 2 * 4 + 2 - 1
    assert not tick_weights(got["hlo"], ticks)
    setup = build(small_config(**{**settings, "model.remat": "none"}), devices_for(settings))
    shape = (setup.config.train.batch_size, setup.config.train.seq_len)
    batch = {field: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=setup.layout.batch) for field in BATCH_FIELDS}
    traced = str(jax.make_jaxpr(setup.steps.loss_and_grads)(setup.steps.abstract_state().params, batch))
    assert len(tick_weights(traced, ticks)) >= 2, tick_weights(traced, ticks)


UNROLLED = {"model.scan_unroll": 4}  # each of 2 stages' 4 layers unrolled, as configs/bench_1b.py's 16


# The split sequence's row (branch-free slots, tensor and sequence in the stages) in the slow tier
# (`-m slow`), for the suite's time: the rows alone are the property, and its parts are other rows'.
@pytest.mark.parametrize("settings", [pipelined("1f1b", 2, 8, UNROLLED),
                                      pytest.param(pipelined("1f1b", 2, 8, {**UNROLLED, **RING}, sequence=2, tensor=2),
                                                   marks=pytest.mark.slow)],
                         ids=["alone", "sequence2_tensor2_ring"])
def test_one_f_one_b_keeps_its_ring_in_layer_rows_where_the_layer_loop_unrolls(one_device, stdlib_batches,
                                                                              settings):
    """The same training as one device, and no residual or gradient stacked over the stage's 4 layers
    ([4, ...]) is concatenated in the step (35 times with the ring stacked, alone). Microbatches of
    2 rows, so no other array starts with a 4. With a split sequence the slots are branch-free."""
    got = run_config(small_config(**settings), devices_for(settings), stdlib_batches)
    assert_same_training(got, one_device)
    assert not re.findall(r"= \w+\[4,[\d,]*\]\S* concatenate\(", got["hlo"])


def test_the_ring_keeps_layer_rows_where_the_stages_layers_are_unrolled():
    layout = pipeline_layout("1f1b", 2, 4)
    assert not keeps_layer_rows(layout, 4)  # a loop of one layer a trip (model.scan_unroll=1)
    unrolled = dataclasses.replace(layout, pipeline=dataclasses.replace(layout.pipeline, layer_unroll=4))
    assert keeps_layer_rows(unrolled, 4) and keeps_layer_rows(unrolled, 2)
    assert not keeps_layer_rows(unrolled, 8)
    config = small_config(**pipelined("1f1b", 2, 4, UNROLLED))
    assert build(config, jax.devices()[:2]).plan.pipeline.layer_unroll == 4


def test_layer_rows_restack_and_accumulate_layer_by_layer():
    layers = 3
    stacked_residual, other = jnp.arange(3 * 4 * 2.0).reshape(3, 4, 2), jnp.ones((5, 2))
    rows = layer_rows([stacked_residual, other, jnp.float32(2)], layers)
    assert len(rows[0]) == layers and rows[1] is other
    np.testing.assert_array_equal(stacked(rows)[0], stacked_residual)
    assert layer_rows([stacked_residual], 0)[0] is stacked_residual
    acc = jnp.full((1, 1, 1, 3, 4, 2), 0.5)
    expected = acc + stacked_residual[None, None, None]
    for layers_apart in (layers, 0):
        np.testing.assert_array_equal(accumulate(acc, stacked_residual, True, layers_apart), expected)
        np.testing.assert_array_equal(accumulate(acc, stacked_residual, jnp.bool_(True), layers_apart), expected)
        np.testing.assert_array_equal(accumulate(acc, stacked_residual, jnp.bool_(False), layers_apart), acc)


# --------------------------------------------------------------------------- mixture of experts in the stages

# tiny_moe at the test sizes, 4 layers (2 stages x 2 rounds for circular), dropless, the routing bias
# moving. The reference is one device with each step's batch in the 4 parts the pipeline cuts it
# into (train.grad_accum): 1F1B weights each microbatch's aux terms by its token count as
# grad_accum does, and matches it to the suite's tolerance.
MOE = {**SMALL_MOE, "model.n_layers": 4}
# GPipe and circular average the microbatches' aux terms (balancing loss, expert loads) equally;
# their reference weights them by each microbatch's target tokens, which differ by a few here: the
# reported terms differ by up to 1e-3 relative, and through the balancing loss's gradient the
# parameters by about 1e-5 after three steps. They run with the bias still: it moves by the sign of
# an expert's load against the mean, which can tie in whole tokens and then tips either way.
STILL = {"model.moe.bias_update_rate": 0.0}
MOE_RTOL, MOE_AUX_RTOL = 5e-5, 2e-3
MOE_LAYOUTS = {
    "1f1b_2x4_expert2_fsdp2": pipelined("1f1b", 2, 4, MOE, expert=2, fsdp=2),
    # Every expert's width split over mesh.expert inside the stages (parallel.expert_split).
    "1f1b_2x4_expert2_fsdp2_width": pipelined("1f1b", 2, 4, {**MOE, "parallel.expert_split": "width"},
                                              expert=2, fsdp=2),
    "circular_2x4_expert4": pipelined("circular", 2, 4, {**MOE, **STILL}, expert=4),
    # The ragged dispatch reports its busiest device where the experts are over devices: 1F1B takes
    # the aux terms' structure from inside its slots (it failed on the missing key before).
    "1f1b_2x4_expert2_fsdp2_ragged": pipelined("1f1b", 2, 4, {**MOE, "model.moe.dispatch": "ragged"}, expert=2,
                                               fsdp=2),
    # In the slow sweep (`-m slow`): the suite's time, not their result (both matched when added).
    "1f1b_2x4_expert2_tensor2": pipelined("1f1b", 2, 4, MOE, expert=2, tensor=2),
    "gpipe_2x4_expert2_fsdp2": pipelined("gpipe", 2, 4, {**MOE, **STILL}, expert=2, fsdp=2),
}
# The circular one and the width split too, for the suite's time: the default tier keeps 1F1B with
# experts (the width split's parity outside the stages is in test_parallel_parity.py's default tier).
# 1F1B with experts in the stages is in the default tier as the layer-rows test below (the same
# layout with the stages' layers unrolled, its placement checked the same way).
SLOW_MOE_LAYOUTS = ("1f1b_2x4_expert2_tensor2", "gpipe_2x4_expert2_fsdp2", "circular_2x4_expert4",
                    "1f1b_2x4_expert2_fsdp2_width", "1f1b_2x4_expert2_fsdp2", "1f1b_2x4_expert2_fsdp2_ragged")


def one_device_moe_run(settings, batches):
    """The MoE model on one device, each step's batch in the 4 parts the pipeline cuts it into."""
    return run_config(small_config("tiny_moe", **settings, **{"train.grad_accum": 4}), jax.devices()[:1], batches)


@pytest.fixture(scope="module")
def one_device_moe_moving(stdlib_batches):
    return one_device_moe_run(MOE, stdlib_batches)


@pytest.fixture(scope="module")
def one_device_moe_still(stdlib_batches):
    return one_device_moe_run({**MOE, **STILL}, stdlib_batches)


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_MOE_LAYOUTS else n
                                  for n in MOE_LAYOUTS])
def test_moe_pipeline_matches_one_device(request, stdlib_batches, name):
    settings = MOE_LAYOUTS[name]
    got = run_config(small_config("tiny_moe", **settings), devices_for(settings), stdlib_batches)
    if settings["parallel.pipeline_schedule"] == "1f1b":
        assert_same_training(got, request.getfixturevalue("one_device_moe_moving"))
    else:
        reference = request.getfixturevalue("one_device_moe_still")
        assert_same_training({**got, "aux": []}, reference, MOE_RTOL, MOE_RTOL)
        for got_aux, ref_aux in zip(got["aux"], reference["aux"], strict=True):
            assert got_aux.keys() == ref_aux.keys()
            np.testing.assert_allclose([got_aux[k] for k in ref_aux], list(ref_aux.values()), rtol=MOE_AUX_RTOL)
    # Each stage holds its layers' experts split over mesh.expert; tokens reach them by all-to-all
    # (with the widths split, each stage holds a slice of every expert and gathers the tokens).
    w_up = spec_at(got["init_shardings"].params, ("blocks", "mlp", "experts", "w_up"))
    if settings.get("parallel.expert_split") == "width":
        assert w_up[0] == "pipeline" and w_up[1] is None and "expert" in w_up[3], w_up
        assert re.search(r" all-gather(?:-start)?\(", got["hlo"]) and not re.search(r" all-to-all", got["hlo"])
    else:
        assert_experts_split_in_the_stages(got)


def assert_experts_split_in_the_stages(got):
    """Each stage holds its layers' experts split over mesh.expert; tokens reach them by all-to-all."""
    w_up = spec_at(got["init_shardings"].params, ("blocks", "mlp", "experts", "w_up"))
    assert w_up[0] == "pipeline" and w_up[1] == "expert", w_up
    assert re.search(r" all-to-all(?:-start)?\(", got["hlo"])
    assert re.search(r"= \S+ collective-permute(?:-start)?\(", got["hlo"])


def test_moe_one_f_one_b_keeps_layer_rows_with_the_experts_split_in_the_stages(stdlib_batches, one_device_moe_moving):
    """The ring in layer rows (the stages' 2 layers unrolled) with expert=2 inside the stages: no
    collective-permute in the slots' conditionals (a row fetched from the device holding its layer was
    one, naming devices of stages that took the other branch: a deadlock), and the same training as
    one device."""
    settings = pipelined("1f1b", 2, 4, {**MOE, "model.scan_unroll": 2}, expert=2, fsdp=2)
    config = small_config("tiny_moe", **settings)
    # Checked before any step runs: with a permute inside a branch the run hangs in XLA:CPU's
    # rendezvous instead of failing.
    def no_permute_in_branches(hlo):
        assert not collectives_in_branches(hlo, "collective-permute")

    got = run_config(config, devices_for(settings), stdlib_batches, before_running=no_permute_in_branches)
    assert_same_training(got, one_device_moe_moving)
    assert_experts_split_in_the_stages(got)


# --------------------------------------------------------------------------- memory
# Microbatches of the same size, 2 x stages then 4 x stages of them (2 stages: 4 then 8): what 1F1B
# holds is bounded by the stages, what GPipe's autodiff keeps grows with the microbatches.


def toy_step_bytes(schedule, microbatches, rows_per_microbatch=16, dim=64, layers=4):
    """Per-device bytes (arguments + temporaries) of the toy's compiled gradients on 2 stages."""
    layout = pipeline_layout(schedule, 2, microbatches)
    rows = rows_per_microbatch * microbatches
    f32 = jnp.float32
    outer = {"embedding": jax.ShapeDtypeStruct((TOY_VOCAB, dim), f32), "head": jax.ShapeDtypeStruct((dim, 3), f32)}
    stack = {"w": jax.ShapeDtypeStruct((layers, dim, dim), f32), "b": jax.ShapeDtypeStruct((layers, dim), f32)}
    batch = {"tokens": jax.ShapeDtypeStruct((rows,), jnp.int32), "targets": jax.ShapeDtypeStruct((rows, 3), f32),
             "scale": jax.ShapeDtypeStruct((rows,), f32)}

    def gpipe_grads(outer, stack, batch):
        def objective(outer, stack):
            x, aux = run_stages(toy_stage, stack, toy_first(outer, batch), {"scale": batch["scale"]}, layout)
            return toy_last(outer, x, aux, batch)[0]

        with use_layout(layout):
            return jax.grad(objective, argnums=(0, 1))(outer, stack)

    def one_f_one_b_grads(outer, stack, batch):
        with use_layout(layout):
            return one_f_one_b(toy_first, toy_stage, toy_last, outer, stack, batch, layout)

    grads = one_f_one_b_grads if schedule == "1f1b" else gpipe_grads
    return per_device_bytes(jax.jit(grads).lower(outer, stack, batch).compile().memory_analysis())


def assert_flat_and_growing(one_f_one_b_bytes, gpipe_bytes):
    assert one_f_one_b_bytes[1] < 1.05 * one_f_one_b_bytes[0], one_f_one_b_bytes  # the inputs grow
    assert gpipe_bytes[1] > 1.4 * gpipe_bytes[0], gpipe_bytes
    assert one_f_one_b_bytes[0] < gpipe_bytes[0]


def test_one_f_one_b_memory_is_bounded_by_the_stages_gpipe_grows_with_the_microbatches():
    """On the toy (measured: 1F1B 188.9 -> 191.4 kB, +1.4%; GPipe 676 -> 1071 kB, +58%)."""
    assert_flat_and_growing(*[[toy_step_bytes(schedule, count) for count in (4, 8)] for schedule in ("1f1b", "gpipe")])


def compiled_loss_and_grads(schedule, microbatches, rows_per_microbatch=2, fsdp=1, sequence=1):
    """The model's compiled loss and gradients on 2 stages (x `fsdp` x `sequence`, ring attention)."""
    config = small_config(**{"mesh.pipeline": 2, "mesh.fsdp": fsdp, "mesh.sequence": sequence,
                             "parallel.pipeline_schedule": schedule, "parallel.pipeline_microbatches": microbatches,
                             "train.batch_size": rows_per_microbatch * microbatches * fsdp})
    setup = build(config, devices=jax.devices()[:2 * fsdp * sequence])
    shape = (config.train.batch_size, config.train.seq_len)
    batch = {field: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=setup.layout.batch) for field in BATCH_FIELDS}
    return setup.steps.loss_and_grads.lower(setup.steps.abstract_state().params, batch).compile()


def step_bytes(schedule, microbatches, rows_per_microbatch=2, sequence=1):
    """Per-device bytes (arguments + temporaries) of the model's compiled loss and gradients on 2 stages."""
    compiled = compiled_loss_and_grads(schedule, microbatches, rows_per_microbatch, sequence=sequence)
    return per_device_bytes(compiled.memory_analysis())


@pytest.mark.slow
def test_the_models_memory_under_1f1b_is_bounded_by_the_stages():
    """The model's loss and gradients (measured: 1F1B 1.350 -> 1.360 MB, GPipe 5.26 -> 9.28 MB)."""
    assert_flat_and_growing(*[[step_bytes(schedule, count) for count in (4, 8)] for schedule in ("1f1b", "gpipe")])


@pytest.mark.slow  # the suite's time
def test_the_models_memory_under_1f1b_with_a_split_sequence_stays_flat():
    """sequence=2 (ring attention inside the stages, their slots branch-free): what 1F1B holds is still
    bounded by the stages as the microbatches double, and each device holds half of each sequence."""
    one_f_one_b = [step_bytes("1f1b", count, sequence=2) for count in (4, 8)]
    assert one_f_one_b[1] < 1.05 * one_f_one_b[0], one_f_one_b


# --------------------------------------------------------------------------- data parallelism


def loop_collectives(hlo: str) -> list[str]:
    """The collectives (kind and replica groups, sorted) in what the compiled while loops run: their
    bodies and every computation those call."""
    computations = dict(re.findall(r"^(?:ENTRY )?%?([\w.\-]+) [^\n]*\{\n(.*?)^\}", hlo, re.S | re.M))
    inside = set(re.findall(r"body=%?([\w.\-]+)", hlo))
    frontier = list(inside)
    while frontier:
        for callee in re.findall(r"%([\w.\-]+)", computations.get(frontier.pop(), "")):
            if callee in computations and callee not in inside:
                inside.add(callee)
                frontier.append(callee)
    kinds = r"all-gather|reduce-scatter|all-reduce|all-to-all|collective-permute"
    return sorted(m.group(1) + " " + m.group(2) for name in inside
                  for m in re.finditer(rf"= \S+ ({kinds})(?:-start)?\(.*?(replica_groups=\S+|source_target_pairs=\S+)",
                                       computations[name]))


def test_one_f_one_b_gathers_weights_and_reduces_gradients_once_per_step():
    """fsdp=2 beside 2 stages adds no collective to 1F1B's tick loop: the stage's weights are gathered
    before it and the data-parallel devices reduce their gradients after it, not once per microbatch.
    (The loop's own collectives, the same in both, move activations between stages and reduce the
    vocabulary-split embedding and loss over the stages.)"""
    alone, beside_fsdp = (loop_collectives(compiled_loss_and_grads("1f1b", 4, fsdp=f).as_text()) for f in (1, 2))
    assert alone and len(beside_fsdp) == len(alone), (alone, beside_fsdp)
    assert not [c for c in beside_fsdp if c.startswith(("all-gather", "reduce-scatter"))], beside_fsdp


def test_the_start_up_lines_say_where_the_head_runs():
    for head, where in (("auto", "split over the stages"), ("whole", "whole on every stage")):
        settings = pipelined("1f1b", 2, 4, {"parallel.pipeline_head": head})
        described = build(small_config(**settings), devices_for(settings)).describe()
        assert f"pipeline: 1f1b, 2 stages, 4 microbatches, bubble 20.0%, embedding and head {where}\n" in described
