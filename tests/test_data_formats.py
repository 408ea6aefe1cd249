"""Data beyond bytes and JSONL: a Hugging Face tokenizer.json, Parquet, pre-tokenized .npy token files,
weighted mixtures; and the determinism contract for a run with an HF tokenizer and Parquet data."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import ushard
from conftest import assert_same_global_batch_on_every_mesh, data_config, small_config
from helpers import source_documents
from ushard.config import check_settings, load_config
from ushard.data import make_batches
from ushard.data.corpus import load_corpus
from ushard.data.pipeline import Batches
from ushard.data.tokenizer import get_tokenizer
from ushard.errors import UserError

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex jolly dwarves".split()


def _texts(n: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=rng.integers(5, 60))) + "." for _ in range(n)]


def _write_tokenizer(path, special=("</s>",)) -> str:
    """A byte-level BPE of about 300 tokens trained on _texts, saved as a tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=list(special),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_texts(200, seed=0), trainer)
    tok.save(str(path))
    return str(path)


def _write_parquet(path, texts, row_group_size=None, column="text"):
    pq.write_table(pa.table({column: texts, "id": list(range(len(texts)))}), str(path), row_group_size=row_group_size)
    return str(path)


@pytest.fixture(scope="module")
def hf_data(tmp_path_factory):
    """A tokenizer.json and two Parquet files (the first in several row groups, with a null row)."""
    root = tmp_path_factory.mktemp("hf_data")
    texts = _texts(60, seed=1)
    _write_parquet(root / "a.parquet", texts[:40] + [None], row_group_size=16)
    _write_parquet(root / "b.parquet", texts[40:])
    return {"tokenizer": _write_tokenizer(root / "tokenizer.json"), "paths": str(root / "*.parquet"), "texts": texts}




# --------------------------------------------------------------------------- Hugging Face tokenizer


def test_hf_tokenizer_encodes_decodes_and_ends_documents(hf_data):
    tok = get_tokenizer(hf_data["tokenizer"])
    assert tok.vocab_size == 300 and tok.eos_id == 0  # the special token comes first
    ids = tok.encode("the lazy dog jumps")
    assert ids.dtype == np.uint16 and 0 < len(ids) < len("the lazy dog jumps") and tok.eos_id not in ids
    assert tok.decode(ids) == "the lazy dog jumps"
    assert tok.decode(tok.encode(b"over seven wizards")) == "over seven wizards"  # bytes from text files
    # Streaming decode (ushard sample) gives the same text, whole characters only.
    stream = tok.incremental_decoder()
    ids = tok.encode("fox é dwarves")
    assert "".join(stream(int(t)) for t in ids) + stream(None, final=True) == "fox é dwarves"
    assert get_tokenizer(hf_data["tokenizer"]) is tok  # read once


def test_hf_tokenizer_vocab_size_checked_against_the_model(hf_data):
    config = load_config("tiny", {"data.tokenizer": hf_data["tokenizer"], "model.vocab_size": 256})
    with pytest.raises(UserError, match=r"^model.vocab_size=256 is smaller than the '.*tokenizer.json' tokenizer's "
                                        r"300 tokens; use at least that.$"):
        check_settings(config)
    config.model.vocab_size = 320
    check_settings(config)


def test_hf_tokenizer_mistakes_are_one_sentence(tmp_path, hf_data):
    with pytest.raises(UserError, match="is neither 'byte' nor a Hugging Face tokenizer.json"):
        get_tokenizer(str(tmp_path / "missing.json"))
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(UserError, match=r"is not a Hugging Face tokenizer.json \("):
        get_tokenizer(str(tmp_path / "bad.json"))
    no_eos = _write_tokenizer(tmp_path / "no_eos.json", special=("<pad>",))
    with pytest.raises(UserError, match=r"has none of the end-of-document tokens <\|end_of_text\|>, .*</s>"):
        get_tokenizer(no_eos)
    # A directory holding a tokenizer.json names it too.
    assert get_tokenizer(str(tmp_path.parent / hf_data["tokenizer"].split("/")[-2])).vocab_size == 300


# --------------------------------------------------------------------------- Parquet


def test_parquet_rows_are_documents_in_order(hf_data):
    docs = source_documents(data_config(source="parquet", paths=hf_data["paths"]))
    texts = hf_data["texts"]
    assert [text for _, text in docs] == texts  # row groups in order, the null row skipped
    assert docs[0][0].endswith("a.parquet:0") and docs[40][0].endswith("b.parquet:0")


