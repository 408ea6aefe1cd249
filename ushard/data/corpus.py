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

A weighted mixture (data.weights: one weight per glob of data.paths) repeats each training piece of
component i about f_i times an epoch, f_i = (its weight's share) / (its share of the training tokens):
floor(f_i) times, and once more for the fraction of its pieces with the lowest hashes (so the rounding
is off by at most one piece per component, whatever the paths). So component i makes up its weight's
share of every epoch, and the multiset of pieces, like everything here, depends only on the data
settings. The held-out split is not reweighted.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import zlib

import numpy as np

from ushard.data.chat import FitCounts, chat_template, fit_window, prompt_completion
from ushard.data.sources import component_documents, glob_files, packs_whole, path_patterns
from ushard.data.tokenizer import get_tokenizer, token_dtype
from ushard.errors import UserError


@dataclasses.dataclass(frozen=True, eq=False)
class Corpus:
    """Every document of the source, tokenized, in source order: what the data files hold."""

    tokens: np.ndarray  # each document's tokens and its end token
    names: list[str]
    doc_lengths: np.ndarray  # tokens of each document, its end token included
    settings: dict  # the data settings that decided all of it, and eval_fraction
    components: np.ndarray | None = None  # each document's glob in data.paths; None: all the first
    weights: tuple = ()  # the mixture's weight of each component; (): no reweighting
    # Fine-tuning examples (chat.py): each document at most a window long, packed whole, and which
    # tokens count in the loss; None: plain documents, every token counts.
    counted: np.ndarray | None = None
    summary: str = ""  # what making the examples did (cut, skipped), for the run's first lines

    @property
    def whole(self) -> bool:
        return self.counted is not None

    @functools.cached_property
    def checksum(self) -> int:
        """CRC-32 of the tokens and the document lengths."""
        crc = 0
        for part in getattr(self.tokens, "parts", [self.tokens]):  # a file at a time, nothing copied
            crc = zlib.crc32(np.ascontiguousarray(part), crc)
        if self.counted is not None:
            crc = zlib.crc32(np.ascontiguousarray(self.counted), crc)
        return zlib.crc32(self.doc_lengths.astype("<i8").tobytes(), crc)

    @functools.cached_property
    def name_hashes(self) -> np.ndarray:
        return name_hashes(self.names)

    def pieces(self, chunk: int) -> Pieces:
        lengths, doc, index = cut_into_pieces(self.doc_lengths, chunk)
        held = held_out_pieces(self.name_hashes, doc, index, self.settings["eval_fraction"])
        return Pieces(self, np.cumsum(lengths) - lengths, lengths, held, chunk, doc, index)


@dataclasses.dataclass(frozen=True, eq=False)
class Pieces:
    """The corpus cut into pieces of at most `chunk` tokens, each in the training or held-out split."""

    corpus: Corpus
    starts: np.ndarray  # piece i is corpus.tokens[starts[i] : starts[i] + lengths[i]]
    lengths: np.ndarray
    held_out: np.ndarray  # per piece: in the held-out split
    chunk: int
    doc: np.ndarray  # per piece: its document
    index: np.ndarray  # per piece: its index within its document

    def split(self, held_out: bool) -> tuple[np.ndarray, np.ndarray]:
        """(starts, lengths) of the pieces of one split, in source order."""
        keep = self.held_out == held_out
        return self.starts[keep], self.lengths[keep]

    def training(self) -> tuple[np.ndarray, np.ndarray]:
        """(starts, lengths) of one epoch's training pieces: the training split, each piece repeated as
        the mixture's weights ask (once each without weights)."""
        starts, lengths = self.split(False)
        if not self.corpus.weights:
            return starts, lengths
        keep = ~self.held_out
        components = self.corpus.components[self.doc[keep]]
        scores = piece_scores(self.corpus.name_hashes ^ MIXTURE_SALT, self.doc[keep], self.index[keep])
        counts = mixture_repeats(components, lengths, scores, self.corpus.weights, self.corpus.settings["paths"])
        return np.repeat(starts, counts), np.repeat(lengths, counts)

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


def data_position(state: dict, order: dict) -> int:
    """A data state's position, where the state belongs to `order`. A bug in the caller otherwise, not
    the user's: a restored state goes through its source's check_resume first."""
    if not isinstance(state, dict) or state.get("order") != order:
        raise ValueError(f"the data state {state!r:.200} belongs to another data order; pass a restored "
                         f"state through check_resume first")
    return int(state["position"])


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


def held_out_pieces(doc_hashes: np.ndarray, doc: np.ndarray, index: np.ndarray, eval_fraction: float) -> np.ndarray:
    score = piece_scores(doc_hashes, doc, index)
    held = score < eval_fraction
    # A small corpus may draw no held-out piece (or only held-out ones): move the nearest piece over.
    if len(score) >= 2 and not held.any():
        held[np.argmin(score)] = True
    if len(score) >= 2 and held.all():
        held[np.argmax(score)] = False
    return held


# Keys the mixture's piece scores apart from the held-out split's, so the two choices are independent.
MIXTURE_SALT = np.uint64(0x6D69787475726521)


def mixture_weights(data_cfg) -> tuple[float, ...]:
    """data.weights as numbers, one per glob of data.paths; () when empty. Raises UserError if invalid."""
    if not data_cfg.weights.strip():
        return ()
    globs = path_patterns(data_cfg.paths) if data_cfg.source != "stdlib" else []
    try:
        weights = tuple(float(w) for w in data_cfg.weights.split(","))
    except ValueError:
        weights = ()
    if not weights or not all(np.isfinite(w) and w > 0 for w in weights):
        raise UserError(f"data.weights={data_cfg.weights!r} is not a comma-separated list of positive numbers.")
    if len(weights) != len(globs):
        raise UserError(f"data.weights={data_cfg.weights!r} has {len(weights)} weights but data.paths has "
                        f"{len(globs)} globs; give one weight per comma-separated glob of data.paths.")
    return weights


def mixture_repeats(components: np.ndarray, lengths: np.ndarray, scores: np.ndarray, weights: tuple,
                    paths: str) -> np.ndarray:
    """How many times each training piece appears in an epoch (see the module docstring)."""
    tokens = np.bincount(components, weights=lengths, minlength=len(weights))
    if not tokens.all():
        empty = path_patterns(paths)[int(np.argmin(tokens))]
        raise UserError(f"the data.paths glob {empty!r} has no training tokens, so data.weights cannot give it a "
                        f"share; remove it or add data.")
    factor = (np.asarray(weights) / sum(weights)) * tokens.sum() / tokens
    # Stratified rounding: within each component, the pieces ranked lowest by score take the extra
    # repeat, as many as the fraction asks. (A coin per piece would leave the share off by a few percent.)
    order = np.lexsort((scores, components))
    first_of_component = np.searchsorted(components[order], components[order])
    rank = np.empty(len(order), np.int64)
    rank[order] = np.arange(len(order)) - first_of_component
    pieces = np.bincount(components, minlength=len(weights))
    extra = np.round((factor - np.floor(factor)) * pieces)
    return (np.floor(factor)[components] + (rank < extra[components])).astype(np.int64)


def load_corpus(data_cfg, window: int | None = None) -> Corpus:
    """The corpus of the data settings; fine-tuning examples are fitted to `window` tokens (seq_len + 1)."""
    tokenizer = get_tokenizer(data_cfg.tokenizer)
    settings, weights = corpus_settings(data_cfg, window), mixture_weights(data_cfg)
    if packs_whole(data_cfg):
        if window is None:
            raise ValueError("fine-tuning examples are fitted to a window: pass seq_len + 1")
        tokens, counted, names, doc_lengths, components, summary = tokenize_examples(data_cfg, tokenizer, window)
        return Corpus(tokens, names, doc_lengths, settings, components, weights, counted, summary)
    if data_cfg.source == "tokens":
        tokens, names, doc_lengths, components = read_token_files(data_cfg.paths, tokenizer)
    else:
        tokens, names, doc_lengths, components = tokenize_documents(data_cfg, tokenizer)
    return Corpus(tokens, names, doc_lengths, settings, components, weights)


def corpus_settings(data_cfg, window: int | None) -> dict:
    """The data settings that decide the corpus (its fingerprint). Settings newer than a checkpoint are
    present only where they apply, so an older checkpoint's fingerprint still matches."""
    settings = {
        "source": data_cfg.source,
        "paths": None if data_cfg.source == "stdlib" else data_cfg.paths,
        "jsonl_field": data_cfg.jsonl_field if data_cfg.source == "jsonl" else None,
        "tokenizer": data_cfg.tokenizer,
        "eval_fraction": data_cfg.eval_fraction,
    }
    if data_cfg.source == "parquet":
        settings["parquet_column"] = data_cfg.parquet_column
    if data_cfg.weights.strip():
        settings["weights"] = data_cfg.weights
    if packs_whole(data_cfg):  # the examples are fitted to the window, and the mask is chosen
        settings.update(seq_len=window - 1, train_on=data_cfg.train_on, jsonl_field=None)
        if data_cfg.source != "chat":
            settings.update(prompt_field=data_cfg.prompt_field, completion_field=data_cfg.completion_field)
    return settings


def tokenize_documents(data_cfg, tokenizer):
    """(tokens, names, document lengths, components) of a text source, every document ending in EOS."""
    eos = np.array([tokenizer.eos_id], token_dtype(tokenizer.vocab_size))
    names, parts, doc_lengths, components = [], [], [], []
    for component, name, content in component_documents(data_cfg):
        tokens = tokenizer.encode(content)
        names.append(name)
        parts += [tokens, eos]
        doc_lengths.append(len(tokens) + 1)
        components.append(component)
    tokens = np.concatenate(parts) if parts else eos[:0]
    return tokens, names, np.array(doc_lengths, np.int64), np.array(components, np.int64)


def tokenize_examples(data_cfg, tokenizer, window: int):
    """(tokens, counted, names, document lengths, components, summary) of fine-tuning examples, each
    fitted to `window` tokens (chat.py); examples with nothing left to count are left out."""
    chat = data_cfg.source == "chat"
    template = chat_template(tokenizer) if chat else None
    what = "conversations" if chat else "prompt / completion records"
    counts, all_count = FitCounts(), data_cfg.train_on == "all"
    names, parts, masks, doc_lengths, components = [], [], [], [], []
    read_in, used_in = {}, set()  # per file (a name is "path:line"): examples read; files with one used
    for component, name, content in component_documents(data_cfg):
        example = template.example(content, name) if chat else prompt_completion(tokenizer, *content)
        example = fit_window(example, window, all_count, counts)
        path = name.rsplit(":", 1)[0]
        read_in[path] = read_in.get(path, 0) + 1
        if example is None:
            continue
        used_in.add(path)
        names.append(name)
        parts.append(example.tokens)
        masks.append(example.counted)
        doc_lengths.append(len(example.tokens))
        components.append(component)
    if not names:
        raise UserError(f"data.paths={data_cfg.paths!r} holds no usable {what}: {counts.describe(what)}; give "
                        f"files with at least one {'assistant turn' if chat else 'completion'} each.")
    unusable = [path for path in read_in if path not in used_in]
    if unusable:
        raise UserError(f"{unusable[0]} holds no usable {what}: none of its {read_in[unusable[0]]:,} has a token "
                        f"that counts in the loss (data.train_on={data_cfg.train_on!r}) within a window of "
                        f"train.seq_len+1={window} tokens; remove it from data.paths or fix it.")
    return (np.concatenate(parts), np.concatenate(masks), names, np.array(doc_lengths, np.int64),
            np.array(components, np.int64), counts.describe(what))


# --------------------------------------------------------------------------- pre-tokenized token files

SCAN_BLOCK = 1 << 24  # tokens checked at a time: the scan of a memory-mapped file stays in bounded memory


class ConcatenatedTokens:
    """Token arrays (memory-mapped files) read as one array without being copied together: what the
    pipeline asks of a corpus's tokens (len, dtype, indexing by an integer array or a slice)."""

    def __init__(self, parts: list[np.ndarray]):
        self.parts = parts
        self.offsets = np.cumsum([0] + [len(p) for p in parts])
        self.dtype = np.result_type(*(p.dtype for p in parts))

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __getitem__(self, index) -> np.ndarray:
        if isinstance(index, slice):
            index = np.arange(*index.indices(len(self)))
        index = np.asarray(index)
        out = np.empty(index.shape, self.dtype)
        part = np.searchsorted(self.offsets, index, "right") - 1
        for p in np.unique(part):  # a window touches one or two files
            where = part == p
            out[where] = self.parts[p][index[where] - self.offsets[p]]
        return out


def read_token_files(paths: str, tokenizer):
    """(tokens, names, document lengths, components) of data.source="tokens": .npy files of token ids,
    each document ending in the tokenizer's EOS. The files are memory-mapped and never copied: the
    tokens are one file, or several read as one (ConcatenatedTokens)."""
    parts, names, doc_lengths, components = [], [], [], []
    for component, pattern in enumerate(path_patterns(paths)):
        for path in glob_files(pattern, "data.paths"):
            tokens = load_token_file(path)
            parts.append(tokens)
            ends = document_ends(tokens, tokenizer, path)
            if not len(ends) or ends[-1] != len(tokens) - 1:  # the last document's EOS is optional
                parts.append(np.array([tokenizer.eos_id], tokens.dtype))
                ends = np.append(ends, len(tokens))
            lengths = np.diff(ends + 1, prepend=0)
            names += [f"{path}:{i}" for i in range(len(lengths))]
            doc_lengths.append(lengths)
            components.append(np.full(len(lengths), component, np.int64))
    tokens = parts[0] if len(parts) == 1 else ConcatenatedTokens(parts)
    return tokens, names, np.concatenate(doc_lengths).astype(np.int64), np.concatenate(components)


def load_token_file(path: str) -> np.ndarray:
    try:
        tokens = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read {path} as a .npy array of token ids ({' '.join(str(e).split()).rstrip('.')}); "
                        f"data.source='tokens' reads files written by numpy.save.") from None
    if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
        raise UserError(f"{path} holds a {tokens.ndim}-D {tokens.dtype} array; data.source='tokens' needs a 1-D "
                        f"array of integer token ids (e.g. uint16 or uint32).")
    return tokens


