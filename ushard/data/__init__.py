"""Data: documents from a source, a tokenizer, packing into windows, and the global batch of a step."""

from ushard.data.pipeline import Batches, make_batches

__all__ = ["Batches", "make_batches"]
