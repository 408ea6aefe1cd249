"""`ushard eval` without `--tasks`: the perplexity of a trained model on a data source.

By default the source is the run's own held-out split, built from the data settings, train.seq_len,
train.batch_size and piece length saved with the checkpoint: the very batches training scored, so
`--batches N` with N = train.eval_batches (the default) gives the `eval_loss` it logged.
`--config.data.*` overrides score other data; they are also how an imported Hugging Face checkpoint
(`--hf`), which has no data settings, is told what to score.

The loss is the sum of next-token cross-entropy over the tokens `loss_mask` counts, divided by their
count, as training computes it (on chat data only the assistant's tokens count, and so here too).

`TokenScorer` is the one forward pass of evaluation, shared with the lm-eval adapter
(lm_eval_adapter.py): each target token's log-probability and whether it is the model's likeliest
next token, over rows that may pack several documents (segment_ids and positions, as in training).
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from ushard.checkpoint import Checkpoints
from ushard.config import apply_override_dict, apply_overrides, check_settings, default_config
from ushard.data import make_batches
from ushard.errors import UserError
from ushard.sharding import use_layout
from ushard.trained import TrainedModel, load_model
from ushard.training.loss import token_cross_entropy

# Rows of one forward pass, unless asked otherwise: evaluation batches (train.batch_size rows, sized
# for a training mesh) are scored in parts of this many, so the logits [rows, seq_len, vocab] fit
# on the devices used here.
DEFAULT_ROWS = 8
# The longest window an imported checkpoint is scored in when --seq_len does not say (its
# max_position_embeddings, if shorter).
HF_MAX_SEQ_LEN = 2048


class TokenScorer:
    """`scorer(inputs, targets, positions=None, segment_ids=None)` -> (log-probabilities [rows, length]
    of each target, whether each target is the likeliest next token), numpy.

    Log-probabilities are over the model's whole vocabulary (the distribution training fit, as its
    loss does); "likeliest" is among the tokenizer's `vocab` ids, as `ushard sample` picks. Without
    positions and segment_ids every row is one document from position 0, like `TrainedModel`. A
    call's rows must be a multiple of the devices (`row_multiple`); each new shape compiles once.
    """

    def __init__(self, trained: TrainedModel, vocab: int | None = None):
        self.trained = trained
        self.row_multiple = trained.layout.mesh.size
        model, layout = trained.model, trained.layout
        vocab = model.cfg.vocab_size if vocab is None else min(vocab, model.cfg.vocab_size)

        def score(params, inputs, targets, positions, segment_ids):
            if positions is None:
                positions = jnp.broadcast_to(jnp.arange(inputs.shape[1]), inputs.shape)
            with use_layout(layout):
                logits = model.apply(params, inputs, positions, segment_ids)[0]
                log_probs = -token_cross_entropy(logits, targets)  # training's loss, term for term
            greedy = jnp.argmax(logits[..., :vocab], axis=-1) == targets
            return log_probs, greedy

        self._score = jax.jit(score)

    def __call__(self, inputs, targets, positions=None, segment_ids=None) -> tuple[np.ndarray, np.ndarray]:
        if len(inputs) % self.row_multiple:  # a caller's bug: they pad to row_multiple
            raise ValueError(f"{len(inputs)} rows do not split over {self.row_multiple} devices")
        as_ids = lambda a: None if a is None else jnp.asarray(np.asarray(a, np.int32))  # noqa: E731
        log_probs, greedy = self._score(self.trained.params, as_ids(inputs), as_ids(targets), as_ids(positions),
                                        as_ids(segment_ids))
        return np.asarray(log_probs), np.asarray(greedy)


def rows_per_forward(rows: int | None, devices: int) -> int:
    """`rows` (default DEFAULT_ROWS) rounded up to a multiple of the devices."""
    rows = DEFAULT_ROWS if rows is None else rows
    if rows < 1:
        raise UserError(f"--batch_size={rows} must be at least 1 row per forward pass.")
    return -(-rows // devices) * devices


# --------------------------------------------------------------------------- the model and its settings


@dataclass
class EvalSetup:
    """A model to evaluate and the settings that say what to score: `config.data` and `config.train`'s
    seq_len, batch_size, seed and eval_batches (the run's, with the user's data.* overrides)."""

    trained: TrainedModel
    config: ml_collections.ConfigDict
    source: str  # what the data is, for the report: "the run's held-out split" or the overrides
    data_state: dict | None  # the checkpoint's data position (its piece length); None: none applies

    @property
    def seq_len(self) -> int:
        return self.config.train.seq_len


def load(workdir: str | None = None, hf: str | None = None, overrides=(), seq_len: int | None = None,
         devices=None, need_data: bool = True, log=print) -> EvalSetup:
    """The model in `workdir`'s newest checkpoint or in Hugging Face directory `hf` (exactly one), with
    its data settings: the saved config's, under `overrides` (`data.KEY=VALUE` strings; nothing
    else). `need_data`: an `hf` model must be told what data to score (perplexity, not benchmarks)."""
    if (workdir is None) == (hf is None):
        raise UserError("eval takes either --workdir DIR (a training run) or --hf PATH (a Hugging Face checkpoint).")
    overrides = [o.removeprefix("--config.") for o in overrides]
    for item in overrides:
        if not item.startswith("data."):
            raise UserError(f"eval takes only --config.data.* overrides, which say what data to score, not "
                            f"--config.{item}; the model's settings come from its checkpoint.")
    if seq_len is not None and seq_len < 1:
        raise UserError(f"--seq_len={seq_len} must be at least 1 token.")
    if workdir is not None:
        trained = load_model(workdir, devices, log=log)
        saved, data_state = _saved_items(workdir, trained.step)
        defaults = {}
    else:
        from ushard import hf_convert as hf_checkpoint

        trained = hf_checkpoint.from_hf(hf, devices)
        saved, data_state = {}, None
        defaults = _hf_defaults(hf, overrides, need_data)
    config = _eval_config(saved, defaults, overrides, trained.model.cfg.vocab_size, seq_len)
    if overrides:
        data_state = None  # another source: the run's data position means nothing there
        source = " ".join(f"--config.{o}" for o in overrides)
    else:
        source = "the run's held-out split"
    return EvalSetup(trained, config, source, data_state)


def _saved_items(workdir: str, step: int) -> tuple[dict, dict]:
    """(the config, the data state) saved with checkpoint `step` of `workdir`."""
    import orbax.checkpoint as ocp

    checkpoints = Checkpoints(workdir, create=False)
    try:
        items = checkpoints.manager.restore(
            step, args=ocp.args.Composite(config=ocp.args.JsonRestore(), data=ocp.args.JsonRestore()))
    finally:
        checkpoints.close()
    return items["config"], items["data"]


def _hf_defaults(path: str, overrides: list[str], need_data: bool) -> dict:
    """The settings an imported checkpoint starts from: its tokenizer.json, a window it was made for."""
    given = {o.split("=", 1)[0] for o in overrides}
    if need_data and not given & {"data.source", "data.paths"}:
        raise UserError(f"--hf {path} holds no data settings; say what to score with --config.data.source=... "
                        f"and --config.data.paths=... (--config.data.source=stdlib for the built-in text).")
    defaults = {}
    tokenizer = os.path.join(path, "tokenizer.json")
    if os.path.isfile(tokenizer):
        defaults["data.tokenizer"] = tokenizer
    elif "data.tokenizer" not in given:
        raise UserError(f"--hf {path} holds no tokenizer.json; name the model's tokenizer with "
                        f"--config.data.tokenizer=PATH/tokenizer.json (or byte).")
    from ushard.hf import read_config

    positions = read_config(path).get("max_position_embeddings")
    defaults["train.seq_len"] = min(HF_MAX_SEQ_LEN, positions) if isinstance(positions, int) else HF_MAX_SEQ_LEN
    return defaults


def _eval_config(saved: dict, defaults: dict, overrides: list[str], vocab_size: int, seq_len: int | None):
    """default_config() with the saved data and train settings this version knows, `defaults`, the
    user's overrides and `seq_len`, checked as `ushard train` checks them (the tokenizer against the
    model's vocabulary among them)."""
    config = default_config()
    known = {
        group: {k: v for k, v in saved.get(group, {}).items()
                if k in config[group] and not isinstance(config[group][k], ml_collections.ConfigDict)}
        for group in ("data", "train")
    }
    apply_override_dict(config, known)
    apply_override_dict(config, defaults)
    apply_overrides(config, overrides)
    if seq_len is not None:
        config.train.seq_len = seq_len
    config.model.vocab_size = vocab_size  # the one model setting the data checks depend on
    check_settings(config)
    return config


