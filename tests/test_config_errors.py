"""Every class of bad input ends in one clear sentence and a non-zero exit, never a traceback.

A few cases go through the real `ushard train` CLI in a subprocess (exit status 2, one line on stderr);
the remaining classes are checked in-process against `validate`, `load_config` and `apply_overrides`,
which is where the CLI's sentences come from.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ushard.cli import _split_overrides, main
from ushard.config import apply_overrides, default_config, load_config, validate
from ushard.errors import UserError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEVICES = 8


# --------------------------------------------------------------------------- helpers


def _one_sentence(excinfo) -> str:
    """The message of a raised UserError, checked to be one line ending in a full stop."""
    message = str(excinfo.value)
    assert "\n" not in message, f"not one line: {message!r}"
    assert message.rstrip().endswith("."), f"not a sentence: {message!r}"
    return message


def _tiny(*overrides: str):
    return load_config("tiny", list(overrides))


def _invalid(config, match: str, num_devices: int = DEVICES) -> str:
    with pytest.raises(UserError, match=match) as excinfo:
        validate(config, num_devices)
    return _one_sentence(excinfo)


def _run_cli(tmp_path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["JAX_NUM_CPU_DEVICES"] = str(DEVICES)
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "ushard", "train", *args, "--workdir", str(tmp_path / "run")]
    # The timeout only matters if validation wrongly lets a bad config through and training starts.
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)


# --------------------------------------------------------------------------- through the CLI

# (arguments after `train`, substrings the one line must contain: the offending key and value)
CLI_CASES = {
    "unknown_key": (["--config", "tiny", "--config.model.d_modle=3"], ["model.d_modle", "d_model"]),
    "bad_type": (["--config", "tiny", "--config.train.steps=abc"], ["train.steps", "'abc'", "int"]),
    "mesh_product": (["--config", "tiny", "--config.mesh.fsdp=3"], ["fsdp=3", "8"]),
    "kv_heads": (["--config", "tiny", "--config.model.n_kv_heads=4"], ["model.n_heads=6", "model.n_kv_heads=4"]),
    "batch_shards": (["--config", "tiny", "--config.train.batch_size=12"], ["train.batch_size=12", "multiple of 8"]),
    "zero_stage": (["--config", "tiny", "--config.parallel.zero_stage=4"], ["parallel.zero_stage=4", "0, 1, 2, 3"]),
    "unknown_shipped": (["--config", "no_such_config"], ["'no_such_config'", "tiny"]),
    "empty_glob": (
        ["--config", "tiny", "--config.data.source=text", "--config.data.paths=/nonexistent/*.txt"],
        ["data.paths", "/nonexistent/*.txt"],
    ),
    "expert_axis_without_experts": (
        ["--config", "tiny", "--config.mesh.expert=2", "--config.mesh.fsdp=4"],
        ["mesh.expert=2", "model.moe.num_experts=0"],
    ),
    "pipeline_layers": (
        ["--config", "tiny", "--config.mesh.pipeline=8", "--config.mesh.fsdp=1"],
        ["model.n_layers=4", "mesh.pipeline=8", "multiple of 8"],
    ),
}


@pytest.mark.parametrize("case", list(CLI_CASES))
def test_cli_bad_input_is_one_line_exit_2(tmp_path, case):
    args, needles = CLI_CASES[case]
    proc = _run_cli(tmp_path, *args)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr
    assert proc.stderr.startswith("ushard: error: "), proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


# --------------------------------------------------------------------------- valid input


def test_shipped_tiny_is_valid_on_8_and_1_devices():
    assert validate(_tiny(), DEVICES)["fsdp"] == 8
    assert validate(_tiny(), 1)["fsdp"] == 1


@pytest.mark.parametrize("name, params", [
    ("llama3_8b", 8_030_261_248), ("llama3_70b", 70_553_706_496), ("bench_1b", 953_223_168),
    # 16 x (q 2048 x 3072, latent 2048 x 576 and its norm, keys and values 512 x 16 x 256, output
    # 2048 x 2048, the MLP, two norms) + two embeddings + the final norm.
    ("bench_mla", 904_996_864)])
def test_shipped_configs_are_valid_and_the_size_they_say(name, params):
    from ushard.models.config import ModelConfig
    from ushard.models.definition import ModelDef

    config = load_config(name)
    assert validate(config, DEVICES)["fsdp"] == 8
    # For Llama 3, Meta's published counts.
    assert ModelDef(ModelConfig.from_config(config.model)).num_params() == params


@pytest.mark.parametrize("name, devices, mesh, params, active", [
    ("tiny_moe", 8, {"expert": 8}, 5_316_320, 1_677_312),
    ("bench_moe", 8, {"fsdp": 8}, 2_614_429_824, 887_881_728),
    # Mistral AI's published 46.7B (Hugging Face counts 46_702_792_704; + 8 routing biases per layer)
    # and 12.9B active with the input embedding (12_879_659_008 here).
    ("mixtral_8x7b", 64, {"expert": 8, "fsdp": 8}, 46_702_792_704 + 32 * 8, 12_748_587_008),
    ("deepseek_v3_like", 512, {"expert": 64, "fsdp": 8}, 666_776_743_424, 32_375_046_144),
    # DeepSeek's published 15.7B, 2.4B active (V2-Lite) and 671B, 37B active (V3, without its MTP
    # module), each count here the weights plus the routing biases of its 26 or 58 MoE layers; V3 ships
    # with its MTP module too: 11,610,068,224 more (an MoE layer with its biases, the projection, three
    # norms; it shares the embedding and head), 688,062,464 of them active.
    ("deepseek_v2_lite", 64, {"expert": 8, "fsdp": 8}, 15_706_484_224 + 26 * 64, 2_451_308_544),
    ("deepseek_v3", 512, {"expert": 64, "fsdp": 8}, 671_026_404_352 + 58 * 256 + 11_610_068_224,
     36_624_596_992 + 688_062_464),
])
def test_shipped_moe_configs_are_valid_and_the_size_they_say(name, devices, mesh, params, active):
    from ushard.models.config import ModelConfig
    from ushard.models.definition import ModelDef

    config = load_config(name)
    assert {a: s for a, s in validate(config, devices).items() if s > 1} == mesh
    model = ModelDef(ModelConfig.from_config(config.model))
    assert (model.num_params(), model.num_matmul_params()) == (params, active)


def test_default_config_is_valid():
    assert validate(default_config(), DEVICES)["fsdp"] == 8


def test_overrides_parse_to_the_existing_type():
    c = _tiny("train.steps=5", "model.tie_embeddings=true", "train.lr=1", "model.remat=full", "mesh.data=2")
    assert c.train.steps == 5 and type(c.train.steps) is int
    assert c.model.tie_embeddings is True
    assert c.train.lr == 1.0 and type(c.train.lr) is float
    assert c.model.remat == "full"
    assert c.mesh.data == 2
    c = _tiny("model.tie_embeddings=False", "model.document_mask=0")
    assert c.model.tie_embeddings is False and c.model.document_mask is False
    assert validate(_tiny("mesh.data=2", "mesh.fsdp=4"), DEVICES)["data"] == 2


def test_cli_splits_both_override_forms():
    rest, overrides = _split_overrides(
        ["train", "--config", "tiny", "--config.train.steps=5", "--config.model.remat", "full", "--workdir", "w"]
    )
    assert rest == ["train", "--config", "tiny", "--workdir", "w"]
    assert overrides == ["train.steps=5", "model.remat=full"]


def test_config_by_path_or_configs_prefix_from_another_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert load_config("configs/tiny.py").model.d_model == 192  # no such file here: the shipped one
    assert load_config(os.path.join(REPO, "configs", "tiny.py")).model.d_model == 192
    (tmp_path / "mine.py").write_text(
        "from ushard.config import default_config\n"
        "def get_config():\n    c = default_config()\n    c.train.steps = 7\n    return c\n"
    )
    assert load_config("mine.py", ["train.seq_len=64"]).train.steps == 7


# --------------------------------------------------------------------------- overrides


@pytest.mark.parametrize(
    "override, match",
    [
        ("model.d_modle=3", r"unknown config key 'model\.d_modle'.*d_model"),
        ("modle.d_model=3", r"unknown config key 'modle\.d_model'.*model"),
        ("train.steps.x=1", r"unknown config key 'train\.steps\.x'"),
        ("train.steps=abc", r"train\.steps='abc' is not a valid int"),
        ("train.steps=2.5", r"train\.steps='2\.5' is not a valid int"),
        ("train.lr=fast", r"train\.lr='fast' is not a valid float"),
        ("model.tie_embeddings=maybe", r"model\.tie_embeddings='maybe' is not a valid bool"),
        ("mesh=3", r"--config\.mesh is a group of settings"),
        ("train.steps", r"--config\.train\.steps has no value"),
    ],
)
def test_bad_override(override, match):
    config = _tiny()
    with pytest.raises(UserError, match=match) as excinfo:
        apply_overrides(config, [override])
    _one_sentence(excinfo)


def test_cli_main_in_process_returns_2(capsys):
    assert main(["train", "--config", "tiny", "--config.train.steps"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ushard: error: ") and len(err.splitlines()) == 1 and "train.steps" in err


@pytest.mark.parametrize("override, sentence", [
    ("train.seed=-1", "train.seed=-1 must be between 0 and 2**32-1=4294967295."),
    ("optim.b1=1.0", "optim.b1=1.0 must be >= 0 and < 1 (AdamW's decay rate; typical: b1=0.9, b2=0.95)."),
    ("train.b1=0.8", "train.b1 is now optim.b1 (the optimizer's settings moved to the optim group); set that instead."),
    ("optim.name=sgd", "optim.name='sgd' is not valid; choose one of: adamw, lion, adafactor, muon."),
    ("optim.muon.momentum=1", "optim.muon.momentum=1.0 must be >= 0 and < 1 (Muon's momentum; typical: 0.95)."),
    ("model.rope_theta=0", "model.rope_theta=0.0 must be a finite number > 0."),
    ("model.rope_scaling.type=ntk",
     "model.rope_scaling.type='ntk' is not valid; choose one of: none, llama3, linear, yarn."),
    ("model.rope_scaling.high_freq_factor=1", "model.rope_scaling.high_freq_factor=1.0 must be larger than "
                                              "model.rope_scaling.low_freq_factor=1.0 (the blend between them "
                                              "divides by the gap)."),
])
def test_cli_refuses_a_bad_value_before_any_work(tmp_path, capsys, override, sentence):
    assert main(["train", "--config", "tiny", f"--config.{override}", "--workdir", str(tmp_path / "run")]) == 2
    assert capsys.readouterr().err.splitlines() == [f"ushard: error: {sentence}"]
    assert not (tmp_path / "run").exists()  # refused before the workdir (and the data) was touched


# --------------------------------------------------------------------------- config files


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize(
    "name, match",
    [
        ("no_such_config", r"'no_such_config' is neither a file nor a shipped config.*tiny"),
        ("configs/no_such_config.py", r"is neither a file nor a shipped config"),
        ("/nonexistent/dir/cfg.py", r"'/nonexistent/dir/cfg\.py' is neither a file"),
    ],
)
def test_missing_config(tmp_path, monkeypatch, name, match):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match=match) as excinfo:
        load_config(name)
    _one_sentence(excinfo)


HEADER = "from ushard.config import default_config\n"


@pytest.mark.parametrize(
    "body, match",
    [
        ("def get_config(:\n", r"failed to load: SyntaxError"),
        ("raise RuntimeError('boom')\n", r"failed to load: RuntimeError: boom"),
        ("CONFIG = 1\n", r"defines no get_config\(\)"),
        (HEADER + "def get_config():\n    c = default_config()\n    c.model.d_modle = 3\n    return c\n",
         r", line 4 \(c.model.d_modle = 3\), sets a key ushard does not know: 'd_modle' "
         r"\(did you mean 'd_model'\?\)\.$"),
        (HEADER + "def get_config():\n    c = default_config()\n    c.train.steps = 'abc'\n    return c\n",
         r"sets a value of the wrong type.*steps"),
    ],
)
def test_broken_config_file(tmp_path, body, match):
    path = _write(tmp_path, "cfg.py", body)
    with pytest.raises(UserError, match=match) as excinfo:
        load_config(path)
    assert path in _one_sentence(excinfo)


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "overrides, match",
    [
        # the mesh
        (["mesh.fsdp=3"], r"the mesh \(fsdp=3\) has 3 devices but 8 are available"),
        (["mesh.data=2", "mesh.fsdp=2"], r"has 4 devices but 8 are available"),
        (["mesh.data=-1"], r"mesh\.data, mesh\.fsdp are all -1"),
        (["mesh.data=3"], r"multiply to 3, which does not divide the 8 devices"),
        (["mesh.data=0"], r"mesh\.data=0 is not valid"),
        (["mesh.tensor=-2"], r"mesh\.tensor=-2 is not valid"),
        (["mesh.dcn.fsdp=3"], r"mesh\.dcn\.fsdp=3 must be a positive divisor of mesh\.fsdp=8"),
        (["mesh.dcn.data=0"], r"mesh\.dcn\.data=0"),
        # the pipeline (tiny: 4 layers, 32 sequences a step, fsdp=-1)
        (["mesh.pipeline=2", "parallel.pipeline_schedule=zigzag"],
         r"parallel\.pipeline_schedule='zigzag' is not valid; choose one of: gpipe, circular, 1f1b"),
        (["mesh.pipeline=2", "parallel.pipeline_head=last"],
         r"parallel\.pipeline_head='last' is not valid; choose one of: auto, split, whole"),
        (["mesh.pipeline=8", "mesh.fsdp=1"],
         r"model\.n_layers=4 does not split into mesh\.pipeline=8 stages x parallel\.pipeline_repeats=1 "
         r".*multiple of 8"),
        (["mesh.pipeline=2", "parallel.pipeline_schedule=circular", "parallel.pipeline_repeats=4"],
         r"model\.n_layers=4 does not split into mesh\.pipeline=2 stages x parallel\.pipeline_repeats=4 "
         r".*multiple of 8"),
        (["parallel.pipeline_repeats=2"], r"parallel\.pipeline_repeats=2 needs parallel\.pipeline_schedule='circular'"),
        (["mesh.pipeline=4", "mesh.fsdp=2", "parallel.pipeline_schedule=circular", "parallel.pipeline_microbatches=2"],
         r"parallel\.pipeline_microbatches=2 is fewer than the circular schedule needs.*at least mesh\.pipeline=4"),
        (["mesh.pipeline=2", "parallel.pipeline_microbatches=3"],
         r"the 32 sequences of a step .* do not split into parallel\.pipeline_microbatches=3 microbatches"),
        (["mesh.pipeline=2", "train.grad_accum=2", "parallel.pipeline_microbatches=8"],
         r"train\.grad_accum=2 / parallel\.pipeline_microbatches=8 .*'act_batch' dimension of 2, .*mesh\.fsdp=4"),
        (["parallel.pipeline_microbatches=0"], r"parallel\.pipeline_microbatches=0 must be a number >= 1"),
        # mixture of experts
        (["mesh.expert=2", "mesh.fsdp=4"],
         r"mesh\.expert=2 splits the experts of an MoE model, but this model has none"),
        (["model.moe.num_experts=8", "model.moe.top_k=9"],
         r"model\.moe\.top_k=9 is more than model\.moe\.num_experts=8"),
        (["model.moe.num_experts=8", "model.moe.score_func=relu"],
         r"model\.moe\.score_func='relu' is not valid; choose one of: softmax, sigmoid"),
        (["model.moe.num_experts=8", "model.moe.num_groups=3"],
         r"model\.moe\.num_experts=8 does not split into model\.moe\.num_groups=3 equal groups"),
        (["model.moe.num_experts=8", "model.moe.num_groups=4", "model.moe.top_groups=1", "model.moe.top_k=3"],
         r"model\.moe\.top_k=3 is more than the 2 experts in model\.moe\.top_groups=1 groups"),
        (["model.moe.num_experts=8", "model.moe.every=2", "model.moe.first_dense_layers=1"],
         r"model\.n_layers=4 minus model\.moe\.first_dense_layers=1 leaves 3 layers, not a positive multiple of "
         r"model\.moe\.every=2"),
        (["model.moe.capacity_factor=-1"], r"model\.moe\.capacity_factor=-1\.0 must be a finite number >= 0"),
        (["model.moe.num_experts=8", "mesh.expert=4", "mesh.fsdp=2", "parallel.expert_split=width",
          "parallel.expert_width_parts=3"],
         r"parallel\.expert_width_parts=3 does not divide the 4 sequences each device holds in an MoE layer "
         r"\(train\.batch_size=32 / train\.grad_accum=1 over mesh\.fsdp=2 x mesh\.expert=4\); use a divisor of 4\."),
        (["parallel.expert_width_parts=0"], r"parallel\.expert_width_parts=0 must be a number >= 1"),
        (["model.moe.num_experts=8", "model.moe.dispatch=sparse"],
         r"model\.moe\.dispatch='sparse' is not valid; choose one of: padded, ragged"),
        (["model.moe.num_experts=4", "mesh.expert=8", "mesh.fsdp=1"],
         r"parameter blocks\.mlp\.experts\.w_down has a 'experts' dimension of 4, which does not split over "
         r"mesh\.expert=8"),
        (["model.moe.num_experts=8", "model.moe.expert_d_ff=100", "mesh.tensor=8", "mesh.fsdp=1", "model.n_heads=8",
          "model.n_kv_heads=8", "model.d_model=192"],
         r"'expert_mlp' dimension of 100, which does not split over mesh\.tensor=8"),
        (["mesh.pipeline=2", "model.moe.num_experts=8", "model.moe.first_dense_layers=2",
          "parallel.pipeline_schedule=1f1b"],
         r"parallel\.pipeline_schedule='1f1b' runs one stack of layers .*this model has 2 \(dense_blocks: 2 layers, "
         r"blocks: 2 layers\).*or model\.moe\.first_dense_layers=0\."),
        # heads
        (["model.n_kv_heads=4"], r"model\.n_heads=6 is not divisible by model\.n_kv_heads=4"),
        (["model.d_model=100"], r"model\.d_model=100 is not divisible by model\.n_heads=6"),
        (["model.d_model=18"], r"model\.head_dim=3 must be even"),
        # sharded dimensions: one generic check names the parameter (or batch), the dimension and the axes
        (["mesh.tensor=4", "mesh.fsdp=2"],
         r"parameter blocks\.attn\.wo has a 'heads' dimension of 6, which does not split over mesh\.tensor=4"),
        # fewer KV heads than tensor ranks are repeated, but each rank needs whole ones
        (["mesh.tensor=2", "mesh.fsdp=4", "model.n_kv_heads=3"],
         r"model\.n_kv_heads=3 and mesh\.tensor=2: each tensor rank needs whole key/value heads"),
        (["mesh.tensor=2", "mesh.fsdp=4", "model.vocab_size=513"],
         r"parameter embedding has a 'vocab' dimension of 513, which does not split over mesh\.tensor=2"),
        (["model.d_model=204", "model.n_heads=6"], r"'embed' dimension of 204, which does not split over mesh\.fsdp=8"),
        (["mesh.sequence=2", "mesh.fsdp=4", "train.seq_len=33"],
         r"train\.seq_len=33\) has a 'act_length' dimension of 33, which does not split over mesh\.sequence=2"),
        (["mesh.tensor=2", "mesh.fsdp=4", "parallel.sequence_parallel=true", "train.seq_len=33"],
         r"with parallel\.sequence_parallel, a microbatch .* 'act_residual_length' dimension of 33, which does "
         r"not split over mesh\.tensor=2"),
        (["mesh.sequence=4", "mesh.fsdp=2", "train.seq_len=36"],
         r"train\.seq_len=36 must be a multiple of 8 when the sequence is split 4 ways"),
        # the batch
        (["train.batch_size=12"],
         r"train\.batch_size=12 .*'act_batch' dimension of 12, .* mesh\.fsdp=8; make 12 a multiple of 8"),
        (["train.batch_size=8", "train.grad_accum=2"],
         r"train\.batch_size=8 / train\.grad_accum=2 .*'act_batch' dimension of 4, .*multiple of 8"),
        (["train.batch_size=9", "train.grad_accum=2"], r"train\.batch_size=9 is not divisible by train\.grad_accum=2"),
        (["mesh.data=2", "mesh.fsdp=4", "train.batch_size=4"],
         r"train\.batch_size=4 .*does not split over mesh\.data=2 x mesh\.fsdp=4"),
        # unknown choices
        (["model.remat=everything"], r"model\.remat='everything' is not valid; choose one of: none, full"),
        (["train.schedule=exp"], r"train\.schedule='exp' is not valid; choose one of: cosine"),
        (["parallel.zero_stage=4"], r"parallel\.zero_stage=4 is not valid; choose one of: 0, 1, 2, 3"),
        (["parallel.collective_combine_mib=-1"], r"parallel\.collective_combine_mib=-1 is negative"),
        (["parallel.context_parallel=ulysses"],
         r"parallel\.context_parallel='ulysses' is not valid; choose one of: ring, all_gather"),
        (["model.attention_impl=flash2"], r"model\.attention_impl='flash2' is not valid"),
        (["model.compute_dtype=fp8"], r"model\.compute_dtype='fp8' is not valid"),
        (["model.param_dtype=int8"], r"model\.param_dtype='int8' is not valid"),
        (["data.source=csv"], r"data\.source='csv' is not valid; choose one of: stdlib, text, jsonl, parquet, tokens"),
        (["data.tokenizer=bpe"], r"data\.tokenizer='bpe' is neither 'byte' nor a Hugging Face tokenizer\.json"),
        # numbers out of range
        (["train.steps=0"], r"train\.steps=0 must be a number >= 1"),
        (["train.batch_size=-8"], r"train\.batch_size=-8 must be a number >= 1"),
        (["model.n_layers=0"], r"model\.n_layers=0 must be a number >= 1"),
        (["train.lr=-0.1"], r"train\.lr=-0\.1 must be a number >= 0"),
        (["train.lr=nan"], r"train\.lr=nan must be a number >= 0"),
        (["train.grad_clip=inf"], r"train\.grad_clip=inf must be a number >= 0"),
        (["data.eval_fraction=0"], r"data\.eval_fraction=0\.0 must be strictly between 0 and 1"),
        (["data.eval_fraction=1"], r"data\.eval_fraction=1\.0 must be strictly between 0 and 1"),
        (["train.min_lr_ratio=1.5"], r"train\.min_lr_ratio=1\.5 must be between 0 and 1"),
        (["train.seed=-1"], r"train\.seed=-1 must be between 0 and 2\*\*32-1=4294967295"),
        (["train.seed=4294967296"], r"train\.seed=4294967296 must be between 0 and 2\*\*32-1"),
        (["optim.b1=1.0"], r"optim\.b1=1\.0 must be >= 0 and < 1 \(AdamW's decay rate"),
        (["optim.b2=-0.5"], r"optim\.b2=-0\.5 must be >= 0 and < 1"),
        (["optim.b2=nan"], r"optim\.b2=nan must be >= 0 and < 1"),
        (["optim.eps=0"], r"optim\.eps=0\.0 must be a finite number > 0"),
        (["train.decay_fraction=1.5"], r"train\.decay_fraction=1\.5 must be between 0 and 1"),
        (["train.max_nonfinite_steps=0"], r"train\.max_nonfinite_steps=0 must be a number >= 1"),
        (["model.rope_theta=0"], r"model\.rope_theta=0\.0 must be a finite number > 0"),
        (["model.rope_theta=-1"], r"model\.rope_theta=-1\.0 must be a finite number > 0"),
        (["model.vocab_size=256"], r"model\.vocab_size=256 is smaller than the 'byte' tokenizer's 257 tokens"),
        # data
        (["data.source=text"], r"data\.source='text' needs data\.paths"),
        (["data.source=jsonl"], r"data\.source='jsonl' needs data\.paths"),
        (["data.source=parquet"], r"data\.source='parquet' needs data\.paths"),
        (["data.weights=1,1"], r"data\.weights='1,1' has 2 weights but data\.paths has 0 globs"),
    ],
)
def test_invalid_config(overrides, match):
    _invalid(_tiny(*overrides), match)


def test_zero_stage_0_does_not_shard_embed_over_fsdp():
    # d_model=204 does not divide over fsdp=8: only a problem when ZeRO shards over fsdp.
    validate(_tiny("model.d_model=204", "parallel.zero_stage=0"), DEVICES)


def test_fewer_kv_heads_than_tensor_ranks_are_valid():
    """n_kv_heads=1 or 2 on tensor=2: each rank gets a copy of the KV head its query heads use."""
    for kv in (1, 2):
        validate(_tiny(f"model.n_kv_heads={kv}", "mesh.tensor=2", "mesh.fsdp=4"), DEVICES)
    # sequence parallelism with a length that splits over sequence x tensor
    validate(_tiny("mesh.tensor=2", "mesh.sequence=2", "mesh.fsdp=2", "parallel.sequence_parallel=true"), DEVICES)


def test_device_count_is_part_of_the_check():
    _invalid(_tiny("mesh.data=2", "mesh.fsdp=4"), r"has 8 devices but 4 are available", num_devices=4)
    assert validate(_tiny("mesh.data=2"), 4) == {
        "pipeline": 1, "data": 2, "fsdp": 2, "expert": 1, "sequence": 1, "tensor": 1
    }

