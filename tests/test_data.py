"""The data pipeline: deterministic global batches, independent of the mesh; packing; sources; tokenizer."""

from __future__ import annotations

import json
import re

import jax
import numpy as np
import pytest

from ushard.config import default_config, load_config
from ushard.data import make_batches
from ushard.data.pipeline import FIELDS, Batches, PackedWindows, is_held_out
from ushard.data.sources import documents
from ushard.data.tokenizer import ByteTokenizer, get_tokenizer
from ushard.errors import UserError

SEQ_LEN = 32
BATCH = 8
SMALL = [f"train.batch_size={BATCH}", f"train.seq_len={SEQ_LEN}"]


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
    if shared is not None and shared.train_windows.window == SEQ_LEN + 1:
        return shared
    return make_batches(tiny_config.data, SEQ_LEN, tiny_config.train.seed)


def _assert_same(a: dict, b: dict):
    assert set(a) == set(b) == set(FIELDS)
    for k in FIELDS:
        np.testing.assert_array_equal(np.asarray(a[k]), np.asarray(b[k]), err_msg=k)


# --------------------------------------------------------------------------- (a) determinism


def test_batch_shape_and_dtype(batches):
    batch = batches.train_batch(0, BATCH)
    for k in FIELDS:
        assert batch[k].shape == (BATCH, SEQ_LEN), k
        assert batch[k].dtype == np.int32, k
    assert batch["inputs"].max() < 257 and batch["inputs"].min() >= 0
    assert set(np.unique(batch["loss_mask"])) <= {0, 1}


def test_global_batch_depends_only_on_config_seed_and_step(tiny_config, batches):
    steps = (0, 1, 7, 1234)
    rebuilt = make_batches(tiny_config.data, SEQ_LEN, tiny_config.train.seed)  # from scratch
    for s in steps:
        _assert_same(batches.train_batch(s, BATCH), rebuilt.train_batch(s, BATCH))
        _assert_same(batches.eval_batch(s, BATCH), rebuilt.eval_batch(s, BATCH))
    # Asking in another order, or twice, gives the same answer: no hidden iterator state.
    for s in reversed(steps):
        _assert_same(batches.train_batch(s, BATCH), rebuilt.train_batch(s, BATCH))

    # Another seed draws another order over the same windows (reused here: loading is what costs time).
    other = Batches(batches.train_windows, batches.eval_windows, seed=tiny_config.train.seed + 1)
    for s in steps:
        assert not np.array_equal(batches.train_batch(s, BATCH)["inputs"], other.train_batch(s, BATCH)["inputs"])

    # Consecutive steps see different windows.
    assert not np.array_equal(batches.train_batch(0, BATCH)["inputs"], batches.train_batch(1, BATCH)["inputs"])


def test_row_slices_concatenate_to_the_global_batch(batches):
    """Each process builds only its own rows; together they are the global batch."""
    for s in (0, 3):
        full = batches.train_batch(s, BATCH)
        halves = [batches.train_batch(s, BATCH, rows=range(0, 4)), batches.train_batch(s, BATCH, rows=range(4, 8))]
        quarters = [batches.train_batch(s, BATCH, rows=range(i, i + 2)) for i in range(0, BATCH, 2)]
        for parts in (halves, quarters):
            _assert_same(full, {k: np.concatenate([p[k] for p in parts]) for k in FIELDS})
        _assert_same(
            batches.eval_batch(s, BATCH),
            {k: np.concatenate([batches.eval_batch(s, BATCH, rows=range(i, i + 4))[k] for i in (0, 4)]) for k in FIELDS},
        )


def test_every_window_once_per_epoch_and_reshuffled():
    """The order is a permutation of the windows in each epoch, re-drawn for the next epoch."""
    rng = np.random.default_rng(0)
    pieces = [np.append(rng.integers(0, 256, size=rng.integers(5, 40)), 256).astype(np.uint16) for _ in range(40)]
    windows = PackedWindows(pieces, 9)
    n = len(windows)
    b = Batches(windows, windows, seed=3)
    starts = {windows[i]["inputs"].tobytes(): i for i in range(n)}
    assert len(starts) == n  # the windows themselves are all distinct here
    epochs = [[starts[b.train_batch(s, 1)["inputs"][0].tobytes()] for s in range(e * n, (e + 1) * n)] for e in (0, 1)]
    assert sorted(epochs[0]) == sorted(epochs[1]) == list(range(n))
    assert epochs[0] != epochs[1]
    assert epochs[0] != list(range(n))


