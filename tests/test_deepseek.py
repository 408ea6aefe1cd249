"""The deepseek family (ushard/models/deepseek/): DeepSeek-V3 and DeepSeek-V2 against transformers' classes.

A tiny random `DeepseekV3ForCausalLM` (queries through a q_lora_rank bottleneck, a dense layer then
MoE layers of 8 routed experts in 4 groups of which a token sees 2, one shared expert, a nonzero
e_score_correction_bias, YaRN with mscale and mscale_all_dim both set and different, interleaved
RoPE) and a `DeepseekV2ForCausalLM` (V2-Lite's plain q_proj, softmax routing with
group_limited_greedy, 2 shared experts, routed_scaling_factor) are saved with `save_pretrained`:
`ushard.from_hf` gives their logits (float32, 1e-5 relative), ushard's export loads back into the same
class with the same logits, and the round trip is bit-exact. Each thing the match depends on (YaRN's
two scale corrections, the interleaved columns' reordering, the group limit and its score, the
routing bias) is shown to move the logits when changed, so the comparison cannot pass without it.
Refusals name the field; decoding with a cache of latents matches the whole sequence.

Skipped without torch and transformers (the `hf` extra).
"""

import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import test_hf
import ushard
from test_hf import FINETUNE, cli, first_batch, first_loss, relative_error, torch_logits, transformers_loss
from ushard import hf
from ushard.errors import UserError
from ushard.models.config import MLAConfig, ModelConfig, MoEConfig, MTPConfig, RopeScaling
from ushard.models.definition import model_definition
from ushard.trained import TrainedModel

text_file = test_hf.text_file  # the fixture, shared
VOCAB = 300  # at least the byte tokenizer's 257, for the fine-tuning run
KINDS = ("v3", "v2")
TOKENS = np.random.default_rng(0).integers(0, VOCAB, (2, 40)).astype(np.int32)
SIZES = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
             v_head_dim=12, n_routed_experts=8, n_group=4, topk_group=2, first_k_dense_replace=1,
             max_position_embeddings=256)
# YaRN over a short original context, so that the 40 tokens reach the stretched frequencies.
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 32,
        "beta_fast": 32, "beta_slow": 1}


def torch_model(kind: str):
    """A tiny transformers model of `kind`, every weight random (norm scales near 1, V3's routing bias too)."""
    import torch
    import transformers as tf

    torch.manual_seed(KINDS.index(kind))
    if kind == "v3":
        config = tf.DeepseekV3Config(**SIZES, q_lora_rank=24, n_shared_experts=1, num_experts_per_tok=2,
                                     routed_scaling_factor=2.5, norm_topk_prob=True, rope_interleave=True,
                                     rope_parameters={**YARN, "mscale": 0.9, "mscale_all_dim": 0.8})
        model = tf.DeepseekV3ForCausalLM(config)
    else:
        config = tf.DeepseekV2Config(**SIZES, q_lora_rank=None, n_shared_experts=2, num_experts_per_tok=3,
                                     routed_scaling_factor=1.5, topk_method="group_limited_greedy",
                                     rope_parameters={**YARN, "mscale": 0.707, "mscale_all_dim": 0.707})
        model = tf.DeepseekV2ForCausalLM(config)
    with torch.no_grad():
        for weight in model.parameters():
            if weight.ndim == 1:
                weight.copy_(0.1 * torch.randn_like(weight) + 1)
            else:
                weight.copy_(torch.randn_like(weight) / weight.shape[-1] ** 0.5)
        if kind == "v3":
            for layer in model.model.layers[1:]:
                layer.mlp.gate.e_score_correction_bias.copy_(0.1 * torch.randn(8))
    return model.eval()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    made = {}
    for kind in KINDS:
        model = torch_model(kind)
        directory = tmp_path_factory.mktemp(kind)
        model.save_pretrained(directory)
        made[kind] = (str(directory), model, torch_logits(model, TOKENS))
    return made


@pytest.fixture(scope="module")
def imported(checkpoints):
    return {kind: ushard.from_hf(checkpoints[kind][0]) for kind in KINDS}


def with_settings(model: TrainedModel, params=None, **changes) -> TrainedModel:
    cfg = dataclasses.replace(model.model.cfg, **changes)
    return TrainedModel(model_definition(cfg), model.params if params is None else params, model.layout, 0, None,
                        None)


