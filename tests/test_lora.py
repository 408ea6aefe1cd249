"""LoRA (ushard/training/lora.py): against peft + transformers + torch AdamW step for step, the PEFT
export loaded by peft, the merged export, every layout against one device, what the optimizer and the
all-reduce see, the base checked on a resume, and the refusals."""

from __future__ import annotations

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ushard
from conftest import small_config
from helpers import assert_same_training, run_config
from ushard.errors import UserError
from ushard.models.low_rank import LowRankAdapted
from ushard.training.loop import Trainer

VOCAB, LENGTH, ROWS, STEPS = 300, 16, 4, 20
LORA = {"model.lora.rank": 4, "model.lora.alpha": 8.0}
PEFT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def relative_error(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


# --------------------------------------------------------------------------- the low-rank weight itself


def test_low_rank_projection_is_the_merged_weights_product():
    """`project` through a LowRankAdapted weight (the update from the activations) equals the product
    with the merged weight, for a column-parallel [embed, heads, head_dim] and a row-parallel one."""
    from ushard.models.layers import project

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(2, 5, 8)), jnp.float32)
    for spec, base_shape, ins in (("btd,dhk->bthk", (8, 3, 4), 1), ("bthk,hkd->btd", (3, 4, 8), 2)):
        base = jnp.asarray(rng.normal(size=base_shape), jnp.float32)
        a = jnp.asarray(rng.normal(size=(*base_shape[:ins], 2)), jnp.float32)
        b = jnp.asarray(rng.normal(size=(2, *base_shape[ins:])), jnp.float32)
        w = LowRankAdapted(base, a, b, jnp.zeros(()), scale=1.5)
        inputs = x if ins == 1 else jnp.asarray(rng.normal(size=(2, 5, 3, 4)), jnp.float32)
        np.testing.assert_allclose(project(spec, inputs, w), jnp.einsum(spec, inputs, w.merged()), rtol=1e-5,
                                   atol=1e-5)


# --------------------------------------------------------------------------- against peft


def save_tiny(kind: str, directory: str) -> str:
    torch = pytest.importorskip("torch")
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    sizes = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False)
    if kind == "qwen3":
        model = tf.Qwen3ForCausalLM(tf.Qwen3Config(**sizes, head_dim=16))
    else:
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**sizes, attention_bias=False))
    model.float().save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return save_tiny("llama", str(tmp_path_factory.mktemp("llama")))


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    return save_tiny("qwen3", str(tmp_path_factory.mktemp("qwen3")))


def lora_config(base: str, **overrides):
    """tiny with the Hugging Face checkpoint `base`'s model settings (as `convert --from-hf` prints
    them), LoRA on, and AdamW as torch's with a constant learning rate."""
    from ushard import hf
    from ushard.hf_convert import _hf_settings

    model = {f"model.{k}": v for k, v in _hf_settings(hf.model_config(hf.read_config(base), base)).items()}
    settings = {**model, "model.param_dtype": "float32", "train.seq_len": LENGTH, "train.batch_size": ROWS,
                "train.steps": STEPS, "train.warmup_steps": 0, "train.schedule": "constant", "train.lr": 1e-2,
                "train.grad_clip": 0.0, "optim.weight_decay": 0.01, "optim.b2": 0.999,
                "checkpoint.init_from": base, **LORA}
    return small_config("tiny", **{**settings, **overrides})


def fixed_batches(count: int):
    # Two batches in turn, so that 20 steps visibly learn them.
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, VOCAB, (2, ROWS, LENGTH + 1)).astype(np.int32)[np.arange(count) % 2]
    positions = np.broadcast_to(np.arange(LENGTH, dtype=np.int32), (ROWS, LENGTH))
    return tokens, [{"inputs": t[:, :-1], "targets": t[:, 1:], "positions": positions,
                     "segment_ids": np.ones((ROWS, LENGTH), np.int32), "loss_mask": np.ones((ROWS, LENGTH), np.int32)}
                    for t in tokens]


