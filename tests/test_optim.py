"""The optimizer seam: each registry entry against optax's reference applied by hand, Muon's matrices,
the schedules, checkpoints of a Muon run, and Muon on every parallel layout against one device.

float32 throughout (Muon's iteration too: `optim.muon.ns_dtype=float32`), so that the comparisons are
exact to rounding.
"""

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from optax.contrib import MuonDimensionNumbers as Dims

from conftest import SMALL_MOE, small_config
from helpers import RTOL, assert_same_training, run_config
from ushard.build import build
from ushard.config import default_config, load_config, shipped_config_names
from ushard.errors import UserError
from ushard.models.config import ModelConfig
from ushard.models.definition import model_definition
from ushard.training import muon, optim
from ushard.training.loop import Trainer

MUON = {"optim.name": "muon", "optim.muon.ns_dtype": "float32"}
PARITY_STEPS = 5


def flat(tree) -> dict:
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


# --------------------------------------------------------------------------- which matrices


def test_muon_takes_the_matrices_per_layer_expert_and_projection():
    axes = muon.matrix_axes
    assert axes(("layers", "embed", "heads", "head_dim")) == muon.MatrixAxes((0,), (1,), (2, 3))  # q
    assert axes(("layers", "heads", "head_dim", "embed")) == muon.MatrixAxes((0,), (1, 2), (3,))  # o
    assert axes(("layers", "embed", None, "mlp")) == muon.MatrixAxes((0, 2), (1,), (3,))  # gate and up apart
    assert axes(("layers", "experts", "expert_mlp", "embed")) == muon.MatrixAxes((0, 1), (2,), (3,))
    assert axes(("layers", "latent", "heads", "head_dim")) == muon.MatrixAxes((0,), (1,), (2, 3))
    assert axes((None, "embed", None)) == muon.MatrixAxes((), (0, 1), (2,))  # MTP's projection of a concatenation
    assert axes(("layers", "embed", None)) == muon.MatrixAxes((0,), (1,), (2,))  # the router
    for adamw in (("vocab", "embed"), ("embed", "vocab"), ("layers", "norm"), ("norm",), ("layers", None)):
        assert axes(adamw) is None, adamw


def test_every_shipped_parameter_is_muons_or_adamws_by_its_names():
    """Every parameter of every shipped model: a matrix per batch index (fan-in and fan-out > 1), or
    one of AdamW's (vocabulary, norms, routing biases)."""
    for name in shipped_config_names():
        model = model_definition(ModelConfig.from_config(load_config(name).model))
        shapes = jax.tree.leaves(model.shapes)
        names = jax.tree.leaves(model.logical, is_leaf=lambda x: isinstance(x, tuple))
        for shape, logical in zip(shapes, names):
            a = muon.matrix_axes(logical)
            if a is None:
                assert "vocab" in logical or "norm" in logical or len(shape.shape) - logical.count("layers") <= 1
            else:
                assert sorted(a.batch + a.reduction + a.output) == list(range(len(shape.shape)))
                assert all(logical[i] in ("layers", "experts", None) for i in a.batch), (name, logical)


# --------------------------------------------------------------------------- schedules


@pytest.mark.parametrize("shape, at_90", [("linear", 0.55), ("cosine", 0.55), ("sqrt", 0.1 + 0.9 * (1 - 0.5 ** 0.5))])
def test_wsd_warms_up_holds_and_decays_over_its_fraction(shape, at_90):
    c = default_config().train
    c.lr, c.steps, c.warmup_steps, c.min_lr_ratio, c.schedule, c.decay_fraction, c.wsd_decay = (
        1.0, 100, 10, 0.1, "wsd", 0.2, shape)
    schedule = optim.learning_rate_schedule(c)
    values = {s: float(schedule(s)) for s in (0, 5, 10, 50, 80, 90, 100)}
    np.testing.assert_allclose(list(values.values()), [0.0, 0.5, 1.0, 1.0, 1.0, at_90, 0.1], rtol=1e-6)
    # The same run extended to 200 steps from a checkpoint of its stable phase: at lr until step 160.
    c.steps = 200
    longer = optim.learning_rate_schedule(c)
    np.testing.assert_allclose([float(longer(s)) for s in (90, 160, 180, 200)], [1.0, 1.0, at_90, 0.1], rtol=1e-6)


# --------------------------------------------------------------------------- against optax, by hand