# --------------------------------------------------------------------------- perplexity


@dataclass
class Perplexity:
    loss: float  # mean cross-entropy (nats) per counted token
    perplexity: float  # exp(loss)
    tokens: int  # the targets counted (loss_mask)
    batches: int
    rows: int  # per batch
    seq_len: int
    source: str
    step: int  # the checkpoint's training step (0: imported)

    def as_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        batches = f"{self.batches} batch" + ("es" if self.batches > 1 else "")
        return (f"loss {self.loss:.4f}, perplexity {self.perplexity:.3f} over {self.tokens:,} tokens "
                f"({batches} of {self.rows} x {self.seq_len} from {self.source}; step {self.step})")


def perplexity(setup: EvalSetup, batches: int | None = None, rows: int | None = None, log=print) -> Perplexity:
    """Scores `batches` eval batches (default train.eval_batches) of `setup`'s data: each batch is
    train.batch_size rows, fed `rows` (default DEFAULT_ROWS) at a time."""
    t = setup.config.train
    if batches is None:  # the run's own count; a run that never evaluated (0) gets the default one
        batches = t.eval_batches or default_config().train.eval_batches
    if batches < 1:
        raise UserError(f"--batches={batches} must be at least 1.")
    data = make_batches(setup.config.data, t.seq_len, t.seed)
    if setup.data_state is not None:
        data.check_resume(setup.data_state, restart=True)  # adopts the checkpoint's piece length, if it applies
        if data.order != setup.data_state.get("order"):
            log("ushard: note: the run's data has changed since the checkpoint (or its piece length no longer "
                "applies): these are not the batches training scored.")
    scorer = TokenScorer(setup.trained)
    part = rows_per_forward(rows, scorer.row_multiple)
    loss, count = 0.0, 0
    for index in range(batches):
        batch = data.eval_batch(index, t.batch_size)
        for first in range(0, t.batch_size, part):
            rows_here = {k: _pad_rows(v[first:first + part], part) for k, v in batch.items()}
            log_probs, _ = scorer(rows_here["inputs"], rows_here["targets"], rows_here["positions"],
                                  rows_here["segment_ids"])
            mask = rows_here["loss_mask"].astype(np.float64)
            loss -= float(np.sum(log_probs.astype(np.float64) * mask))
            count += int(mask.sum())
    if count == 0:
        raise UserError(f"the {batches} batches of {setup.source} hold no counted tokens (loss_mask is 0 "
                        f"everywhere); score other data.")
    mean = loss / count
    return Perplexity(mean, math.exp(mean), count, batches, t.batch_size, t.seq_len, setup.source,
                      setup.trained.step)


def _pad_rows(array: np.ndarray, rows: int) -> np.ndarray:
    """`array` with zero rows after it up to `rows` (a zero loss_mask: they count for nothing)."""
    return np.pad(array, ((0, rows - len(array)), (0, 0))) if len(array) < rows else array
