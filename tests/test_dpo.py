"""DPO: the loss and its gradients against TRL's, every layout against one device, accumulation, the
precomputed reference against the frozen one, the preference source's tokens, masks and pairing, and
the bad inputs it refuses."""

from __future__ import annotations

import collections
import json
import os
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import SMALL_MOE, data_config, small_config
from helpers import RTOL, assert_same_training, run_config, tree_relative_difference
from ushard.cli import main
from ushard.data.packing import FIELDS
from ushard.data.preference import REFERENCE_FIELDS, REJECTED, Pairs, PreferenceBatches
from ushard.data.tokenizer import get_tokenizer
from ushard.errors import UserError
from ushard.sharding import split_rows
from ushard.training import dpo, dpo_reference
from ushard.training.loop import Trainer

DATA = os.path.join(os.path.dirname(__file__), "data")
TEXT_PAIRS = os.path.join(DATA, "preference.jsonl")
CHAT_PAIRS = os.path.join(DATA, "preference_chat.jsonl")


def dpo_config(config_name="tiny", **overrides):
    settings = {"train.objective": "dpo", "data.source": "preference", "data.paths": TEXT_PAIRS,
                "train.batch_size": 16, "train.seq_len": 16, "train.steps": 3, "train.warmup_steps": 0}
    return small_config(config_name, **{**settings, **overrides})


def one_sentence(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message and message.endswith("."), message
    return message


# --------------------------------------------------------------------------- the loss against TRL

PAIRS, TOKENS, VOCAB = 4, 9, 11


@pytest.fixture(scope="module")
def fixed_pairs():
    """Logits of 4 pairs (TRL's order: the chosen rows, then the rejected ones), their tokens, which
    tokens are completion, and reference log-probs."""
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2 * PAIRS, TOKENS - 1, VOCAB)).astype(np.float32)
    tokens = rng.integers(0, VOCAB, size=(2 * PAIRS, TOKENS)).astype(np.int32)
    counted = np.zeros((2 * PAIRS, TOKENS), np.int32)
    for row in range(2 * PAIRS):  # a prompt of 2-4 tokens, a completion of 2-5, then padding
        start = rng.integers(2, 5)
        counted[row, start:start + rng.integers(2, 6)] = 1
    ref = rng.normal(size=(2, PAIRS)).astype(np.float32) * 3 - 12
    return logits, tokens, counted, ref


def trl_loss(fixed_pairs, loss_type, beta, label_smoothing):
    """TRL's own DPOTrainer._compute_loss (trl 1.16) run on the fixed logits: a stand-in for the
    trainer's attributes and a model that returns them, precomputed reference log-probs. -> (loss,
    d loss / d logits in TRL's row order, TRL's logged metrics)."""
    torch = pytest.importorskip("torch")
    trl_dpo = pytest.importorskip("trl.trainer.dpo_trainer")
    logits, tokens, counted, ref = fixed_pairs
    logits_t = torch.tensor(logits, requires_grad=True)
    input_ids = torch.tensor(tokens, dtype=torch.long)

    def model(input_ids, labels, **kwargs):  # what a transformers model's fused head returns
        targets = labels[:, 1:]
        picked = torch.log_softmax(logits_t, dim=-1).gather(-1, targets.clamp(min=0)[..., None])[..., 0]
        zeros = torch.zeros(targets.shape)
        return types.SimpleNamespace(log_probs=picked * (targets != -100), entropy=zeros, mean_logits=zeros,
                                     is_top1=zeros.bool())

    model.training = True
    accelerator = types.SimpleNamespace(device="cpu", gather=lambda x: x, gather_for_metrics=lambda x: x)
    trainer = types.SimpleNamespace(
        model=model, accelerator=accelerator, aux_loss_enabled=False, ld_alpha=None, precompute_ref_logps=True,
        f_divergence_type="reverse_kl", loss_types=[loss_type], loss_weights=[1.0], beta=beta,
        label_smoothing=label_smoothing, use_weighting=False, _tp_size=1, _total_train_tokens=0,
        _metrics=collections.defaultdict(lambda: collections.defaultdict(list)))
    inputs = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids),
              "completion_mask": torch.tensor(counted), "ref_chosen_logps": torch.tensor(ref[0]),
              "ref_rejected_logps": torch.tensor(ref[1])}
    loss = trl_dpo.DPOTrainer._compute_loss(trainer, model, inputs, return_outputs=False)
    loss.backward()
    metrics = {k: v[0] for k, v in trainer._metrics["train"].items()}
    return loss.item(), logits_t.grad.numpy(), metrics


