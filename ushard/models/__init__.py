"""Transformer models. They name logical axes only; ushard.sharding maps those onto a mesh."""
