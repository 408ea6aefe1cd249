"""Data: documents from a source, a tokenizer, pieces packed into a stream, and the global batch at a position."""

from ushard.data.pipeline import Batches, make_batches
from ushard.data.placement import local_block, place_batch

__all__ = ["Batches", "local_block", "make_batches", "place_batch"]