def transcribed_loss(fixed_pairs, loss_type, beta, label_smoothing):
    """TRL's loss transcribed line by line into jax.numpy, in TRL's row order (the chosen rows, then
    the rejected ones): trl 1.16's `DPOTrainer._compute_loss` for `sigmoid`, `robust` and `ipo`, and
    for `sigmoid` with label smoothing the conservative DPO form TRL's `sigmoid` had before 1.x (1.16
    dropped its smoothing term, so there is no code of it to call). The default tier's check: TRL's
    own code runs in the slow tier (importing trl takes 10-40 s here). -> (loss, d loss / d logits,
    the metrics TRL logs)."""
    logits, tokens, counted, ref = fixed_pairs
    shift_completion_mask = jnp.asarray(counted[:, 1:], jnp.float32)
    ref_chosen_logps, ref_rejected_logps = jnp.asarray(ref[0]), jnp.asarray(ref[1])
    completion_mask = jnp.asarray(counted, jnp.float32)
    chosen_mask, rejected_mask = completion_mask[:PAIRS], completion_mask[PAIRS:]

    def loss_of(logits):
        log_probs = jnp.take_along_axis(jax.nn.log_softmax(logits, -1), tokens[:, 1:, None], -1)[..., 0]
        logps = (log_probs * shift_completion_mask).sum(axis=1)
        chosen_logps, rejected_logps = logps[:PAIRS], logps[PAIRS:]
        chosen_logratios = chosen_logps - ref_chosen_logps
        rejected_logratios = rejected_logps - ref_rejected_logps
        delta_score = chosen_logratios - rejected_logratios
        if loss_type == "sigmoid":  # cDPO; at label_smoothing 0, 1.16's -logsigmoid(beta * delta_score)
            per_sequence_loss = (-jax.nn.log_sigmoid(beta * delta_score) * (1 - label_smoothing)
                                 - jax.nn.log_sigmoid(-beta * delta_score) * label_smoothing)
        elif loss_type == "ipo":
            chosen_avg_score = chosen_logratios / jnp.maximum(chosen_mask.sum(axis=1), 1.0)
            rejected_avg_score = rejected_logratios / jnp.maximum(rejected_mask.sum(axis=1), 1.0)
            per_sequence_loss = (chosen_avg_score - rejected_avg_score - 1 / (2 * beta)) ** 2
        else:  # robust
            clean_loss_term = -(1 - label_smoothing) * jax.nn.log_sigmoid(beta * delta_score)
            flipped_loss_term = -label_smoothing * jax.nn.log_sigmoid(-beta * delta_score)
            per_sequence_loss = (clean_loss_term - flipped_loss_term) / (1 - 2 * label_smoothing)
        chosen_rewards = beta * jax.lax.stop_gradient(chosen_logratios)
        rejected_rewards = beta * jax.lax.stop_gradient(rejected_logratios)
        metrics = {"rewards/chosen": chosen_rewards.mean(), "rewards/rejected": rejected_rewards.mean(),
                   "rewards/accuracies": (chosen_rewards > rejected_rewards).astype(jnp.float32).mean(),
                   "rewards/margins": (chosen_rewards - rejected_rewards).mean()}
        return per_sequence_loss.mean(), metrics

    (loss, metrics), grad = jax.value_and_grad(loss_of, has_aux=True)(jnp.asarray(logits))
    return float(loss), np.asarray(grad), {k: float(v) for k, v in metrics.items()}


