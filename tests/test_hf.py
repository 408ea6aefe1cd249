"""Hugging Face checkpoints: tiny random models built with transformers (Llama untied and tied with GQA,
Llama 3.1 RoPE scaling, Mistral, Mixtral with 4 experts, top 2) give the same logits through
`ushard.from_hf` as through transformers; HF -> ushard -> HF -> ushard is exact; `ushard convert` both
ways; fine-tuning from an imported checkpoint (`checkpoint.init_from`) starts at the loss transformers
computes on the same batch; what ushard cannot compute is refused in one sentence naming the field (on
export too: an MoE model that Mixtral cannot compute).

The tests that need torch and transformers (the `hf` extra) are skipped without them.
"""

import contextlib
import dataclasses
import io
import json
import os
import re
import shutil

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

import ushard
from ushard import hf
from ushard.models.config import ModelConfig, MoEConfig, RopeScaling
from ushard.models.definition import model_definition
from ushard.models.llama import hf as llama_hf
from ushard.trained import TrainedModel

VOCAB = 300  # at least the byte tokenizer's 257, for the fine-tuning run
SIZES = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, rms_norm_eps=1e-6)
LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16}  # small, so a 24-token input meets all three bands
MIXTRAL = dict(num_local_experts=4, num_experts_per_tok=2)
KINDS = ("llama", "llama_tied", "llama31", "mistral", "mixtral")


def relative_error(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - b)) / np.max(np.abs(b)))


def torch_model(kind: str):
    """A tiny transformers model of `kind` with every weight random (norm scales near 1, not 1)."""
    import torch
    import transformers as tf

    torch.manual_seed(KINDS.index(kind))
    if kind == "mistral":
        model = tf.MistralForCausalLM(tf.MistralConfig(**SIZES, sliding_window=None))
    elif kind == "mixtral":
        model = tf.MixtralForCausalLM(tf.MixtralConfig(**SIZES, **MIXTRAL, sliding_window=None))
    else:
        extra = {"tie_word_embeddings": kind == "llama_tied"}
        if kind == "llama31":
            extra.update(rope_theta=500000.0, rope_scaling=LLAMA31_ROPE)
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**SIZES, **extra))
    with torch.no_grad():
        for weight in model.parameters():
            if weight.ndim == 1:
                weight.copy_(1 + 0.1 * torch.randn_like(weight))
            else:
                weight.copy_(torch.randn_like(weight) / weight.shape[-1] ** 0.5)  # [..., out, in]
    return model.eval()


def torch_logits(model, tokens) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.tensor(np.asarray(tokens), dtype=torch.long)).logits.numpy()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{kind: (directory, transformers model)}; Mistral is saved in several shards with an index."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    made = {}
    for kind in KINDS:
        model = torch_model(kind)
        directory = tmp_path_factory.mktemp(kind)
        model.save_pretrained(directory, max_shard_size="40KB" if kind == "mistral" else "5GB")
        made[kind] = (str(directory), model)
    assert os.path.isfile(os.path.join(made["mistral"][0], hf.INDEX_FILE))
    return made


TOKENS = np.random.default_rng(0).integers(0, VOCAB, (8, 24)).astype(np.int32)


@pytest.mark.parametrize("kind", KINDS)
def test_logits_match_transformers(checkpoints, kind):
    directory, model = checkpoints[kind]
    imported = ushard.from_hf(directory)
    expected = torch_logits(model, TOKENS)
    assert relative_error(imported(TOKENS), expected) <= 1e-4
    if kind == "llama31":  # the scaling matters at these positions: without it the logits are wrong
        cfg = imported.model.cfg
        assert cfg.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 16) and cfg.rope_theta == 500000.0
        unscaled_cfg = dataclasses.replace(cfg, rope_scaling=RopeScaling())
        unscaled = TrainedModel(model_definition(unscaled_cfg), imported.params, imported.layout, 0, None, None)
        assert relative_error(unscaled(TOKENS), expected) > 1e-2
    if kind == "mixtral":  # Mixtral's routing; without renormalised gates the logits are wrong
        assert imported.model.cfg.moe == MoEConfig(num_experts=4, top_k=2, **llama_hf.MIXTRAL_ROUTING)
        other = dataclasses.replace(imported.model.cfg, moe=MoEConfig(num_experts=4, top_k=2, normalize_gates=False))
        unnormalised = TrainedModel(model_definition(other), imported.params, imported.layout, 0, None, None)
        assert relative_error(unnormalised(TOKENS), expected) > 1e-2


