"""Multi-token prediction (ushard/models/mtp.py) against a plain jnp reference, and under layouts.

The reference below recomputes the MTP objective by hand from the parameters: the shifted tokens and
masks by Python loops over positions, RMSNorm, the projection and the cross-entropy in jnp. Only the
main model's layers and the MTP module's transformer block are called through ushard (the families'
tests compare those with transformers). Loss and gradients must agree for depth 1 and 2.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import SMALL_MOE, small_config
from helpers import RTOL, assert_same_training, run_config, tree_relative_difference
from ushard.errors import UserError
from ushard.models.config import ModelConfig, MTPConfig
from ushard.models.definition import model_definition
from ushard.models.mtp import with_mtp_fields
from ushard.training.objectives import objective_terms

CFG = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, compute_dtype="float32")
B, T = 2, 16


def packed_batch(seed=0) -> dict:
    """Two rows of packed documents (row 0: lengths 7 and 9; row 1: one document) with a loss mask
    that also hides two targets, as SFT's prompt masking would."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, CFG.vocab_size, (B, T + 1))
    segments = np.array([[1] * 7 + [2] * 9, [1] * 16])
    positions = np.concatenate([np.r_[0:7, 0:9][None], np.arange(16)[None]])
    loss_mask = np.ones((B, T), np.int32)
    loss_mask[0, 6] = 0  # the first document's last input predicts the next document's first token
    loss_mask[1, 3:5] = 0
    return {"inputs": jnp.asarray(tokens[:, :-1]), "targets": jnp.asarray(tokens[:, 1:]),
            "segment_ids": jnp.asarray(segments), "positions": jnp.asarray(positions),
            "loss_mask": jnp.asarray(loss_mask)}


def test_shifted_fields_match_a_loop_over_positions():
    batch = packed_batch()
    got = with_mtp_fields(batch, 3)
    for k in (1, 2, 3):
        for b in range(B):
            for i in range(T):
                j = i + k
                inside = j < T and batch["segment_ids"][b, j] == batch["segment_ids"][b, i]
                assert got[f"mtp_mask_{k}"][b, i] == (bool(batch["loss_mask"][b, j]) if inside else False), (k, b, i)
                if j < T:
                    assert got[f"mtp_inputs_{k}"][b, i] == batch["inputs"][b, j]
                    assert got[f"mtp_targets_{k}"][b, i] == batch["targets"][b, j]
    assert with_mtp_fields(batch, 0) is batch


def rms(x, scale, eps):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def summed_cross_entropy(logits, targets, mask):
    picked = jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], axis=-1)[..., 0]
    return -jnp.sum(picked * mask.astype(jnp.float32))


def reference_objective(model, params, batch, depth, weight):
    """The main mean cross-entropy plus weight / depth times each depth's summed over its counted
    positions, divided by the main loss's token count: computed by hand."""
    module = model.module(params)
    eps = model.cfg.norm_eps
    x, _ = module.layers(module.embed(batch["inputs"]), batch["positions"], batch["segment_ids"])
    head = params["lm_head"]
    count = jnp.sum(batch["loss_mask"])
    main = summed_cross_entropy(rms(x, params["final_norm"]["scale"], eps) @ head, batch["targets"],
                                batch["loss_mask"]) / count
    total = 0.0
    for k in range(1, depth + 1):
        tokens = np.zeros((B, T), np.int32)
        targets = np.zeros((B, T), np.int32)
        mask = np.zeros((B, T), np.float32)
        for b in range(B):
            for i in range(T - k):
                tokens[b, i] = batch["inputs"][b, i + k]
                targets[b, i] = batch["targets"][b, i + k]
                same = batch["segment_ids"][b, i + k] == batch["segment_ids"][b, i]
                mask[b, i] = float(same and batch["loss_mask"][b, i + k])
        p = params[f"mtp{k}"]
        embedded = params["embedding"][tokens]
        joined = jnp.concatenate([rms(embedded, p["embed_norm"]["scale"], eps),
                                  rms(x, p["hidden_norm"]["scale"], eps)], axis=-1)
        projected = joined @ p["proj"].reshape(2 * CFG.d_model, CFG.d_model)
        x = getattr(module, f"mtp{k}").block(projected, batch["positions"], batch["segment_ids"])[0]
        logits = rms(x, p["final_norm"]["scale"], eps) @ head
        total = total + summed_cross_entropy(logits, jnp.asarray(targets), jnp.asarray(mask)) / count
    return main + weight * total / depth


