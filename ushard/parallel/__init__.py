"""The parallelisms XLA cannot derive from shardings alone: explicit `jax.shard_map` code, one module each.

Each module knows the Layout (which mesh axes a logical name maps to) and no model layer; the model
reaches them through the active layout's `Seams`, which `build` fills from `SEAMS` (context.py:
attention over a split sequence; pipeline.py: the layer stack; expert.py: an MoE layer's routed
experts). The model imports none of this package.
"""

from ushard.parallel.context import attention as _context_attention
from ushard.parallel.expert import routed_experts as _routed_experts
from ushard.parallel.pipeline import run_stages as _run_stages
from ushard.sharding import Seams

SEAMS = Seams(run_stack=_run_stages, context_attention=_context_attention, routed_experts=_routed_experts)