def reference_optimizer(config, params: dict, schedule):
    """optax's own transformations on the flat dict of parameters, built without ushard's code: for
    Muon, optax.contrib.muon on the matrices as written out here (each stacked layer a matrix, the
    fused gate and up apart) and optax.adamw on the rest."""
    o, clip = config.optim, optax.clip_by_global_norm(config.train.grad_clip)
    decay = {k: "norm" not in k for k in params}
    if o.name == "lion":
        return optax.chain(clip, optax.lion(schedule, b1=o.lion.b1, b2=o.lion.b2, weight_decay=o.weight_decay,
                                            mask=decay))
    if o.name == "adafactor":
        a = o.adafactor
        return optax.chain(clip, optax.adafactor(schedule, min_dim_size_to_factor=a.min_dim_size_to_factor,
                                                 decay_rate=a.decay_rate, multiply_by_parameter_scale=False,
                                                 clipping_threshold=a.clipping_threshold))
    matrices = {"['attn']['wq']": Dims(1, (2, 3)), "['attn']['wk']": Dims(1, (2, 3)), "['attn']['wv']": Dims(1, (2, 3)),
                "['attn']['wo']": Dims((1, 2), 3), "['mlp']['w_gate_up']": Dims(1, 3), "['mlp']['w_down']": Dims(1, 2)}
    dims = {k: next((d for end, d in matrices.items() if k.endswith(end)), None) for k in params}
    assert {k for k, d in dims.items() if d is None} == {"['embedding']", "['lm_head']", "['final_norm']['scale']",
                                                         "['blocks']['attn_norm']['scale']",
                                                         "['blocks']['mlp_norm']['scale']"}
    labels = {k: "muon" if d is not None else "adamw" for k, d in dims.items()}
    m = o.muon
    reference_muon = optax.contrib.muon(schedule, ns_steps=m.ns_steps, beta=m.momentum, eps=muon.NS_EPS,
                                        weight_decay=o.weight_decay, nesterov=True,
                                        muon_weight_dimension_numbers=dims, consistent_rms=m.rms)
    adamw = optax.adamw(schedule, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay, mask=decay)
    return optax.chain(clip, optax.partition({"muon": reference_muon, "adamw": adamw}, labels))


@pytest.mark.parametrize("name", ["muon", pytest.param("lion", marks=pytest.mark.slow),
                                  pytest.param("adafactor", marks=pytest.mark.slow)])
def test_updates_equal_optax_applied_by_hand(name, stdlib_batches):
    overrides = {**MUON, "optim.name": name, "model.fused_mlp": True, "optim.adafactor.min_dim_size_to_factor": 32,
                 "train.steps": PARITY_STEPS}
    config = small_config("tiny", **overrides)
    trainer = Trainer(config, devices=jax.devices()[:1], batches=stdlib_batches)
    steps, batches, setup = trainer.steps, trainer.global_batches(PARITY_STEPS), trainer.setup
    initial = steps.init(0).params
    # ushard's optimizer as the train step applies it (tests/test_parallel_parity.py and the layout
    # rows below run the step itself), beside optax's own, each from its own parameters' gradients.
    ours, ours_state, ours_update = initial, setup.tx.init(initial), jax.jit(setup.tx.update)
    params, treedef = flat(initial), jax.tree.structure(initial)
    tx = reference_optimizer(config, params, setup.schedule)
    opt_state, update = tx.init(params), jax.jit(tx.update)  # one compile, not one per operation
    for batch in batches:
        _, grads = steps.loss_and_grads(jax.tree.unflatten(treedef, list(params.values())), batch)
        updates, opt_state = update(flat(grads), opt_state, params)
        params = optax.apply_updates(params, updates)
        _, grads = steps.loss_and_grads(ours, batch)
        updates, ours_state = ours_update(grads, ours_state, ours)
        ours = optax.apply_updates(ours, updates)
        got = flat(ours)
        for k in params:
            np.testing.assert_allclose(got[k], params[k], rtol=1e-6, atol=1e-6, err_msg=k)
    assert max(np.abs(got[k] - flat(initial)[k]).max() for k in got) > 1e-3  # it trained


def test_adamw_keeps_the_state_its_checkpoints_were_written_with():
    """chain(clip, adamw) as before the registry: a checkpoint of an earlier version restores."""
    config = small_config("tiny")
    model = model_definition(ModelConfig.from_config(config.model))
    tx, schedule = optim.make_optimizer(config, model.logical)
    before = optax.chain(optax.clip_by_global_norm(1.0),
                         optax.adamw(schedule, weight_decay=0.1, mask=optim.weight_decay_mask(model.logical)))
    assert jax.tree.structure(jax.eval_shape(tx.init, model.shapes)) == jax.tree.structure(
        jax.eval_shape(before.init, model.shapes))