def ushard_loss(fixed_pairs, cfg):
    """ushard's DPO objective on the same logits, laid out as its batches are (pair k: row k of the
    chosen and of the rejected fields; the model's rows interleaved). -> (loss, gradient in TRL's
    order, metrics)."""
    logits, tokens, counted, ref = fixed_pairs
    objective = dpo.DPO(cfg)
    rows = {"targets": tokens[:, 1:], "loss_mask": counted[:, 1:]}
    batch = {}
    for prefix, half in (("", slice(0, PAIRS)), (REJECTED, slice(PAIRS, None))):
        for f in FIELDS:
            batch[prefix + f] = jnp.asarray(rows[f][half] if f in rows else np.zeros((PAIRS, TOKENS - 1), np.int32))
    for name, values in zip(REFERENCE_FIELDS, ref):  # the precomputed form: the value in column 0
        batch[name] = jnp.zeros((PAIRS, TOKENS - 1)).at[:, 0].set(values)
    interleave = np.stack([np.arange(PAIRS), PAIRS + np.arange(PAIRS)], axis=1).reshape(-1)

    def mean_loss(model_logits):
        _, (loss, pairs, sums) = objective.terms(model_logits, {}, batch)
        return loss / pairs, {k: v / pairs for k, v in sums.items()}

    (loss, metrics), grad = jax.value_and_grad(mean_loss, has_aux=True)(jnp.asarray(logits[interleave]))
    return float(loss), np.asarray(grad)[np.argsort(interleave)], {k: float(v) for k, v in metrics.items()}


def dpo_settings(**values):
    """train.dpo's keys (with the reference precomputed: the batch holds it)."""
    base = {"beta": 0.1, "label_smoothing": 0.0, "loss_type": "sigmoid", "reference": "precomputed"}
    return types.SimpleNamespace(**{**base, **values})


VARIANTS = [("sigmoid", 0.1, 0.0), ("sigmoid", 0.5, 0.0), ("sigmoid", 0.2, 0.1), ("robust", 0.3, 0.2),
            ("ipo", 0.4, 0.0)]
TRL_NAMES = {"dpo/rewards_chosen": "rewards/chosen", "dpo/rewards_rejected": "rewards/rejected",
             "dpo/margin": "rewards/margins", "dpo/accuracy": "rewards/accuracies"}


def assert_same_loss(got, want):
    (loss, grad, metrics), (want_loss, want_grad, want_metrics) = got, want
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    assert np.abs(want_grad).max() > 1e-3  # the gradient is not trivially zero
    np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-5 * np.abs(want_grad).max())
    for ours, theirs in TRL_NAMES.items():
        np.testing.assert_allclose(metrics[ours], want_metrics[theirs], rtol=1e-5, atol=1e-6)
    assert 0 < metrics["dpo/accuracy"] < 1  # the fixed pairs have both kinds


@pytest.mark.parametrize("loss_type, beta, label_smoothing", VARIANTS)
def test_loss_and_gradients_equal_trls_formula(fixed_pairs, loss_type, beta, label_smoothing):
    settings = dpo_settings(loss_type=loss_type, beta=beta, label_smoothing=label_smoothing)
    assert_same_loss(ushard_loss(fixed_pairs, settings),
                     transcribed_loss(fixed_pairs, loss_type, beta, label_smoothing))
    if label_smoothing:  # the smoothing term matters
        plain = ushard_loss(fixed_pairs, dpo_settings(loss_type=loss_type, beta=beta))[0]
        assert abs(plain - transcribed_loss(fixed_pairs, loss_type, beta, label_smoothing)[0]) > 1e-3


@pytest.mark.slow  # importing trl: 10-40 s on two shared cores; the transcription above keeps the point
@pytest.mark.parametrize("loss_type, beta, label_smoothing", [v for v in VARIANTS if v[0] != "sigmoid" or not v[2]])
def test_loss_and_gradients_equal_trls_own_code(fixed_pairs, loss_type, beta, label_smoothing):
    settings = dpo_settings(loss_type=loss_type, beta=beta, label_smoothing=label_smoothing)
    assert_same_loss(ushard_loss(fixed_pairs, settings), trl_loss(fixed_pairs, loss_type, beta, label_smoothing))


# --------------------------------------------------------------------------- the preference source


