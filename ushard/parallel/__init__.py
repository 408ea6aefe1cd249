"""The parallelisms XLA cannot derive from shardings alone: explicit `jax.shard_map` code, one module each.

Each module knows the Layout (which mesh axes a logical name maps to) and no model layer; the model
reaches them through one seam each (context.py: the attention kernel; pipeline.py: the layer stack;
expert.py: an MoE layer's routed experts).
"""
