"""The Layout: which mesh axes each logical name maps to, per kind of array; the generic divisibility
check; and the seams a parallelism or an MoE model plugs into (the layer stack's aux terms, the loss)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from conftest import small_config
from helpers import layout_for
from ushard import UserError, build
from ushard.config import MESH_AXES, validate
from ushard.mesh import build_mesh
from ushard.models.stack import run_layers
from ushard.sharding import Layout, ZeroRules, check_divisible, current_layout, use_layout

BATCH = ("data", "fsdp", "expert")


@pytest.mark.parametrize("stage, sizes, embed_by_kind", [
    (3, {"fsdp": 8}, {"params": ("fsdp",), "grads": ("fsdp",), "opt_state": ("fsdp",), "compute": ()}),
    (1, {"tensor": 2, "fsdp": 4}, {"params": (), "grads": (), "opt_state": ("fsdp",), "compute": ()}),
    (2, {"data": 2, "fsdp": 2, "sequence": 2},
     {"params": (), "grads": ("fsdp",), "opt_state": ("fsdp",), "compute": ()}),
    (0, {"data": 8}, {"params": (), "grads": (), "opt_state": (), "compute": ()}),
])
def test_layout_answers_axes_and_specs(stage, sizes, embed_by_kind):
    layout = layout_for(stage, **sizes)
    for kind, axes in embed_by_kind.items():
        assert layout.axes("embed", kind) == axes, kind
    assert layout.axes("mlp") == ("tensor",) and layout.axes("heads", "params") == ("tensor",)
    assert layout.axes("act_batch") == BATCH and layout.axes("act_length") == ("sequence",)
    assert layout.axes("act_embed") == () and layout.axes(None) == ()
    assert layout.size("act_batch") == sizes.get("data", 1) * sizes.get("fsdp", 1)
    assert layout.size("mlp") == sizes.get("tensor", 1)
    # a weight [layers, embed, mlp] as stored, and as the matmul uses it
    stored = P(None, "fsdp" if embed_by_kind["params"] else None, "tensor")
    assert layout.spec(("layers", "embed", "mlp"), "params") == stored
    assert layout.spec(("layers", "embed", "mlp"), "compute") == P(None, None, "tensor")
    assert layout.spec(("act_batch", "act_length", "act_vocab")) == P(BATCH, "sequence", "tensor")
    # the global batch of token ids is placed by its activation names
    assert layout.batch.spec == P(BATCH, "sequence")
    assert layout.sharding(("embed",), "opt_state").spec == P("fsdp" if embed_by_kind["opt_state"] else None)


@pytest.mark.parametrize("sequence_parallel, residual", [(False, ("sequence",)), (True, ("sequence", "tensor"))])
def test_sequence_parallelism_splits_only_the_residual_stream_over_tensor(sequence_parallel, residual):
    shape = {axis: 1 for axis in MESH_AXES} | {"tensor": 2, "sequence": 2, "fsdp": 2}
    layout = Layout.create(build_mesh(shape, devices=jax.devices()[:8]), sequence_parallel=sequence_parallel)
    assert layout.axes("act_residual_length") == residual
    assert layout.axes("act_length") == ("sequence",)  # inside attention and the MLP
    assert layout.spec(("act_batch", "act_residual_length", "act_embed")) == P(BATCH, residual, None)


@pytest.mark.parametrize("n_kv_heads, split", [(8, True), (4, True), (2, False), (1, False)])
def test_kv_weights_split_over_tensor_only_by_whole_heads(n_kv_heads, split):
    """tensor=4: 8 or 4 KV heads split; 2 or 1 stay whole on every rank (each rank uses one copy)."""
    shape = {axis: 1 for axis in MESH_AXES} | {"tensor": 4, "fsdp": 2}
    layout = Layout.create(build_mesh(shape, devices=jax.devices()[:8]), n_kv_heads=n_kv_heads)
    assert layout.axes("kv_heads", "params") == (("tensor",) if split else ())
    assert layout.axes("heads", "params") == ("tensor",) and layout.axes("act_kv_heads") == ("tensor",)


def test_an_unknown_logical_name_is_refused():
    with pytest.raises(KeyError, match="'embedding_dim' has no sharding rule"):
        layout_for().spec(("embedding_dim",))


def test_the_active_layout_is_visible_only_inside_use_layout():
    layout = layout_for(fsdp=8)
    assert current_layout() is None
    with use_layout(layout):
        assert current_layout() is layout
    assert current_layout() is None


def test_divisibility_check_names_the_parameter_dimension_and_axis():
    config = small_config(**{"model.d_ff": 101, "mesh.tensor": 2, "mesh.fsdp": 4})  # 101 does not split 2 ways
    with pytest.raises(UserError, match=r"parameter blocks\.mlp\.w_down has a 'mlp' dimension of 101, "
                                        r"which does not split over mesh\.tensor=2; make 101 a multiple of 2"):
        validate(config, 8)
    # On abstract shapes and axis sizes alone: no devices involved (the planner's use).
    sizes = {axis: 1 for axis in MESH_AXES} | {"fsdp": 16, "tensor": 4}
    shapes = {"parameter w": (("embed", "mlp"), (4096, 14336)), "parameter v": (("vocab", "embed"), (128256, 4100))}
    rules = ZeroRules.for_stage(3)
    check_divisible({"parameter w": shapes["parameter w"]}, rules.params, sizes)
    with pytest.raises(UserError,
                       match=r"parameter v has a 'embed' dimension of 4100, which does not split over mesh\.fsdp=16"):
        check_divisible(shapes, rules.params, sizes)
    check_divisible(shapes, rules.compute, sizes)  # gathered for compute: embed is not split


# --------------------------------------------------------------------------- the layer stack's aux terms


class ScaledLayer(nnx.Module):
    """x * w, reporting sum(w^2) as an auxiliary term: a stand-in for an MoE layer's balancing loss."""

    def __init__(self, dim, rngs):
        self.w = nnx.Param(jax.random.normal(rngs.params(), (dim,)), out_sharding=("embed",))

    def __call__(self, x, bias):
        return x * self.w[...] + bias, {"l2": jnp.sum(self.w[...] ** 2)}


