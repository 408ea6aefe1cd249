"""Packing: pieces of one token array laid end to end in an order re-drawn each epoch, cut into windows.

A `PackedStream` is an endless token stream: epoch e is every piece once, in `order(e)`, and epoch
e + 1 follows it directly. A position in the stream is a plain token count, so the stream does not
care how it is later cut into rows: that is what lets a run resume with another batch size or
sequence length and continue at exactly the next token.

A window of seq_len + 1 tokens gives the fields of one row. Every piece start begins a new segment:
pieces are shuffled apart, so a piece never continues the text before it.

Fine-tuning examples (chat.py) are never cut by a window: `pack_whole` lays them into windows once,
best-fit decreasing, the rest of each window padding (a segment of its own that the loss does not
count), and those windows are the pieces that each epoch shuffles. Examples that share a window keep
sharing it, which changes nothing a step computes: attention stays within each segment.
"""

from __future__ import annotations

import bisect
from typing import Callable

import numpy as np

# The arrays of a batch, each [rows, seq_len]: what the train step takes (ushard/training/step.py).
FIELDS = ("inputs", "targets", "segment_ids", "positions", "loss_mask")


class PackedStream:
    """`tokens[starts[i] : starts[i] + lengths[i]]` is piece i; `order(epoch)` permutes the pieces.

    `segment_starts` (bool per token) marks more segment starts inside the pieces, and `counted`
    (bool per token) the tokens the loss counts as targets; None: pieces alone, and every token."""

    def __init__(self, tokens: np.ndarray, starts: np.ndarray, lengths: np.ndarray,
                 order: Callable[[int], np.ndarray], segment_starts: np.ndarray | None = None,
                 counted: np.ndarray | None = None):
        self.tokens = tokens
        self.segment_starts = segment_starts
        self.counted = counted
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

    def read(self, start: int, length: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Tokens at stream positions [start, start + length), whether each one starts a segment, and
        whether each one counts in the loss as a target."""
        sources, first = [], []
        while length > 0:  # a read crosses at most a few epoch boundaries
            epoch, a = divmod(start, self.epoch_tokens)
            b = min(a + length, self.epoch_tokens)
            s, f = self._read_in_epoch(epoch, a, b)
            sources.append(s)
            first.append(f)
            start, length = start + (b - a), length - (b - a)
        source = np.concatenate(sources) if sources else np.zeros(0, np.int64)
        first = np.concatenate(first) if first else np.zeros(0, bool)
        if self.segment_starts is not None:
            first |= self.segment_starts[source]
        counted = self.counted[source] if self.counted is not None else np.ones(len(source), bool)
        return self.tokens[source], first, counted

    def _read_in_epoch(self, epoch: int, a: int, b: int) -> tuple[np.ndarray, np.ndarray]:
        """(the token index of each stream position in [a, b) of `epoch`, whether it starts a piece)."""
        piece_starts, offsets = self._epoch(epoch)
        pieces = np.arange(np.searchsorted(offsets, a, "right") - 1, np.searchsorted(offsets, b, "left"))
        lo = np.maximum(offsets[pieces], a)
        hi = np.minimum(offsets[pieces + 1], b)
        # Stream position q inside piece i is token starts[i] + (q - offsets[i]).
        source = np.arange(a, b) + np.repeat(piece_starts[pieces] - offsets[pieces], hi - lo)
        first = np.zeros(b - a, bool)
        begins = offsets[pieces]
        first[begins[begins >= a] - a] = True
        return source, first


def window_rows(stream: PackedStream, position: int, window: int, rows) -> dict[str, np.ndarray]:
    """Rows `rows` (indices, in the order wanted) of the windows of `window` tokens laid end to end from
    stream `position`."""
    tokens = np.zeros((len(rows), window), np.int32)
    starts = np.zeros((len(rows), window), bool)
    counted = np.zeros((len(rows), window), bool)
    for i, r in enumerate(rows):
        tokens[i], starts[i], counted[i] = stream.read(position + int(r) * window, window)
    return row_fields(tokens, starts, counted)


def row_fields(tokens: np.ndarray, starts: np.ndarray, counted: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """The fields of rows of `window` tokens, given which tokens start a segment and which count as
    targets ([rows, window] each; `counted` None: all)."""
    n = tokens.shape[1] - 1  # tokens of input per row
    t = np.arange(n)
    last_start = np.maximum.accumulate(np.where(starts[:, :n], t, 0), axis=1)
    return {
        "inputs": tokens[:, :n],
        "targets": tokens[:, 1:],
        "segment_ids": (np.cumsum(starts[:, :n], axis=1) + 1 - starts[:, :1]).astype(np.int32),
        "positions": (t - last_start).astype(np.int32),
        "loss_mask": (~starts[:, 1:] & (True if counted is None else counted[:, 1:])).astype(np.int32),
    }


def best_fit_windows(lengths: np.ndarray, window: int) -> list[list[int]]:
    """Pieces (by index) grouped into windows of `window` tokens: longest first, each into the window
    it fills best (best-fit decreasing: rarely more than a few percent more windows than needed).
    Windows are found by their space left, of which there are at most `window` values: a step costs
    a search of those, whatever the number of pieces."""
    spaces: list[int] = []  # the space left in some window, each value once, sorted
    with_space: dict[int, list[int]] = {}  # space left -> the windows that have that much
    windows: list[list[int]] = []
    for piece in np.argsort(-np.asarray(lengths), kind="stable"):
        need = int(lengths[piece])
        k = bisect.bisect_left(spaces, need)
        if k < len(spaces):
            space = spaces[k]
            w = with_space[space].pop()
            if not with_space[space]:
                del with_space[space], spaces[k]
        else:
            space, w = window, len(windows)
            windows.append([])
        windows[w].append(int(piece))
        left = space - need
        if left:
            if left not in with_space:
                bisect.insort(spaces, left)
                with_space[left] = []
            with_space[left].append(w)
    return windows


def pack_whole(tokens: np.ndarray, counted: np.ndarray, starts: np.ndarray, lengths: np.ndarray, window: int,
               pad_id: int, order_of: Callable[[int], Callable[[int], np.ndarray]]) -> PackedStream:
    """A stream of whole pieces (each at most `window` tokens) laid into windows (see the module
    docstring); `order_of(number of windows)` gives the windows' order per epoch."""
    groups = best_fit_windows(lengths, window)
    pieces = np.array([p for g in groups for p in g], np.int64)
    group = np.repeat(np.arange(len(groups)), [len(g) for g in groups])
    sizes = np.asarray(lengths, np.int64)[pieces]
    before = np.cumsum(sizes) - sizes  # tokens of the pieces before each one, all windows together
    first_of_group = np.searchsorted(group, group)  # each piece's window's first piece
    dest = group * window + before - before[first_of_group]
    offset = np.arange(int(sizes.sum())) - np.repeat(before, sizes)
    to, source = np.repeat(dest, sizes) + offset, np.repeat(np.asarray(starts)[pieces], sizes) + offset
    out_tokens = np.full(len(groups) * window, pad_id, tokens.dtype)
    out_tokens[to] = tokens[source]
    out_counted = np.zeros(len(out_tokens), bool)
    out_counted[to] = counted[source]
    segment_starts = np.zeros(len(out_tokens), bool)
    segment_starts[dest] = True
    used = np.bincount(group, weights=sizes, minlength=len(groups)).astype(np.int64)
    padded = np.flatnonzero(used < window)
    segment_starts[padded * window + used[padded]] = True  # the padding: a segment of its own
    return PackedStream(out_tokens, np.arange(len(groups)) * window, np.full(len(groups), window),
                        order_of(len(groups)), segment_starts, out_counted)