@pytest.mark.parametrize("kind", KINDS)
def test_logits_match_transformers(checkpoints, imported, kind):
    _, _, expected = checkpoints[kind]
    model = imported[kind]
    assert relative_error(model(TOKENS), expected) <= 1e-5
    cfg = model.model.cfg
    assert cfg.family == "deepseek" and cfg.rope_scaling.type == "yarn"
    assert cfg.mla == MLAConfig(24 if kind == "v3" else 0, 16, 16, 8, 12)
    assert (cfg.moe.num_experts, cfg.moe.first_dense_layers, cfg.moe.num_groups, cfg.moe.top_groups) == (8, 1, 4, 2)
    assert (cfg.moe.score_func, cfg.moe.group_score) == (("sigmoid", "top2_sum") if kind == "v3" else
                                                          ("softmax", "max"))


# V2's in the slow tier (`-m slow`): V3's covers each kind of setting but V2's group score.
@pytest.mark.parametrize("kind", ["v3", pytest.param("v2", marks=pytest.mark.slow)])
def test_each_setting_the_match_depends_on_moves_the_logits(checkpoints, imported, kind):
    _, _, expected = checkpoints[kind]
    model = imported[kind]
    cfg = model.model.cfg
    rope, moe = cfg.rope_scaling, cfg.moe
    # YaRN's softmax-scale correction (mscale_all_dim, which the attention factor divides by too) and
    # its attention factor alone (mscale); the group limit; V3's routing bias read from
    # e_score_correction_bias, or V2's group score.
    changes = [{"rope_scaling": dataclasses.replace(rope, mscale_all_dim=0.0)},
               {"rope_scaling": dataclasses.replace(rope, mscale=0.5)},
               {"moe": dataclasses.replace(moe, num_groups=1, top_groups=1)}]
    if kind == "v2":
        changes += [{"moe": dataclasses.replace(moe, group_score="top2_sum")}, {"rope_scaling": RopeScaling()}]
    for change in changes:
        assert relative_error(with_settings(model, **change)(TOKENS), expected) > 1e-3, change
    if kind == "v3":
        unbiased = jax.tree.map(lambda x, is_bias: jnp.zeros_like(x) if is_bias else x, model.params,
                                model.model.expert_biases)
        assert relative_error(with_settings(model, params=unbiased)(TOKENS), expected) > 1e-3


def test_without_reordering_the_interleaved_rope_columns_the_logits_are_wrong(checkpoints, monkeypatch):
    from ushard.models.deepseek import hf as deepseek_hf

    directory, _, expected = checkpoints["v3"]
    monkeypatch.setattr(deepseek_hf, "rope_pairs_to_halves", lambda size, rope: tuple(range(size)))
    assert relative_error(ushard.from_hf(directory)(TOKENS), expected) > 1e-3


