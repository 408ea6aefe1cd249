"""The parallelisms XLA cannot derive from shardings alone, each an explicit `shard_map` in one module."""
