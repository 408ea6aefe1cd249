"""lm-evaluation-harness benchmarks on a trained model: `ushard eval --workdir DIR --tasks NAME[,NAME]`.

`UshardLM` answers lm-eval's three kinds of request with a `TrainedModel`:
- loglikelihood (context, continuation): the summed log-probability of the continuation's tokens
  after the context's, and whether greedy decoding would write exactly them;
- loglikelihood_rolling (text): the whole text's log-likelihood, each token predicted once, in
  windows of the model's length with as much context as fits (lm-eval's rolling windows);
- generate_until (context, {until, max_gen_toks}): the greedy continuation, cut before the first
  stop string, or at the end-of-document token.

A row is one request from position 0, as documents start in training; an empty context is the
end-of-document token, which is what every document follows. Text longer than the window loses its
oldest tokens. Scoring requests are sorted by length and scored `rows` at a time (a multiple of the
devices), padded to the next of a few lengths (powers of two, and the window), so a task compiles a
handful of shapes rather than one per request. The numbers are `evaluate.TokenScorer`'s: log-probabilities
over the model's whole vocabulary, "greedy" among the tokenizer's ids, as `ushard sample` picks.
"""

from __future__ import annotations

import difflib
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from lm_eval.api.model import LM
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from ushard.data.tokenizer import get_tokenizer
from ushard.errors import UserError
from ushard.evaluate import TokenScorer, rows_per_forward
from ushard.sharding import use_layout
from ushard.trained import TrainedModel

DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's own default, for tasks that do not set max_gen_toks
SHORTEST_ROW = 16  # the shortest padded length: shorter ones would only add compilations