def test_resuming_under_another_optimizer_is_refused():
    config = small_config("tiny", **MUON)
    with pytest.raises(UserError, match=r"trained with optim.name='adamw', not 'muon'; resume with "
                                         r"optim.name='adamw'.*checkpoint.init_from"):
        optim.check_same_optimizer({"model": {}, "train": {"b1": 0.9}}, config, "/w/checkpoints")  # before optim
    optim.check_same_optimizer({"optim": {"name": "muon"}}, config, "/w/checkpoints")


# --------------------------------------------------------------------------- layouts

MUON_LAYOUTS = {
    "zero3": ({"mesh.fsdp": 8, "parallel.zero_stage": 3}, 8),
    "zero3_gspmd": ({"mesh.fsdp": 8, "parallel.zero_stage": 3, "optim.muon.layout": "gspmd"}, 8),
    "zero1": ({"mesh.fsdp": 8, "parallel.zero_stage": 1}, 8),
    "tensor2_fsdp4_sp": ({"mesh.tensor": 2, "mesh.fsdp": 4, "parallel.sequence_parallel": True}, 8),
    "pipeline2_1f1b": ({"mesh.pipeline": 2, "mesh.fsdp": 4, "parallel.pipeline_schedule": "1f1b",
                        "parallel.pipeline_microbatches": 4}, 8),
    "expert4_moe": ({**SMALL_MOE, "mesh.expert": 4, "mesh.fsdp": 2}, 8),
}
QUICK_LAYOUTS = ()  # the owners' path on 8 devices: test_owners_iterate_what_gspmd_iterates, in seconds


def muon_run(overrides, devices, batches):
    name = "tiny_moe" if "model.moe.expert_d_ff" in overrides else "tiny"
    config = small_config(name, **{**MUON, "train.steps": PARITY_STEPS, **overrides})
    return run_config(config, jax.devices()[:devices], batches)


@pytest.fixture(scope="module")
def muon_single(stdlib_batches):
    return muon_run({}, 1, stdlib_batches)


@pytest.fixture(scope="module")
def muon_single_moe(stdlib_batches):
    return muon_run(SMALL_MOE, 1, stdlib_batches)


@pytest.mark.parametrize("name", [n if n in QUICK_LAYOUTS else pytest.param(n, marks=pytest.mark.slow)
                                  for n in MUON_LAYOUTS])
def test_muon_on_every_layout_trains_as_one_device(name, request, stdlib_batches):
    overrides, devices = MUON_LAYOUTS[name]
    reference = request.getfixturevalue("muon_single_moe" if name.endswith("_moe") else "muon_single")
    assert_same_training(muon_run(overrides, devices, stdlib_batches), reference, trained_rtol=RTOL)


def test_owners_iterate_what_gspmd_iterates():
    """Buckets of whole matrices spread over the devices (padded to a multiple of them) give what the
    iteration on the sharded operands gives, matrix by matrix."""
    from helpers import layout_for

    layout = layout_for(zero_stage=3, fsdp=4, tensor=2)
    owners = muon.Owners(layout.mesh, ("fsdp", "tensor"))
    rng = np.random.default_rng(0)
    mats = [jnp.asarray(rng.normal(size=shape), jnp.float32) for shape in ((4, 16, 32), (3, 16, 32), (2, 32, 16),
                                                                          (1, 8, 8))]
    plain = jax.jit(lambda ms: muon.orthogonalise(ms, 5, jnp.float32, None))(mats)
    owned = jax.jit(lambda ms: muon.orthogonalise(ms, 5, jnp.float32, owners))(mats)
    for p, o in zip(plain, owned):
        np.testing.assert_allclose(o, p, rtol=1e-5, atol=1e-6)
        # Orthogonalised: the singular values near 1 (the quintic's band, about 0.7 to 1.2).
        s = np.linalg.svd(np.asarray(o), compute_uv=False)
        assert s.min() > 0.5 and s.max() < 1.3


# --------------------------------------------------------------------------- checkpoints


def quiet(*_):
    pass


