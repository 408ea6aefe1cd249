"""Packing documents into windows, and the global batch of step s.

Every document becomes its tokens plus an end-of-document token; all of them, in source order, form
one stream that is cut into windows of seq_len + 1 tokens (no padding is ever wasted). A window gives
`inputs` and `targets` (shifted by one), `segment_ids` (1, 2, ... per document inside the window, so
attention never crosses documents), `positions` (restarting at each document) and `loss_mask` (0 where
the target is the first token of the next document).

Row i of the global batch of step s is window `order[s * batch_size + i]`, where `order` is a grain
MapDataset: a seeded permutation of the windows, re-drawn for each epoch. It depends only on the data
config, the seed and s, so any process can build any rows, and a resumed run sees the same batches.
A document lands in the held-out split by a hash of its name, so the split is stable too.
"""

from __future__ import annotations

import zlib

import grain
import numpy as np

from ushard.data.sources import documents
from ushard.data.tokenizer import get_tokenizer
from ushard.errors import UserError

FIELDS = ("inputs", "targets", "segment_ids", "positions", "loss_mask")


def is_held_out(name: str, eval_fraction: float) -> bool:
    return (zlib.crc32(name.encode("utf-8")) % 1_000_000) < eval_fraction * 1_000_000


class PackedWindows:
    """A token stream cut into windows of `window` tokens, with document starts marked."""

    def __init__(self, pieces: list[np.ndarray], window: int):
        self.window = window
        lengths = np.array([len(p) for p in pieces], dtype=np.int64)
        self.tokens = np.concatenate(pieces) if pieces else np.zeros(0, np.uint16)
        self.starts = np.zeros(len(self.tokens) + 1, dtype=bool)
        self.starts[np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)] = True
        self.starts[-1] = True  # nothing follows the stream's last token
        self.num_windows = len(self.tokens) // window

    def __len__(self):
        return self.num_windows

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        a = int(index) * self.window
        n = self.window - 1  # tokens of input per row
        tokens = self.tokens[a : a + n + 1].astype(np.int32)
        starts = self.starts[a : a + n + 1]
        t = np.arange(n)
        last_start = np.maximum.accumulate(np.where(starts[:n], t, 0))
        return {
            "inputs": tokens[:n],
            "targets": tokens[1:],
            "segment_ids": (np.cumsum(starts[:n]) + 1 - starts[0]).astype(np.int32),
            "positions": (t - last_start).astype(np.int32),
            "loss_mask": (~starts[1 : n + 1]).astype(np.int32),
        }


class Batches:
    """The training and eval batches of one data config, seed and sequence length."""

    def __init__(self, train: PackedWindows, held_out: PackedWindows, seed: int):
        self.train_windows = train
        self.eval_windows = held_out
        self.train_order = grain.MapDataset.range(len(train)).shuffle(seed=seed).repeat().map(train.__getitem__)
        self.eval_order = grain.MapDataset.range(len(held_out)).repeat().map(held_out.__getitem__)

    @staticmethod
    def _rows(order, first: int, rows: range) -> dict[str, np.ndarray]:
        examples = [order[first + i] for i in rows]
        return {k: np.stack([e[k] for e in examples]) for k in FIELDS}

    def train_batch(self, step: int, batch_size: int, rows: range | None = None) -> dict[str, np.ndarray]:
        """Rows `rows` (default: all) of the global batch of `step`."""
        return self._rows(self.train_order, step * batch_size, range(batch_size) if rows is None else rows)

    def eval_batch(self, index: int, batch_size: int, rows: range | None = None) -> dict[str, np.ndarray]:
        return self._rows(self.eval_order, index * batch_size, range(batch_size) if rows is None else rows)


def make_batches(data_cfg, seq_len: int, seed: int) -> Batches:
    tokenizer = get_tokenizer(data_cfg.tokenizer)
    eos = np.array([tokenizer.eos_id], np.uint16)
    train, held_out = [], []
    for name, content in documents(data_cfg):
        pieces = held_out if is_held_out(name, data_cfg.eval_fraction) else train
        pieces.append(np.concatenate([tokenizer.encode(content), eos]))
    window = seq_len + 1
    train_windows, eval_windows = PackedWindows(train, window), PackedWindows(held_out, window)
    for split, windows in (("training", train_windows), ("held-out", eval_windows)):
        if len(windows) == 0:
            raise UserError(
                f"the {split} split of data.source={data_cfg.source!r} has fewer than train.seq_len+1={window} "
                f"tokens; add data or lower train.seq_len (or adjust data.eval_fraction)."
            )
    return Batches(train_windows, eval_windows, seed)