def test_multi_token_prediction_modules_survive_a_round_trip_and_transformers_ignores_them(checkpoints, imported,
                                                                                           tmp_path):
    """V3 with an MTP module: exported at layer num_hidden_layers as DeepSeek-V3 stores it, read back
    bit-exact, and transformers loads the export with the main model's logits unchanged."""
    import transformers

    first = imported["v3"]
    cfg = dataclasses.replace(first.model.cfg, mtp=MTPConfig(depth=1))
    params = {**model_definition(cfg).init(3), **first.params}  # the imported weights, a random module
    exported = tmp_path / "with_mtp"
    hf.save_hf(params, cfg, str(exported))
    config = json.loads((exported / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1
    second = ushard.from_hf(str(exported))
    assert second.model.cfg == cfg
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(second.params), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(exported))
    np.testing.assert_allclose(torch_logits(reloaded, TOKENS), checkpoints["v3"][2], rtol=0, atol=1e-5)
    # Stripped of its MTP layer (as transformers saves DeepSeek-V3, num_nextn_predict_layers kept), the
    # checkpoint imports without the module; asked for one, it names what is missing.
    from safetensors.numpy import load_file, save_file

    tensors = {k: v for k, v in load_file(exported / "model.safetensors").items()
               if not k.startswith("model.layers.3.")}
    save_file(tensors, exported / "model.safetensors", metadata={"format": "pt"})
    assert ushard.from_hf(str(exported)).model.cfg == first.model.cfg
    with pytest.raises(UserError, match="has no tensor model.layers.3.eh_proj.weight"):
        ushard.from_hf(str(exported), mtp={"depth": 1})


def test_a_tensor_at_a_layer_the_model_does_not_have_is_refused(checkpoints, tmp_path):
    """Past the MTP modules' layers a checkpoint's layers are left out as transformers leaves them;
    any other unknown tensor is refused."""
    import shutil

    from safetensors.numpy import load_file, save_file

    directory = checkpoints["v3"][0]
    for extra, ok in (("model.layers.3.eh_proj.weight", True), ("model.layers.2.eh_proj.weight", False)):
        copy = tmp_path / extra
        shutil.copytree(directory, copy)
        tensors = load_file(copy / "model.safetensors")
        save_file({**tensors, extra: np.zeros((4, 4), np.float32)}, copy / "model.safetensors",
                  metadata={"format": "pt"})
        if ok:
            assert ushard.from_hf(str(copy)).model.cfg.mtp.depth == 0
        else:
            with pytest.raises(UserError, match="holds tensor model.layers.2.eh_proj.weight"):
                ushard.from_hf(str(copy))


def test_the_interleaved_columns_become_rotate_halfs_halves():
    from ushard.models.hf_names import rope_pairs_to_halves

    assert rope_pairs_to_halves(7, 4) == (0, 1, 2, 3, 5, 4, 6)


@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_is_exact_and_transformers_loads_the_export(checkpoints, imported, tmp_path, kind):
    import transformers

    _, model, expected = checkpoints[kind]
    first = imported[kind]
    exported = tmp_path / "exported"
    hf.save_hf(first.params, first.model.cfg, str(exported))
    second = ushard.from_hf(str(exported))
    assert second.model.cfg == first.model.cfg
    for a, b in zip(jax.tree.leaves(first.params), jax.tree.leaves(second.params)):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(exported))
    assert type(reloaded) is type(model)
    np.testing.assert_allclose(torch_logits(reloaded, TOKENS), expected, rtol=0, atol=1e-5)


def test_decode_with_a_cache_of_latents_matches_the_whole_sequence(imported):
    """The cache holds a token's latent (16) and RoPE key (8), not its 4 heads' keys (24) and values (12)."""
    model, params = imported["v3"].model, imported["v3"].params
    tokens, positions = TOKENS[:1, :24], np.arange(24, dtype=np.int32)[None]
    whole, _ = model.apply(params, tokens, positions)
    cache = model.init_cache(1, 32)
    assert cache["k"].shape == (3, 1, 32, 1, 16) and cache["v"].shape == (3, 1, 32, 1, 8)
    decode = jax.jit(model.decode)
    logits, cache = decode(params, tokens[:, :16], positions[:, :16], cache)
    steps = [logits]
    for i in range(16, 24):
        logits, cache = decode(params, tokens[:, i:i + 1], positions[:, i:i + 1], cache)
        steps.append(logits)
    np.testing.assert_allclose(np.concatenate(steps, axis=1), whole, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_finetune_from_a_converted_checkpoint_starts_at_transformers_loss(checkpoints, text_file, tmp_path):
    """docs/finetuning.md's recipe on DeepSeek-V3: convert, train with the printed settings, export."""
    import transformers

    directory, model, _ = checkpoints["v3"]
    converted, run, exported = (str(tmp_path / name) for name in ("converted", "run", "exported"))
    status, out, err = cli("convert", "--from-hf", directory, "--to", converted)
    assert status == 0, err
    settings = [a for a in out.split() if a.startswith("--config.model.")]
    assert "--config.model.family=deepseek" in settings and "--config.model.mla.kv_lora_rank=16" in settings
    sizes = [a for a in FINETUNE if not a.startswith(("--config.model.", "--config.train.seq_len"))]
    status, out, err = cli("train", *sizes, *settings, "--config.train.seq_len=32", f"--config.data.paths={text_file}",
                           f"--config.checkpoint.init_from={converted}", "--workdir", run)
    assert status == 0, err
    expected = transformers_loss(model, first_batch(text_file))
    assert abs(first_loss(run) - expected) <= 1e-5 * expected
    status, _, err = cli("convert", "--from", run, "--to-hf", exported)
    assert status == 0, err
    trained = ushard.load_model(run, log=lambda *_: None)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(exported)
    assert type(reloaded) is type(model)
    assert relative_error(trained(TOKENS), torch_logits(reloaded, TOKENS)) <= 1e-4


@pytest.mark.parametrize("kind, changes, match", [
    ("v3", {"quantization_config": {"quant_method": "fp8"}}, "quantization_config=\"fp8\".*dequantize"),
    ("v3", {"attention_bias": True}, "attention_bias=true"),
    ("v3", {"rope_interleave": False}, "rope_interleave=false"),
    ("v3", {"topk_method": "greedy"}, "topk_method=\"greedy\""),
    ("v3", {"scoring_func": "softmax"}, "scoring_func=\"softmax\""),
    ("v3", {"num_key_value_heads": 2}, "num_key_value_heads=2"),
    ("v2", {"topk_method": "noaux_tc"}, "topk_method=\"noaux_tc\""),
    ("v2", {"moe_layer_freq": 2}, "moe_layer_freq=2"),
    ("v2", {"norm_topk_prob": True}, "norm_topk_prob=true"),
    ("v2", {"rope_parameters": {**YARN, "attention_factor": 1.2}}, "rope_parameters.attention_factor=1.2"),
    ("v2", {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}},
     "rope_parameters.rope_type=\"dynamic\""),
])
def test_what_ushard_cannot_compute_is_refused_naming_the_field(checkpoints, kind, changes, match):
    directory = checkpoints[kind][0]
    with pytest.raises(UserError, match=match):
        hf.model_config({**hf.read_config(directory), **changes}, directory)