def test_text_pairs_count_the_completion_and_its_end_token_only():
    tokenizer = get_tokenizer("byte")
    pairs = Pairs(data_config(source="preference", paths=TEXT_PAIRS), 17)
    records = [json.loads(line) for line in open(TEXT_PAIRS)]
    fields = pairs.fields(np.arange(len(records)))
    for k, record in enumerate(records):
        for prefix, key in (("", "chosen"), (REJECTED, "rejected")):
            counted = fields[prefix + "targets"][k][fields[prefix + "loss_mask"][k] == 1]
            assert counted[-1] == tokenizer.eos_id
            assert tokenizer.decode(counted[:-1]) == record[key]
            prompt = tokenizer.encode(record["prompt"])
            np.testing.assert_array_equal(fields[prefix + "inputs"][k][:len(prompt)], prompt)
            assert fields[prefix + "segment_ids"][k][0] == 1  # one sequence a row, from column 0


def test_chat_pairs_count_the_assistant_completion_only(tmp_path):
    """A prompt with an earlier assistant turn: only the completion's tokens count."""
    tokenizer = get_tokenizer("byte")
    record = {"prompt": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "EARLIER"},
                         {"role": "user", "content": "colour?"}],
              "chosen": [{"role": "assistant", "content": "blue"}],
              "rejected": [{"role": "assistant", "content": "no idea"}]}
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps(record) + "\n" + open(CHAT_PAIRS).readline())
    fields = Pairs(data_config(source="preference", paths=str(path)), 96).fields(np.arange(2))
    for prefix, answer in (("", "blue"), (REJECTED, "no idea")):
        counted = fields[prefix + "targets"][0][fields[prefix + "loss_mask"][0] == 1]
        assert counted[-1] == tokenizer.eos_id and tokenizer.decode(counted[:-1]) == answer
        assert "EARLIER" in tokenizer.decode(fields[prefix + "inputs"][0])


def test_a_pair_stays_together_through_every_split_of_the_rows():
    """Row k of the chosen and of the rejected fields is one record's, in every microbatch split
    (strided, as the step and the pipeline split) and every contiguous data shard, and the model's
    rows put them side by side."""
    batches = PreferenceBatches(data_config(source="preference", paths=TEXT_PAIRS), 16, 0)
    batch, _ = batches.train_batch(batches.initial_state(), 8)
    record = {tuple(v): i for i, v in enumerate(batches.pairs.fields(np.arange(24))["inputs"].tolist())}
    chosen_of = [record[tuple(r)] for r in batch["inputs"].tolist()]
    rejected = batches.pairs.fields(np.array(chosen_of))["rejected_inputs"]
    np.testing.assert_array_equal(batch["rejected_inputs"], rejected)
    for count in (1, 2, 4):
        for micro in range(count):
            parts = {k: split_rows(jnp.asarray(v), count, None)[micro] for k, v in batch.items()}
            rows = np.asarray(dpo.pair_rows(parts)["inputs"])
            for shard in np.split(np.arange(len(rows)), len(rows) // 2):  # the finest: a pair per device
                chosen, rejected_row = rows[shard]
                k = record[tuple(chosen.tolist())]
                np.testing.assert_array_equal(rejected_row, batches.pairs.fields(np.array([k]))["rejected_inputs"][0])


def test_the_data_position_counts_pairs_and_resumes_at_the_next_one():
    batches = PreferenceBatches(data_config(source="preference", paths=TEXT_PAIRS), 16, 0)
    whole, _ = batches.train_batch(batches.initial_state(), 8)
    _, after_three = batches.train_batch(batches.initial_state(), 3)
    rest, _ = batches.train_batch(batches.check_resume(after_three, False), 5)
    np.testing.assert_array_equal(rest["inputs"], whole["inputs"][3:])
    assert batches.check_resume(after_three, False)["position"] == 3


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("record, sentence", [
    ({"prompt": "a", "chosen": "", "rejected": "b"}, "{name}: its 'chosen' completion is empty"),
    ({"prompt": "a", "chosen": "b"}, "{name} has no 'rejected' field"),
    ({"prompt": "a", "chosen": "b", "rejected": "x" * 40}, "{name}: its prompt and 'rejected' completion are 42 "
                                                            "tokens, more than train.seq_len + 1 = 17"),
    ({"prompt": "a", "chosen": [{"role": "user", "content": "b"}], "rejected": "c"},
     "{name}: its 'chosen' completion has no non-empty assistant message"),
    ({"prompt": [{"role": "user", "content": "a"}], "chosen": "b", "rejected": "c"},
     "{name}: its 'prompt' and 'chosen' fields must both be text or both be messages"),
])
def test_a_bad_record_is_named(tmp_path, record, sentence):
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps({"prompt": "ok", "chosen": "yes", "rejected": "no"}) + "\n" + json.dumps(record) + "\n")
    with pytest.raises(UserError) as excinfo:
        Pairs(data_config(source="preference", paths=str(path)), 17)
    assert one_sentence(excinfo).startswith(sentence.format(name=f"{path}:2"))