def ushard_objective(model, params, batch):
    logits, aux, mtp_logits = model.apply_for_training(params, with_mtp_fields(batch, model.cfg.mtp.depth))
    terms = objective_terms(logits, aux, with_mtp_fields(batch, model.cfg.mtp.depth), mtp_logits,
                            model.cfg.mtp.loss_weight)
    _, (loss, count, weighted_aux) = terms
    return terms[0] / count, (loss / count, {k: v / count for k, v in weighted_aux.items()})


# Depth 1 in the slow tier (`-m slow`), for the suite's time: depth 2's first module is the same path.
@pytest.mark.parametrize("depth", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_loss_and_gradients_match_a_plain_reference(depth):
    cfg = dataclasses.replace(CFG, mtp=MTPConfig(depth=depth, loss_weight=0.4))
    model = model_definition(cfg)
    params = model.init(1)
    batch = packed_batch()
    objective = jax.value_and_grad(lambda p: ushard_objective(model, p, batch), has_aux=True)
    (got, (main, aux)), got_grads = objective(params)
    want, want_grads = jax.value_and_grad(lambda p: reference_objective(model, p, batch, depth, 0.4))(params)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert tree_relative_difference(got_grads, want_grads) < 1e-5
    assert float(aux["mtp_loss"]) > 0.1 and np.isclose(got, main + aux["mtp_loss"], rtol=1e-6)
    # The modules' own weights and the shared head all get gradients from the MTP term.
    for k in range(1, depth + 1):
        assert float(jnp.abs(got_grads[f"mtp{k}"]["proj"]).max()) > 0
    without = model_definition(dataclasses.replace(cfg, mtp=MTPConfig(depth=depth, loss_weight=0.0)))
    assert not np.isclose(ushard_objective(without, params, batch)[0], got, rtol=1e-3)


def test_flops_count_the_modules_and_the_head_again():
    plain, with_mtp = model_definition(CFG), model_definition(dataclasses.replace(CFG, mtp=MTPConfig(depth=2)))
    module_params = sum(x.size for x in jax.tree.leaves(with_mtp.shapes["mtp1"])) - 3 * CFG.d_model  # not norms
    head = CFG.d_model * CFG.vocab_size
    per_layer_attention = plain.attention_flops_per_token(T) / CFG.n_layers
    extra = with_mtp.flops_per_token(T) - plain.flops_per_token(T)
    block_norms = 2 * CFG.d_model
    assert extra == pytest.approx(2 * (6 * (module_params - block_norms + head) + per_layer_attention))


def test_a_family_without_an_mtp_block_refuses_the_setting():
    cfg = ModelConfig(family="gemma3", sliding_window=8, mtp=MTPConfig(depth=1))
    with pytest.raises(UserError, match="model.mtp.depth=1: model.family='gemma3' has no multi-token prediction"):
        model_definition(cfg)
    with pytest.raises(UserError, match=r"model.mtp.depth=-1 must be a number >= 0"):
        MTPConfig(depth=-1)


def test_sampling_ignores_the_modules():
    cfg = dataclasses.replace(CFG, mtp=MTPConfig(depth=1))
    model = model_definition(cfg)
    params = model.init(0)
    batch = packed_batch()
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))
    logits, _ = model.apply(params, batch["inputs"], positions)
    decoded, _ = model.decode(params, batch["inputs"], positions, model.init_cache(B, T))
    np.testing.assert_allclose(decoded, logits, rtol=1e-4, atol=1e-4)


