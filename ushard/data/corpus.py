"""The corpus: every document tokenized, then cut into pieces, each in the training or held-out split.

A document (its tokens and its end-of-document token) is cut into ceil(n / chunk) pieces of
near-equal length, so no piece is a stray tail of a few tokens. The piece, not the document, is the
unit of the held-out split and of shuffling:
- the split works for any corpus, a single file included: piece i of document `name` is held out
  when a hash of (name, i) falls below data.eval_fraction. About that share of the tokens is held
  out, and a piece's side depends only on its name, its index and the chunk, never on the run;
- attention never spans two pieces, and a batch of consecutive windows mixes only about
  batch_size * (seq_len + 1) / chunk pieces: pieces about as long as a row keep both (see
  pipeline.py for the default).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import zlib

import numpy as np

from ushard.data.sources import documents
from ushard.data.tokenizer import get_tokenizer
from ushard.errors import UserError


@dataclasses.dataclass(frozen=True, eq=False)
class Corpus:
    """Every document of the source, tokenized, in source order: what the data files hold."""

    tokens: np.ndarray  # each document's tokens and its end token
    names: list[str]
    doc_lengths: np.ndarray  # tokens of each document, its end token included
    settings: dict  # the data settings that decided all of it, and eval_fraction

    @functools.cached_property
    def checksum(self) -> int:
        """CRC-32 of the tokens and the document lengths."""
        return zlib.crc32(self.doc_lengths.astype("<i8").tobytes(), zlib.crc32(np.ascontiguousarray(self.tokens)))

    @functools.cached_property
    def name_hashes(self) -> np.ndarray:
        return name_hashes(self.names)

    def pieces(self, chunk: int) -> Pieces:
        lengths, doc, index = cut_into_pieces(self.doc_lengths, chunk)
        held = held_out_pieces(self.name_hashes, doc, index, self.settings["eval_fraction"])
        return Pieces(self, np.cumsum(lengths) - lengths, lengths, held, chunk)


@dataclasses.dataclass(frozen=True, eq=False)
class Pieces:
    """The corpus cut into pieces of at most `chunk` tokens, each in the training or held-out split."""

    corpus: Corpus
    starts: np.ndarray  # piece i is corpus.tokens[starts[i] : starts[i] + lengths[i]]
    lengths: np.ndarray
    held_out: np.ndarray  # per piece: in the held-out split
    chunk: int

    def split(self, held_out: bool) -> tuple[np.ndarray, np.ndarray]:
        """(starts, lengths) of the pieces of one split, in source order."""
        keep = self.held_out == held_out
        return self.starts[keep], self.lengths[keep]

    def split_tokens(self, held_out: bool) -> int:
        return int(self.split(held_out)[1].sum())

    def checksum(self) -> int:
        """CRC-32 of the corpus and the split: whatever the data files hold now, and which side each piece is."""
        return zlib.crc32(self.held_out.tobytes(), self.corpus.checksum)


def cut_into_pieces(doc_lengths: np.ndarray, chunk: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(length, document, index within the document) of each piece, in source order."""
    per_doc = -(-doc_lengths // chunk)
    doc = np.repeat(np.arange(len(doc_lengths)), per_doc)
    index = np.arange(int(per_doc.sum())) - np.repeat(np.cumsum(per_doc) - per_doc, per_doc)
    n, k = doc_lengths[doc], per_doc[doc]
    return n // k + (index < n % k), doc, index


def splitmix64(x: np.ndarray) -> np.ndarray:
    """A fixed bijective mix of 64-bit integers (wrapping arithmetic): stable across library versions."""
    with np.errstate(over="ignore"):
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def name_hashes(names: list[str]) -> np.ndarray:
    """A 64-bit hash of each document's name: one string hash per document, the pieces then vectorised."""
    digests = (hashlib.blake2b(n.encode("utf-8", "surrogatepass"), digest_size=8).digest() for n in names)
    return np.array([int.from_bytes(d, "little") for d in digests], np.uint64)


def piece_scores(doc_hashes: np.ndarray, doc: np.ndarray, index: np.ndarray) -> np.ndarray:
    """A stable pseudo-random number in [0, 1) for each piece (its document's name hash, its index in it)."""
    mixed = splitmix64(doc_hashes[doc] ^ splitmix64(np.asarray(index, np.uint64)))
    return (mixed >> np.uint64(11)).astype(np.float64) / 2.0**53


def piece_score(name: str, index: int) -> float:
    return float(piece_scores(name_hashes([name]), np.array([0]), np.array([index]))[0])


def held_out_pieces(doc_hashes: np.ndarray, doc: np.ndarray, index: np.ndarray, eval_fraction: float) -> np.ndarray:
    score = piece_scores(doc_hashes, doc, index)
    held = score < eval_fraction
    # A small corpus may draw no held-out piece (or only held-out ones): move the nearest piece over.
    if len(score) >= 2 and not held.any():
        held[np.argmin(score)] = True
    if len(score) >= 2 and held.all():
        held[np.argmax(score)] = False
    return held


def load_corpus(data_cfg) -> Corpus:
    tokenizer = get_tokenizer(data_cfg.tokenizer)
    eos = np.array([tokenizer.eos_id], np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32)
    names, parts, doc_lengths = [], [], []
    for name, content in documents(data_cfg):
        tokens = tokenizer.encode(content)
        names.append(name)
        parts += [tokens, eos]
        doc_lengths.append(len(tokens) + 1)
    settings = {
        "source": data_cfg.source,
        "paths": None if data_cfg.source == "stdlib" else data_cfg.paths,
        "jsonl_field": data_cfg.jsonl_field if data_cfg.source == "jsonl" else None,
        "tokenizer": data_cfg.tokenizer,
        "eval_fraction": data_cfg.eval_fraction,
    }
    tokens = np.concatenate(parts) if parts else eos[:0]
    return Corpus(tokens, names, np.array(doc_lengths, np.int64), settings)


def require_window(pieces: Pieces, window: int) -> None:
    """Both splits must hold at least one window of train.seq_len + 1 tokens; say what fits if not."""
    total, source = len(pieces.corpus.tokens), pieces.corpus.settings["source"]
    if len(pieces.lengths) < 2:  # one document, no longer than a piece
        fit = (total - 1) // 2 - 1  # the longest seq_len whose automatic pieces cut it in two, each a window
        if fit < 1:
            raise UserError(f"data.source={source!r} holds only {total} tokens, too few to train on and hold "
                            f"some out for eval; add data.")
        raise UserError(
            f"data.source={source!r} holds {total:,} tokens, one piece of at most {pieces.chunk} tokens "
            f"(data.chunk_tokens), so none can be held out for eval; train.seq_len={fit} with "
            f"data.chunk_tokens=0 cuts it in two, or add data."
        )
    for split, held, remedy in (("training", False, "lower data.eval_fraction"),
                                ("held-out", True, "raise data.eval_fraction")):
        have = pieces.split_tokens(held)
        if have < window:
            fits = f"train.seq_len={have - 1} or less fits it" if have >= 2 else "no train.seq_len fits it"
            raise UserError(
                f"the {split} split of data.source={source!r} has {have:,} of the corpus's {total:,} tokens, "
                f"fewer than train.seq_len+1={window}; {fits}, or {remedy}, or add data."
            )
