"""Preference pairs (data.source="preference"): records of a prompt, a chosen and a rejected completion,
for DPO (ushard/training/dpo.py).

A record is a JSONL line or a Parquet row with three fields, `prompt`, `chosen` and `rejected` (TRL's
names), each either text or a list of chat messages (`{"role": ..., "content": ...}`, rendered through
the tokenizer's chat template as data.source="chat" renders a conversation, chat.py):
- text: the prompt's tokens, then the completion's, then the end-of-document token (as a prompt /
  completion record is made, chat.py's `prompt_completion`); the completion and that token count;
- messages: the prompt's messages followed by the completion's, rendered as one conversation; the
  completion's assistant tokens count, never the prompt's (even where the prompt holds assistant turns).

Each sequence (prompt + chosen, prompt + rejected) is one row of its own, padded to the window of
train.seq_len + 1 tokens (the padding a segment of its own that nothing counts); one that does not fit
is refused, not cut: a cut completion would be another preference. A batch of P pairs has the usual
fields [P, seq_len] (packing.FIELDS) for the chosen rows and the same fields named `rejected_*` for
the rejected rows: pair k is row k of both, so every split of the rows (microbatches, data shards,
pipeline microbatches, 1F1B's row groups) keeps a pair together by construction.

The pairs' order: the training pairs in a seeded order re-drawn each epoch; the data position a
checkpoint keeps is the count of pairs consumed, so a resume with another batch size goes on at the
next pair. data.eval_fraction of the pairs (by a hash of the record's name) are held out.
With train.dpo.reference="precomputed", `with_reference(table)` adds each pair's reference log-probs
(`ref_logps`, `rejected_ref_logps`, float32 [P, seq_len] whose row sums are the values) from a table
computed once before training.
"""

from __future__ import annotations

import json
import zlib

import numpy as np

from ushard.data.chat import chat_template, prompt_completion
from ushard.data.corpus import data_position, name_hashes, splitmix64
from ushard.data.packing import FIELDS, row_fields
from ushard.data.sources import ROLES, glob_files, jsonl_lines, open_parquet, path_patterns
from ushard.data.tokenizer import get_tokenizer
from ushard.errors import UserError

KEYS = ("prompt", "chosen", "rejected")
REJECTED = "rejected_"  # the prefix of the rejected rows' fields
REFERENCE_FIELDS = ("ref_logps", "rejected_ref_logps")
PAIR_FIELDS = FIELDS + tuple(REJECTED + f for f in FIELDS)
ORDER_VERSION = 1


def batch_fields(precomputed: bool) -> tuple[str, ...]:
    """The fields of a batch of pairs (with the precomputed reference's, or without)."""
    return PAIR_FIELDS + (REFERENCE_FIELDS if precomputed else ())


# --------------------------------------------------------------------------- reading records


def read_records(data_cfg):
    """(name, prompt, chosen, rejected) of every record in data.paths, in order (each value text or a
    checked list of messages)."""
    for pattern in path_patterns(data_cfg.paths):
        for path in glob_files(pattern, "data.paths"):
            empty = True
            rows = parquet_rows(path) if path.endswith(".parquet") else jsonl_rows(path)
            for name, record in rows:
                empty = False
                yield (name, *(_value(record, key, name) for key in KEYS))
            if empty:
                raise UserError(f"{path} holds no preference record; remove it from data.paths or fill it.")


def jsonl_rows(path: str):
    for name, line in jsonl_lines(path):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        if not isinstance(record, dict):
            raise UserError(f"{name} is not a JSON object with {_fields()}.")
        yield name, record


def parquet_rows(path: str):
    _, file = open_parquet(path, "preference records in Parquet")
    missing = [key for key in KEYS if key not in file.schema_arrow.names]
    if missing:
        raise UserError(f"{path} has no column {missing[0]!r}; preference records need {_fields()}.")
    row = 0
    for group in range(file.num_row_groups):
        for record in file.read_row_group(group, columns=list(KEYS)).to_pylist():
            yield f"{path}:{row}", record
            row += 1


def _fields() -> str:
    return "\"prompt\", \"chosen\" and \"rejected\" fields, each text or a list of {\"role\", \"content\"} messages"