def test_mixtral_loaded_over_expert_and_fsdp_axes_matches_transformers(checkpoints):
    """The experts split over mesh.expert (2: two experts per device), the rest ZeRO-3 over fsdp (4),
    as a training run with checkpoint.init_from lays them out; tokens reach their experts by all-to-all."""
    from ushard.config import MESH_AXES
    from ushard.mesh import build_mesh
    from ushard.sharding import Layout
    from ushard.trained import abstract_params

    directory, model = checkpoints["mixtral"]
    cfg = hf.model_config(hf.read_config(directory), directory, **hf.IMPORT_SETTINGS)
    mesh = build_mesh({axis: {"expert": 2, "fsdp": 4}.get(axis, 1) for axis in MESH_AXES})
    layout = Layout.create(mesh, 3, n_kv_heads=cfg.n_kv_heads)
    params = hf.load_params(directory, cfg, abstract_params(model_definition(cfg), layout))
    w_gate = params["blocks"]["mlp"]["experts"]["w_gate"]
    assert w_gate.shape == (2, 4, 64, 128) and w_gate.sharding.spec[1] == "expert"
    assert w_gate.addressable_shards[0].data.shape[1] == 2
    spread = TrainedModel(model_definition(cfg), params, layout, 0, None, None)
    assert relative_error(spread(TOKENS), torch_logits(model, TOKENS)) <= 1e-4


def test_fused_layout_loaded_over_eight_devices_matches_transformers(checkpoints):
    directory, model = checkpoints["llama"]
    imported = ushard.from_hf(directory, devices=jax.devices(), fused_mlp=True)
    w_gate_up = imported.params["blocks"]["mlp"]["w_gate_up"]
    assert w_gate_up.shape == (2, 64, 2, 128) and len(w_gate_up.sharding.device_set) == 8
    assert not w_gate_up.sharding.is_fully_replicated
    assert relative_error(imported(TOKENS), torch_logits(model, TOKENS)) <= 1e-4


def hf_tensors(directory) -> dict:
    tensors = {}
    for name in os.listdir(directory):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(directory, name)))
    return tensors


def assert_same_hf_tensors(expected_directory, directory):
    expected, written = hf_tensors(expected_directory), hf_tensors(directory)
    assert set(written) == set(expected)
    for name, value in expected.items():
        assert written[name].dtype == value.dtype and np.array_equal(written[name], value), name


@pytest.mark.parametrize("kind, fused", [("llama31", False), ("llama_tied", True), ("mixtral", True)])
def test_round_trip_is_exact_and_transformers_loads_the_export(checkpoints, tmp_path, kind, fused):
    import transformers

    directory, model = checkpoints[kind]
    first = ushard.from_hf(directory, fused_mlp=fused)
    exported = tmp_path / "exported"
    hf.save_hf(first.params, first.model.cfg, str(exported), max_file_bytes=64 * 1024)  # several shards
    assert (exported / hf.INDEX_FILE).is_file()
    assert_same_hf_tensors(directory, exported)
    second = ushard.from_hf(str(exported), fused_mlp=fused)
    assert second.model.cfg == first.model.cfg
    for a, b in zip(jax.tree.leaves(first.params), jax.tree.leaves(second.params)):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(exported))
    assert np.array_equal(torch_logits(reloaded, TOKENS), torch_logits(model, TOKENS))


# ----------------------------------------------------------------------------- convert and fine-tune


def cli(*argv) -> tuple[int, str, str]:
    from ushard.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(list(argv))
    return status, out.getvalue(), err.getvalue()


FINETUNE = [
    "--config", "tiny", "--config.model.vocab_size=300", "--config.model.d_model=64", "--config.model.n_layers=2",
    "--config.model.n_heads=4", "--config.model.n_kv_heads=2", "--config.model.d_ff=128",
    "--config.model.norm_eps=1e-06", "--config.train.seq_len=32", "--config.train.batch_size=8",
    "--config.train.steps=1", "--config.train.warmup_steps=0", "--config.train.log_every=1",
    "--config.train.eval_every=0", "--config.data.source=text",
]


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    words = "the model reads these words in many orders and learns a little of them".split()
    rng = np.random.default_rng(0)
    path = tmp_path_factory.mktemp("data") / "words.txt"
    path.write_text(" ".join(rng.choice(words, 3000)))
    return str(path)