def with_random_b(state, seed=2, size=0.05):
    """The adapters with B random too (peft's zeros leave A's first gradient zero)."""
    rng = np.random.default_rng(seed)

    def fill(path, x):
        if path[-1].key == "lora_b":
            return jax.device_put(jnp.asarray(size * rng.normal(size=x.shape), x.dtype), x.sharding)
        return x

    return state.replace(params=jax.tree_util.tree_map_with_path(fill, state.params))


@pytest.mark.parametrize("kind", ["llama", pytest.param("qwen3", marks=pytest.mark.slow)])  # the same path
def test_lora_trains_as_peft_and_its_export_loads_in_peft(kind, request, tmp_path):
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    tf = pytest.importorskip("transformers")
    from ushard.hf_peft import save_peft

    llama_dir = request.getfixturevalue(f"{kind}_dir")  # the base: a tiny random Llama or Qwen3
    trainer = Trainer(lora_config(llama_dir), devices=jax.devices()[:1])
    state = with_random_b(trainer._start_from(llama_dir, log=lambda *_: None))
    adapters = trainer.setup.adapters
    initial = str(tmp_path / "initial")
    save_peft(adapters, state.params, initial, llama_dir)

    tokens, batches = fixed_batches(STEPS)
    losses = []
    for batch in batches:
        state, metrics = trainer.steps.train_step(state, {k: jnp.asarray(v) for k, v in batch.items()})
        losses.append(float(metrics["loss"]))

    base = tf.AutoModelForCausalLM.from_pretrained(llama_dir, torch_dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, initial, is_trainable=True)
    trained = [p for p in model.parameters() if p.requires_grad]
    assert sum(p.numel() for p in trained) == adapters.num_params()
    opt = torch.optim.AdamW(trained, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    expected = []
    for t in tokens:
        logits = model(input_ids=torch.from_numpy(t[:, :-1]).long()).logits
        targets = torch.from_numpy(t[:, 1:]).long().reshape(-1)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
        expected.append(loss.item())
    np.testing.assert_allclose(losses, expected, rtol=1e-4)
    assert losses[-1] < losses[0] - 0.1  # it learned: the comparison is not of two flat lines

    # The trained adapters exported, loaded by peft onto the base: the same logits.
    exported = str(tmp_path / "trained")
    save_peft(adapters, state.params, exported, llama_dir)
    loaded = peft.PeftModel.from_pretrained(
        tf.AutoModelForCausalLM.from_pretrained(llama_dir, torch_dtype=torch.float32), exported)
    probe = tokens[0][:, :-1]
    with torch.no_grad():
        theirs = loaded(input_ids=torch.from_numpy(probe).long()).logits.numpy()
    model_params = trainer.steps.model_params(state.params, state.frozen)
    ours = jax.jit(lambda p, t: trainer.setup.model.apply(p, t, jnp.asarray(batches[0]["positions"]))[0])(
        model_params, jnp.asarray(probe))
    assert relative_error(ours, theirs) <= 1e-5


# --------------------------------------------------------------------------- a run: resume, export, refusals


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "corpus.txt"
    path.write_text("a low-rank update of every projection, trained on a frozen base. " * 200)
    return str(path)


def test_a_lora_run_resumes_exports_merged_and_checks_its_base(llama_dir, tmp_path, text_file):
    tf = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    run = str(tmp_path / "run")
    common = {"data.source": "text", "data.paths": text_file, "train.steps": 1, "checkpoint.every": 1,
              "mesh.fsdp": -1, "train.batch_size": 8}
    rows = ushard.train(lora_config(llama_dir, **common), run)
    assert len(rows) == 1
    saved = os.path.join(run, "checkpoints")
    # The checkpoint holds the adapters and the base's fingerprint, not the base.
    assert not any("embedding" in f for _, _, files in os.walk(saved) for f in files)
    more = ushard.train(lora_config(llama_dir, **{**common, "train.steps": 2}), run)
    assert [r["step"] for r in more] == [2]

    merged = ushard.load_model(run, log=lambda *_: None)
    hf_dir = str(tmp_path / "merged")
    ushard.to_hf(merged, hf_dir, log=lambda *_: None)
    probe = np.random.default_rng(3).integers(0, VOCAB, (2, LENGTH)).astype(np.int32)
    with torch.no_grad():
        theirs = tf.LlamaForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32)(
            input_ids=torch.from_numpy(probe).long()).logits.numpy()
    assert relative_error(merged(probe), theirs) <= 1e-5

    # The adapters as a PEFT adapter (`ushard convert --to-peft`), loaded by peft onto the base.
    from test_hf import cli

    peft = pytest.importorskip("peft")
    adapter_dir = str(tmp_path / "adapter")
    assert cli("convert", "--from", run, "--to-peft", adapter_dir)[0] == 0
    base = tf.LlamaForCausalLM.from_pretrained(llama_dir, torch_dtype=torch.float32)
    with torch.no_grad():
        adapted = peft.PeftModel.from_pretrained(base, adapter_dir)(input_ids=torch.from_numpy(probe).long())
    assert relative_error(adapted.logits.numpy(), theirs) <= 1e-5
    status, _, err = cli("convert", "--from", run, "--to-peft", adapter_dir)
    assert status == 2 and f"{adapter_dir} is not empty" in err  # nothing written over

    # Another base under the same workdir: refused in a sentence, nothing written.
    other = str(tmp_path / "other")
    model = tf.LlamaForCausalLM.from_pretrained(llama_dir, torch_dtype=torch.float32)
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.mul_(1.5)
    model.save_pretrained(other)
    before = sorted(os.listdir(saved))
    with pytest.raises(UserError, match=r"hold LoRA adapters trained on another base than checkpoint.init_from="):
        ushard.train(lora_config(other, **{**common, "train.steps": 3}), run)
    assert sorted(os.listdir(saved)) == before


