"""`ushard eval`: perplexity is the model's own cross-entropy over loss_mask and the run's logged
eval_loss; lm-eval's requests, answered by the adapter, equal the log-likelihoods computed from
`ushard.load_model`'s logits; greedy generation is `ushard.sample`'s; mistakes are one sentence."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest

import ushard
from conftest import small_config
from ushard.cli import main
from ushard.data import make_batches
from ushard.data.tokenizer import get_tokenizer
from ushard.sharding import use_layout

DATA = Path(__file__).parent / "data" / "eval"  # the local task and documents, found from this file
BYTE = get_tokenizer("byte")
RUN = {"train.batch_size": 8, "train.steps": 3, "train.eval_every": 3, "train.eval_batches": 2,
       "mesh.fsdp": -1}  # trained over all 8 devices, evaluated on one


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(workdir, config, the eval_loss it logged at its last step) of a 3-step run."""
    workdir = tmp_path_factory.mktemp("eval_run")
    config = small_config(**RUN)
    rows = ushard.train(config, str(workdir), log=lambda *_: None)
    return str(workdir), config, rows[-1]["eval_loss"]


@pytest.fixture(scope="module")
def model(run):
    return ushard.load_model(run[0])


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """lm-eval reads the local task's data set without a network, from another working directory."""
    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    monkeypatch.chdir(tmp_path)  # not the task's folder: its data is found from its own file