def first_batch(text_file) -> dict:
    from ushard.config import load_config
    from ushard.data import make_batches

    config = load_config("tiny", [a[len("--config."):] for a in FINETUNE if a.startswith("--config.")]
                         + [f"data.paths={text_file}"])
    batches = make_batches(config.data, config.train.seq_len, config.train.seed)
    return batches.train_batch(batches.initial_state(), config.train.batch_size)[0]


def transformers_loss(model, batch) -> float:
    """The trainer's loss on `batch` computed by transformers: each packed document (segment) of a row
    run on its own from position 0, cross-entropy summed over the unmasked targets, divided by their count."""
    total, count = 0.0, 0.0
    for row in range(batch["inputs"].shape[0]):
        segments = batch["segment_ids"][row]
        for segment in np.unique(segments):
            where = segments == segment
            # Positions as transformers numbers them.
            assert np.array_equal(batch["positions"][row][where], np.arange(where.sum()))
            logits = torch_logits(model, batch["inputs"][row][where][None])[0].astype(np.float64)
            log_z = np.log(np.sum(np.exp(logits - logits.max(-1, keepdims=True)), -1)) + logits.max(-1)
            targets = batch["targets"][row][where]
            losses = log_z - logits[np.arange(len(targets)), targets]
            mask = batch["loss_mask"][row][where]
            total, count = total + float(np.sum(losses * mask)), count + float(mask.sum())
    return total / count


def first_loss(workdir) -> float:
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return json.loads(f.readline())["loss"]


def test_finetune_from_an_imported_checkpoint_starts_at_transformers_loss(checkpoints, text_file, tmp_path):
    import transformers

    directory, model = checkpoints["llama"]
    converted, run = str(tmp_path / "converted"), str(tmp_path / "run")
    status, out, err = cli("convert", "--from-hf", directory, "--to", converted)
    assert status == 0, err
    assert "--config.checkpoint.init_from=" in out and "--config.model.norm_eps=1e-06" in out
    assert "moe." not in out  # a dense model: the MoE settings stay the run's defaults
    status, out, err = cli("train", *FINETUNE, f"--config.data.paths={text_file}",
                           f"--config.checkpoint.init_from={converted}", "--workdir", run)
    assert status == 0, err
    assert "starting from the parameters in" in out
    expected = transformers_loss(model, first_batch(text_file))
    assert abs(first_loss(run) - expected) <= 1e-5 * expected
    # The fine-tuned run back to Hugging Face: transformers computes what ushard does.
    exported = str(tmp_path / "exported")
    status, _, err = cli("convert", "--from", run, "--to-hf", exported)
    assert status == 0, err
    trained = ushard.load_model(run, log=lambda *_: None)
    assert trained.step == 1
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(exported)
    assert relative_error(trained(TOKENS), torch_logits(reloaded, TOKENS)) <= 1e-4
    assert not np.array_equal(hf_tensors(exported)["lm_head.weight"], hf_tensors(directory)["lm_head.weight"])
    # The converted workdir holds parameters only: training in it is refused, not taken for damage.
    status, _, err = cli("train", *FINETUNE, f"--config.data.paths={text_file}", "--workdir", converted)
    assert status == 2 and "holds parameters only" in err and f"init_from={converted}" in err
    assert os.listdir(os.path.join(converted, "checkpoints")) == ["0"]


def test_init_from_a_hf_directory_starts_like_its_converted_workdir(checkpoints, text_file, tmp_path):
    from ushard.config import load_config
    from ushard.training.loop import Trainer

    directory, _ = checkpoints["llama"]
    converted = str(tmp_path / "converted")
    assert cli("convert", "--from-hf", directory, "--to", converted)[0] == 0
    overrides = [a[len("--config."):] for a in FINETUNE if a.startswith("--config.")]
    config = load_config("tiny", overrides + [f"data.paths={text_file}", f"checkpoint.init_from={directory}"])
    state, data_state = Trainer(config).initial_state(log=lambda *_: None)
    assert int(state.step) == 0 and data_state["position"] == 0
    assert all(not np.any(np.asarray(x)) for x in jax.tree.leaves(state.opt_state))  # a fresh optimizer
    imported = ushard.load_model(converted, log=lambda *_: None)
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(imported.params)):
        assert np.array_equal(np.asarray(a), np.asarray(b))