def test_parquet_mistakes_are_one_sentence(tmp_path):
    _write_parquet(tmp_path / "body.parquet", ["x"], column="body")
    with pytest.raises(UserError, match=r"has no column 'text' \(data.parquet_column names the text column\); "
                                        r"its columns: body, id.$"):
        source_documents(data_config(source="parquet", paths=str(tmp_path / "body.parquet")))
    with pytest.raises(UserError, match=r"column 'id' holds int64, not text"):
        source_documents(data_config(source="parquet", paths=str(tmp_path / "body.parquet"), parquet_column="id"))
    (tmp_path / "junk.parquet").write_bytes(b"not parquet")
    with pytest.raises(UserError, match=r"^cannot read .*junk.parquet as Parquet: "):
        source_documents(data_config(source="parquet", paths=str(tmp_path / "junk.parquet")))


# --------------------------------------------------------------------------- token files


def test_token_files_split_at_eos_memory_mapped(tmp_path):
    np.save(tmp_path / "one.npy", np.array([5, 6, 256, 7, 256, 256, 8, 9, 10, 256], np.uint16))
    corpus = load_corpus(data_config(source="tokens", paths=str(tmp_path / "one.npy")))
    assert isinstance(corpus.tokens, np.memmap)  # used in place, never read into memory whole
    assert corpus.doc_lengths.tolist() == [3, 2, 1, 4]
    assert corpus.names[1].endswith("one.npy:1")
    # Several files (the last document of one without its EOS) are read as one array, still mapped;
    # one EOS is added.
    np.save(tmp_path / "two.npy", np.array([1, 2, 256, 3], np.uint32))
    corpus = load_corpus(data_config(source="tokens", paths=str(tmp_path / "*.npy")))
    assert all(isinstance(part, np.memmap) for part in corpus.tokens.parts[:2])
    assert corpus.tokens[:].tolist() == [5, 6, 256, 7, 256, 256, 8, 9, 10, 256, 1, 2, 256, 3, 256]
    assert corpus.tokens[np.array([[11, 9], [14, 0]])].tolist() == [[2, 256], [256, 5]]
    assert corpus.doc_lengths.tolist() == [3, 2, 1, 4, 3, 2]


def test_batches_of_token_files_are_those_of_their_tokens_in_memory(two_sources):
    data = data_config(source="tokens", paths=two_sources, eval_fraction=0.05)
    mapped = make_batches(data, 31, seed=3)
    in_memory = Batches(dataclasses.replace(mapped.corpus, tokens=mapped.corpus.tokens[:]), 31, seed=3)
    assert type(mapped.corpus.tokens).__name__ == "ConcatenatedTokens" and in_memory.order == mapped.order
    state = mapped.initial_state()
    for _ in range(3):
        (got, state), (expected, _) = mapped.train_batch(state, 8), in_memory.train_batch(state, 8)
        for k in expected:
            np.testing.assert_array_equal(got[k], expected[k], err_msg=k)


def test_token_file_mistakes_are_one_sentence(tmp_path):
    np.save(tmp_path / "big.npy", np.array([1, 300, 256], np.int32))
    with pytest.raises(UserError, match=r"holds token id 300 at index 1, outside data.tokenizer's vocabulary of 257"):
        load_corpus(data_config(source="tokens", paths=str(tmp_path / "big.npy")))
    np.save(tmp_path / "flat.npy", np.zeros((2, 3), np.uint16))
    with pytest.raises(UserError, match=r"holds a 2-D uint16 array; data.source='tokens' needs a 1-D array"):
        load_corpus(data_config(source="tokens", paths=str(tmp_path / "flat.npy")))
    (tmp_path / "text.npy").write_text("hello")
    with pytest.raises(UserError, match=r"cannot read .*text.npy as a .npy array of token ids"):
        load_corpus(data_config(source="tokens", paths=str(tmp_path / "text.npy")))


# --------------------------------------------------------------------------- mixtures


@pytest.fixture(scope="module")
def two_sources(tmp_path_factory):
    """Two glob components of token files: 'small' with 1/5 of the tokens, 'large' with 4/5."""
    root = tmp_path_factory.mktemp("mixture")
    rng = np.random.default_rng(0)
    for name, docs in (("small", 40), ("large", 160)):
        (root / name).mkdir()
        tokens = np.concatenate([np.append(rng.integers(0, 256, 49), 256) for _ in range(docs)]).astype(np.uint16)
        np.save(root / name / "part.npy", tokens)
    return f"{root}/small/*.npy,{root}/large/*.npy"