# --------------------------------------------------------------------------- (b) independent of the mesh


MESHES = {
    "fsdp8": ["mesh.fsdp=8"],
    "data2_fsdp4": ["mesh.data=2", "mesh.fsdp=4"],
    "data8": ["mesh.data=8", "mesh.fsdp=1"],
    "tensor2_fsdp4": ["mesh.tensor=2", "mesh.fsdp=4"],
    "one_device": ["mesh.fsdp=-1"],
}


def test_global_batch_is_identical_on_every_mesh(batches):
    from ushard.training.loop import Trainer

    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices: run with JAX_NUM_CPU_DEVICES=8")
    steps = (0, 1, 5)
    results = {}
    for name, overrides in MESHES.items():
        devices = jax.devices()[:1] if name == "one_device" else jax.devices()[:8]
        trainer = Trainer(load_config("tiny", SMALL + overrides), None, devices=devices, batches=batches)
        assert trainer.setup.mesh.size == len(devices)
        results[name] = []
        for s in steps:
            arrays = trainer.global_batch(s)
            assert set(arrays) == set(FIELDS)
            for k, array in arrays.items():
                assert array.shape == (BATCH, SEQ_LEN), (name, k)
                full = np.asarray(array)
                # every device holds exactly its slice of the global batch
                for shard in array.addressable_shards:
                    np.testing.assert_array_equal(np.asarray(shard.data), full[shard.index], err_msg=f"{name} {k}")
            results[name].append({k: np.asarray(v) for k, v in arrays.items()})

    reference = results.pop("one_device")
    for s, ref in enumerate(reference):
        _assert_same(ref, batches.train_batch(steps[s], BATCH))
    for name, per_step in results.items():
        for ref, got in zip(reference, per_step):
            _assert_same(ref, got)


# --------------------------------------------------------------------------- (c) packing


def _reference_window(stream, doc_start, a, n):
    """Row fields of the window starting at stream index a, written out token by token."""
    inputs, targets, seg, pos, mask = [], [], [], [], []
    for j in range(n):
        inputs.append(stream[a + j])
        targets.append(stream[a + j + 1])
        mask.append(0 if doc_start[a + j + 1] else 1)
        if j == 0:
            seg.append(1)
            pos.append(0)
        else:
            seg.append(seg[-1] + (1 if doc_start[a + j] else 0))
            pos.append(0 if doc_start[a + j] else pos[-1] + 1)
    return {"inputs": inputs, "targets": targets, "segment_ids": seg, "positions": pos, "loss_mask": mask}


def test_packing_small_example():
    # Documents [1 2 E] [3 E] [4 5 6 E] [7 E] with E = 256; windows of 5 tokens (seq_len 4).
    E = 256
    pieces = [np.array(p, np.uint16) for p in ([1, 2, E], [3, E], [4, 5, 6, E], [7, E])]
    w = PackedWindows(pieces, 5)
    assert len(w) == 2  # 11 tokens: two windows, the last token dropped
    first, second = w[0], w[1]
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


@pytest.mark.parametrize("window", [2, 5, 17, 64])
def test_packing_properties(window):
    rng = np.random.default_rng(window)
    tok = ByteTokenizer()
    lengths = rng.integers(0, 30, size=60)
    lengths[:3] = 0  # empty documents: just the end-of-document token
    pieces = [np.concatenate([rng.integers(0, 256, size=n).astype(np.uint16), [tok.eos_id]]) for n in lengths]
    stream = np.concatenate(pieces).astype(np.int64)
    doc_start = np.zeros(len(stream) + 1, bool)
    doc_start[np.concatenate([[0], np.cumsum([len(p) for p in pieces])[:-1]])] = True

    w = PackedWindows(pieces, window)
    n = window - 1
    assert len(w) == len(stream) // window
    for i in range(len(w)):
        row = w[i]
        a = i * window
        for k in FIELDS:
            assert row[k].shape == (n,) and row[k].dtype == np.int32, k
        # targets are the inputs shifted by one
        np.testing.assert_array_equal(row["inputs"][1:], row["targets"][:-1])
        np.testing.assert_array_equal(row["inputs"], stream[a : a + n])
        np.testing.assert_array_equal(row["targets"], stream[a + 1 : a + n + 1])
        # loss_mask is 0 exactly where the target is the first token of a new document
        np.testing.assert_array_equal(row["loss_mask"] == 0, doc_start[a + 1 : a + n + 1])
        # segment ids start at 1 and step by one at each document start, positions restart there
        starts_here = doc_start[a : a + n].copy()
        assert row["segment_ids"][0] == 1 and row["positions"][0] == 0
        np.testing.assert_array_equal(np.diff(row["segment_ids"]), starts_here[1:].astype(int))
        assert np.all(row["positions"][starts_here] == 0)
        inner = ~starts_here[1:]
        np.testing.assert_array_equal(np.diff(row["positions"])[inner], 1)
        # and the whole row against the token-by-token reference
        ref = _reference_window(stream, doc_start, a, n)
        for k in FIELDS:
            np.testing.assert_array_equal(row[k], ref[k], err_msg=f"window {i} {k}")