# ----------------------------------------------------------------------------- refusals (no transformers needed)


SMALL = ModelConfig(vocab_size=VOCAB, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, norm_eps=1e-6,
                    compute_dtype="float32")


SMALL_MOE = dataclasses.replace(SMALL, moe=MoEConfig(num_experts=4, top_k=2))


def random_params(cfg: ModelConfig, routing_bias: float = 0.0):
    """Random parameters of `cfg`; MoE routing biases all `routing_bias`."""
    rng = np.random.default_rng(0)
    model = model_definition(cfg)
    return jax.tree.map(lambda s, is_bias: jax.numpy.asarray(np.full(s.shape, routing_bias, s.dtype) if is_bias
                                                             else rng.normal(size=s.shape).astype(s.dtype)),
                        model.shapes, model.expert_biases)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint of SMALL's random parameters written by ushard itself (no transformers needed)."""
    directory = tmp_path_factory.mktemp("saved")
    hf.save_hf(random_params(SMALL), SMALL, str(directory))
    return str(directory)


@pytest.fixture(scope="module")
def saved_moe(tmp_path_factory):
    """SMALL_MOE's random parameters as a Mixtral checkpoint written by ushard."""
    directory = tmp_path_factory.mktemp("saved_moe")
    hf.save_hf(random_params(SMALL_MOE), SMALL_MOE, str(directory))
    return str(directory)


def edited(saved, tmp_path, **changes) -> str:
    """A copy of the saved checkpoint with config.json's entries changed (None removes one)."""
    directory = tmp_path / "edited"
    shutil.copytree(saved, directory)
    config = json.loads((directory / "config.json").read_text())
    config.update(changes)
    (directory / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    return str(directory)


@pytest.mark.parametrize("changes, match", [
    ({"model_type": "qwen2"}, r"model_type=\"qwen2\" is not supported: ushard imports llama, mistral, mixtral, qwen3, "
                             r"qwen3_moe, gemma3_text, deepseek_v3, deepseek_v2\."),
    ({"head_dim": 32}, r"tensor model\.layers\.0\.self_attn\.q_proj\.weight is \[64, 64\], but config\.json's "
                       r"sizes make it \[128, 64\]"),  # a head size of its own: then its tensors are larger
    ({"attention_bias": True}, r"attention_bias=true is not supported: ushard's projections have no biases\."),
    ({"mlp_bias": True}, r"mlp_bias=true is not supported"),
    ({"hidden_act": "gelu"}, r"hidden_act=\"gelu\" is not supported: this family's MLP uses silu"),
    ({"model_type": "mistral", "sliding_window": 4096}, r"sliding_window=4096 is not supported"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
     r"rope_scaling\.rope_type=\"yarn\" is not supported: ushard computes RoPE of types default, llama3, linear\."),
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}},
     r"rope_parameters\.rope_type=\"dynamic\""),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
     r"the llama3 type needs low_freq_factor, high_freq_factor"),
    ({"intermediate_size": 96}, r"tensor model\.layers\.0\.mlp\.gate_proj\.weight is \[128, 64\], but config\.json's "
                                r"sizes make it \[96, 64\]"),
    ({"num_hidden_layers": 3}, r"has no tensor model\.layers\.2\.input_layernorm\.weight \(and 8 more\)"),
])
def test_what_ushard_cannot_compute_is_refused_naming_the_field(saved, tmp_path, changes, match):
    with pytest.raises(ushard.UserError, match=match):
        ushard.from_hf(edited(saved, tmp_path, **changes))


