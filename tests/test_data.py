"""The data pipeline: deterministic global batches, independent of the mesh; pieces, packing, the
held-out split; sources; tokenizer. The data position and resuming: test_data_position.py."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from conftest import assert_same_global_batch_on_every_mesh, data_config
from helpers import source_documents
from ushard.config import load_config
from ushard.data import make_batches
from ushard.data.corpus import Pieces, cut_into_pieces, held_out_pieces, load_corpus, name_hashes, piece_scores
from ushard.data.packing import FIELDS, PackedStream, window_rows
from ushard.data.pipeline import Batches, in_source_order, shuffled
from ushard.data.tokenizer import ByteTokenizer, get_tokenizer
from ushard.errors import UserError

SEQ_LEN = 32
BATCH = 8
SMALL = [f"train.batch_size={BATCH}", f"train.seq_len={SEQ_LEN}"]
E = 256  # the byte tokenizer's end-of-document token


def piece_score(name: str, index: int) -> float:
    """The held-out score of piece `index` of the document called `name`."""
    return float(piece_scores(name_hashes([name]), np.array([0]), np.array([index]))[0])


@pytest.fixture(scope="module")
def tiny_config():
    return load_config("tiny", SMALL)


@pytest.fixture(scope="module")
def batches(request, tiny_config):
    """The stdlib corpus of configs/tiny.py at SEQ_LEN, loaded once (about a second).

    conftest's session-wide `stdlib_batches` is the same data when its sizes match; reuse it then.
    """
    try:
        shared = request.getfixturevalue("stdlib_batches")
    except pytest.FixtureLookupError:
        shared = None
    if shared is not None and shared.seq_len == SEQ_LEN:
        return shared
    return make_batches(tiny_config.data, SEQ_LEN, tiny_config.train.seed)


def _assert_same(a: dict, b: dict):
    assert set(a) == set(b) == set(FIELDS)
    for k in FIELDS:
        np.testing.assert_array_equal(np.asarray(a[k]), np.asarray(b[k]), err_msg=k)


def _states(batches, steps, batch_size=BATCH):
    """The data state before each of `steps` (sorted step numbers), from the start of the data."""
    state, out = batches.initial_state(), {}
    for s in range(max(steps) + 1):
        out[s] = state
        state = batches.advance(state, batch_size)
    return [out[s] for s in steps]


def _stream_of(pieces, order=None) -> PackedStream:
    """The pieces (token lists) of one token array, in source order unless `order` says otherwise."""
    lengths = np.array([len(p) for p in pieces], np.int64)
    tokens = np.concatenate([np.asarray(p, np.uint16) for p in pieces])
    return PackedStream(tokens, np.cumsum(lengths) - lengths, lengths, order or in_source_order(len(pieces)))


_data_cfg = data_config


# --------------------------------------------------------------------------- (a) determinism


def test_batch_shape_and_dtype(batches):
    batch, _ = batches.train_batch(batches.initial_state(), BATCH)
    for k in FIELDS:
        assert batch[k].shape == (BATCH, SEQ_LEN), k
        assert batch[k].dtype == np.int32, k
    assert batch["inputs"].max() < 257 and batch["inputs"].min() >= 0
    assert set(np.unique(batch["loss_mask"])) <= {0, 1}
    assert batches.eval_batch(0, BATCH)["targets"].shape == (BATCH, SEQ_LEN)


def test_global_batch_depends_only_on_config_seed_and_position(tiny_config, batches):
    steps = (0, 1, 7, 1234)
    states = _states(batches, steps)
    rebuilt = make_batches(tiny_config.data, SEQ_LEN, tiny_config.train.seed)  # from scratch
    rebuilt_states = _states(rebuilt, steps)
    assert rebuilt_states == states
    for s, state in zip(steps, states):
        assert state["position"] == s * BATCH * (SEQ_LEN + 1)
        _assert_same(batches.train_batch(state, BATCH)[0], rebuilt.train_batch(state, BATCH)[0])
        _assert_same(batches.eval_batch(s, BATCH), rebuilt.eval_batch(s, BATCH))
    # Asking in another order, or twice, gives the same answer: no hidden iterator state.
    for state in reversed(states):
        _assert_same(batches.train_batch(state, BATCH)[0], rebuilt.train_batch(state, BATCH)[0])

    # Another seed draws another order over the same pieces (reused here: loading is what costs time).
    other = Batches(batches.corpus, SEQ_LEN, seed=tiny_config.train.seed + 1)
    for s, state in zip(steps, _states(other, steps)):
        assert state["position"] == s * BATCH * (SEQ_LEN + 1)
        ours = batches.train_batch(states[steps.index(s)], BATCH)[0]["inputs"]
        assert not np.array_equal(ours, other.train_batch(state, BATCH)[0]["inputs"])

    # Consecutive steps see different windows.
    first, second = (batches.train_batch(st, BATCH)[0]["inputs"] for st in _states(batches, (0, 1)))
    assert not np.array_equal(first, second)


def test_row_slices_concatenate_to_the_global_batch(batches):
    """Each process builds only its own rows; together they are the global batch, and all agree on the next state."""
    for state in _states(batches, (0, 3)):
        full, next_state = batches.train_batch(state, BATCH)
        halves = [batches.train_batch(state, BATCH, rows=range(i, i + 4)) for i in (0, 4)]
        quarters = [batches.train_batch(state, BATCH, rows=range(i, i + 2)) for i in range(0, BATCH, 2)]
        for parts in (halves, quarters):
            _assert_same(full, {k: np.concatenate([p[k] for p, _ in parts]) for k in FIELDS})
            assert all(n == next_state for _, n in parts)
        assert batches.train_batch(state, BATCH, rows=range(0))[1] == next_state == batches.advance(state, BATCH)
    for s in (0, 3):
        _assert_same(
            batches.eval_batch(s, BATCH),
            {k: np.concatenate([batches.eval_batch(s, BATCH, rows=range(i, i + 4))[k] for i in (0, 4)])
             for k in FIELDS},
        )


def test_every_piece_once_per_epoch_and_reshuffled():
    """The order is a permutation of the pieces in each epoch, re-drawn for the next epoch."""
    rng = np.random.default_rng(0)
    pieces = [np.append(rng.integers(0, 256, size=rng.integers(5, 40)), E) for _ in range(40)]
    stream = _stream_of(pieces, shuffled(len(pieces), seed=3))
    by_content = {p.astype(np.uint16).tobytes(): i for i, p in enumerate(pieces)}
    assert len(by_content) == len(pieces)  # the pieces themselves are all distinct here
    tokens, first, _ = stream.read(0, 2 * stream.epoch_tokens)
    cuts = list(np.flatnonzero(first)) + [len(tokens)]
    order = [by_content[tokens[a:b].tobytes()] for a, b in zip(cuts[:-1], cuts[1:])]  # each cut is a whole piece
    epochs = order[: len(pieces)], order[len(pieces):]
    assert sorted(epochs[0]) == sorted(epochs[1]) == list(range(len(pieces)))
    assert epochs[0] != epochs[1]
    assert epochs[0] != list(range(len(pieces)))


def test_the_order_and_the_split_are_fixed_functions():
    """Checkpoints keep positions in this order and split: if these values change, bump ORDER_VERSION."""
    assert shuffled(10, seed=0)(0).tolist() == [0, 9, 1, 6, 3, 5, 4, 2, 8, 7]
    assert shuffled(10, seed=0)(1).tolist() == [8, 3, 0, 1, 5, 2, 7, 4, 9, 6]
    assert shuffled(10, seed=1)(0).tolist() == [2, 5, 8, 9, 1, 4, 6, 0, 3, 7]
    assert [piece_score("a.txt", 0), piece_score("a.txt", 1), piece_score("lib/os.py", 0)] == pytest.approx(
        [0.4776813383167493, 0.6610956592967604, 0.6782510650325599], abs=1e-15)


# --------------------------------------------------------------------------- (b) independent of the mesh


def test_global_batch_is_identical_on_every_mesh(batches):
    """Each process's rows, placed by the trainer's batch sharding, make the same global batch on every mesh."""
    assert_same_global_batch_on_every_mesh(lambda mesh: load_config("tiny", SMALL + mesh), batches, (0, 1, 5))


# --------------------------------------------------------------------------- (c) pieces and packing


def _reference_window(stream, piece_start, a, n):
    """Row fields of the window starting at stream index a, written out token by token."""
    inputs, targets, seg, pos, mask = [], [], [], [], []
    for j in range(n):
        inputs.append(stream[a + j])
        targets.append(stream[a + j + 1])
        mask.append(0 if piece_start[a + j + 1] else 1)
        if j == 0:
            seg.append(1)
            pos.append(0)
        else:
            seg.append(seg[-1] + (1 if piece_start[a + j] else 0))
            pos.append(0 if piece_start[a + j] else pos[-1] + 1)
    return {"inputs": inputs, "targets": targets, "segment_ids": seg, "positions": pos, "loss_mask": mask}


def _window(stream, position, window):
    return {k: v[0] for k, v in window_rows(stream, position, window, range(1)).items()}


def test_packing_small_example():
    # Documents [1 2 E] [3 E] [4 5 6 E] [7 E]; windows of 5 tokens (seq_len 4), laid end to end.
    w = _stream_of([[1, 2, E], [3, E], [4, 5, 6, E], [7, E]])
    assert w.epoch_tokens == 11
    first, second, third = (_window(w, i * 5, 5) for i in range(3))
    np.testing.assert_array_equal(first["inputs"], [1, 2, E, 3])
    np.testing.assert_array_equal(first["targets"], [2, E, 3, E])
    np.testing.assert_array_equal(first["loss_mask"], [1, 1, 0, 1])
    np.testing.assert_array_equal(first["segment_ids"], [1, 1, 1, 2])
    np.testing.assert_array_equal(first["positions"], [0, 1, 2, 0])
    # The second window starts at token 5 (4), the start of document 3.
    np.testing.assert_array_equal(second["inputs"], [4, 5, 6, E])
    np.testing.assert_array_equal(second["targets"], [5, 6, E, 7])
    np.testing.assert_array_equal(second["loss_mask"], [1, 1, 1, 0])
    np.testing.assert_array_equal(second["segment_ids"], [1, 1, 1, 1])
    np.testing.assert_array_equal(second["positions"], [0, 1, 2, 3])
    # The third crosses into the next epoch (source order here): the last E, then documents 1 and 2 again.
    np.testing.assert_array_equal(third["inputs"], [E, 1, 2, E])
    np.testing.assert_array_equal(third["targets"], [1, 2, E, 3])
    np.testing.assert_array_equal(third["loss_mask"], [0, 1, 1, 0])
    np.testing.assert_array_equal(third["segment_ids"], [1, 2, 2, 2])
    np.testing.assert_array_equal(third["positions"], [0, 0, 1, 2])


@pytest.mark.parametrize("window", [2, 5, 17, 64])
def test_packing_properties(window):
    rng = np.random.default_rng(window)
    lengths = rng.integers(0, 30, size=60)
    lengths[:3] = 0  # empty documents: just the end-of-document token
    pieces = [np.append(rng.integers(0, 256, size=n), E) for n in lengths]
    one_epoch = np.concatenate(pieces).astype(np.int64)
    stream = np.concatenate([one_epoch, one_epoch])  # source order repeats: windows may cross the seam
    piece_start = np.zeros(len(stream) + 1, bool)
    piece_start[np.concatenate([[0], np.cumsum([len(p) for p in pieces * 2])])] = True

    w = _stream_of(pieces)
    n = window - 1
    for i in range(len(stream) // window):
        row = _window(w, i * window, window)
        a = i * window
        for k in FIELDS:
            assert row[k].shape == (n,) and row[k].dtype == np.int32, k
        # targets are the inputs shifted by one
        np.testing.assert_array_equal(row["inputs"][1:], row["targets"][:-1])
        np.testing.assert_array_equal(row["inputs"], stream[a : a + n])
        np.testing.assert_array_equal(row["targets"], stream[a + 1 : a + n + 1])
        # loss_mask is 0 exactly where the target is the first token of a new document
        np.testing.assert_array_equal(row["loss_mask"] == 0, piece_start[a + 1 : a + n + 1])
        # segment ids start at 1 and step by one at each document start, positions restart there
        starts_here = piece_start[a : a + n].copy()
        assert row["segment_ids"][0] == 1 and row["positions"][0] == 0
        np.testing.assert_array_equal(np.diff(row["segment_ids"]), starts_here[1:].astype(int))
        assert np.all(row["positions"][starts_here] == 0)
        inner = ~starts_here[1:]
        np.testing.assert_array_equal(np.diff(row["positions"])[inner], 1)
        # and the whole row against the token-by-token reference
        ref = _reference_window(stream, piece_start, a, n)
        for k in FIELDS:
            np.testing.assert_array_equal(row[k], ref[k], err_msg=f"window {i} {k}")


def test_documents_are_cut_into_near_equal_pieces():
    doc_lengths = np.array([1, 7, 8, 9, 17, 30], np.int64)
    lengths, doc, index = cut_into_pieces(doc_lengths, 8)
    assert lengths.tolist() == [1, 7, 8, 5, 4, 6, 6, 5, 8, 8, 7, 7]
    assert doc.tolist() == [0, 1, 2, 3, 3, 4, 4, 4, 5, 5, 5, 5]
    assert index.tolist() == [0, 0, 0, 0, 1, 0, 1, 2, 0, 1, 2, 3]
    for d, n in enumerate(doc_lengths):  # each document: whole, in pieces of at most 8 and at least 8/2 (if cut)
        mine = lengths[doc == d]
        assert mine.sum() == n and mine.max() <= 8 and (len(mine) == 1 or mine.min() >= 4)


def test_the_default_piece_is_two_rows_long(batches):
    """data.chunk_tokens=0: pieces of at most 2 * (seq_len + 1), so a batch mixes many places of the corpus."""
    assert batches.pieces.chunk == batches.order["chunk_tokens"] == 2 * (SEQ_LEN + 1)
    assert batches.pieces.lengths.max() == 2 * (SEQ_LEN + 1)
    batch, _ = batches.train_batch(batches.initial_state(), BATCH)
    pieces_seen = batch["segment_ids"].max(axis=1).sum()
    assert pieces_seen >= BATCH  # each row holds at least one piece, most hold two or more


def test_a_piece_of_a_long_document_starts_a_segment(tmp_path):
    text = "".join(chr(ord("a") + i % 26) for i in range(99))  # one document of 100 tokens with its end token
    (tmp_path / "long.txt").write_text(text)
    corpus = load_corpus(_data_cfg(source="text", paths=str(tmp_path / "*.txt")))
    pieces = corpus.pieces(30)
    assert pieces.lengths.tolist() == [25, 25, 25, 25]
    np.testing.assert_array_equal(corpus.tokens[:-1], np.frombuffer(text.encode(), np.uint8))
    stream = PackedStream(corpus.tokens, pieces.starts, pieces.lengths, in_source_order(4))
    row = _window(stream, 10, 31)  # tokens 10..40 of the text: crosses the piece boundary at 25
    np.testing.assert_array_equal(row["inputs"], corpus.tokens[10:40])
    assert row["segment_ids"].tolist() == [1] * 15 + [2] * 15
    assert row["positions"].tolist() == list(range(15)) + list(range(15))
    assert row["loss_mask"].tolist() == [1] * 14 + [0] + [1] * 15


# --------------------------------------------------------------------------- (d) the held-out split


def _lines(n: int, seed: int = 0) -> str:
    rng = np.random.default_rng(seed)
    return "".join(f"line {i}: {'abcdefgh'[: rng.integers(1, 9)] * rng.integers(1, 12)}\n" for i in range(n))


def _held_share(pieces: Pieces) -> float:
    return pieces.split_tokens(True) / len(pieces.corpus.tokens)


def _assert_partition(pieces: Pieces):
    """Every token of the corpus is in exactly one piece, and every piece in exactly one split."""
    covered = np.zeros(len(pieces.corpus.tokens), int)
    for held in (False, True):
        for start, length in zip(*pieces.split(held)):
            covered[start : start + length] += 1
    assert np.all(covered == 1)
    assert pieces.split_tokens(False) + pieces.split_tokens(True) == len(pieces.corpus.tokens)


@pytest.mark.parametrize("eval_fraction", [0.02, 0.1, 0.3])
def test_a_single_text_file_gets_both_splits(tmp_path, monkeypatch, eval_fraction):
    monkeypatch.chdir(tmp_path)  # a relative path: the document's name, hence the split, is the same every run
    (tmp_path / "book.txt").write_text(_lines(40_000))  # about 0.8 million tokens, one document
    cfg = _data_cfg(source="text", paths="book.txt", eval_fraction=eval_fraction, chunk_tokens=1024)
    b = make_batches(cfg, 128, seed=0)
    pieces = b.pieces
    assert len(pieces.lengths) > 700 and pieces.lengths.max() <= 1024
    _assert_partition(pieces)
    assert eval_fraction * 0.6 < _held_share(pieces) < eval_fraction * 1.4
    assert b.held_out.epoch_tokens == pieces.split_tokens(True) > 0
    batch = b.eval_batch(0, 4)
    tokens = pieces.corpus.tokens
    held_text = ByteTokenizer().decode(np.concatenate([tokens[s : s + n] for s, n in zip(*pieces.split(True))]))
    first_row = ByteTokenizer().decode(batch["inputs"][0])
    assert held_text.startswith(first_row)  # eval reads the held-out pieces, in source order
    # Deterministic: loading again draws the same split.
    np.testing.assert_array_equal(load_corpus(cfg).pieces(1024).held_out, pieces.held_out)


def test_jsonl_split_by_pieces_of_records(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    records = [{"text": _lines(40, seed=i)} for i in range(400)]  # about 1,000 tokens each
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    b = make_batches(_data_cfg(source="jsonl", paths="c.jsonl", eval_fraction=0.1, chunk_tokens=256), 64, seed=0)
    pieces = b.pieces
    assert len(pieces.lengths) > 1500
    _assert_partition(pieces)
    assert 0.07 < _held_share(pieces) < 0.13
    # Records are split by piece: some record has pieces on both sides.
    names = [f"c.jsonl:{i + 1}" for i in range(400)]
    doc_lengths = np.array([len(r["text"]) + 1 for r in records], np.int64)
    lengths, doc, index = cut_into_pieces(doc_lengths, 256)
    np.testing.assert_array_equal(lengths, pieces.lengths)
    np.testing.assert_array_equal(held_out_pieces(name_hashes(names), doc, index, 0.1), pieces.held_out)
    mixed = [d for d in range(400) if 0 < pieces.held_out[doc == d].sum() < (doc == d).sum()]
    assert mixed


def test_split_of_a_piece_depends_only_on_its_name_and_index(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.txt").write_text(_lines(5_000, seed=1))
    one = load_corpus(_data_cfg(source="text", paths="a.txt", eval_fraction=0.2)).pieces(512)
    (tmp_path / "b.txt").write_text(_lines(5_000, seed=2))
    two = load_corpus(_data_cfg(source="text", paths="*.txt", eval_fraction=0.2)).pieces(512)
    n = len(one.lengths)
    np.testing.assert_array_equal(two.held_out[:n], one.held_out)  # adding a file moves no piece of the first
    expected = [piece_score("a.txt", i) < 0.2 for i in range(n)]
    assert one.held_out.tolist() == expected
    assert 0 < sum(expected) < n


def test_a_small_corpus_still_holds_one_piece_out():
    names = ["x", "y", "z"]
    doc, index = np.array([0, 1, 2]), np.array([0, 0, 0])
    scores = [piece_score(n, 0) for n in names]
    held = held_out_pieces(name_hashes(names), doc, index, 1e-9)  # nothing would fall below the fraction
    assert held.tolist() == [s == min(scores) for s in scores]
    held = held_out_pieces(name_hashes(names), doc, index, 1 - 1e-9)  # everything would
    assert held.tolist() == [s != max(scores) for s in scores]


# --------------------------------------------------------------------------- (e) text and jsonl sources


def _text(i: int) -> str:
    return f"text file {i}: {'é' * (i % 3)} {'word ' * (5 + i % 7)}\n"


def test_text_source(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    expected, a_files, b_files = {}, [], []
    for i in range(40):
        path = tmp_path / ("a" if i % 2 else "b") / f"doc{i:02d}.txt"
        path.write_text(_text(i), encoding="utf-8")
        expected[str(path)] = _text(i).encode("utf-8")
        (a_files if i % 2 else b_files).append(str(path))
    (tmp_path / "a" / "ignored.md").write_text("not matched")
    cfg = _data_cfg(source="text", paths=f"{tmp_path}/a/*.txt, {tmp_path}/b/*.txt", eval_fraction=0.3,
                    chunk_tokens=4096)

    docs = source_documents(cfg)
    assert [name for name, _ in docs] == sorted(a_files) + sorted(b_files)  # globs in order, each sorted
    assert all(content == expected[name] for name, content in docs)

    b = make_batches(cfg, 16, seed=0)
    tok = get_tokenizer("byte")
    np.testing.assert_array_equal(
        b.corpus.tokens, np.concatenate([np.append(tok.encode(c), tok.eos_id) for _, c in docs])
    )
    # Short documents are one piece each, held out by a hash of their name.
    assert b.pieces.held_out.tolist() == [piece_score(n, 0) < 0.3 for n, _ in docs]
    for stream, held in ((b.train, False), (b.held_out, True)):
        mine = [np.append(tok.encode(c), tok.eos_id).astype(np.uint16) for n, c in docs
                if (piece_score(n, 0) < 0.3) == held]
        tokens, _, _ = stream.read(0, stream.epoch_tokens)
        assert sorted(t.tobytes() for t in mine) == sorted(  # the same documents, in some order
            tokens[a:b].tobytes() for a, b in _piece_bounds(stream))
    state = b.advance(b.initial_state(), 4)
    batch, _ = b.train_batch(state, 4)
    assert batch["inputs"].shape == (4, 16)
    _assert_same(batch, make_batches(cfg, 16, seed=0).train_batch(state, 4)[0])


def _piece_bounds(stream):
    _, first, _ = stream.read(0, stream.epoch_tokens)
    cuts = list(np.flatnonzero(first)) + [stream.epoch_tokens]
    return list(zip(cuts[:-1], cuts[1:]))


def test_jsonl_source_with_custom_field(tmp_path):
    lines = [json.dumps({"id": i, "body": f"record {i} — naïve café {'x' * i}"}, ensure_ascii=False) for i in range(60)]
    lines.insert(10, "")  # blank lines are skipped
    lines.insert(20, "   ")
    path = tmp_path / "corpus.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    cfg = _data_cfg(source="jsonl", paths=str(tmp_path / "*.jsonl"), jsonl_field="body", eval_fraction=0.25)

    docs = source_documents(cfg)
    assert len(docs) == 60
    assert docs[0] == (f"{path}:1", "record 0 — naïve café ")
    assert docs[15] == (f"{path}:17", f"record 15 — naïve café {'x' * 15}")  # line numbers count blank lines
    b = make_batches(cfg, 16, seed=0)
    assert b.train.epoch_tokens > 0 and b.held_out.epoch_tokens > 0
    text = ByteTokenizer().decode(b.corpus.tokens)
    assert text == "".join(c for _, c in docs)

    with pytest.raises(UserError, match=r"is not a JSON object with a string 'text' field"):
        source_documents(_data_cfg(source="jsonl", paths=str(path)))  # default field name: absent


@pytest.mark.parametrize(
    "bad_line",
    ['{"text": "unterminated', "[1, 2, 3]", '"just a string"', '{"other": "x"}', '{"text": 5}', '{"text": null}'],
)
def test_malformed_jsonl_line_names_file_and_line(tmp_path, bad_line):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "fine"}\n\n' + bad_line + '\n{"text": "also fine"}\n')
    with pytest.raises(UserError, match="^" + re.escape(f"{path}:3") + " is not a JSON object") as excinfo:
        source_documents(_data_cfg(source="jsonl", paths=str(path)))
    assert "\n" not in str(excinfo.value)


def test_data_user_errors(tmp_path):
    with pytest.raises(UserError, match=r"data\.paths='/nonexistent/\*\.txt' matched no files"):
        source_documents(_data_cfg(source="text", paths="/nonexistent/*.txt"))
    (tmp_path / "ok.txt").write_text("x")
    with pytest.raises(UserError, match=r"matched no files"):  # one pattern of several matching nothing
        source_documents(_data_cfg(source="text", paths=f"{tmp_path}/ok.txt,{tmp_path}/missing*.txt"))
    with pytest.raises(UserError, match=r"^data\.chunk_tokens=-1 must be a number of tokens, or 0 for 2 \* "):
        make_batches(_data_cfg(source="text", paths=str(tmp_path / "ok.txt"), chunk_tokens=-1), 16, seed=0)


def _one_sentence(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message and message.endswith(".")
    return message


def test_a_corpus_too_small_says_what_would_fit(tmp_path, monkeypatch):
    """Each message gives the token counts and settings that work; following its advice works."""
    monkeypatch.chdir(tmp_path)  # relative paths: the same names, hence the same split, every run
    (tmp_path / "short.txt").write_text("too short")  # 10 tokens: one piece
    cfg = _data_cfg(source="text", paths="short.txt", eval_fraction=0.5)
    for chunk, piece in ((0, 130), (4096, 4096)):  # the default, 2 * (seq_len + 1), or as set
        cfg.chunk_tokens = chunk
        with pytest.raises(UserError) as excinfo:
            make_batches(cfg, 64, seed=0)
        assert _one_sentence(excinfo) == (
            f"data.source='text' holds 10 tokens, one piece of at most {piece} tokens (data.chunk_tokens), so "
            f"none can be held out for eval; train.seq_len=3 with data.chunk_tokens=0 cuts it in two, or add data."
        )
    cfg.chunk_tokens = 0
    b = make_batches(cfg, 3, seed=0)
    assert b.pieces.lengths.tolist() == [5, 5]
    assert b.train.epoch_tokens == b.held_out.epoch_tokens == 5

    (tmp_path / "book.txt").write_text("y" * 19_999)  # 20,000 tokens: 5 pieces of 4,000, one held out
    cfg = _data_cfg(source="text", paths="book.txt", eval_fraction=0.02, chunk_tokens=4096)
    with pytest.raises(UserError) as excinfo:
        make_batches(cfg, 8191, seed=0)
    assert _one_sentence(excinfo) == (
        "the held-out split of data.source='text' has 4,000 of the corpus's 20,000 tokens, fewer than "
        "train.seq_len+1=8192; train.seq_len=3999 or less fits it, or raise data.eval_fraction, or add data."
    )
    b = make_batches(cfg, 3999, seed=0)
    assert b.held_out.epoch_tokens == 4000 and b.train.epoch_tokens == 16_000

    cfg.eval_fraction = 0.99  # now the training split is the small one
    with pytest.raises(UserError, match=r"^the training split of data\.source='text' has 4,000 of the corpus's "
                                        r"20,000 tokens, .*train\.seq_len=3999 or less fits it, or lower "
                                        r"data\.eval_fraction, or add data\.$"):
        make_batches(cfg, 8191, seed=0)

    (tmp_path / "empty.jsonl").write_text("\n  \n")
    with pytest.raises(UserError) as excinfo:
        make_batches(_data_cfg(source="jsonl", paths="empty.jsonl"), 16, seed=0)
    assert _one_sentence(excinfo) == (
        "data.source='jsonl' holds only 0 tokens, too few to train on and hold some out for eval; add data."
    )


# --------------------------------------------------------------------------- (f) tokenizer


def test_byte_tokenizer_roundtrip():
    tok = get_tokenizer("byte")
    assert tok.vocab_size == 257 and tok.eos_id == 256
    for text in ["", "plain ascii", "héllo wörld — ∑ 日本語 🚀\n\ttabs", "\x00 nul and \u00ff"]:
        ids = tok.encode(text)
        assert ids.max(initial=0) < 256
        assert len(ids) == len(text.encode("utf-8"))
        assert tok.decode(ids) == text
        np.testing.assert_array_equal(tok.encode(text.encode("utf-8")), ids)  # bytes in: the same tokens
        assert tok.decode(np.append(ids, tok.eos_id)) == text  # the end-of-document token decodes to nothing
    assert list(tok.encode("é")) == [0xC3, 0xA9]
