"""Tokenizers. The byte tokenizer needs no vocabulary file: tokens 0-255 are bytes, 256 ends a document."""

from __future__ import annotations

import numpy as np


class ByteTokenizer:
    vocab_size = 257
    eos_id = 256

    def encode(self, text: bytes | str) -> np.ndarray:
        data = text.encode("utf-8") if isinstance(text, str) else text
        return np.frombuffer(data, dtype=np.uint8).astype(np.uint16)

    def decode(self, tokens) -> str:
        data = bytes(int(t) for t in tokens if 0 <= int(t) < 256)
        return data.decode("utf-8", errors="replace")


TOKENIZERS = {"byte": ByteTokenizer}


def get_tokenizer(name: str):
    return TOKENIZERS[name]()