@pytest.mark.parametrize("changes, match", [
    ({"router_jitter_noise": 0.01}, r"router_jitter_noise=0\.01 is not supported: ushard's router adds no noise\."),
    ({"num_local_experts": 2.5}, r"num_local_experts=2\.5 is not supported: it must be a whole number\."),
    ({"num_local_experts": 6},
     r"has no tensor model\.layers\.0\.block_sparse_moe\.experts\.4\.w1\.weight \(and 11 more\)"),
    ({"num_local_experts": 3},
     r"tensor model\.layers\.0\.block_sparse_moe\.gate\.weight is \[4, 64\], but config\.json's "
     r"sizes make it \[3, 64\]"),
])
def test_what_ushard_cannot_compute_of_mixtral_is_refused(saved_moe, tmp_path, changes, match):
    with pytest.raises(ushard.UserError, match=match):
        ushard.from_hf(edited(saved_moe, tmp_path, **changes))


def test_mixtral_written_by_ushard_reads_back_with_its_routing(saved_moe, tmp_path):
    config = hf.read_config(saved_moe)
    assert config["architectures"] == ["MixtralForCausalLM"] and config["intermediate_size"] == 128
    assert (config["num_local_experts"], config["num_experts_per_tok"], config["router_jitter_noise"]) == (4, 2, 0.0)
    imported = ushard.from_hf(saved_moe, moe={"dispatch": "ragged", "aux_loss_weight": 0.0})  # how, not what
    assert imported.model.cfg.moe == MoEConfig(num_experts=4, top_k=2, **llama_hf.MIXTRAL_ROUTING, dispatch="ragged",
                                               aux_loss_weight=0.0)
    assert not np.any(np.asarray(imported.params["blocks"]["mlp"]["bias"]))
    for a, b in zip(jax.tree.leaves(imported.params), jax.tree.leaves(random_params(SMALL_MOE))):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ushard.UserError, match=r"model\.moe\.top_k of a Hugging Face checkpoint comes from its "
                                               r"config\.json; leave it out\."):
        ushard.from_hf(saved_moe, moe={"top_k": 1})
    # A capacity only limits training batches: exported with a note, the weights as they are.
    capped = dataclasses.replace(imported.model.cfg, moe=MoEConfig(num_experts=4, top_k=2, capacity_factor=1.25))
    notes = []
    ushard.to_hf(TrainedModel(model_definition(capped), imported.params, imported.layout, 0, None, None),
                 str(tmp_path / "capped"), log=notes.append)
    assert notes[0] == ("note: model.moe.capacity_factor=1.25 is not exported: transformers' Mixtral routes every "
                        "token to its experts (as ushard does with capacity_factor=0).")
    assert len(notes) == 2 and "tokenizer is unknown" in notes[1]  # a model built in Python: no tokenizer files
    assert_same_hf_tensors(saved_moe, tmp_path / "capped")


