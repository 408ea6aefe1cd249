"""Fine-tuning examples: conversations (data.source="chat") and prompt / completion records, each made
into tokens with a mask of the tokens the loss counts.

A conversation is a JSONL line `{"messages": [{"role": ..., "content": ...}, ...]}` (the OpenAI and
Hugging Face form), roles system, user, assistant and tool. It is rendered with a chat template:
- a Hugging Face tokenizer's own, from `chat_template.jinja` or `tokenizer_config.json` beside its
  tokenizer.json, rendered with jinja2 as `transformers`' `apply_chat_template` renders it;
- with the byte tokenizer, the built-in BYTE_TEMPLATE below.

Which tokens are the assistant's: rendering the first i messages with the generation prompt gives the
text before assistant turn i, and rendering the first i + 1 the text through its end (the turn's end
token included). So the turn is the characters between the two, and its tokens are those that start
there (the tokenizer's character offsets). That needs a template under which a conversation's
rendering begins with the rendering of each of its beginnings, as the common templates do; one that
rewrites earlier turns once later ones follow is refused with a sentence.

An example longer than a window (train.seq_len + 1 tokens) is cut after the last whole turn that
fits and still leaves a counted token; where none does, at the window.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os

import numpy as np

from ushard.data.sources import read_bytes
from ushard.data.tokenizer import HFTokenizer, special_token_text
from ushard.errors import UserError, install_hint

# The byte tokenizer's template: each turn is a header line `<|role|>` then its content; a user,
# system or tool turn ends with a newline, an assistant turn with the end-of-document token (what the
# model learns to emit when its answer is done). The prompt for an answer is "<|assistant|>\n".
BYTE_TEMPLATE = "<|{role}|>\n{content}"
BYTE_ANSWER_PROMPT = "<|assistant|>\n"


@dataclasses.dataclass
class Example:
    """One training document: its tokens, which of them the loss counts, and where its turns end."""

    tokens: np.ndarray
    counted: np.ndarray  # bool per token
    turn_ends: list[int]  # token index just after each turn: where a truncation may cut


# --------------------------------------------------------------------------- templates


class ByteTemplate:
    """BYTE_TEMPLATE, built token by token (the end-of-document token is no character)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def example(self, messages: list[dict], name: str) -> Example:
        parts, counted, turn_ends, n = [], [], [], 0
        for m in messages:
            header = self.tokenizer.encode(BYTE_TEMPLATE.format(role=m["role"], content=""))
            body = self.tokenizer.encode(m["content"])
            answer = m["role"] == "assistant"
            end = np.array([self.tokenizer.eos_id] if answer else self.tokenizer.encode("\n"), header.dtype)
            parts += [header, body, end]
            counted += [np.zeros(len(header), bool), np.full(len(body) + len(end), answer)]
            n += len(header) + len(body) + len(end)
            turn_ends.append(n)
        return Example(np.concatenate(parts), np.concatenate(counted), turn_ends)