def test_packing_empty_corpus_has_no_windows():
    assert len(PackedWindows([], 9)) == 0


# --------------------------------------------------------------------------- (d) text and jsonl sources


def _data_cfg(**values):
    c = default_config().data
    for k, v in values.items():
        c[k] = v
    return c


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
    cfg = _data_cfg(source="text", paths=f"{tmp_path}/a/*.txt, {tmp_path}/b/*.txt", eval_fraction=0.3)

    docs = list(documents(cfg))
    assert [name for name, _ in docs] == sorted(a_files) + sorted(b_files)  # globs in order, each sorted
    assert all(content == expected[name] for name, content in docs)

    b = make_batches(cfg, 16, seed=0)
    tok = get_tokenizer("byte")
    for windows, held in ((b.train_windows, False), (b.eval_windows, True)):
        stream = np.concatenate(
            [np.concatenate([tok.encode(c), [tok.eos_id]]) for n, c in docs if is_held_out(n, 0.3) == held]
        )
        np.testing.assert_array_equal(windows.tokens, stream)
    batch = b.train_batch(2, 4)
    assert batch["inputs"].shape == (4, 16)
    _assert_same(batch, make_batches(cfg, 16, seed=0).train_batch(2, 4))


def test_jsonl_source_with_custom_field(tmp_path):
    lines = [json.dumps({"id": i, "body": f"record {i} — naïve café {'x' * i}"}, ensure_ascii=False) for i in range(60)]
    lines.insert(10, "")  # blank lines are skipped
    lines.insert(20, "   ")
    path = tmp_path / "corpus.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    cfg = _data_cfg(source="jsonl", paths=str(tmp_path / "*.jsonl"), jsonl_field="body", eval_fraction=0.25)

    docs = list(documents(cfg))
    assert len(docs) == 60
    assert docs[0] == (f"{path}:1", "record 0 — naïve café ")
    assert docs[15] == (f"{path}:17", f"record 15 — naïve café {'x' * 15}")  # line numbers count blank lines
    b = make_batches(cfg, 16, seed=0)
    assert len(b.train_windows) > 0 and len(b.eval_windows) > 0
    text = ByteTokenizer().decode(np.concatenate([b.train_windows.tokens, b.eval_windows.tokens]))
    assert "naïve café" in text

    with pytest.raises(UserError, match=r"is not a JSON object with a string 'text' field"):
        list(documents(_data_cfg(source="jsonl", paths=str(path))))  # default field name: absent


@pytest.mark.parametrize(
    "bad_line",
    ['{"text": "unterminated', "[1, 2, 3]", '"just a string"', '{"other": "x"}', '{"text": 5}', '{"text": null}'],
)
def test_malformed_jsonl_line_names_file_and_line(tmp_path, bad_line):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "fine"}\n\n' + bad_line + '\n{"text": "also fine"}\n')
    with pytest.raises(UserError, match="^" + re.escape(f"{path}:3") + " is not a JSON object") as excinfo:
        list(documents(_data_cfg(source="jsonl", paths=str(path))))
    assert "\n" not in str(excinfo.value)


def test_data_user_errors(tmp_path):
    with pytest.raises(UserError, match=r"data\.paths='/nonexistent/\*\.txt' matched no files"):
        list(documents(_data_cfg(source="text", paths="/nonexistent/*.txt")))
    (tmp_path / "ok.txt").write_text("x")
    with pytest.raises(UserError, match=r"matched no files"):  # one pattern of several matching nothing
        list(documents(_data_cfg(source="text", paths=f"{tmp_path}/ok.txt,{tmp_path}/missing*.txt")))
    (tmp_path / "short.txt").write_text("too short")
    with pytest.raises(UserError, match=r"fewer than train\.seq_len\+1=65 tokens"):
        make_batches(_data_cfg(source="text", paths=str(tmp_path / "*.txt"), eval_fraction=0.5), 64, seed=0)


# --------------------------------------------------------------------------- (e) tokenizer


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