def _component_share(batches) -> float:
    """The share of an epoch's training tokens that come from component 0."""
    corpus, pieces = batches.corpus, batches.pieces
    of_piece = dict(zip(pieces.starts.tolist(), corpus.components[pieces.doc].tolist()))
    starts, lengths = pieces.training()
    first = np.array([of_piece[s] == 0 for s in starts.tolist()])
    return float(lengths[first].sum() / lengths.sum())


def _natural_share(batches) -> float:
    """Component 0's share of the training split's tokens, each piece counted once."""
    pieces = batches.pieces
    kept = ~pieces.held_out
    first = batches.corpus.components[pieces.doc[kept]] == 0
    return float(pieces.lengths[kept][first].sum() / pieces.lengths[kept].sum())


@pytest.mark.parametrize("weights, share", [("", None), ("1,1", 0.5), ("0.7,0.3", 0.7), ("1,9", 0.1)])
def test_mixture_weights_set_each_components_share(two_sources, weights, share):
    data = data_config(source="tokens", paths=two_sources, weights=weights, eval_fraction=0.05)
    batches = make_batches(data, 31, seed=3)
    if share is None:
        # Unweighted, each training piece comes once. Which pieces are held out hangs on the documents'
        # names, here temporary paths, so the split's share is near the files' 1/5 but not exactly it.
        share = _natural_share(batches)
        assert share == pytest.approx(0.2, abs=0.04)
    assert _component_share(batches) == pytest.approx(share, abs=0.01)
    again = make_batches(data, 31, seed=3)  # the epoch's pieces depend only on the settings
    np.testing.assert_array_equal(again.train.starts, batches.train.starts)
    assert ("weights" in batches.order) == bool(weights)


def test_mixture_mistakes_are_one_sentence(two_sources):
    for weights, message in (("1", r"has 1 weights but data.paths has 2 globs; give one weight per"),
                             ("1,-2", r"is not a comma-separated list of positive numbers"),
                             ("1,x", r"is not a comma-separated list of positive numbers")):
        config = load_config("tiny", {"data.source": "tokens", "data.paths": two_sources, "data.weights": weights})
        with pytest.raises(UserError, match=f"^data.weights={weights!r} {message}"):
            check_settings(config)


# --------------------------------------------------------------------------- the contract, end to end

SEQ = 32


def _hf_parquet_config(hf_data, mesh=(), **overrides):
    settings = {"data.source": "parquet", "data.paths": hf_data["paths"], "data.tokenizer": hf_data["tokenizer"],
                "model.vocab_size": 320, "train.seq_len": SEQ, "data.eval_fraction": 0.1, **overrides}
    config = small_config(**settings)
    ushard.config.apply_overrides(config, list(mesh))
    return config


@pytest.fixture(scope="module")
def hf_batches(hf_data):
    config = _hf_parquet_config(hf_data)
    return make_batches(config.data, SEQ, config.train.seed)


def test_hf_parquet_batches_are_the_same_on_every_mesh(hf_data, hf_batches):
    assert_same_global_batch_on_every_mesh(lambda mesh: _hf_parquet_config(hf_data, mesh), hf_batches, (0, 1, 4))


def test_hf_parquet_resume_goes_on_at_the_next_token(hf_data, hf_batches):
    """A resumed run (the data state through JSON, the corpus loaded again) reads the straight run's batches."""
    straight, state = [], hf_batches.initial_state()
    for _ in range(6):
        batch, state = hf_batches.train_batch(state, 16)
        straight.append(batch)
    state = hf_batches.initial_state()
    for _ in range(3):
        state = hf_batches.advance(state, 16)
    config = _hf_parquet_config(hf_data)
    resumed = make_batches(config.data, SEQ, config.train.seed)
    state = resumed.check_resume(json.loads(json.dumps(state)), restart=False)
    for expected in straight[3:]:
        batch, state = resumed.train_batch(state, 16)
        for k in expected:
            np.testing.assert_array_equal(batch[k], expected[k], err_msg=k)
    assert int(straight[0]["inputs"].max()) < 300 and (straight[0]["targets"] == 0).any()  # BPE ids, EOS 0


def test_hf_parquet_run_trains(hf_data):
    config = _hf_parquet_config(hf_data, ["mesh.fsdp=8"], **{"train.steps": 4, "train.lr": 1e-2})
    losses = [row["loss"] for row in ushard.train(config, log=lambda *_: None)]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0] - 0.3
