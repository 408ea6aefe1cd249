"""The model families beside Llama (ushard/models/registry.py): Qwen3 dense, Qwen3-MoE and Gemma 3.

Each is checked against transformers' own class: a tiny random model saved with `save_pretrained`
gives the same logits through `ushard.from_hf` (float32, 1e-5 relative), and ushard's export loads
back into transformers with the same logits. Gemma 3's tiny model has more layers than one window
cycle and a sequence longer than its window, with a remainder of local layers after the last whole
cycle (`tail_blocks`), so every kind of layer and its RoPE is exercised. The settings of the HF
config that change the function (QK-norm, the window, norm_topk_prob, the leading dense layers) are
also shown to matter: with them changed the logits are wrong. Refusals name the field.

Skipped without torch and transformers (the `hf` extra).
"""

import dataclasses

import jax
import numpy as np
import pytest

import test_hf
import ushard
from test_hf import FINETUNE, cli, first_batch, first_loss, relative_error, torch_logits, transformers_loss
from ushard import hf
from ushard.errors import UserError
from ushard.models.definition import model_definition
from ushard.trained import TrainedModel

text_file = test_hf.text_file  # the fixture, shared
VOCAB = 300  # at least the byte tokenizer's 257, for the fine-tuning run
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
            head_dim=24, rms_norm_eps=1e-6)  # head_dim independent of hidden_size / heads (16)
KINDS = ("qwen3", "qwen3_tied", "qwen3_moe", "gemma3")
TOKENS = np.random.default_rng(0).integers(0, VOCAB, (4, 40)).astype(np.int32)
GEMMA_WINDOW = 8  # shorter than TOKENS' 40


def torch_model(kind: str):
    """A tiny transformers model of `kind`, every weight random (norm weights too)."""
    import torch
    import transformers as tf

    torch.manual_seed(KINDS.index(kind))
    if kind.startswith("qwen3") and kind != "qwen3_moe":
        tied = kind == "qwen3_tied"
        config = tf.Qwen3Config(**BASE, num_hidden_layers=2, tie_word_embeddings=tied, rope_theta=1e6)
        model = tf.Qwen3ForCausalLM(config)
    elif kind == "qwen3_moe":
        model = tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(
            **BASE, num_hidden_layers=3, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            norm_topk_prob=True, mlp_only_layers=[0], decoder_sparse_step=1))
    else:  # 3 cycles of 2 local layers then a global one would be 9; 8 leaves 2 local layers after 2 cycles
        config = tf.Gemma3TextConfig(**BASE, num_hidden_layers=8, sliding_window=GEMMA_WINDOW,
                                     layer_types=["full_attention" if (i + 1) % 3 == 0 else "sliding_attention"
                                                  for i in range(8)], query_pre_attn_scalar=32,
                                     rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                         "rope_theta": 1e6},
                                                      "sliding_attention": {"rope_type": "default",
                                                                            "rope_theta": 1e4}})
        model = tf.Gemma3ForCausalLM(config)
    with torch.no_grad():
        for weight in model.parameters():
            if weight.ndim == 1:
                weight.copy_(0.1 * torch.randn_like(weight) + (0 if kind == "gemma3" else 1))
            else:
                weight.copy_(torch.randn_like(weight) / weight.shape[-1] ** 0.5)
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
        made[kind] = (str(directory), model)
    return made


def with_settings(imported, **changes) -> TrainedModel:
    cfg = dataclasses.replace(imported.model.cfg, **changes)
    return TrainedModel(model_definition(cfg), imported.params, imported.layout, 0, None, None)


@pytest.mark.parametrize("kind", KINDS)
def test_logits_match_transformers(checkpoints, kind):
    directory, model = checkpoints[kind]
    imported = ushard.from_hf(directory)
    expected = torch_logits(model, TOKENS)
    assert relative_error(imported(TOKENS), expected) <= 1e-5
    cfg = imported.model.cfg
    assert cfg.family == ("gemma3" if kind == "gemma3" else "qwen3") and cfg.head_dim == 24
    if kind == "qwen3_moe":
        assert cfg.moe.num_experts == 4 and cfg.moe.first_dense_layers == 1 and cfg.moe.normalize_gates
        unnormalised = with_settings(imported, moe=dataclasses.replace(cfg.moe, normalize_gates=False))
        assert relative_error(unnormalised(TOKENS), expected) > 1e-3
    if kind == "gemma3":
        assert (cfg.sliding_window, cfg.sliding_window_pattern, cfg.local_rope_theta) == (GEMMA_WINDOW, 3, 1e4)
        assert cfg.rope_scaling.type == "linear" and model_definition(cfg).stacks() == (
            ("blocks", 6, 3), ("tail_blocks", 2, 1))
        for changes in ({"sliding_window": 64}, {"sliding_window": 2 * GEMMA_WINDOW}, {"local_rope_theta": 1e6},
                        {"query_pre_attn_scalar": 0.0}):
            assert relative_error(with_settings(imported, **changes)(TOKENS), expected) > 1e-3, changes


