"""Packing: pieces of one token array laid end to end in an order re-drawn each epoch, cut into windows.

A `PackedStream` is an endless token stream: epoch e is every piece once, in `order(e)`, and epoch
e + 1 follows it directly. A position in the stream is a plain token count, so the stream does not
care how it is later cut into rows: that is what lets a run resume with another batch size or
sequence length and continue at exactly the next token.

A window of seq_len + 1 tokens gives the fields of one row. Every piece start begins a new segment:
pieces are shuffled apart, so a piece never continues the text before it.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

# The arrays of a batch, each [rows, seq_len]: what the train step takes (ushard/training/step.py).
FIELDS = ("inputs", "targets", "segment_ids", "positions", "loss_mask")


class PackedStream:
    """`tokens[starts[i] : starts[i] + lengths[i]]` is piece i; `order(epoch)` permutes the pieces."""

    def __init__(self, tokens: np.ndarray, starts: np.ndarray, lengths: np.ndarray,
                 order: Callable[[int], np.ndarray]):
        self.tokens = tokens
        self.starts = np.asarray(starts, np.int64)
        self.lengths = np.asarray(lengths, np.int64)
        self.epoch_tokens = int(self.lengths.sum())
        self._order = order
        self._epochs: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(each piece's first token, each piece's offset in the epoch), pieces in this epoch's order."""
        if epoch not in self._epochs:
            perm = self._order(epoch)
            offsets = np.concatenate([[0], np.cumsum(self.lengths[perm])])
            # Batches move forward through the epochs: keep this one and the one before it.
            self._epochs = {e: v for e, v in self._epochs.items() if e == epoch - 1}
            self._epochs[epoch] = (self.starts[perm], offsets)
        return self._epochs[epoch]

    def read(self, start: int, length: int) -> tuple[np.ndarray, np.ndarray]:
        """Tokens at stream positions [start, start + length), and whether each one starts a piece."""
        tokens, first = [], []
        while length > 0:  # a read crosses at most a few epoch boundaries
            epoch, a = divmod(start, self.epoch_tokens)
            b = min(a + length, self.epoch_tokens)
            t, f = self._read_in_epoch(epoch, a, b)
            tokens.append(t)
            first.append(f)
            start, length = start + (b - a), length - (b - a)
        if not tokens:
            return np.zeros(0, self.tokens.dtype), np.zeros(0, bool)
        return np.concatenate(tokens), np.concatenate(first)

    def _read_in_epoch(self, epoch: int, a: int, b: int) -> tuple[np.ndarray, np.ndarray]:
        piece_starts, offsets = self._epoch(epoch)
        pieces = np.arange(np.searchsorted(offsets, a, "right") - 1, np.searchsorted(offsets, b, "left"))
        lo = np.maximum(offsets[pieces], a)
        hi = np.minimum(offsets[pieces + 1], b)
        # Stream position q inside piece i is token starts[i] + (q - offsets[i]).
        source = np.arange(a, b) + np.repeat(piece_starts[pieces] - offsets[pieces], hi - lo)
        first = np.zeros(b - a, bool)
        begins = offsets[pieces]
        first[begins[begins >= a] - a] = True
        return self.tokens[source], first


def window_rows(stream: PackedStream, position: int, window: int, rows) -> dict[str, np.ndarray]:
    """Rows `rows` (indices, in the order wanted) of the windows of `window` tokens laid end to end from
    stream `position`."""
    tokens = np.zeros((len(rows), window), np.int32)
    starts = np.zeros((len(rows), window), bool)
    for i, r in enumerate(rows):
        tokens[i], starts[i] = stream.read(position + int(r) * window, window)
    return row_fields(tokens, starts)


def row_fields(tokens: np.ndarray, starts: np.ndarray) -> dict[str, np.ndarray]:
    """The fields of rows of `window` tokens, given which tokens start a piece ([rows, window] each)."""
    n = tokens.shape[1] - 1  # tokens of input per row
    t = np.arange(n)
    last_start = np.maximum.accumulate(np.where(starts[:, :n], t, 0), axis=1)
    return {
        "inputs": tokens[:, :n],
        "targets": tokens[:, 1:],
        "segment_ids": (np.cumsum(starts[:, :n], axis=1) + 1 - starts[:, :1]).astype(np.int32),
        "positions": (t - last_start).astype(np.int32),
        "loss_mask": (~starts[:, 1:]).astype(np.int32),
    }