@pytest.mark.parametrize("moe, routing_bias, match", [
    (dict(score_func="sigmoid"), 0.0, r"model\.moe\.score_func='sigmoid' cannot be exported: Hugging Face's Mixtral, "
                                      r"the one MoE architecture of the llama family, has score_func='softmax'\."),
    (dict(num_shared_experts=1), 0.0, r"model\.moe\.num_shared_experts=1 cannot be exported"),
    (dict(), 0.5, r"routing biases \(model\.moe\.bias_update_rate\) are not zero, "
                  r"and Hugging Face's MixtralForCausalLM router"),
])
def test_what_mixtral_cannot_compute_is_not_exported(tmp_path, moe, routing_bias, match):
    cfg = dataclasses.replace(SMALL, moe=MoEConfig(num_experts=4, top_k=2, **moe))
    with pytest.raises(ushard.UserError, match=match):
        hf.save_hf(random_params(cfg, routing_bias), cfg, str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_convert_a_mixtral_both_ways(saved_moe, tmp_path):
    converted, exported = str(tmp_path / "converted"), str(tmp_path / "exported")
    status, out, err = cli("convert", "--from-hf", saved_moe, "--to", converted)
    assert status == 0, err
    for setting in ("moe.num_experts=4", "moe.top_k=2", "moe.score_func=softmax", "moe.normalize_gates=True",
                    "moe.capacity_factor=0.0", "moe.every=1", "d_ff=128"):
        assert f"--config.model.{setting} " in out + " "
    assert "aux_loss_weight" not in out and "dispatch" not in out  # how it trains: the run's choice
    status, _, err = cli("convert", "--from", converted, "--to-hf", exported)
    assert status == 0, err
    assert_same_hf_tensors(saved_moe, exported)


def test_init_from_a_mixtral_compares_the_routing_only(saved_moe):
    from ushard.trained import abstract_params, inference_layout
    from ushard.training.init_from import initial_params

    with pytest.raises(ushard.UserError, match=r"holds another model: model\.moe\.top_k=2 there but 1 here; set"):
        initial_params(saved_moe, dataclasses.replace(SMALL_MOE, moe=MoEConfig(num_experts=4, top_k=1)), target=None)
    run = dataclasses.replace(SMALL_MOE, moe=MoEConfig(num_experts=4, top_k=2, aux_loss_weight=0.1))
    params = initial_params(saved_moe, run, abstract_params(model_definition(run), inference_layout()))
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(random_params(SMALL_MOE))):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_both_rope_spellings_and_hf_defaults_are_read(saved, tmp_path):
    legacy = edited(saved, tmp_path, rope_theta=500000.0, rope_scaling={"type": "llama3", **{
        k: v for k, v in LLAMA31_ROPE.items() if k != "rope_type"}}, rms_norm_eps=None, num_key_value_heads=None,
        num_attention_heads=4)
    cfg = hf.model_config(hf.read_config(legacy), legacy)
    assert cfg.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 16) and cfg.rope_theta == 500000.0
    assert cfg.norm_eps == 1e-6 and cfg.n_kv_heads == 4  # transformers' defaults, not ushard's
    modern = {"rope_parameters": {"rope_theta": 500000.0, **LLAMA31_ROPE}}
    assert hf.model_config(modern | {k: v for k, v in hf.read_config(legacy).items() if not k.startswith("rope")},
                           legacy) == cfg


def test_each_device_block_is_read_once_and_alone(saved, monkeypatch):
    """Loading over 8 devices reads every stored element exactly once, in blocks of at most one
    device's share: no host ever holds a whole tensor of the model, let alone the whole model."""
    reads = []
    read = hf.SafetensorsFiles.read
    def recorded(self, name, slices):
        reads.append(read(self, name, slices))
        return reads[-1]

    monkeypatch.setattr(hf.SafetensorsFiles, "read", recorded)
    spread = ushard.from_hf(saved, devices=jax.devices())
    stored = hf_tensors(saved)
    assert sum(r.size for r in reads) == sum(t.size for t in stored.values())
    assert max(r.size for r in reads) <= max(t.size for t in stored.values()) // 8
    one = ushard.from_hf(saved)
    for a, b in zip(jax.tree.leaves(spread.params), jax.tree.leaves(one.params)):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_bfloat16_weights_on_disk_are_written_and_read(saved, tmp_path):
    """Published checkpoints store bfloat16: written with dtype="bfloat16", read back into float32
    parameters they are the float32 ones rounded to bfloat16."""
    one = ushard.from_hf(saved)
    ushard.to_hf(one, str(tmp_path / "bf16"), dtype="bfloat16")
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert {t.dtype for t in hf_tensors(tmp_path / "bf16").values()} == {np.dtype(jax.numpy.bfloat16)}
    back = ushard.from_hf(str(tmp_path / "bf16"))
    for a, b in zip(jax.tree.leaves(one.params), jax.tree.leaves(back.params)):
        assert b.dtype == np.float32
        assert np.array_equal(np.asarray(a).astype(jax.numpy.bfloat16).astype(np.float32), np.asarray(b))
    with pytest.raises(ushard.UserError, match=r"is not empty; write the Hugging Face checkpoint into a new"):
        ushard.to_hf(one, str(tmp_path / "bf16"))