MTP = {"model.mtp.depth": 2, "model.mtp.loss_weight": 0.5}
LAYOUTS = {
    "fsdp": {"mesh.fsdp": 8, "parallel.zero_stage": 3},
    "ring": {"mesh.sequence": 4, "mesh.fsdp": 2, "parallel.context_parallel": "ring"},
    "1f1b": {"mesh.pipeline": 2, "parallel.pipeline_schedule": "1f1b", "parallel.pipeline_microbatches": 4,
             "mesh.fsdp": 4},
    # The modules after GPipe's stages run microbatch by microbatch (`Steps._objective_mtp_by_microbatch`),
    # each under the remat policy, as do the ticks (`models.stack.tick_policy`).
    "gpipe_remat": {"mesh.pipeline": 2, "parallel.pipeline_schedule": "gpipe", "parallel.pipeline_microbatches": 4,
                    "mesh.fsdp": 4, "model.remat": "full"},
}


@pytest.fixture(scope="module")
def single(stdlib_batches):
    return run_config(small_config("tiny", **MTP), jax.devices()[:1], stdlib_batches)


# fsdp and the ring in the slow tier (`-m slow`): ZeRO-3 places the modules' weights as any other's,
# and the DeepSeek model's ring row (tests/test_family_layouts.py) trains with a module.
@pytest.mark.parametrize("layout", [pytest.param("fsdp", marks=pytest.mark.slow),
                                    pytest.param("ring", marks=pytest.mark.slow), "1f1b", "gpipe_remat"])
def test_layouts_match_one_device(single, stdlib_batches, layout):
    got = run_config(small_config("tiny", **MTP, **LAYOUTS[layout]), jax.devices()[:8], stdlib_batches)
    assert_same_training(got, single, RTOL, RTOL)
    assert [a["mtp_loss"] for a in got["aux"]] == pytest.approx([a["mtp_loss"] for a in single["aux"]], rel=RTOL)


MOE_PIPELINE = {**SMALL_MOE, "model.mtp.depth": 1, "mesh.pipeline": 2, "mesh.fsdp": 2, "mesh.expert": 2,
                "parallel.pipeline_microbatches": 4, "train.steps": 1}


@pytest.mark.slow  # the suite's time: the DeepSeek layouts' 1F1B rows (tests/test_family_layouts.py) train one too
def test_one_f_one_b_runs_an_moe_module_on_its_last_stage(stdlib_batches):
    """The module's MoE block inside the last stage's slots (pipeline.StageTail), against one device
    running the pipeline's 4 microbatches as accumulation parts (the balancing terms are each
    microbatch's)."""
    got = run_config(small_config("tiny_moe", **MOE_PIPELINE, **{"parallel.pipeline_schedule": "1f1b"}),
                     jax.devices()[:8], stdlib_batches)
    single = {k: v for k, v in MOE_PIPELINE.items() if not k.startswith(("mesh.", "parallel."))}
    ref = run_config(small_config("tiny_moe", **single, **{"train.grad_accum": 4}), jax.devices()[:1], stdlib_batches)
    assert_same_training(got, ref, RTOL, RTOL)
    assert got["aux"][0]["mtp_loss"] > 0


@pytest.mark.slow  # the suite's time: the DeepSeek layouts' ring row runs an MoE module in the default tier
def test_gpipe_runs_an_moe_module_after_its_stages(stdlib_batches):
    got = run_config(small_config("tiny_moe", **MOE_PIPELINE, **{"parallel.pipeline_schedule": "gpipe"}),
                     jax.devices()[:8], stdlib_batches)
    assert np.isfinite(got["losses"]).all() and got["aux"][0]["mtp_loss"] > 0
