"""The global batches of training and eval, and the data position a checkpoint keeps.

The training data is one endless token stream: the training pieces of the corpus (see corpus.py)
in a seeded order re-drawn each epoch, laid end to end (packing.py). Batches cut it into windows of
seq_len + 1 tokens, row after row, step after step. The data position is a token offset into that
stream, so a run resumed with another train.batch_size or train.seq_len goes on at exactly the next
token: nothing replayed, nothing skipped.

Pieces: data.chunk_tokens=0 (the default) cuts documents into pieces of at most 2 * (seq_len + 1)
tokens, so a row holds about one piece of a long document and a batch mixes about 2 * batch_size
pieces from all over the corpus (pieces much longer than a batch's rows make a batch a few passages
of a few files: small-batch training learns visibly worse). The piece length is part of the data
order: a resume keeps the checkpoint's, even under another seq_len (check_resume re-cuts to it).

A window gives `inputs` and `targets` (shifted by one), `segment_ids` (1, 2, ... per piece inside
the window, so attention never crosses documents), `positions` (restarting at each piece) and
`loss_mask` (0 where the target is the first token of the next piece, e.g. the next document).
Fields are numpy int32 [rows, seq_len].

Interface (`batches = make_batches(data_cfg, seq_len, seed)`):
- `batches.initial_state() -> dict`: the state at the start of the data, JSON-serialisable:
  `{"position": tokens consumed, "order": fingerprint of what decides the stream}`; the fingerprint
  holds train.seed, the data settings and a checksum of the corpus, never batch size or seq_len.
- `batches.train_batch(state, batch_size, rows=None) -> (batch, next_state)`: rows `rows` (row indices,
  e.g. those a process's devices hold; default all) of the global batch at `state`, in that order.
  Row r is the window at position + r * (seq_len + 1);
  next_state is position + batch_size * (seq_len + 1) whatever `rows` is, so every process that
  builds its own rows from the same state gets the same next state. The batch depends only on the
  data settings, the seed and the position: never on the mesh or the number of processes.
- `batches.advance(state, batch_size) -> next_state`: the same next state without building a row
  (to step over a batch).
- `batches.eval_batch(index, batch_size, rows=None) -> batch`: rows of eval batch `index`, cut from
  the held-out pieces in source order (repeated), the same for every run.
- `batches.check_resume(saved_state, restart) -> state`: the state to go on from after restoring a
  checkpoint; call it before building any batch. A saved state whose order matches this run's
  continues at its position (with data.chunk_tokens=0, the checkpoint's piece length is adopted, and
  eval uses its held-out pieces). One that cannot be continued (another seed, source, paths,
  tokenizer, eval_fraction, explicit chunk_tokens, changed data files, or the old
  `{"next_batch": N}` format) raises a one-sentence `UserError`, unless `restart` (config
  `data.restart`): then the data starts afresh at position 0. A matching state continues even with
  `restart`, so a config left with it on never replays data.
"""

from __future__ import annotations

import numpy as np

from ushard.data.corpus import Corpus, data_position, load_corpus, require_window, splitmix64
from ushard.data.packing import FIELDS, PackedStream, pack_whole, window_rows
from ushard.data.preference import PreferenceBatches
from ushard.errors import UserError

__all__ = ["FIELDS", "Batches", "make_batches"]

ORDER_VERSION = 2  # the old {"next_batch": N} states are version 1
# The fingerprint entries a user sets, with the config key that sets each.
SETTING_KEYS = {
    "seed": "train.seed", "seq_len": "train.seq_len", "source": "data.source", "paths": "data.paths",
    "jsonl_field": "data.jsonl_field", "tokenizer": "data.tokenizer", "eval_fraction": "data.eval_fraction",
    "chunk_tokens": "data.chunk_tokens", "parquet_column": "data.parquet_column", "weights": "data.weights",
    "train_on": "data.train_on", "prompt_field": "data.prompt_field", "completion_field": "data.completion_field",
}
RESTART = "--config.data.restart=true starts a fresh data order from the beginning of the data"


def shuffled(num_pieces: int, seed: int):
    """order(epoch): the pieces sorted by a hash keyed by (seed, epoch), another permutation each epoch.

    A whole epoch's order is needed at once (to find a position's piece), so it is drawn vectorised:
    grain's per-index shuffle costs microseconds a piece, seconds an epoch for 10^5 pieces. A fixed
    hash, not a library RNG, so a numpy upgrade never changes the order of a run being resumed.
    """
    salt = splitmix64(np.array([seed % 2**64], np.uint64))

    def order(epoch: int) -> np.ndarray:
        key = splitmix64(salt ^ np.uint64(epoch % 2**64))
        return np.argsort(splitmix64(np.arange(num_pieces, dtype=np.uint64) ^ key), kind="stable")

    return order


def in_source_order(num_pieces: int):
    return lambda epoch: np.arange(num_pieces)