def test_deepseek_imports_its_training_settings_where_config_json_has_them(checkpoints):
    directory = checkpoints["v2"][0]
    cfg = hf.model_config({**hf.read_config(directory), "aux_loss_alpha": 0.001, "seq_aux": True}, directory)
    assert (cfg.moe.aux_loss_weight, cfg.moe.aux_loss_per_sequence, cfg.moe.z_loss_weight) == (0.001, True, 0.0)
    mine = hf.model_config({**hf.read_config(directory), "aux_loss_alpha": 0.001}, directory,
                           moe={"aux_loss_weight": 0.01})
    assert mine.moe.aux_loss_weight == 0.01  # the user's own setting wins


def test_an_export_transformers_would_route_otherwise_is_refused(imported, tmp_path):
    v2, v3 = imported["v2"], imported["v3"]
    biased = jax.tree.map(lambda x, is_bias: x + 0.5 if is_bias else x, v2.params, v2.model.expert_biases)
    with pytest.raises(UserError, match="Hugging Face's DeepseekV2ForCausalLM router has none"):
        hf.save_hf(biased, v2.model.cfg, str(tmp_path / "biased"))
    for model, moe, match in ((v2, {"normalize_gates": True}, "normalize_gates=True cannot be exported"),
                              (v2, {"group_score": "top2_sum"}, "group_score='top2_sum' cannot be exported"),
                              (v3, {"group_score": "max"}, "DeepseekV3ForCausalLM has group_score='top2_sum'")):
        cfg = dataclasses.replace(model.model.cfg, moe=dataclasses.replace(model.model.cfg.moe, **moe))
        with pytest.raises(UserError, match=match):
            hf.save_hf(model.params, cfg, str(tmp_path / "out"))


def test_yarn_frequencies_and_factor_are_transformers():
    import transformers as tf
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from ushard.models.layers import rope_attention_factor, rope_frequencies

    for mscales in ({}, {"mscale": 0.9, "mscale_all_dim": 0.8}, {"mscale": 1.0}):
        params = {**YARN, "factor": 40.0, "original_max_position_embeddings": 4096, **mscales}
        config = tf.DeepseekV3Config(**{**SIZES, "qk_rope_head_dim": 64}, rope_parameters=params)
        inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](config)
        scaling = RopeScaling("yarn", 40.0, original_max_position_embeddings=4096, **mscales)
        np.testing.assert_allclose(rope_frequencies(64, 10000.0, scaling), inv_freq.numpy(), rtol=1e-6)
        assert math.isclose(rope_attention_factor(scaling), factor, rel_tol=1e-12)