def _value(record: dict, key: str, name: str):
    if key not in record or record[key] is None:
        raise UserError(f"{name} has no {key!r} field; preference records need {_fields()}.")
    value = record[key]
    if isinstance(value, str):
        if key != "prompt" and not value.strip():
            raise UserError(f"{name}: its {key!r} completion is empty; drop the record or complete it.")
        return value
    if not (isinstance(value, list) and value and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in value)):
        raise UserError(f"{name}: its {key!r} field is neither text nor a non-empty list of "
                        f"{{\"role\": ..., \"content\": ...}} messages with string values.")
    for m in value:
        if m["role"] not in ROLES:
            raise UserError(f"{name}: a message of its {key!r} field has role {m['role']!r}; the roles are "
                            f"{', '.join(ROLES[:-1])} and {ROLES[-1]}.")
    if key != "prompt" and not any(m["role"] == "assistant" and m["content"].strip() for m in value):
        raise UserError(f"{name}: its {key!r} completion has no non-empty assistant message; drop the record or "
                        f"complete it.")
    return value


# --------------------------------------------------------------------------- tokens


def sequence(tokenizer, template, name: str, prompt, completion, key: str) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, counted) of prompt + completion; both text, or both messages."""
    if isinstance(prompt, str) != isinstance(completion, str):
        raise UserError(f"{name}: its 'prompt' and {key!r} fields must both be text or both be messages.")
    if isinstance(prompt, str):
        example = prompt_completion(tokenizer, prompt, completion)
        return example.tokens, example.counted
    example = template.example(prompt + completion, name)
    counted = example.counted.copy()
    counted[:example.turn_ends[len(prompt) - 1]] = False  # the prompt's own assistant turns never count
    if not counted.any():
        raise UserError(f"{name}: its {key!r} completion renders to no token of the assistant's; drop the record "
                        f"or complete it.")
    return example.tokens, counted


class Pairs:
    """Every record's chosen and rejected sequence, each padded to the window: [pairs, window] arrays."""

    def __init__(self, data_cfg, window: int):
        tokenizer = get_tokenizer(data_cfg.tokenizer)
        template = None
        names, rows = [], {key: ([], []) for key in KEYS[1:]}
        for name, prompt, chosen, rejected in read_records(data_cfg):
            if template is None and not isinstance(prompt, str):
                template = chat_template(tokenizer)
            names.append(name)
            for key, completion in (("chosen", chosen), ("rejected", rejected)):
                tokens, counted = sequence(tokenizer, template, name, prompt, completion, key)
                if len(tokens) > window:
                    raise UserError(f"{name}: its prompt and {key!r} completion are {len(tokens)} tokens, more than "
                                    f"train.seq_len + 1 = {window}; raise train.seq_len or drop the record.")
                rows[key][0].append(tokens)
                rows[key][1].append(counted)
        self.names = names
        self.window = window
        self.arrays = {key: _padded(tokens, counted, window) for key, (tokens, counted) in rows.items()}
        crc = 0
        for arrays in self.arrays.values():
            for a in arrays:
                crc = zlib.crc32(np.ascontiguousarray(a), crc)
        self.checksum = crc  # of what the records became: a changed file or tokenizer changes it

    def __len__(self) -> int:
        return len(self.names)

    def fields(self, indices) -> dict[str, np.ndarray]:
        """The batch fields of pairs `indices` (PAIR_FIELDS)."""
        out = {}
        for key, prefix in (("chosen", ""), ("rejected", REJECTED)):
            tokens, starts, counted = (a[indices] for a in self.arrays[key])
            out.update({prefix + k: v for k, v in row_fields(tokens, starts, counted).items()})
        return out


def _padded(tokens: list, counted: list, window: int):
    """(tokens, segment starts, counted), each [sequences, window]: each sequence from column 0, the rest
    padding (token 0), a segment of its own that counts nowhere."""
    n = len(tokens)
    out_tokens = np.zeros((n, window), np.int32)
    starts = np.zeros((n, window), bool)
    out_counted = np.zeros((n, window), bool)
    starts[:, 0] = True
    for i, (t, c) in enumerate(zip(tokens, counted)):
        out_tokens[i, :len(t)] = t
        out_counted[i, :len(t)] = c
        if len(t) < window:
            starts[i, len(t)] = True
    return out_tokens, starts, out_counted


# --------------------------------------------------------------------------- batches