def test_a_target_that_names_no_projection_is_refused():
    with pytest.raises(UserError, match=r"model.lora.targets names 'q_proj', which is no projection of this model; "
                                        r"its projections are .*wq"):
        Trainer(small_config("tiny", **LORA, **{"model.lora.targets": "wq,q_proj"}), devices=jax.devices()[:1])


# --------------------------------------------------------------------------- what is trained, where


def test_only_the_adapters_are_trained_and_all_reduced(single, stdlib_batches):
    """Pure data parallelism over 8 devices trains as one device; the optimizer state is the adapters'
    shapes, and the step's gradient all-reduce moves no more than the adapters' bytes."""
    got = lora_run({"mesh.data": 8}, 8, stdlib_batches)
    assert_same_training(got, single)
    trainer = got["trainer"]
    state = trainer.steps.init(0)
    adapter_leaves = jax.tree.leaves(state.params)
    adapter_bytes = sum(x.size * 4 for x in adapter_leaves)
    moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim]
    assert sorted(x.shape for x in moments) == sorted([x.shape for x in adapter_leaves] * 2)
    hlo = got["hlo"]
    reduced = 0
    for shape in re.findall(r"= (\([^)]*\)|\S+) all-reduce(?:-start)?\(", hlo):
        for dims in re.findall(r"f32\[([0-9,]*)\]", shape):
            reduced += 4 * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
    assert 0 < reduced <= adapter_bytes + 1024
    model_bytes = sum(x.size * 4 for x in jax.tree.leaves(trainer.setup.model.shapes))
    assert adapter_bytes < model_bytes / 10


# --------------------------------------------------------------------------- every layout against one device

LORA_LAYOUTS = {
    "fsdp8_zero3": ({"mesh.fsdp": 8, "parallel.zero_stage": 3}, 8),
    "tensor2_sp": ({"mesh.tensor": 2, "mesh.fsdp": 4, "parallel.sequence_parallel": True}, 8),
    "pipeline2_1f1b": ({"mesh.pipeline": 2, "mesh.fsdp": 4, "parallel.pipeline_schedule": "1f1b",
                        "parallel.pipeline_microbatches": 4}, 8),
    "expert2_moe": ({"mesh.expert": 2, "mesh.fsdp": 4}, 8),
    # A float8 base under tensor parallelism (the KV heads' scales repeated with them) and ZeRO-3.
    "tensor2_sp_float8": ({"mesh.tensor": 2, "mesh.fsdp": 4, "parallel.sequence_parallel": True,
                           "model.lora.base_dtype": "float8"}, 8),
}
QUICK = ()  # the default tier's layout: data=8 in test_only_the_adapters_are_trained_and_all_reduced