class HFChatTemplate:
    """A Hugging Face tokenizer's chat template, rendered as `transformers` renders it."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        directory = os.path.dirname(tokenizer.path)
        self.source, source_text, tokenizer_config = self._find(directory)
        try:
            import jinja2
            from jinja2.ext import loopcontrols
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError:
            raise UserError("data.source='chat' with a Hugging Face tokenizer needs jinja2 for its chat template; "
                            f"{install_hint('data')}.") from None
        self._errors = (jinja2.TemplateError, TemplateRaised)
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(source_text)
        except jinja2.TemplateError as e:
            raise UserError(f"the chat template in {self.source} is not valid jinja2 ({e}).") from None
        # The special tokens a template may name (bos_token, eos_token, ...), as strings.
        self._tokens = {key: special_token_text(value) for key, value in tokenizer_config.items()
                        if key.endswith("_token") and special_token_text(value) is not None}

    @staticmethod
    def _find(directory: str) -> tuple[str, str, dict]:
        """(where the template came from, its text, tokenizer_config.json's contents)."""
        config_path = os.path.join(directory, "tokenizer_config.json")
        config = {}
        if os.path.isfile(config_path):
            try:
                config = json.loads(read_bytes(config_path))
            except json.JSONDecodeError as e:
                raise UserError(f"{config_path} is not valid JSON ({e}).") from None
        jinja_path = os.path.join(directory, "chat_template.jinja")
        if os.path.isfile(jinja_path):
            return jinja_path, read_bytes(jinja_path).decode("utf-8"), config
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        if not isinstance(template, str):
            raise UserError(f"the tokenizer in {directory} has no chat template (neither chat_template.jinja nor a "
                            f"chat_template in tokenizer_config.json), which data.source='chat' renders "
                            f"conversations with; add one, or use data.tokenizer='byte' for the built-in one.")
        return config_path, template, config

    def render(self, messages: list[dict], add_generation_prompt: bool = False, name: str = "") -> str:
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **self._tokens)
        except self._errors as e:
            raise UserError(f"the chat template in {self.source} failed to render the conversation {name} "
                            f"({' '.join(str(e).split()).rstrip('.')}).") from None

    def example(self, messages: list[dict], name: str) -> Example:
        text = self.render(messages, name=name)
        ids, starts = self.tokenizer.encode_with_offsets(text)
        counted = np.zeros(len(ids), bool)
        turn_ends = []
        for i, m in enumerate(messages):
            through = self.render(messages[:i + 1], name=name)
            answer = m["role"] == "assistant"
            before = self.render(messages[:i], add_generation_prompt=True, name=name) if answer and i else ""
            if not (text.startswith(through) and through.startswith(before)):
                raise UserError(
                    f"the chat template in {self.source} renders the start of {name} differently once later "
                    f"turns follow, so the assistant's tokens cannot be told apart; a template that renders "
                    f"turns in order is needed.")
            if answer:
                counted |= (starts >= len(before)) & (starts < len(through))
            turn_ends.append(int(np.searchsorted(starts, len(through))))
        return Example(ids, counted, turn_ends)


class TemplateRaised(Exception):
    """A template's own `raise_exception(message)`."""


def _raise(message):
    raise TemplateRaised(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def chat_template(tokenizer):
    return HFChatTemplate(tokenizer) if isinstance(tokenizer, HFTokenizer) else ByteTemplate(tokenizer)


def prompt_completion(tokenizer, prompt: str, completion: str) -> Example:
    """A prompt / completion record: its two texts end to end, then the end-of-document token; the
    completion and that token count."""
    p, c = tokenizer.encode(prompt), tokenizer.encode(completion)
    tokens = np.concatenate([p, c, np.array([tokenizer.eos_id], p.dtype)])
    return Example(tokens, np.arange(len(tokens)) >= len(p), [len(p), len(tokens)])


# --------------------------------------------------------------------------- fitting a window


@dataclasses.dataclass
class FitCounts:
    """What fitting the examples into windows did, for the line the run starts with."""

    whole: int = 0
    at_turn: int = 0  # cut after a whole turn
    mid_turn: int = 0  # no turn boundary fitted: cut at the window
    skipped: int = 0  # no counted token left

    def describe(self, what: str) -> str:
        used = self.whole + self.at_turn + self.mid_turn
        return (f"{used:,} of {used + self.skipped:,} {what} used ({self.whole:,} whole, {self.at_turn:,} cut at a "
                f"turn boundary, {self.mid_turn:,} cut mid-turn to fit a window), {self.skipped:,} skipped (no "
                f"token that counts in the loss fitted)")


def fit_window(example: Example, window: int, all_count: bool, counts: FitCounts) -> Example | None:
    """The example cut to at most `window` tokens (see the module docstring); None if nothing in it counts."""
    counted = np.ones(len(example.tokens), bool) if all_count else example.counted
    n, how = len(example.tokens), "whole"
    if n > window:
        fits = [end for end in example.turn_ends if end <= window and counted[:end].any()]
        n, how = (fits[-1], "at_turn") if fits else (window, "mid_turn")
    if not counted[:n].any():
        how = "skipped"
    setattr(counts, how, getattr(counts, how) + 1)
    if how == "skipped":
        return None
    return Example(example.tokens[:n], counted[:n], [e for e in example.turn_ends if e <= n])