def test_cudnn_takes_latent_values_as_they_are_where_its_version_does(monkeypatch):
    """From cuDNN 9.10 `whole_sequence` hands cuDNN's blocks values of their own width (192 / 128
    without padding; tools/mla_attention.py checks the kernels on a GPU); before it, and with a
    document mask (which only JAX's public function takes), the values are padded."""
    from ushard.kernels import attention as kernels
    from ushard.kernels import cudnn

    widths = []

    def forward(q, k, v, causal, q_segments, k_segments, window=0):
        widths.append(v.shape[-1])
        return kernels.FLASH_SHAPES.forward(q, k, v, causal, q_segments, k_segments)

    monkeypatch.setattr(cudnn, "CUDNN_BLOCKS", kernels.BlockKernel(forward, kernels.FLASH_SHAPES.backward))
    monkeypatch.setattr(jax.nn, "dot_product_attention", lambda q, k, v, **kw: widths.append(v.shape[-1]) or q)
    keys = jax.random.split(jax.random.key(0), 3)
    q, k = (jax.random.normal(key, (1, 16, 2, 24), jnp.bfloat16) for key in keys[:2])
    v = jax.random.normal(keys[2], (1, 16, 2, 12), jnp.bfloat16)
    index = jnp.arange(16)[None]
    want = kernels.xla_block(q, k, v, index, index, None, None)[0]
    for version, segments, width in ((91900, None, 12), (90800, None, 24), (91900, jnp.zeros((1, 16), int), 24)):
        monkeypatch.setattr(cudnn, "cudnn_version", lambda version=version: version)
        widths.clear()
        out = kernels.whole_sequence(q, k, v, segments, "cudnn")
        assert widths == [width] and out.shape == v.shape
        if width == 12:
            np.testing.assert_allclose(np.asarray(out, np.float32), want, rtol=2e-2, atol=2e-2)


def test_values_narrower_than_qk_run_exactly_on_a_kernel_that_takes_one_head_size():
    """`values_padded` around JAX's attention (one head size) against the XLA einsum of two sizes,
    forward and backward."""
    from ushard.kernels import attention as kernels

    keys = jax.random.split(jax.random.key(0), 3)
    q, k = (jax.random.normal(key, (2, 16, 4, 24)) for key in keys[:2])
    v = jax.random.normal(keys[2], (2, 16, 4, 12))
    segments = jnp.array([[0] * 10 + [1] * 6, [0] * 16])
    mask = (segments[:, :, None] == segments[:, None, :])[:, None]

    @jax.jit
    def padded(q, k, v):
        one_size = lambda v: jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True)  # noqa: E731
        return kernels.values_padded(one_size, q, v)

    @jax.jit
    def einsum(q, k, v):
        return kernels.whole_sequence(q, k, v, segments, "xla")

    weights = jnp.arange(12.0)
    for run in (padded, einsum):
        assert run(q, k, v).shape == (2, 16, 4, 12)
    np.testing.assert_allclose(padded(q, k, v), einsum(q, k, v), rtol=1e-5, atol=1e-6)
    grads = [jax.jit(jax.grad(lambda *a, run=run: jnp.sum(run(*a) * weights), argnums=(0, 1, 2)))(q, k, v)
             for run in (padded, einsum)]
    for a, b in zip(*grads):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_the_per_sequence_balance_loss_is_the_mean_of_the_sequences_losses():
    from ushard.models.moe import load_balancing_loss, sequence_balancing_loss

    rng = np.random.default_rng(0)
    experts = jnp.asarray(rng.integers(0, 4, (3, 10, 2)))
    probs = jax.nn.softmax(jnp.asarray(rng.normal(size=(3, 10, 4))), axis=-1)

    def one(b):  # DeepSeek-V2's alpha * N' * sum_i f_i P_i of sequence b, alpha 1
        counts = np.bincount(np.asarray(experts[b]).reshape(-1), minlength=4)
        f = counts * 4 / (10 * 2)
        return float(np.sum(f * np.asarray(probs[b]).mean(axis=0)))

    assert math.isclose(float(jax.jit(sequence_balancing_loss)(experts, probs)), np.mean([one(b) for b in range(3)]),
                        rel_tol=1e-6)
    # One sequence: the batch's loss.
    share = jnp.bincount(experts[0].reshape(-1), length=4) / 20
    assert math.isclose(float(sequence_balancing_loss(experts[:1], probs[:1])),
                        float(load_balancing_loss(share, probs[:1])), rel_tol=1e-6)