@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_is_exact_and_transformers_loads_the_export(checkpoints, tmp_path, kind):
    import transformers

    directory, model = checkpoints[kind]
    first = ushard.from_hf(directory)
    exported = tmp_path / "exported"
    hf.save_hf(first.params, first.model.cfg, str(exported))
    second = ushard.from_hf(str(exported))
    assert second.model.cfg == first.model.cfg
    for a, b in zip(jax.tree.leaves(first.params), jax.tree.leaves(second.params)):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(exported))
    assert type(reloaded) is type(model)
    np.testing.assert_allclose(torch_logits(reloaded, TOKENS), torch_logits(model, TOKENS), rtol=0, atol=1e-5)


def test_a_qwen3_moe_with_moving_routing_biases_is_not_exported_naming_qwen3_moe(checkpoints, tmp_path):
    imported = ushard.from_hf(checkpoints["qwen3_moe"][0])
    model = imported.model
    biased = jax.tree.map(lambda x, is_bias: x + 0.5 if is_bias else x, imported.params, model.expert_biases)
    with pytest.raises(UserError, match="Hugging Face's Qwen3MoeForCausalLM router has none"):
        hf.save_hf(biased, model.cfg, str(tmp_path / "out"))


def test_decode_with_a_cache_matches_the_whole_sequence(checkpoints):
    """Generation's cached attention keeps each layer's window (Gemma 3: the tokens past it unseen)."""
    directory, _ = checkpoints["gemma3"]
    imported = ushard.from_hf(directory)
    model, params = imported.model, imported.params
    tokens = TOKENS[:1, :24]
    positions = np.arange(24, dtype=np.int32)[None]
    whole, _ = model.apply(params, tokens, positions)
    decode = jax.jit(model.decode)  # two programs: the prompt's, then one token's
    cache = model.init_cache(1, 32)
    logits, cache = decode(params, tokens[:, :16], positions[:, :16], cache)
    steps = [logits]
    for i in range(16, 24):
        logits, cache = decode(params, tokens[:, i:i + 1], positions[:, i:i + 1], cache)
        steps.append(logits)
    np.testing.assert_allclose(np.concatenate(steps, axis=1), whole, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind, changes, match", [
    ("qwen3_moe", {"decoder_sparse_step": 2}, "decoder_sparse_step=2"),
    ("qwen3_moe", {"mlp_only_layers": [1]}, r"mlp_only_layers=\[1\]"),
    ("qwen3", {"use_sliding_window": True, "sliding_window": 4}, "use_sliding_window=true"),
    ("gemma3", {"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0"),
    ("gemma3", {"layer_types": ["full_attention"] + ["sliding_attention"] * 7}, "layer_types="),
    ("gemma3", {"hidden_activation": "silu"}, "hidden_activation=\"silu\""),
    ("qwen3", {"model_type": "qwen2"}, "model_type=\"qwen2\""),
])
def test_what_ushard_cannot_compute_is_refused_naming_the_field(checkpoints, kind, changes, match):
    directory, _ = checkpoints[kind]
    config = {**hf.read_config(directory), **changes}
    with pytest.raises(UserError, match=match):
        hf.model_config(config, directory)


def test_a_family_refuses_the_settings_of_another():
    from ushard.models.config import ModelConfig, MoEConfig

    with pytest.raises(UserError, match="model.sliding_window=8 is not used by model.family='qwen3'"):
        model_definition(ModelConfig(family="qwen3", sliding_window=8))
    with pytest.raises(UserError, match="Gemma 3 has no mixture-of-experts"):
        model_definition(ModelConfig(family="gemma3", moe=MoEConfig(num_experts=4)))
    with pytest.raises(UserError, match="model.family='gpt2' is not a model family ushard has; choose one of: llama"):
        model_definition(ModelConfig(family="gpt2"))


# Qwen3-MoE's in the slow tier (`-m slow`): the same path as Gemma 3's and the Llama's (tests/test_hf.py).
@pytest.mark.parametrize("kind", [pytest.param("qwen3_moe", marks=pytest.mark.slow), "gemma3"])
def test_finetune_from_a_converted_checkpoint_starts_at_transformers_loss(checkpoints, text_file, tmp_path, kind):
    """docs/finetuning.md's recipe: convert, train with the printed settings, export."""
    import transformers

    directory, model = checkpoints[kind]
    converted, run, exported = (str(tmp_path / name) for name in ("converted", "run", "exported"))
    status, out, err = cli("convert", "--from-hf", directory, "--to", converted)
    assert status == 0, err
    settings = [a for a in out.split() if a.startswith("--config.model.")]
    assert f"--config.model.family={cfg_family(kind)}" in settings
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
    assert relative_error(trained(TOKENS), torch_logits(reloaded, TOKENS)) <= 1e-4


def cfg_family(kind: str) -> str:
    return "gemma3" if kind == "gemma3" else "qwen3"