@pytest.mark.slow
def test_a_muon_run_resumes_exactly_on_another_mesh_into_a_longer_wsd(tmp_path, stdlib_batches):
    """A WSD Muon run of 10 steps, against one of 6 (checkpoints at 3 and 6) whose step-3 checkpoint
    resumes on another mesh with train.steps=10: the steps before 3 are in both schedules' stable
    phase, so steps 4-10 log what the 10-step run logged."""
    settings = {**MUON, "train.schedule": "wsd", "train.decay_fraction": 0.5, "train.log_every": 1,
                "checkpoint.every": 3, "mesh.fsdp": 8}
    whole = Trainer(small_config("tiny", **{**settings, "train.steps": 10}), str(tmp_path / "whole"),
                    batches=stdlib_batches).run(log=quiet)
    Trainer(small_config("tiny", **{**settings, "train.steps": 6}), str(tmp_path / "short"),
            batches=stdlib_batches).run(log=quiet)
    shutil.copytree(tmp_path / "short" / "checkpoints" / "3", tmp_path / "resumed" / "checkpoints" / "3")
    other_mesh = {**settings, "train.steps": 10, "mesh.fsdp": 4, "mesh.tensor": 2}
    with pytest.raises(UserError, match="trained with optim.name='muon', not 'adamw'"):
        Trainer(small_config("tiny", **{**other_mesh, "optim.name": "adamw"}), str(tmp_path / "resumed"),
                batches=stdlib_batches).run(log=quiet)
    lines = []
    resumed = Trainer(small_config("tiny", **other_mesh), str(tmp_path / "resumed"),
                      batches=stdlib_batches).run(log=lines.append)
    assert "resumed from the checkpoint at step 3" in lines
    want = {r["step"]: (r["loss"], r["lr"]) for r in whole if r["step"] > 3}
    got = {r["step"]: (r["loss"], r["lr"]) for r in resumed}
    assert sorted(got) == list(range(4, 11))
    np.testing.assert_allclose([got[s] for s in sorted(want)], [want[s] for s in sorted(want)], rtol=1e-5)


def test_optimizer_state_bytes_follow_the_entry():
    """The planner's state bytes (from the abstract state): Muon keeps one moment for its matrices."""
    sizes = {}
    for name in ("adamw", "muon", "lion"):
        setup = build(small_config("tiny", **{**MUON, "optim.name": name}), jax.devices()[:1])
        state = setup.steps.abstract_state()
        sizes[name] = sum(x.size for x in jax.tree.leaves(state.opt_state) if x.ndim)
    params = sum(x.size for x in jax.tree.leaves(state.params))
    assert sizes["adamw"] == 2 * params and sizes["lion"] == params
    matrices = sum(x.size for x, names in zip(jax.tree.leaves(state.params),
                                              jax.tree.leaves(setup.model.logical, is_leaf=lambda v: isinstance(
                                                  v, tuple))) if muon.matrix_axes(names) is not None)
    assert sizes["muon"] == matrices + 2 * (params - matrices)


def test_the_plan_records_where_muons_iterations_run_and_the_planner_counts_them():
    from ushard import step_time

    spread = build(small_config("tiny", **{**MUON, "mesh.fsdp": 4, "mesh.tensor": 2}), jax.devices()[:8])
    assert spread.plan.muon_owners == ("fsdp", "tensor")
    assert "each matrix whole on one of 8 owners over fsdp x tensor" in spread.describe()
    whole = build(small_config("tiny", **{**MUON, "mesh.data": 8}), jax.devices()[:8])
    assert whole.plan.muon_owners == () and "its state is whole on every device" in whole.describe()
    assert "optimizer: adamw" in build(small_config("tiny"), jax.devices()[:1]).describe()
    shape = step_time.shape_of(spread.config, spread.mesh_shape)
    assert shape.newton_schulz_flops == muon.newton_schulz_flops(
        spread.model.shapes, muon.matrix_layouts(spread.model.logical), 5) > 0
    assert shape.newton_schulz_ways == 8 and 5 < shape.optimizer_words < 7  # Muon's 5, AdamW's 7 for the rest
    moves = [i for i in step_time.collective_items(shape) if i.kind == "all-to-all"]
    assert [(i.axis, i.count, i.size) for i in moves] == [("fsdp", 2, shape.muon_matrix_params * 4 / 8)]  # float32


def test_a_resume_that_changes_the_schedule_says_so_in_one_line():
    """train.steps raised on a resume stretches a cosine decay: the note names the change and the rate
    at the resumed step under both schedules; an unchanged schedule says nothing."""
    from ushard.config import load_config
    from ushard.training.optim import learning_rate_schedule, schedule_change

    before = load_config("tiny", ["train.steps=200", "train.warmup_steps=10"])
    after = load_config("tiny", ["train.steps=400", "train.warmup_steps=10"])
    saved = {"train": before.train.to_dict()}
    assert schedule_change(saved, before.train, 150) is None
    note = schedule_change(saved, after.train, 150)
    old, new = (float(learning_rate_schedule(c.train)(150)) for c in (before, after))
    assert new > old
    assert note == (f"note: the learning-rate schedule is not the checkpoint's (train.steps 200 -> 400): at step 150 "
                    f"the rate is {new:.3g} (the checkpoint's schedule had {old:.3g}), and the new schedule holds "
                    f"from here.")
    # A checkpoint written before a schedule key existed: the key's default stands for it.
    assert schedule_change({"train": {"steps": 200, "lr": before.train.lr}}, before.train, 150) is None