@pytest.mark.parametrize("mesh", [dict(pipeline=2, fsdp=2, tensor=2), dict(fsdp=4, tensor=2)])
def test_loading_into_a_training_layout_gives_the_same_parameters(saved, mesh):
    """The fused layout split over pipeline stages (layers), tensor (mlp) and fsdp (embed), as a
    training run with checkpoint.init_from lays it out."""
    from ushard.config import MESH_AXES
    from ushard.mesh import build_mesh
    from ushard.sharding import Layout, with_shardings

    cfg = hf.model_config(hf.read_config(saved), saved, **hf.IMPORT_SETTINGS, fused_mlp=True)
    model = model_definition(cfg)
    layout = Layout.create(build_mesh({a: mesh.get(a, 1) for a in MESH_AXES}), 3, n_kv_heads=cfg.n_kv_heads)
    params = hf.load_params(saved, cfg, with_shardings(model.shapes, layout.shardings(model.logical, "params")))
    w_gate_up = params["blocks"]["mlp"]["w_gate_up"]
    assert len(w_gate_up.sharding.device_set) == 8 and w_gate_up.sharding.spec[3] == "tensor"
    reference = ushard.from_hf(saved, fused_mlp=True).params
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(reference)):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_init_from_another_model_is_one_sentence(saved):
    from ushard.training.init_from import initial_params

    other = dataclasses.replace(SMALL, d_model=128, norm_eps=1e-5)
    with pytest.raises(ushard.UserError, match=rf"checkpoint\.init_from={saved} holds another model: model\.d_model=64 "
                                               r"there but 128 here; model\.norm_eps=1e-06 there but 1e-05 here; set"):
        initial_params(saved, other, target=None)
    with pytest.raises(ushard.UserError, match=r"neither a ushard workdir \(with checkpoints/\) nor a Hugging Face"):
        initial_params(os.path.dirname(saved), SMALL, target=None)


@pytest.mark.parametrize("argv, match", [
    (["convert", "--from-hf", "x"], r"convert takes --from-hf DIR --to WORKDIR \(import\), --from WORKDIR --to-hf DIR"),
    (["convert", "--from-hf", "x", "--to", "y", "--to-hf", "z"], r"convert takes --from-hf"),
    (["convert", "--from-hf", "nowhere", "--to", "y"], r"nowhere holds no config\.json"),
])
def test_convert_mistakes_are_one_sentence(argv, match):
    status, _, err = cli(*argv)
    assert status == 2 and err.startswith("ushard: error: ")
    assert len(err.strip().splitlines()) == 1 and re.search(match, err)


def test_an_export_carries_the_runs_tokenizer_and_its_special_token_ids(saved, tmp_path):
    """Beside the weights: a Hugging Face tokenizer's files, config.json's and generation_config.json's
    bos and eos ids (the document end and the chat turn's end), which transformers reads; the byte
    tokenizer's end of document; for an unknown tokenizer, nothing and a note."""
    tokenizers = pytest.importorskip("tokenizers")
    source = tmp_path / "tokenizer"
    source.mkdir()
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_end|>", "<s>"],
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(["some words to learn from"] * 10, trainer)
    tokenizer.save(str(source / "tokenizer.json"))
    (source / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "bos_token": "<s>",
                                                              "chat_template": "{{ messages }}"}))
    model = ushard.from_hf(saved)
    cases = {str(source): ({"bos_token_id": 2, "eos_token_id": [0, 1]}, {"tokenizer.json", "tokenizer_config.json"}),
             "byte": ({"eos_token_id": 256}, set()), None: ({}, set())}
    for name, (ids, files) in cases.items():
        out, notes = tmp_path / f"export-{name is None}-{name == 'byte'}", []
        ushard.to_hf(dataclasses.replace(model, tokenizer=name), str(out), log=notes.append)
        written = set(os.listdir(out)) - {"config.json", "model.safetensors"}
        assert written == files | ({"generation_config.json"} if ids else set())
        config = json.loads((out / "config.json").read_text())
        assert {k: config[k] for k in ids} == ids and not ({"bos_token_id", "eos_token_id"} - set(ids)) & set(config)
        if ids:
            assert json.loads((out / "generation_config.json").read_text()) == ids
        assert any("tokenizer is unknown" in n for n in notes) == (name is None)
    assert (tmp_path / "export-False-False" / "tokenizer.json").read_bytes() == (source / "tokenizer.json").read_bytes()
    transformers = pytest.importorskip("transformers")
    loaded = transformers.GenerationConfig.from_pretrained(str(tmp_path / "export-False-False"))
    assert (loaded.bos_token_id, loaded.eos_token_id) == (2, [0, 1])
    reread = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "export-False-False"))
    assert reread.eos_token == "<|im_end|>" and reread.chat_template == "{{ messages }}"