class Batches:
    """The training and eval batches of one corpus, sequence length and seed."""

    def __init__(self, corpus: Corpus, seq_len: int, seed: int, chunk_tokens: int = 0):
        self.corpus = corpus
        self.seq_len = seq_len
        self.window = seq_len + 1
        self.seed = seed
        # Then a resume may adopt the checkpoint's piece length; fine-tuning examples are never cut.
        self.auto_chunk = chunk_tokens == 0 and not corpus.whole
        self._own_chunk = self.window if corpus.whole else chunk_tokens or 2 * self.window
        self._use(self._own_chunk)

    def _use(self, chunk: int) -> None:
        """Cut the corpus into pieces of at most `chunk` tokens and lay out both streams."""
        pieces = self.corpus.pieces(chunk)
        require_window(pieces, self.window)  # before anything changes: a refused chunk leaves the old one
        self.pieces = pieces
        train, held_out = pieces.training(), pieces.split(True)
        if self.corpus.whole:
            # Windows of whole examples; the padding's token id is never seen (a segment of its own,
            # counted nowhere), 0 is as good as any.
            corpus, seed = self.corpus, self.seed
            self.train = pack_whole(corpus.tokens, corpus.counted, *train, self.window, 0,
                                    lambda n: shuffled(n, seed))
            self.held_out = pack_whole(corpus.tokens, corpus.counted, *held_out, self.window, 0, in_source_order)
        else:
            self.train = PackedStream(self.corpus.tokens, *train, shuffled(len(train[0]), self.seed))
            self.held_out = PackedStream(self.corpus.tokens, *held_out, in_source_order(len(held_out[0])))
        self.order = {"version": ORDER_VERSION, "seed": self.seed, **self.corpus.settings, "chunk_tokens": chunk,
                      "train_tokens": self.train.epoch_tokens, "checksum": pieces.checksum()}

    def summary(self) -> str:
        """For fine-tuning examples, a line on what was made of them; "" otherwise."""
        if not self.corpus.whole:
            return ""
        windows = self.train.epoch_tokens // self.window
        padding = 1 - int(self.pieces.training()[1].sum()) / self.train.epoch_tokens
        return (f"data: {self.corpus.summary}; packed whole into {windows:,} training windows of {self.window} "
                f"tokens an epoch ({100 * padding:.0f}% padding), {self.held_out.epoch_tokens // self.window:,} "
                f"held out")

    # ------------------------------------------------------------------ batches

    def _rows(self, stream, position: int, batch_size: int, rows) -> dict[str, np.ndarray]:
        return window_rows(stream, position, self.window, range(batch_size) if rows is None else rows)

    def train_batch(self, state: dict, batch_size: int, rows=None) -> tuple[dict, dict]:
        """(rows `rows`, default all, of the global batch at `state`; the state after this batch)."""
        return self._rows(self.train, self._position(state), batch_size, rows), self.advance(state, batch_size)

    def advance(self, state: dict, batch_size: int) -> dict:
        """The state after a batch of `batch_size` rows at `state`, without building it."""
        return {"position": self._position(state) + batch_size * self.window, "order": dict(self.order)}

    def eval_batch(self, index: int, batch_size: int, rows=None) -> dict[str, np.ndarray]:
        return self._rows(self.held_out, index * batch_size * self.window, batch_size, rows)

    # ------------------------------------------------------------------ the position

    def initial_state(self) -> dict:
        return {"position": 0, "order": dict(self.order)}

    def _position(self, state: dict) -> int:
        return data_position(state, self.order)

    def check_resume(self, saved: dict, restart: bool) -> dict:
        """The state to continue from, given the data state a checkpoint saved (see the module docstring)."""
        order = saved.get("order") if isinstance(saved, dict) else None
        chunk = order.get("chunk_tokens") if isinstance(order, dict) else None
        if self.auto_chunk and isinstance(chunk, int) and chunk > 0 and chunk != self.pieces.chunk:
            self._use(chunk)  # the checkpoint's pieces, so that its position means the same tokens
        problem = self._cannot_continue(saved)
        if problem is None:
            return {"position": int(saved["position"]), "order": dict(self.order)}
        if self.pieces.chunk != self._own_chunk:
            self._use(self._own_chunk)
        if restart:
            return self.initial_state()
        raise UserError(f"{problem}; {RESTART}.")

    def _cannot_continue(self, saved) -> str | None:
        """Why `saved` cannot be continued exactly, as the first half of a sentence; None if it can."""
        if isinstance(saved, dict) and "next_batch" in saved and "order" not in saved:
            return (f"the checkpoint's data position {saved} was written by an older ushard whose data order "
                    f"cannot be continued exactly")
        if not (isinstance(saved, dict) and isinstance(saved.get("order"), dict)
                and isinstance(saved.get("position"), int) and saved["position"] >= 0):
            return f"the checkpoint's data state {saved!r} is not one this ushard can continue"
        old = saved["order"]
        if old.get("version") != ORDER_VERSION:
            return (f"the checkpoint's data order was made by another version of ushard's data pipeline "
                    f"(order version {old.get('version')}, this one {ORDER_VERSION})")
        for key, name in SETTING_KEYS.items():
            if old.get(key) != self.order.get(key):  # a setting that does not apply is absent (None)
                return (f"the checkpoint's data order was made with {name}={old.get(key)!r} but this run has "
                        f"{name}={self.order.get(key)!r} (set it back to continue)")
        if old != self.order:
            return (f"the data files have changed since the checkpoint's data order was made "
                    f"({old.get('train_tokens')} training tokens then, {self.order['train_tokens']} now)")
        return None


def make_batches(data_cfg, seq_len: int, seed: int) -> Batches | PreferenceBatches:
    """The batches of the configured source (preference pairs: ushard/data/preference.py)."""
    if data_cfg.source == "preference":
        return PreferenceBatches(data_cfg, seq_len, seed)
    if data_cfg.chunk_tokens < 0:
        raise UserError(f"data.chunk_tokens={data_cfg.chunk_tokens} must be a number of tokens, or 0 for "
                        f"2 * (train.seq_len + 1).")
    return Batches(load_corpus(data_cfg, seq_len + 1), seq_len, seed, data_cfg.chunk_tokens)