def lora_run(overrides, devices, batches, moe=False):
    name = "tiny_moe" if moe else "tiny"
    moe_sizes = {"model.moe.expert_d_ff": 64} if moe else {}
    config = small_config(name, **{**LORA, **moe_sizes, "train.steps": 3, "train.lr": 1e-2, **overrides})
    return run_config(config, jax.devices()[:devices], batches)


@pytest.fixture(scope="module")
def single(stdlib_batches):
    return lora_run({}, 1, stdlib_batches)


@pytest.fixture(scope="module")
def single_moe(stdlib_batches):
    return lora_run({}, 1, stdlib_batches, moe=True)


@pytest.fixture(scope="module")
def single_float8(stdlib_batches):
    return lora_run({"model.lora.base_dtype": "float8"}, 1, stdlib_batches)


@pytest.mark.parametrize("name", [n if n in QUICK else pytest.param(n, marks=pytest.mark.slow) for n in LORA_LAYOUTS])
def test_lora_on_every_layout_trains_as_one_device(name, request, stdlib_batches):
    overrides, devices = LORA_LAYOUTS[name]
    moe = name.endswith("_moe")
    reference = request.getfixturevalue({"moe": "single_moe", "float8": "single_float8"}.get(name.split("_")[-1],
                                                                                          "single"))
    got = lora_run(overrides, devices, stdlib_batches, moe=moe)
    assert_same_training(got, reference)
    assert reference["losses"][-1] < reference["losses"][0]  # the adapters moved the loss


# --------------------------------------------------------------------------- a float8 base