class UshardLM(LM):
    """lm-eval's model interface over `trained`, reading text with `tokenizer` (a data.tokenizer
    value), in windows of `window` tokens, `rows` rows per forward pass (default evaluate.DEFAULT_ROWS)."""

    def __init__(self, trained: TrainedModel, tokenizer: str, window: int, rows: int | None = None):
        super().__init__()
        self.tokenizer = get_tokenizer(tokenizer)
        self.window = window
        self.scorer = TokenScorer(trained, self.tokenizer.vocab_size)
        self.rows = rows_per_forward(rows, self.scorer.row_multiple)
        self.lengths = sorted({*(2**k for k in range(4, 31) if SHORTEST_ROW <= 2**k < window), window})
        self.decoder = GreedyDecoder(trained, self.tokenizer.vocab_size, self.scorer.row_multiple)

    # ------------------------------------------------------------------ lm-eval's requests

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        pairs = [self._encode_pair(*request.args) for request in requests]
        results = self._score(pairs, "loglikelihood")
        for request, result in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood", request.args, result)
        return results

    def loglikelihood_rolling(self, requests) -> list[float]:
        windows, owners = [], []
        for i, request in enumerate(requests):
            tokens = self._encode(request.args[0])
            for pair in get_rolling_token_windows(tokens, self.tokenizer.eos_id, self.window, context_len=1):
                windows.append(make_disjoint_window(pair))
                owners.append(i)
        totals = [0.0] * len(requests)
        for owner, (log_prob, _) in zip(owners, self._score(windows, "loglikelihood_rolling windows")):
            totals[owner] += log_prob
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def generate_until(self, requests) -> list[str]:
        results = []
        for request in tqdm(requests, desc="generate_until"):
            context, kwargs = request.args
            until, max_new = _generation_settings(kwargs)
            # Room for the continuation inside the window, but never less than half the window of prompt.
            keep = self.window - min(max_new, self.window // 2)
            prompt = (self._encode(context) or [self.tokenizer.eos_id])[-keep:]
            text = self.decoder.generate(prompt, max_new, self.tokenizer, until)
            self.cache_hook.add_partial("generate_until", request.args, text)
            results.append(text)
        return results

    # ------------------------------------------------------------------ tokens

    def _encode(self, text: str) -> list[int]:
        return [int(t) for t in self.tokenizer.encode(text)]

    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """(context tokens, continuation tokens). Spaces ending the context go to the continuation,
        and the continuation's tokens are those of the joined text after the context's: subword
        tokenizers fold a space into the word after it, so this is how the text is written."""
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        if not context:
            return [self.tokenizer.eos_id], self._encode(continuation)
        whole, head = self._encode(context + continuation), self._encode(context)
        if whole[:len(head)] != head:  # the join merged a token across the boundary: encode the parts apart
            return head, self._encode(continuation)
        return head, whole[len(head):]

    # ------------------------------------------------------------------ scoring

    def _length(self, tokens: int) -> int:
        return next(length for length in self.lengths if length >= tokens)

    def _score(self, pairs: list[tuple[list[int], list[int]]], what: str) -> list[tuple[float, bool]]:
        """(summed log-probability, all greedy) of each pair's continuation after its context."""
        rows = []
        for context, continuation in pairs:
            tokens = (context + continuation)[-(self.window + 1):]  # the oldest tokens go first
            rows.append((tokens, min(len(continuation), len(tokens) - 1)))
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
        results: list = [None] * len(rows)
        for first in tqdm(range(0, len(order), self.rows), desc=f"{what} ({self.rows} rows a batch)"):
            chunk = order[first:first + self.rows]
            length = self._length(max(len(rows[i][0]) - 1 for i in chunk))
            inputs = np.zeros((self.rows, length), np.int32)  # padding after a row's text never reaches it
            targets = np.zeros((self.rows, length), np.int32)
            for r, i in enumerate(chunk):
                tokens = rows[i][0]
                inputs[r, :len(tokens) - 1] = tokens[:-1]
                targets[r, :len(tokens) - 1] = tokens[1:]
            log_probs, greedy = self.scorer(inputs, targets)
            for r, i in enumerate(chunk):
                tokens, scored = rows[i]
                span = slice(len(tokens) - 1 - scored, len(tokens) - 1)
                results[i] = (float(log_probs[r, span].sum()), bool(greedy[r, span].all()))
        return results


def _generation_settings(kwargs) -> tuple[list[str], int]:
    """(stop strings, most new tokens) from a request's generation arguments. Sampling settings are
    ignored: generation here is greedy."""
    kwargs = dict(kwargs or {})
    until = kwargs.get("until") or []
    until = [until] if isinstance(until, str) else list(until)
    max_new = kwargs.get("max_gen_toks", kwargs.get("max_new_tokens", DEFAULT_MAX_GEN_TOKS))
    return until, int(max_new)


class GreedyDecoder:
    """Greedy generation with a KV cache (the model's `decode`), one prompt at a time.

    The cache's fill level is one number for all its rows, so prompts of different lengths cannot
    share a batch; the prompt is copied to the devices' rows instead. It is prefilled padded to a
    power of two, into a cache of that size plus the new tokens: the padding's slots lie past the
    fill level, where attention does not look, and are overwritten by the new tokens. So a task
    compiles a few prefill and step shapes, not one per prompt length; the tokens are those
    `ushard.sample.generate` picks at temperature 0.
    """

    def __init__(self, trained: TrainedModel, vocab: int, rows: int):
        self.trained, self.rows = trained, rows
        model, layout = trained.model, trained.layout
        vocab = min(vocab, model.cfg.vocab_size)

        def step(params, cache, tokens, length):
            positions = jnp.broadcast_to(length + jnp.arange(tokens.shape[1]), tokens.shape)
            with use_layout(layout):
                logits, cache = model.decode(params, tokens, positions, {**cache, "length": length})
            return jnp.argmax(logits[..., :vocab], axis=-1), cache

        self._step = jax.jit(step, donate_argnums=1)

    def generate(self, prompt: list[int], max_new: int, tokenizer, until: list[str]) -> str:
        """The text of up to `max_new` greedy tokens after `prompt`, cut before the first of `until`."""
        padded = max(SHORTEST_ROW, 1 << (len(prompt) - 1).bit_length())
        tokens = np.zeros((self.rows, padded), np.int32)
        tokens[:, :len(prompt)] = prompt
        cache = self.trained.model.init_cache(self.rows, padded + max_new)
        picked, cache = self._step(self.trained.params, cache, jnp.asarray(tokens), jnp.int32(0))
        token, new = int(picked[0, len(prompt) - 1]), []
        while len(new) < max_new and token != tokenizer.eos_id:
            new.append(token)
            text = tokenizer.decode(new)
            stops = [text.index(s) for s in until if s and s in text]
            if stops:
                return text[:min(stops)]
            if len(new) < max_new:
                column = np.full((self.rows, 1), token, np.int32)
                picked, cache = self._step(self.trained.params, cache, jnp.asarray(column),
                                           jnp.int32(len(prompt) + len(new) - 1))
                token = int(picked[0, 0])
        return tokenizer.decode(new)


# --------------------------------------------------------------------------- running tasks


def task_manager(names: list[str], include_path: str | None = None):
    """lm-eval's index of tasks that knows every name (UserError naming one it does not). Indexing
    lm-eval's own thousands of tasks takes seconds: tasks all found under `include_path` skip it."""
    from lm_eval.tasks import TaskManager

    if not names:
        raise UserError("--tasks names no task; give one or more, separated by commas.")
    if include_path is not None and not os.path.isdir(include_path):
        raise UserError(f"--include_path {include_path} is not a directory of task YAML files.")
    if include_path is not None:
        own = TaskManager(include_path=include_path, include_defaults=False)
        if all(name in own.all_tasks for name in names):
            return own
    manager = TaskManager(include_path=include_path)
    for name in names:
        if name not in manager.all_tasks and not os.path.isfile(name):
            close = difflib.get_close_matches(name, manager.all_tasks, n=3)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise UserError(f"unknown lm-eval task {name!r}{hint}; `lm-eval ls tasks` lists them, and "
                            f"--include_path DIR adds a directory of your own task YAML files.")
    return manager


def run_tasks(trained: TrainedModel, tokenizer: str, window: int, tasks: list[str], manager=None,
              num_fewshot=None, limit=None, output=None, rows=None) -> dict:
    """lm-eval's `simple_evaluate` of `tasks` on the model; its results dict. `manager`: the tasks'
    index (default: `task_manager(tasks)`, lm-eval's own tasks). `output`: a JSON file for the whole
    of it, per-example requests and responses (`samples`) included."""
    from lm_eval import simple_evaluate

    if num_fewshot is not None and num_fewshot < 0:
        raise UserError(f"--num_fewshot={num_fewshot} must be 0 or more.")
    if limit is not None and limit <= 0:
        raise UserError(f"--limit={limit:g} must be a number of examples (or a fraction below 1) above 0.")
    manager = task_manager(tasks) if manager is None else manager
    model = UshardLM(trained, tokenizer, window, rows)
    if limit is not None and limit >= 1:
        limit = int(limit)
    try:
        results = simple_evaluate(model=model, tasks=tasks, task_manager=manager, num_fewshot=num_fewshot,
                                  limit=limit, log_samples=output is not None)
    except ConnectionError as e:  # a task's data set, to be downloaded with no network (or HF_*_OFFLINE set)
        raise UserError(f"a task's data could not be fetched ({' '.join(str(e).split())}); run once with a "
                        f"network connection to cache it.") from None
    if output:
        os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
        with open(output, "w") as f:
            json.dump(results, f, indent=2, default=plain)
    return results


def plain(value):
    """A JSON-ready stand-in for what lm-eval's results hold beyond JSON: numpy scalars, sets, types."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, (set, tuple)):
        return list(value)
    return str(value)


def results_table(results: dict) -> str:
    """lm-eval's own Markdown table of the results (and of the groups, where tasks form any)."""
    from lm_eval.utils import make_table

    table = make_table(results)
    return table + "\n" + make_table(results, "groups") if results.get("groups") else table