def test_settings_are_checked_and_other_families_refuse_latent_attention():
    with pytest.raises(UserError, match="model.mla.qk_rope_head_dim=7 must be even"):
        MLAConfig(kv_lora_rank=16, qk_rope_head_dim=7, v_head_dim=8)
    with pytest.raises(UserError, match="model.mla.v_head_dim=8 is set but model.mla.kv_lora_rank=0"):
        MLAConfig(v_head_dim=8)
    with pytest.raises(UserError, match="model.moe.group_score='min' is not valid; choose one of: top2_sum, max"):
        MoEConfig(group_score="min")
    with pytest.raises(UserError, match="model.rope_scaling.beta_fast=1.0 must be larger than"):
        ModelConfig(rope_scaling=RopeScaling("yarn", beta_fast=1.0, beta_slow=1.0))
    mla = MLAConfig(kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12)
    for family in ("llama", "qwen3", "gemma3"):
        with pytest.raises(UserError, match=f"model.mla.kv_lora_rank=16 is not used by model.family='{family}'"):
            model_definition(ModelConfig(family=family, mla=mla))
    with pytest.raises(UserError, match="model.family='deepseek' computes multi-head latent attention"):
        model_definition(ModelConfig(family="deepseek"))
    assert ModelConfig.from_config({"family": "deepseek", "mla": dataclasses.asdict(mla)}).mla == mla
    flops = model_definition(ModelConfig(family="deepseek", mla=mla)).family.attention_shape(
        ModelConfig(family="deepseek", mla=mla))
    assert (flops.qk_head_dim, flops.v_head_dim) == (24, 12)


# The published config.json files (deepseek-ai/DeepSeek-V2-Lite, deepseek-ai/DeepSeek-V3), in their
# transformers-4 spelling (top-level rope_theta, rope_scaling with `type`).
YARN_40 = {"beta_fast": 32, "beta_slow": 1, "factor": 40, "original_max_position_embeddings": 4096, "type": "yarn"}
PUBLISHED = {
    "deepseek_v2_lite": {
        "architectures": ["DeepseekV2ForCausalLM"], "attention_bias": False, "aux_loss_alpha": 0.001,
        "first_k_dense_replace": 1, "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 10944,
        "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v2",
        "moe_intermediate_size": 1408, "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 64,
        "n_shared_experts": 2, "norm_topk_prob": False, "num_attention_heads": 16, "num_experts_per_tok": 6,
        "num_hidden_layers": 27, "num_key_value_heads": 16, "q_lora_rank": None, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
        "rope_scaling": {**YARN_40, "mscale": 0.707, "mscale_all_dim": 0.707}, "rope_theta": 10000,
        "routed_scaling_factor": 1.0, "scoring_func": "softmax", "seq_aux": True, "tie_word_embeddings": False,
        "topk_group": 1, "topk_method": "greedy", "v_head_dim": 128, "vocab_size": 102400},
    "deepseek_v3": {
        "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "aux_loss_alpha": 0.001, "ep_size": 1,
        "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168, "intermediate_size": 18432,
        "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v3",
        "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256,
        "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128, "num_experts_per_tok": 8,
        "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "q_lora_rank": 1536,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                "weight_block_size": [128, 128]},
        "rms_norm_eps": 1e-06, "rope_scaling": {**YARN_40, "mscale": 1.0, "mscale_all_dim": 1.0},
        "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True,
        "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "v_head_dim": 128,
        "vocab_size": 129280},
}


@pytest.mark.parametrize("name", PUBLISHED)
def test_the_shipped_configs_are_the_published_models(name):
    """configs/<name>.py computes what the published config.json describes (the FP8 one refused until
    dequantized, as its weights are)."""
    published = dict(PUBLISHED[name])
    if "quantization_config" in published:
        with pytest.raises(UserError, match="dequantize"):
            hf.model_config(published, name)
        del published["quantization_config"]
    imported = hf.model_config(published, name).settings()
    shipped = ModelConfig.from_config(ushard.load_config(name).model).settings()
    assert {k: v for k, v in imported.items() if hf.decided_by_hf(k)} == {
        k: v for k, v in shipped.items() if hf.decided_by_hf(k)}