@pytest.mark.parametrize("overrides, sentence", [
    (["train.objective=dpo"], "train.objective='dpo' with data.source='stdlib': DPO trains on preference pairs"),
    (["data.source=preference", f"data.paths={TEXT_PAIRS}"], "train.objective='lm' with data.source='preference'"),
    (["train.objective=dpo", "data.source=preference", f"data.paths={TEXT_PAIRS}", "train.dpo.beta=0"],
     "train.dpo.beta=0.0 must be positive"),
])
def test_the_cli_refuses_dpo_settings_before_any_work(tmp_path, capsys, overrides, sentence):
    workdir = tmp_path / "run"
    args = [f"--config.{o}" for o in overrides]
    assert main(["train", "--config", "tiny", *args, "--workdir", str(workdir)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"ushard: error: {sentence}"), err
    assert not workdir.exists()


def test_the_cli_refuses_a_record_too_long_and_leaves_the_workdir_as_it_was(tmp_path, capsys):
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps({"prompt": "q", "chosen": "a", "rejected": "r" * 100}) + "\n")
    workdir = tmp_path / "run"
    workdir.mkdir()
    (workdir / "metrics.jsonl").write_text('{"step": 1}\n')
    args = ["--config.train.objective=dpo", "--config.data.source=preference", f"--config.data.paths={path}",
            "--config.train.seq_len=32"]
    assert main(["train", "--config", "tiny", *args, "--workdir", str(workdir)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [f"ushard: error: {path}:1: its prompt and 'rejected' completion are 102 tokens, more than "
                   f"train.seq_len + 1 = 33; raise train.seq_len or drop the record."]
    assert (workdir / "metrics.jsonl").read_text() == '{"step": 1}\n'


# --------------------------------------------------------------------------- layouts, accumulation, reference


def assert_same_dpo_training(got, want, trained_rtol=RTOL):
    """assert_same_training, with the `dpo/` metrics to an absolute 1e-6 besides 1e-5 relative (a
    reward is β times a difference of log-probs summed in float32: near 0 its relative error is
    large), and step 1's accuracy not compared: while the policy is its reference every reward is 0
    up to rounding, and the accuracy of those ties is rounding's."""
    assert_same_training({**got, "aux": []}, {**want, "aux": []}, trained_rtol=trained_rtol)
    # 0 while the policy is its reference, exactly for a frozen copy (the same computation), up to
    # rounding under LoRA (the base's product and the adapters' zero update, fused otherwise)
    assert abs(want["aux"][0]["dpo/margin"]) <= 1e-6
    for step, (aux, want_aux) in enumerate(zip(got["aux"], want["aux"])):
        assert aux.keys() == want_aux.keys()
        for name in aux:
            if not (step == 0 and name == "dpo/accuracy"):
                np.testing.assert_allclose(aux[name], want_aux[name], rtol=1e-5, atol=1e-6, err_msg=name)


def pair_batches(config):
    return PreferenceBatches(config.data, config.train.seq_len, config.train.seed)


def run_dpo(devices, config_name="tiny", precomputed=False, **overrides):
    config = dpo_config(config_name, **overrides, **({"train.dpo.reference": "precomputed"} if precomputed else {}))
    batches = pair_batches(config)
    if precomputed:
        trainer = Trainer(config, devices=jax.devices()[:devices], batches=batches)
        batches.with_reference(dpo_reference.compute(trainer, trainer.steps.reference_source(
            trainer.steps.init(config.train.seed))))
    return run_config(config, jax.devices()[:devices], batches)


@pytest.fixture(scope="module")
def single():
    return run_dpo(1)


def test_dpo_trains_and_reports_its_metrics(single):
    assert single["losses"][0] == pytest.approx(np.log(2), rel=1e-6)  # the policy is its reference at step 1
    assert single["losses"][2] < single["losses"][1] < single["losses"][0]
    assert set(single["aux"][2]) == {f"dpo/{m}" for m in dpo.METRICS}
    assert single["aux"][2]["dpo/margin"] > 0 and single["aux"][2]["dpo/accuracy"] > 0.5


@pytest.mark.slow  # the fsdp row below accumulates too
def test_gradient_accumulation_equals_one_microbatch(single):
    assert_same_dpo_training(run_dpo(1, **{"train.grad_accum": 2}), single)


def test_fsdp_zero3_with_accumulation_and_the_precomputed_reference_match_one_device_and_the_frozen_one(single):
    """The default tier's row: one pair per device in each of two microbatches (a pair split across
    either would change the loss), the reference precomputed against the frozen copy of one device."""
    got = run_dpo(8, precomputed=True, **{"mesh.fsdp": 8, "parallel.zero_stage": 3, "train.grad_accum": 2})
    assert "reference" not in got["init_shardings"].as_dict()  # no second model in the state
    assert_same_dpo_training(got, single)


@pytest.mark.slow  # the row above accumulates with the precomputed reference
def test_fsdp_zero3_with_accumulation_matches_one_device(single):
    assert_same_dpo_training(run_dpo(8, **{"mesh.fsdp": 8, "parallel.zero_stage": 3, "train.grad_accum": 2}), single)


@pytest.mark.slow  # the fsdp row above compares the two
def test_the_precomputed_reference_equals_the_frozen_copy(single):
    assert_same_dpo_training(run_dpo(1, precomputed=True), single)


@pytest.mark.slow
def test_tensor_with_sequence_parallelism_matches_one_device(single):
    got = run_dpo(8, **{"mesh.tensor": 2, "mesh.fsdp": 4, "parallel.sequence_parallel": True})
    assert_same_dpo_training(got, single)


@pytest.mark.slow
def test_one_f_one_b_matches_one_device():
    deep = {"model.n_layers": 4}
    want = run_dpo(1, **deep)
    got = run_dpo(8, **deep, **{"mesh.pipeline": 2, "mesh.fsdp": 4, "parallel.pipeline_schedule": "1f1b",
                                "parallel.pipeline_microbatches": 2})
    assert_same_dpo_training(got, want)


@pytest.mark.slow
def test_experts_over_two_devices_match_one_device():
    want = run_dpo(1, "tiny_moe", **SMALL_MOE)
    got = run_dpo(8, "tiny_moe", **SMALL_MOE, **{"mesh.expert": 2, "mesh.fsdp": 4})
    assert_same_dpo_training(got, want)


def test_the_planner_counts_the_frozen_reference():
    """In the compute dtype: bfloat16 adds half the float32 parameters' bytes."""
    from ushard import build
    from ushard.planner import estimate_state_bytes

    lm = estimate_state_bytes(build(small_config(**{"model.compute_dtype": "bfloat16"}), jax.devices()[:1]))[0]
    frozen = estimate_state_bytes(build(dpo_config(**{"model.compute_dtype": "bfloat16"}), jax.devices()[:1]))[0]
    precomputed = estimate_state_bytes(build(dpo_config(**{"model.compute_dtype": "bfloat16",
                                                           "train.dpo.reference": "precomputed"}),
                                             jax.devices()[:1]))[0]
    assert frozen == lm * 3 // 2 and precomputed == lm


def train_in(workdir, steps, **overrides):
    config = dpo_config(**{"train.steps": steps, "checkpoint.every": 2, "checkpoint.async_save": False, **overrides})
    return Trainer(config, str(workdir), devices=jax.devices()[:1]).run(log=lambda *a: None)


@pytest.mark.slow  # the default tier: the checkpoint holds the reference (below)
@pytest.mark.parametrize("reference", ["frozen", "precomputed"])
def test_a_resume_continues_exactly(tmp_path, reference):
    settings = {"train.dpo.reference": reference, "train.schedule": "constant"}  # the same rates, 2 steps or 4
    straight = train_in(tmp_path / "straight", 4, **settings)
    train_in(tmp_path / "resumed", 2, **settings)
    resumed = train_in(tmp_path / "resumed", 4, **settings)
    assert [r["step"] for r in resumed] == [3, 4]
    np.testing.assert_allclose([r["loss"] for r in resumed], [r["loss"] for r in straight[2:]], rtol=1e-6)
    np.testing.assert_allclose([r["dpo/margin"] for r in resumed], [r["dpo/margin"] for r in straight[2:]], rtol=1e-5)


def test_a_checkpoint_holds_the_frozen_reference_and_a_changed_reference_is_refused(tmp_path):
    """What makes a resume exact: the restored state's reference is the initial parameters, not the
    trained ones."""
    train_in(tmp_path, 2)
    trainer = Trainer(dpo_config(**{"train.steps": 4}), str(tmp_path), devices=jax.devices()[:1])
    state, _ = trainer.initial_state(log=lambda *a: None)
    initial = jax.device_get(trainer.steps.init(0).params)
    assert int(state.step) == 2
    for got, want in zip(jax.tree.leaves(jax.device_get(state.reference)), jax.tree.leaves(initial)):
        np.testing.assert_array_equal(got, want)
    assert tree_relative_difference(jax.device_get(state.params), initial) > 1e-4
    trainer.checkpoints.close()
    with pytest.raises(UserError) as excinfo:
        train_in(tmp_path, 4, **{"train.dpo.reference": "precomputed"})
    assert one_sentence(excinfo).startswith(
        f"the checkpoints in {tmp_path / 'checkpoints'} were trained with train.objective='dpo' with "
        f"train.dpo.reference='frozen', not train.objective='dpo' with train.dpo.reference='precomputed'; ")


@pytest.mark.slow  # a training run for a refusal; the sentence is the file's, read before any device work
def test_a_precomputed_resume_without_its_reference_file_is_refused(tmp_path):
    settings = {"train.dpo.reference": "precomputed"}
    train_in(tmp_path, 2, **settings)
    assert (tmp_path / dpo_reference.FILE).is_file()
    (tmp_path / dpo_reference.FILE).unlink()
    with pytest.raises(UserError) as excinfo:
        train_in(tmp_path, 4, **settings)
    assert "holds no dpo_reference.npz" in one_sentence(excinfo)


def test_parquet_records_give_the_jsonl_records_rows(tmp_path):
    """Text and message columns alike (a list of structs reads back as a list of dicts)."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    for source in (TEXT_PAIRS, CHAT_PAIRS):
        records = [json.loads(line) for line in open(source)]
        path = tmp_path / (os.path.basename(source) + ".parquet")
        pq.write_table(pa.Table.from_pylist(records), path, row_group_size=5)
        want = Pairs(data_config(source="preference", paths=source), 97).fields(np.arange(len(records)))
        got = Pairs(data_config(source="preference", paths=str(path)), 97).fields(np.arange(len(records)))
        for name in want:
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    pq.write_table(pa.Table.from_pylist([{"prompt": "a", "chosen": "b"}]), tmp_path / "short.parquet")
    with pytest.raises(UserError) as excinfo:
        Pairs(data_config(source="preference", paths=str(tmp_path / "short.parquet")), 17)
    assert one_sentence(excinfo).startswith(f"{tmp_path / 'short.parquet'} has no column 'rejected'")


# --------------------------------------------------------------------------- DPO with LoRA: the base is the reference

LORA = {"model.lora.rank": 4, "model.lora.alpha": 8.0}
# The trained adapters of a layout against one device's, relative. DPO's gradient is the difference of
# a pair's two sequences' gradients, nearly equal while the policy is near its reference, and Adam's
# first steps scale what is left to full-size updates: float32's summation orders (1F1B's microbatches,
# ZeRO-3's reductions) give ~3e-5 after three steps, with the losses to 1e-5 and the first gradients
# to 1.4e-6 (assert_same_training checks both at the suite's RTOL).
LORA_DPO_TRAINED = 1e-4


@pytest.fixture(scope="module")
def lora_single():
    return run_dpo(1, **LORA)


def test_under_lora_the_reference_is_the_base_without_the_adapters():
    """DPO's loss of LoRA adapters (B random, so the policy is not the base) equals the loss of the
    merged weights as a full policy against a frozen copy of the base, and the state holds no copy."""
    config = dpo_config(**LORA)
    batches = pair_batches(config)
    lora = Trainer(config, devices=jax.devices()[:1], batches=batches)
    state = lora.steps.init(0)
    assert state.reference is None and "reference" not in state.as_dict()
    rng = np.random.default_rng(0)
    adapters = jax.tree_util.tree_map_with_path(
        lambda path, x: jnp.asarray(rng.normal(size=x.shape), x.dtype) if path[-1].key == "lora_b" else x,
        state.params)
    batch = lora.global_batches(1)[0]
    loss, _ = lora.steps.loss_and_grads(adapters, batch, state.frozen)

    full = Trainer(dpo_config(), devices=jax.devices()[:1], batches=pair_batches(config))
    base = state.frozen["weights"]
    merged = jax.jit(lora.setup.adapters.merge)(base, adapters)
    want, _ = full.steps.loss_and_grads(merged, batch, base)
    assert float(loss) > np.log(2) * 1.01 or float(loss) < np.log(2) * 0.99  # the policy is not its reference
    np.testing.assert_allclose(float(loss), float(want), rtol=1e-5)


def test_lora_dpo_starts_at_log_2_and_learns(lora_single):
    assert lora_single["losses"][0] == pytest.approx(np.log(2), rel=1e-6)  # B = 0: the policy is the base
    assert lora_single["losses"][2] < lora_single["losses"][0]


@pytest.mark.slow  # the default tier: the reference under LoRA (above), and fsdp ZeRO-3 without LoRA
def test_lora_dpo_under_zero3_with_accumulation_matches_one_device(lora_single):
    got = run_dpo(8, **LORA, **{"mesh.fsdp": 8, "parallel.zero_stage": 3, "train.grad_accum": 2})
    assert_same_dpo_training(got, lora_single, trained_rtol=LORA_DPO_TRAINED)


@pytest.mark.slow
def test_lora_dpo_with_the_precomputed_reference_trains_as_with_the_base(lora_single):
    """The reference log-probs precomputed from the base (one pass over the pairs) against the base's
    own in each step: the same losses. The adapters agree to 1e-4 rather than 1e-5: A's gradients start
    at exactly zero (B is zero at step 0), and Adam scales the float32 summation order's differences
    between the two passes up to a full step in their first updates."""
    got = run_dpo(1, precomputed=True, **LORA)
    np.testing.assert_allclose(got["losses"], lora_single["losses"], rtol=1e-5)
    assert tree_relative_difference(got["params"], lora_single["params"]) <= 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tensor2_sp", "pipeline2_1f1b", "expert2_moe"])
def test_lora_dpo_on_every_layout_matches_one_device(layout):
    deep = {"model.n_layers": 4} if layout == "pipeline2_1f1b" else {}
    name, moe = ("tiny_moe", SMALL_MOE) if layout == "expert2_moe" else ("tiny", {})
    mesh = {"tensor2_sp": {"mesh.tensor": 2, "mesh.fsdp": 4, "parallel.sequence_parallel": True},
            "pipeline2_1f1b": {"mesh.pipeline": 2, "mesh.fsdp": 4, "parallel.pipeline_schedule": "1f1b",
                               "parallel.pipeline_microbatches": 2},
            "expert2_moe": {"mesh.expert": 2, "mesh.fsdp": 4}}[layout]
    want = run_dpo(1, name, **LORA, **deep, **moe)
    assert_same_dpo_training(run_dpo(8, name, **LORA, **deep, **moe, **mesh), want, trained_rtol=LORA_DPO_TRAINED)