def document_ends(tokens: np.ndarray, tokenizer, path: str) -> np.ndarray:
    """Indices of the EOS tokens, checking every id against the tokenizer's vocabulary, a block at a time."""
    ends = []
    for start in range(0, len(tokens), SCAN_BLOCK):
        block = np.asarray(tokens[start:start + SCAN_BLOCK])
        bad = np.flatnonzero((block < 0) | (block >= tokenizer.vocab_size))
        if len(bad):
            raise UserError(f"{path} holds token id {block[bad[0]]} at index {start + bad[0]}, outside "
                            f"data.tokenizer's vocabulary of {tokenizer.vocab_size}; tokenize with the same "
                            f"tokenizer as data.tokenizer.")
        ends.append(np.flatnonzero(block == tokenizer.eos_id) + start)
    return np.concatenate(ends) if ends else np.zeros(0, np.int64)


def require_window(pieces: Pieces, window: int) -> None:
    """Both splits must hold at least one window of train.seq_len + 1 tokens; say what fits if not."""
    total, source = len(pieces.corpus.tokens), pieces.corpus.settings["source"]
    if pieces.corpus.whole:  # whole examples, padded: any one fills a window
        if len(pieces.lengths) < 2:
            raise UserError(f"data.source={source!r} holds one usable example; at least two are needed, one "
                            f"held out for the eval loss; add data.")
        return
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
