"""Tokenizers: `data.tokenizer` is "byte" or the path of a Hugging Face `tokenizer.json`.

The byte tokenizer needs no vocabulary file: tokens 0-255 are bytes, 256 ends a document. A
Hugging Face tokenizer is read with the `tokenizers` library (the `data` extra); its end
of document is its first special token named like one (EOS_NAMES), and its vocabulary size counts the
added tokens, since their ids index the embedding too.
"""

from __future__ import annotations

import codecs
import functools
import os

import numpy as np

from ushard.errors import UserError, install_hint

# The end-of-document tokens of the common tokenizer families, most specific first: Llama 3
# (<|end_of_text|>), GPT-2 / Qwen (<|endoftext|>), Llama 2 / Mistral (</s>), Gemma (<eos>).
EOS_NAMES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>")


def token_dtype(vocab_size: int):
    """The smallest unsigned integer type that holds every token id."""
    return np.uint16 if vocab_size <= 2**16 else np.uint32


class ByteTokenizer:
    vocab_size = 257
    eos_id = 256

    def encode(self, text: bytes | str) -> np.ndarray:
        data = text.encode("utf-8") if isinstance(text, str) else text
        return np.frombuffer(data, dtype=np.uint8).astype(np.uint16)

    def decode(self, tokens) -> str:
        data = bytes(int(t) for t in tokens if 0 <= int(t) < 256)
        return data.decode("utf-8", errors="replace")

    def incremental_decoder(self):
        """decode(token, final=False) -> the text this token completes: a character split over several
        tokens comes out whole. token None with final=True flushes the rest."""
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

        def decode(token, final=False):
            return decoder.decode(bytes([token]) if token is not None and token < 256 else b"", final=final)

        return decode


class HFTokenizer:
    """A Hugging Face `tokenizer.json`, encoding without special tokens (a document is its text and EOS)."""

    def __init__(self, path: str):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise UserError(f"data.tokenizer={path!r} needs the `tokenizers` library; "
                            f"{install_hint('data')}.") from None
        try:
            self._tokenizer = Tokenizer.from_file(path)
        except Exception as e:  # the file is user input; the library's errors are many and untyped
            reason = " ".join(str(e).split()).rstrip(".")
            raise UserError(f"data.tokenizer={path!r} is not a Hugging Face tokenizer.json ({reason}).") from None
        self.path = path
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        self.eos_id = self._find_eos()
        self._dtype = token_dtype(self.vocab_size)

    def token_id(self, token: str) -> int | None:
        """The id of one token's text (a special token's), None where the vocabulary has no such token."""
        return self._tokenizer.token_to_id(token)

    def _find_eos(self) -> int:
        for name in EOS_NAMES:
            token_id = self.token_id(name)
            if token_id is not None:
                return token_id
        raise UserError(f"data.tokenizer={self.path!r} has none of the end-of-document tokens "
                        f"{', '.join(EOS_NAMES)}; ushard ends every document with one.")

    def encode(self, text: bytes | str) -> np.ndarray:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return np.array(self._tokenizer.encode(text, add_special_tokens=False).ids, self._dtype)

    def encode_with_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """Token ids and the character each token starts at (how a chat's turns are told apart)."""
        encoding = self._tokenizer.encode(text, add_special_tokens=False)
        return np.array(encoding.ids, self._dtype), np.array([start for start, _ in encoding.offsets], np.int64)

    def decode(self, tokens) -> str:
        return self._tokenizer.decode([int(t) for t in tokens], skip_special_tokens=True)

    def incremental_decoder(self):
        """As ByteTokenizer's: the text so far is decoded again each time (a token's text can depend on
        its neighbours), and held back while it ends in an incomplete character."""
        tokens, shown = [], 0

        def decode(token, final=False):
            nonlocal shown
            if token is not None:
                tokens.append(token)
            text = self.decode(tokens)
            if text.endswith("\ufffd") and not final:
                return ""
            new, shown = text[shown:], len(text)
            return new

        return decode


TOKENIZERS = {"byte": ByteTokenizer}


def special_token_text(value) -> str | None:
    """A special token as tokenizer_config.json holds it (`eos_token` and the like): a string, or an
    object with its "content"; None for anything else (null, a missing key)."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def tokenizer_file(name: str) -> str:
    """The tokenizer.json that `data.tokenizer` names: the path itself, or tokenizer.json in that directory."""
    path = os.path.expanduser(name)
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(path):
        raise UserError(f"data.tokenizer={name!r} is neither {' nor '.join(map(repr, TOKENIZERS))} nor a Hugging Face "
                        f"tokenizer.json (a file, or a directory holding one).")
    return path


@functools.lru_cache(maxsize=8)
def _hf_tokenizer(path: str, modified: float) -> HFTokenizer:
    return HFTokenizer(path)


def get_tokenizer(name: str):
    """The tokenizer `data.tokenizer` names; a file is read once (again only after it changes)."""
    if name in TOKENIZERS:
        return TOKENIZERS[name]()
    path = tokenizer_file(name)
    return _hf_tokenizer(path, os.path.getmtime(path))