def test_float8_quantization_and_its_product():
    """Each output channel's largest magnitude maps to float8's largest; dequantized, every entry is
    within float8's spacing (1/16 of the channel's magnitude); the projection through a float8 base
    is the product with the dequantized weight plus the update."""
    from ushard.models.layers import project
    from ushard.models.low_rank import quantized

    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.normal(size=(8, 3, 4)), jnp.float32)  # [embed, heads, head_dim]
    q, scale = quantized(w, lead=0, ins=1)
    assert q.dtype == jnp.float8_e4m3fn and scale.shape == (3, 4)
    dequantized = q.astype(jnp.float32) * scale
    amax = jnp.max(jnp.abs(w), axis=0)
    assert float(jnp.max(jnp.abs(dequantized - w) / amax)) <= 1 / 16
    np.testing.assert_allclose(jnp.max(jnp.abs(dequantized), axis=0), amax, rtol=1e-6)
    a = jnp.asarray(rng.normal(size=(8, 2)), jnp.float32)
    b = jnp.asarray(rng.normal(size=(2, 3, 4)), jnp.float32)
    adapted = LowRankAdapted(q, a, b, jnp.zeros(()), base_scale=scale, scale=0.5)
    x = jnp.asarray(rng.normal(size=(2, 5, 8)), jnp.float32)
    expected = jnp.einsum("btd,dhk->bthk", x, dequantized + 0.5 * jnp.einsum("dz,zhk->dhk", a, b))
    np.testing.assert_allclose(project("btd,dhk->bthk", x, adapted), expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(adapted.merged(), dequantized + 0.5 * jnp.einsum("dz,zhk->dhk", a, b), rtol=1e-6)


@pytest.mark.slow  # test_float8_quantization_and_its_product keeps the product's point
def test_a_float8_base_trains_as_the_exact_base_within_its_rounding(single, single_float8):
    got = single_float8
    frozen = got["trainer"].steps.init(0).frozen
    assert frozen["weights"]["blocks"]["attn"]["wq"].dtype == jnp.float8_e4m3fn
    assert frozen["weights"]["embedding"].dtype == jnp.float32  # not adapted: the compute dtype (float32 here)
    np.testing.assert_allclose(got["losses"], single["losses"], rtol=2e-2)
    assert got["losses"] != single["losses"]  # the rounding is there


# --------------------------------------------------------------------------- dropout


def dropout_losses(stdlib_batches, overrides, devices=1):
    """Two steps' losses on the same batch, from adapters whose update shows in the loss."""
    config = small_config("tiny", **{**LORA, "train.steps": 2, "train.lr": 1e-2, **overrides})
    trainer = Trainer(config, devices=jax.devices()[:devices], batches=stdlib_batches)
    state = with_random_b(trainer.steps.init(0), size=1.0)
    batch = trainer.global_batches(1)[0]
    out = []
    for _ in range(2):
        state, metrics = trainer.steps.train_step(state, batch)
        out.append(float(metrics["loss"]))
    return out


@pytest.fixture(scope="module")
def dropped(stdlib_batches):
    return dropout_losses(stdlib_batches, {"model.lora.dropout": 0.3})


def test_dropout_changes_the_loss(stdlib_batches, dropped):
    """Step 0 has the same weights with and without LoRA dropout: only the masks differ."""
    plain = dropout_losses(stdlib_batches, {})
    assert abs(plain[0] - dropped[0]) > 1e-3


@pytest.mark.slow
def test_dropout_masks_do_not_depend_on_the_layout(stdlib_batches, dropped):
    """ZeRO-3 over 8 devices draws the masks one device draws (the random bits are the sharding's own)."""
    got = dropout_losses(stdlib_batches, {"model.lora.dropout": 0.3, "mesh.fsdp": 8}, devices=8)
    np.testing.assert_allclose(got, dropped, rtol=1e-5)


# --------------------------------------------------------------------------- the recipe (docs/finetuning.md, 7.)


@pytest.mark.slow
def test_import_sft_with_lora_dpo_with_lora_export(llama_dir, tmp_path):
    """The recipe: the DPO run starts from the SFT run's merged model with new adapters, and its PEFT
    export on the SFT model's merged export gives its own merged export's logits."""
    torch = pytest.importorskip("torch")
    tf = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from test_hf import cli
    from ushard import hf
    from ushard.hf_convert import _hf_settings

    pairs = os.path.join(os.path.dirname(__file__), "data", "preference.jsonl")
    model = [f"--config.model.{k}={v}" for k, v in _hf_settings(hf.model_config(hf.read_config(llama_dir),
                                                                                  llama_dir)).items()]
    common = ["--config", "tiny", *model, "--config.model.lora.rank=4", "--config.train.seq_len=32",
              "--config.train.batch_size=8", "--config.train.steps=3", "--config.train.eval_every=0",
              "--config.train.warmup_steps=0"]
    runs = {name: str(tmp_path / name) for name in ("sft", "dpo", "adapter", "sft_hf", "hf")}
    assert cli("train", *common, "--workdir", runs["sft"], f"--config.checkpoint.init_from={llama_dir}",
               "--config.data.source=jsonl", f"--config.data.paths={pairs}", "--config.data.prompt_field=prompt",
               "--config.data.completion_field=chosen")[0] == 0
    status, out, _ = cli("train", *common, "--workdir", runs["dpo"], f"--config.checkpoint.init_from={runs['sft']}",
                         "--config.train.objective=dpo", "--config.data.source=preference",
                         f"--config.data.paths={pairs}")
    assert status == 0 and "is a LoRA run: its adapters merged into their base" in out
    assert cli("convert", "--from", runs["dpo"], "--to-peft", runs["adapter"])[0] == 0
    assert cli("convert", "--from", runs["sft"], "--to-hf", runs["sft_hf"])[0] == 0
    assert cli("convert", "--from", runs["dpo"], "--to-hf", runs["hf"])[0] == 0
    ids = torch.from_numpy(np.random.default_rng(4).integers(0, VOCAB, (2, LENGTH))).long()
    with torch.no_grad():
        merged = tf.AutoModelForCausalLM.from_pretrained(runs["hf"])(input_ids=ids).logits.numpy()
        sft = tf.AutoModelForCausalLM.from_pretrained(runs["sft_hf"])
        adapted = peft.PeftModel.from_pretrained(sft, runs["adapter"])(input_ids=ids).logits.numpy()
    assert relative_error(adapted, merged) <= 1e-5