class PreferenceBatches:
    """The training and eval batches of preference pairs (the interface of pipeline.Batches)."""

    def __init__(self, data_cfg, seq_len: int, seed: int):
        self.pairs = Pairs(data_cfg, seq_len + 1)
        self.seq_len, self.seed = seq_len, seed
        n = len(self.pairs)
        scores = (name_hashes(self.pairs.names) >> np.uint64(11)).astype(np.float64) / 2.0**53
        held = scores < data_cfg.eval_fraction
        if held.all():  # a tiny file: train on everything, evaluate on it too
            held[:] = False
        self.train = np.flatnonzero(~held)
        self.held_out = np.flatnonzero(held) if held.any() else self.train
        self.reference = None  # [pairs, 2] float32: precomputed reference log-probs (chosen, rejected)
        self.order = {"version": ORDER_VERSION, "source": "preference", "seed": seed, "paths": data_cfg.paths,
                      "tokenizer": data_cfg.tokenizer, "eval_fraction": data_cfg.eval_fraction,
                      "seq_len": seq_len, "pairs": n, "checksum": self.pairs.checksum}
        self._epochs: dict[int, np.ndarray] = {}

    def summary(self) -> str:
        held = (f"{len(self.held_out):,} held out" if self.held_out is not self.train
                else "none held out: eval scores training pairs")
        return (f"data: {len(self.pairs):,} preference pairs ({len(self.train):,} for training, {held}), a row per "
                f"sequence")

    def with_reference(self, table: np.ndarray) -> None:
        """Batches from now on carry each pair's reference log-probs from `table` ([pairs, 2])."""
        self.reference = np.asarray(table, np.float32)

    def _epoch(self, epoch: int) -> np.ndarray:
        if epoch not in self._epochs:
            key = splitmix64(np.array([(self.seed * 1_000_003 + epoch) % 2**64], np.uint64))
            perm = np.argsort(splitmix64(np.arange(len(self.train), dtype=np.uint64) ^ key), kind="stable")
            self._epochs = {e: v for e, v in self._epochs.items() if e == epoch - 1}
            self._epochs[epoch] = self.train[perm]
        return self._epochs[epoch]

    def fields(self, indices) -> dict[str, np.ndarray]:
        """The fields of pairs `indices` (record indices), with their reference log-probs if held."""
        indices = np.asarray(indices, np.int64)
        out = self.pairs.fields(indices)
        if self.reference is not None:
            for column, name in enumerate(REFERENCE_FIELDS):
                values = np.zeros((len(indices), self.seq_len), np.float32)
                values[:, 0] = self.reference[indices, column]
                out[name] = values
        return out

    def train_indices(self, position: int, batch_size: int, rows=None) -> np.ndarray:
        n = len(self.train)
        at = position + (np.arange(batch_size) if rows is None else np.asarray(rows, np.int64))
        return np.array([self._epoch(int(p // n))[int(p % n)] for p in at], np.int64)

    def train_batch(self, state: dict, batch_size: int, rows=None) -> tuple[dict, dict]:
        indices = self.train_indices(self._position(state), batch_size, rows)
        return self.fields(indices), self.advance(state, batch_size)

    def advance(self, state: dict, batch_size: int) -> dict:
        return {"position": self._position(state) + batch_size, "order": dict(self.order)}

    def eval_batch(self, index: int, batch_size: int, rows=None) -> dict[str, np.ndarray]:
        at = index * batch_size + np.arange(batch_size)
        if rows is not None:
            at = at[np.asarray(rows)]
        return self.fields(self.held_out[at % len(self.held_out)])

    def initial_state(self) -> dict:
        return {"position": 0, "order": dict(self.order)}

    def _position(self, state: dict) -> int:
        return data_position(state, self.order)

    def check_resume(self, saved: dict, restart: bool) -> dict:
        order = saved.get("order") if isinstance(saved, dict) else None
        if order == self.order and isinstance(saved.get("position"), int):
            return {"position": saved["position"], "order": dict(self.order)}
        if restart:
            return self.initial_state()
        if isinstance(order, dict) and order.get("source") == "preference":
            changed = next((k for k in self.order if order.get(k) != self.order[k]), "checksum")
            what = {"checksum": "the preference records have changed", "pairs": "the preference records have changed"}
            problem = what.get(changed, f"the checkpoint's data order was made with {changed}={order.get(changed)!r} "
                                        f"but this run has {self.order[changed]!r}")
        else:
            problem = "the checkpoint's data state is not one of preference pairs"
        raise UserError(f"{problem}, so its data position cannot be continued; --config.data.restart=true starts a "
                        f"fresh data order from the first pair.")


def is_preference(data_cfg) -> bool:
    return data_cfg.source == "preference"