def eval_cli(capsys, *args) -> tuple[int, str, str]:
    status = main(["eval", *args])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def log_softmax(logits) -> np.ndarray:
    logits = np.asarray(logits, np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def log_probs(model, tokens) -> np.ndarray:
    """log softmax of `model`'s logits for one document's tokens: [length, vocab]."""
    return log_softmax(model(np.asarray(tokens, np.int32)[None])[0])


def packed_log_probs(model, batch) -> np.ndarray:
    """log softmax of the logits of packed rows, each document apart (segment_ids, positions)."""
    with use_layout(model.layout):
        logits = model.model.apply(model.params, batch["inputs"], batch["positions"], batch["segment_ids"])[0]
    return log_softmax(logits)


def continuation_score(model, context, continuation) -> tuple[float, bool]:
    """(sum of log p(continuation tokens | context), each the likeliest of the tokenizer's ids)."""
    tokens = list(context) + list(continuation)
    lp = log_probs(model, tokens[:-1])
    steps = range(len(context) - 1, len(tokens) - 1)
    return (sum(lp[i, tokens[i + 1]] for i in steps),
            all(lp[i, :BYTE.vocab_size].argmax() == tokens[i + 1] for i in steps))


# --------------------------------------------------------------------------- perplexity


@pytest.mark.parametrize("overrides", [
    [],  # the run's own held-out split
    ["--config.data.source=jsonl", f"--config.data.paths={DATA / 'documents.jsonl'}",
     "--config.data.eval_fraction=0.3"],
], ids=["run_split", "jsonl_override"])
def test_perplexity_is_the_cross_entropy_of_the_models_logits(run, model, capsys, overrides):
    workdir, config, logged = run
    status, out, _ = eval_cli(capsys, "--workdir", workdir, "--json", "--batch_size", "3", *overrides)
    assert status == 0
    result = json.loads(out)

    data = config.data.copy_and_resolve_references()
    for item in overrides:
        key, value = item.removeprefix("--config.data.").split("=", 1)
        data[key] = type(data[key])(value)
    batches = make_batches(data, config.train.seq_len, config.train.seed)
    total, count = 0.0, 0
    for index in range(config.train.eval_batches):
        b = batches.eval_batch(index, config.train.batch_size)
        picked = np.take_along_axis(packed_log_probs(model, b), b["targets"][..., None], -1)[..., 0]
        total -= float((picked * b["loss_mask"]).sum())
        count += int(b["loss_mask"].sum())
    assert result["tokens"] == count > 0
    assert result["batches"] == config.train.eval_batches
    np.testing.assert_allclose(result["loss"], total / count, rtol=1e-5)
    np.testing.assert_allclose(result["perplexity"], np.exp(total / count), rtol=1e-5)
    if not overrides:  # the batches training scored: the eval_loss it logged
        np.testing.assert_allclose(result["loss"], logged, rtol=1e-5)


def test_an_imported_checkpoint_scores_the_data_it_is_told(run, capsys, tmp_path):
    hf_dir = str(tmp_path / "hf")
    ushard.to_hf(run[0], hf_dir, log=lambda *_: None)
    status, out, _ = eval_cli(capsys, "--workdir", run[0], "--json", "--batches", "4")  # 4 batches of 8 rows
    assert status == 0
    own = json.loads(out)
    # The same 32 windows of the held-out split as one batch of default_config's 32 rows, in the
    # exported model's 32-token window (its max_position_embeddings).
    status, out, _ = eval_cli(capsys, "--hf", hf_dir, "--json", "--batches", "1", "--config.data.tokenizer=byte",
                              "--config.data.source=stdlib")
    assert status == 0
    imported = json.loads(out)
    assert (imported["rows"], imported["seq_len"], imported["tokens"]) == (32, 32, own["tokens"])
    assert imported["loss"] == pytest.approx(own["loss"], rel=1e-5)
    one_sentence(eval_cli(capsys, "--hf", hf_dir, "--config.data.tokenizer=byte"), "--config.data.source")


# --------------------------------------------------------------------------- lm-eval


def test_a_local_multiple_choice_task_scores_as_the_models_logits(run, model, capsys, offline, tmp_path):
    pytest.importorskip("lm_eval")
    output = tmp_path / "results.json"
    status, out, _ = eval_cli(capsys, "--workdir", run[0], "--tasks", "ushard_tiny_choice",
                              "--include_path", str(DATA), "--output", str(output))
    assert status == 0
    assert "ushard_tiny_choice" in out and "acc" in out  # lm-eval's table

    results = json.loads(output.read_text())
    samples = results["samples"]["ushard_tiny_choice"]
    assert len(samples) == 6
    for sample in samples:
        for (context, continuation), response in zip(sample["arguments"], sample["resps"]):
            log_prob, greedy = response[0]
            expected, expected_greedy = continuation_score(model, BYTE.encode(context), BYTE.encode(continuation))
            assert log_prob == pytest.approx(expected, abs=1e-4)
            assert greedy == expected_greedy
    accuracy = np.mean([int(np.argmax([r[0][0] for r in s["resps"]]) == s["target"]) for s in samples])
    assert results["results"]["ushard_tiny_choice"]["acc,none"] == pytest.approx(accuracy)


def test_rolling_log_likelihood_and_greedy_generation(run, model):
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    from ushard.lm_eval_adapter import UshardLM
    from ushard.sample import generate

    lm = UshardLM(model, "byte", window=32, rows=4)
    text = "def add(a, b):\n    return a + b\n\n\nclass Point:\n    x = 0\n    y = 0\n"  # two windows and more
    tokens = [int(t) for t in BYTE.encode(text)]
    expected = sum(continuation_score(model, *make_disjoint_window(w))[0]
                   for w in get_rolling_token_windows(tokens, BYTE.eos_id, 32, 1))
    request = Instance("loglikelihood_rolling", {}, (text,), 0)
    assert lm.loglikelihood_rolling([request])[0] == pytest.approx(expected, abs=1e-4)

    prompt = "def "
    greedy = BYTE.decode(list(generate(model.model, model.params, BYTE.encode(prompt), 12, eos_id=BYTE.eos_id,
                                       vocab=BYTE.vocab_size)))
    ask = lambda until: Instance("generate_until", {}, (prompt, {"until": until, "max_gen_toks": 12}), 0)  # noqa: E731
    assert lm.generate_until([ask([])]) == [greedy]
    stop = greedy[len(greedy) // 2]  # a stop string cuts the text before its first occurrence
    assert lm.generate_until([ask([stop])]) == [greedy[:greedy.index(stop)]]


# --------------------------------------------------------------------------- mistakes


def one_sentence(result: tuple[int, str, str], *words: str) -> None:
    status, _, err = result
    lines = [line for line in err.splitlines() if line.startswith("ushard: error:")]
    assert status == 2 and len(lines) == 1 and lines[0].endswith("."), err
    assert all(word in lines[0] for word in words), lines[0]


def test_a_workdir_without_checkpoints_is_one_sentence(tmp_path, capsys):
    one_sentence(eval_cli(capsys, "--workdir", str(tmp_path)), "train a model first")


def test_an_override_outside_data_is_one_sentence(run, capsys):
    one_sentence(eval_cli(capsys, "--workdir", run[0], "--config.train.seq_len=64"), "--config.train.seq_len")


def test_tasks_without_lm_eval_installed_is_one_sentence(run, capsys, monkeypatch):
    for name in [n for n in sys.modules if n.split(".")[0] == "lm_eval"] + ["lm_eval"]:
        monkeypatch.setitem(sys.modules, name, None)  # importing it fails as if it were not installed
    monkeypatch.delitem(sys.modules, "ushard.lm_eval_adapter", raising=False)
    monkeypatch.delattr(ushard, "lm_eval_adapter", raising=False)
    one_sentence(eval_cli(capsys, "--workdir", run[0], "--tasks", "ushard_tiny_choice"),
                 "pip install -e '.[eval]' in a clone of ushard")


@pytest.mark.slow  # lm-eval indexes its 14,000 tasks to suggest a name: the suite's time
def test_an_unknown_task_is_one_sentence(run, capsys):
    pytest.importorskip("lm_eval")
    one_sentence(eval_cli(capsys, "--workdir", run[0], "--tasks", "ushard_no_such_task", "--include_path",
                           str(DATA)), "unknown lm-eval task", "ushard_no_such_task")