@pytest.mark.parametrize("remat, unroll", [("none", 1), ("full", 3)])
def test_run_layers_chains_the_layers_and_sums_their_aux_terms(remat, unroll):
    @nnx.split_rngs(splits=3)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def stacked(rngs):
        return ScaledLayer(5, rngs)

    with nnx.use_eager_sharding(False):
        layers = stacked(nnx.Rngs(params=0))
    w = np.asarray(layers.w[...])  # [3, 5]
    x = jnp.arange(5.0)
    out, aux = run_layers(layers, x, 0.5, remat=remat, unroll=unroll, compute_dtype=jnp.float32)
    expected = np.asarray(x)
    for layer in range(3):
        expected = expected * w[layer] + 0.5
    np.testing.assert_allclose(out, expected, rtol=1e-6)
    np.testing.assert_allclose(aux["l2"], np.sum(w**2), rtol=1e-6)


def test_aux_terms_join_the_loss_token_weighted_and_are_reported(stdlib_batches):
    """A model that returns aux = {"penalty": c * mean(logits^2)}: the step's gradient is that of
    cross-entropy + penalty, and the metrics report the penalty, whatever the microbatching."""
    from ushard.data import place_batch

    config = small_config(**{"train.grad_accum": 2, "mesh.fsdp": 8, "train.batch_size": 16})
    setup = build(config)
    model = setup.model
    plain_apply, plain_training = model.apply, model.apply_for_training

    def apply_with_penalty(params, batch):
        logits, aux, mtp_logits = plain_training(params, batch)
        return logits, {**aux, "penalty": 0.01 * jnp.mean(logits.astype(jnp.float32) ** 2)}, mtp_logits

    host, _ = stdlib_batches.train_batch(stdlib_batches.initial_state(), 16)
    batch = place_batch(host, setup.layout.batch, (16, config.train.seq_len))
    state = setup.steps.init(0)
    model.apply_for_training = apply_with_penalty
    try:
        _, metrics = jax.jit(setup.steps._train_step)(state, batch)
        loss, aux, grads, _ = jax.jit(setup.steps._mean_loss_and_grads)(state.params, batch)
    finally:
        del model.apply_for_training  # back to the class's method (the definition is shared by a cache)

    from ushard.training.loss import cross_entropy_sums

    def reference(params, rows):
        """Microbatch j = rows i*2 + j; each contributes count_j * penalty_j; all over the total count."""
        total, count_all, penalty_sum = 0.0, 0.0, 0.0
        for j in range(2):
            micro = {k: jnp.asarray(v[j::2]) for k, v in rows.items()}
            logits, _ = plain_apply(params, micro["inputs"], micro["positions"], micro["segment_ids"])
            ce, count = cross_entropy_sums(logits, micro["targets"], micro["loss_mask"])
            penalty = 0.01 * jnp.mean(logits ** 2)
            total, count_all = total + ce + count * penalty, count_all + count
            penalty_sum = penalty_sum + count * penalty
        return total / count_all, penalty_sum / count_all

    params = jax.device_get(state.params)
    (want_objective, want_penalty), want_grads = jax.jit(jax.value_and_grad(reference, has_aux=True))(params, host)
    np.testing.assert_allclose(metrics["aux"]["penalty"], want_penalty, rtol=1e-5)
    np.testing.assert_allclose(aux["penalty"], want_penalty, rtol=1e-5)
    np.testing.assert_allclose(loss + aux["penalty"], want_objective, rtol=1e-5)
    diffs = jax.tree.map(lambda a, b: np.linalg.norm(np.asarray(a) - b) / np.linalg.norm(b), grads, want_grads)
    assert max(jax.tree.leaves(diffs)) < 1e-5
    assert float(want_penalty) > 1e-4  # the term is large enough to matter
