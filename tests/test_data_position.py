"""The data position: a token offset into the training stream that survives a change of batch size or
sequence length, and check_resume's answer to the data state a checkpoint saved."""

from __future__ import annotations

import dataclasses
import json
import re

import numpy as np
import pytest

from ushard.config import default_config
from ushard.data import make_batches
from ushard.data.corpus import Corpus
from ushard.data.pipeline import Batches, shuffled
from ushard.errors import UserError

RESTART = "; --config.data.restart=true starts a fresh data order from the beginning of the data."


def _small_corpus(n_docs: int = 30, eval_fraction: float = 0.2) -> Corpus:
    """About 750 tokens of random documents."""
    rng = np.random.default_rng(0)
    docs = [np.append(rng.integers(0, 256, size=rng.integers(0, 50)), 256) for _ in range(n_docs)]
    settings = {"source": "test", "paths": None, "jsonl_field": None, "tokenizer": "byte",
                "eval_fraction": eval_fraction}
    return Corpus(np.concatenate(docs).astype(np.uint16), [f"doc{i}" for i in range(n_docs)],
                  np.array([len(d) for d in docs], np.int64), settings)


def _reference_stream(batches: Batches, n_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """The first n_tokens of the training stream, written out piece by piece: the training pieces in
    the seeded order of each epoch, epoch after epoch. Also whether each token starts a piece."""
    starts, lengths = batches.pieces.split(False)
    order = shuffled(len(starts), batches.seed)
    tokens, first, have, epoch = [], [], 0, 0
    while have < n_tokens:
        for p in order(epoch):
            tokens.append(batches.corpus.tokens[starts[p] : starts[p] + lengths[p]])
            first.append(np.arange(lengths[p]) == 0)
            have += lengths[p]
            if have >= n_tokens:
                break
        epoch += 1
    return np.concatenate(tokens)[:n_tokens], np.concatenate(first)[:n_tokens]


def _run(batches: Batches, state: dict, batch_size: int, steps: int):
    """(windows, piece starts seen inside them, state after): what `steps` training steps read."""
    windows, starts = [], []
    for _ in range(steps):
        batch, state = batches.train_batch(state, batch_size)
        # A row covers its inputs and its last target; loss_mask is 0 where a target starts a piece.
        windows.append(np.concatenate([batch["inputs"], batch["targets"][:, -1:]], axis=1))
        starts.append(batch["loss_mask"] == 0)
    return windows, starts, state


def _assert_one_stream(batches: Batches, runs: list):
    """The windows of consecutive runs are the stream itself, end to end: no token twice, none missing."""
    windows = [w for run_windows, _ in runs for w in run_windows]
    starts = [s for _, run_starts in runs for s in run_starts]
    seen = np.concatenate([w.ravel() for w in windows])
    tokens, first = _reference_stream(batches, len(seen))
    np.testing.assert_array_equal(seen, tokens)
    at = 0
    for w, s in zip(windows, starts):
        rows, window = w.shape
        expected = first[at : at + rows * window].reshape(rows, window)[:, 1:]
        np.testing.assert_array_equal(s, expected)
        at += rows * window
    return len(seen)


@pytest.mark.parametrize("chunk", [0, 16])  # pieces of 2 * (seq_len + 1) of the first run, or as set
@pytest.mark.parametrize("first, second", [((8, 32), (3, 50)), ((4, 20), (16, 7)), ((5, 9), (5, 64))])
def test_resume_with_another_batch_size_or_seq_len_goes_on_at_the_next_token(first, second, chunk):
    corpus = _small_corpus()
    (batch_a, len_a), (batch_b, len_b) = first, second
    run_a = Batches(corpus, len_a, seed=7, chunk_tokens=chunk)
    windows_a, starts_a, state = _run(run_a, run_a.initial_state(), batch_a, steps=6)
    saved = json.loads(json.dumps(state))  # what a checkpoint keeps

    run_b = Batches(corpus, len_b, seed=7, chunk_tokens=chunk)
    resumed = run_b.check_resume(saved, restart=False)
    assert resumed["position"] == 6 * batch_a * (len_a + 1)
    assert run_b.pieces.chunk == run_a.pieces.chunk == (chunk or 2 * (len_a + 1))  # the checkpoint's pieces
    np.testing.assert_array_equal(run_b.held_out.starts, run_a.held_out.starts)  # and so its eval split
    windows_b, starts_b, end = _run(run_b, resumed, batch_b, steps=9)

    seen = _assert_one_stream(run_a, [(windows_a, starts_a), (windows_b, starts_b)])
    assert end["position"] == seen
    assert seen > 2 * run_a.train.epoch_tokens  # the runs cross epoch boundaries, reshuffled each time


def test_resume_on_the_stdlib_corpus(stdlib_batches):
    """The default corpus: 5 steps of 16 x 32, then 4 steps of 3 x 200, are its first tokens end to end."""
    run_a = stdlib_batches
    assert run_a.seq_len == 32
    windows_a, starts_a, state = _run(run_a, run_a.initial_state(), 16, steps=5)
    run_b = Batches(run_a.corpus, 200, seed=run_a.seed)  # the corpus loaded once, another seq_len
    windows_b, starts_b, end = _run(run_b, run_b.check_resume(json.loads(json.dumps(state)), False), 3, steps=4)
    assert run_b.pieces.chunk == run_a.pieces.chunk == 66  # the first run's automatic pieces, 2 * 33
    seen = _assert_one_stream(run_a, [(windows_a, starts_a), (windows_b, starts_b)])
    assert end["position"] == seen == 5 * 16 * 33 + 4 * 3 * 201


# --------------------------------------------------------------------------- the state and check_resume


@pytest.fixture(scope="module")
def small():
    return Batches(_small_corpus(), 16, seed=7, chunk_tokens=16)


def test_initial_state_is_json_with_the_order_fingerprint(small):
    state = small.initial_state()
    assert json.loads(json.dumps(state)) == state
    assert state["position"] == 0
    order = state["order"]
    assert set(order) == {"version", "seed", "source", "paths", "jsonl_field", "tokenizer", "eval_fraction",
                          "chunk_tokens", "train_tokens", "checksum"}
    assert (order["seed"], order["chunk_tokens"], order["train_tokens"]) == (7, 16, small.train.epoch_tokens)
    assert small.advance(state, 5)["position"] == 5 * 17


def test_a_matching_state_continues(small):
    state = small.advance(small.advance(small.initial_state(), 4), 4)
    saved = json.loads(json.dumps(state))
    assert small.check_resume(saved, restart=False) == state
    # restart only replaces an order that cannot be continued: a config left with it on loses nothing.
    assert small.check_resume(saved, restart=True) == state
    longer = Batches(small.corpus, 40, seed=7, chunk_tokens=16)
    expected = {"position": 2 * 4 * 17, "order": longer.initial_state()["order"]}
    assert longer.check_resume(saved, restart=False) == expected


def _changed(batches: Batches, key: str, value) -> Batches:
    if key == "seed":
        return Batches(batches.corpus, batches.seq_len, seed=value, chunk_tokens=16)
    if key == "chunk_tokens":
        return Batches(batches.corpus, batches.seq_len, seed=7, chunk_tokens=value)
    corpus = dataclasses.replace(batches.corpus, settings={**batches.corpus.settings, key: value})
    return Batches(corpus, batches.seq_len, seed=7, chunk_tokens=16)


@pytest.mark.parametrize("key, name, value", [
    ("seed", "train.seed", 8),
    ("source", "data.source", "jsonl"),
    ("paths", "data.paths", "/data/*.txt"),
    ("jsonl_field", "data.jsonl_field", "body"),
    ("tokenizer", "data.tokenizer", "bpe"),
    ("eval_fraction", "data.eval_fraction", 0.05),
    ("chunk_tokens", "data.chunk_tokens", 32),
])
def test_another_data_order_is_refused_by_name_unless_restart(small, key, name, value):
    saved = json.loads(json.dumps(small.advance(small.initial_state(), 3)))
    run = _changed(small, key, value)
    with pytest.raises(UserError) as excinfo:
        run.check_resume(saved, restart=False)
    old = small.order[key]
    assert str(excinfo.value) == (f"the checkpoint's data order was made with {name}={old!r} but this run has "
                                  f"{name}={value!r} (set it back to continue)" + RESTART)
    fresh = run.check_resume(saved, restart=True)
    assert fresh == run.initial_state() and fresh["position"] == 0 and fresh["order"][key] == value
    assert run.train_batch(fresh, 2)[1]["position"] == 2 * 17  # the fresh state is one this run accepts


def test_a_run_with_automatic_pieces_adopts_the_checkpoints(small):
    """data.chunk_tokens=0 here: the checkpoint's pieces (another seq_len's, or set explicitly) are taken up."""
    saved = json.loads(json.dumps(small.advance(small.initial_state(), 3)))
    auto = Batches(small.corpus, 16, seed=7)
    assert auto.pieces.chunk == 34
    assert auto.check_resume(saved, restart=False) == saved
    assert auto.pieces.chunk == 16 and auto.order == small.order
    np.testing.assert_array_equal(auto.eval_batch(2, 4)["inputs"], small.eval_batch(2, 4)["inputs"])
    # If the order differs in something else as well, it is refused, and the run keeps its own pieces.
    other_seed = Batches(small.corpus, 16, seed=8)
    with pytest.raises(UserError, match=r"train\.seed=7 but this run has train\.seed=8"):
        other_seed.check_resume(saved, restart=False)
    assert other_seed.pieces.chunk == 34
    assert other_seed.check_resume(saved, restart=True) == other_seed.initial_state()
    assert other_seed.pieces.chunk == 34


def test_the_seed_message_in_full(small):
    with pytest.raises(UserError) as excinfo:
        Batches(small.corpus, 16, seed=1, chunk_tokens=16).check_resume(small.initial_state(), restart=False)
    assert str(excinfo.value) == (
        "the checkpoint's data order was made with train.seed=7 but this run has train.seed=1 (set it back to "
        "continue); --config.data.restart=true starts a fresh data order from the beginning of the data."
    )


def test_changed_data_files_are_refused(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("some text to train on, long enough for a few windows\n" * 40)
    cfg = default_config().data
    cfg.source, cfg.paths, cfg.eval_fraction, cfg.chunk_tokens = "text", str(path), 0.3, 64
    before = make_batches(cfg, 16, seed=0)
    saved = json.loads(json.dumps(before.advance(before.initial_state(), 2)))
    assert make_batches(cfg, 16, seed=0).check_resume(saved, restart=False)["position"] == 2 * 17

    with path.open("a") as f:
        f.write("one more line\n")
    after = make_batches(cfg, 16, seed=0)
    with pytest.raises(UserError, match="^" + re.escape(
        f"the data files have changed since the checkpoint's data order was made "
        f"({before.train.epoch_tokens} training tokens then, {after.train.epoch_tokens} now)" + RESTART) + "$"):
        after.check_resume(saved, restart=False)
    assert after.check_resume(saved, restart=True) == after.initial_state()

    # The same length, other content: the checksum still tells.
    path.write_text(path.read_text().replace("one more line", "one more LINE"))
    same_size = make_batches(cfg, 16, seed=0)
    assert same_size.train.epoch_tokens == after.train.epoch_tokens
    with pytest.raises(UserError, match=r"^the data files have changed"):
        same_size.check_resume(after.initial_state(), restart=False)


def test_the_old_next_batch_state_is_refused_unless_restart(small):
    with pytest.raises(UserError) as excinfo:
        small.check_resume({"next_batch": 7}, restart=False)
    assert str(excinfo.value) == (
        "the checkpoint's data position {'next_batch': 7} was written by an older ushard whose data order "
        "cannot be continued exactly" + RESTART
    )
    assert small.check_resume({"next_batch": 7}, restart=True) == small.initial_state()


@pytest.mark.parametrize("saved", [
    None, {}, {"position": 3}, {"position": -1, "order": "x"}, {"position": "3", "order": {}}, {"order": {}},
])
def test_an_unreadable_state_is_refused_unless_restart(small, saved):
    if isinstance(saved, dict) and "order" in saved and saved["order"] == {}:
        saved = {**saved, "order": small.order}  # the right order, but no usable position
    with pytest.raises(UserError, match=r"^the checkpoint's data state .* is not one this ushard can continue; "):
        small.check_resume(saved, restart=False)
    assert small.check_resume(saved, restart=True) == small.initial_state()


def test_another_order_version_is_refused(small):
    saved = small.initial_state()
    saved["order"]["version"] = 1
    with pytest.raises(UserError, match=r"^the checkpoint's data order was made by another version of ushard's "
                                        r"data pipeline \(order version 1, this one 2\); "):
        small.check_resume(saved, restart=False)


def test_train_batch_refuses_a_state_of_another_order(small):
    """A caller bug, not a user error: states from a checkpoint must go through check_resume first."""
    other = Batches(small.corpus, 16, seed=8, chunk_tokens=16)
    with pytest.raises(ValueError, match="another data order"):
        small.train_batch(other.initial_state(), 2)
    with pytest.raises(ValueError, match="another data order"):
        small.advance({"next_batch": 0}, 2)
    with pytest.raises(ValueError, match=r"^the data state 3 belongs to another data order"):
        small.train_batch(3, 2)  # the old interface's batch index
