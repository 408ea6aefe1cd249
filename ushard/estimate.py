"""Per-device memory of a train step, estimated without compiling it (groundwork of the planner, issue 27).

- The training state (parameters, optimizer state, step counters) and the batch: exact, the bytes of
  each array's shard under the layout's shardings.
- Temporaries: what the backward pass keeps of the forward (JAX's own list of saved residuals under
  the model's remat policy, `saved_residuals`, traced for one device's share of the batch), plus one
  layer's full activations (the layer whose backward pass runs; under remat, the one recomputed),
  plus the gradients in float32, laid out as the ZeRO stage lays them out.

Covered so far: layouts that split only the batch (`data`, `fsdp`, any ZeRO stage) and every remat
policy; the activations of tensor, sequence, context, pipeline and expert layouts are not modelled
yet (`estimate` refuses them). Checked against XLA's memory analysis in tests/test_estimate.py.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import ad_checkpoint

from ushard.models.definition import model_definition
from ushard.training.step import objective_terms

# Mesh axes whose split changes more than the batch each device holds (not modelled yet).
UNMODELLED_AXES = ("tensor", "sequence", "pipeline", "expert")


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per device."""

    state: int  # parameters, optimizer state, counters
    batch: int
    saved_activations: int  # kept by the forward pass for the backward pass
    layer_activations: int  # one layer's activations while its backward pass runs
    gradients: int  # float32, laid out as the ZeRO stage lays them out

    @property
    def temporaries(self) -> int:
        return self.saved_activations + self.layer_activations + self.gradients

    @property
    def peak(self) -> int:
        return self.state + self.batch + self.temporaries


def shard_bytes(tree) -> int:
    """The bytes of one device's shard of every array in `tree` (ShapeDtypeStructs with shardings)."""
    return sum(math.prod(leaf.sharding.shard_shape(leaf.shape)) * jnp.dtype(leaf.dtype).itemsize
               for leaf in jax.tree.leaves(tree))


def estimate(setup) -> MemoryEstimate:
    """The per-device memory of `setup`'s train step (ushard.build's Setup); module docstring."""
    split = [a for a in UNMODELLED_AXES if setup.layout.mesh.shape[a] > 1]
    if split:
        raise NotImplementedError(f"the memory estimate does not model activations split over {split} yet")
    state = setup.steps.abstract_state()
    t = setup.config.train
    rows = t.batch_size // t.grad_accum // setup.layout.size("act_batch")
    token_ids = jax.ShapeDtypeStruct((t.batch_size, t.seq_len), jnp.int32, sharding=setup.layout.batch)
    batch = shard_bytes(dict.fromkeys(setup.steps.batch_shardings, token_ids))
    saved = saved_activations(setup, rows, setup.model_config.remat)
    every_layer = saved_activations(setup, rows, "none")
    gradients = jax.tree.map(lambda p, s: jax.ShapeDtypeStruct(p.shape, jnp.float32, sharding=s), state.params,
                             setup.steps.shardings.grads)
    # With gradient accumulation the running sum and one microbatch's gradients exist together.
    copies = 2 if t.grad_accum > 1 else 1
    return MemoryEstimate(state=shard_bytes(state), batch=batch, saved_activations=saved,
                          layer_activations=every_layer // setup.model_config.n_layers,
                          gradients=copies * shard_bytes(gradients))


def saved_activations(setup, rows: int, remat: str) -> int:
    """The bytes the backward pass keeps of a forward pass over `rows` sequences on one device, with
    the model's layers under the remat policy `remat` (JAX's list of saved residuals, arguments excluded)."""
    model = model_definition(dataclasses.replace(setup.model_config, remat=remat))
    params = jax.eval_shape(lambda: model.init(0))
    token_ids = jax.ShapeDtypeStruct((rows, setup.config.train.seq_len), jnp.int32)
    batch = dict.fromkeys(setup.steps.batch_shardings, token_ids)

    def objective(params, batch):
        logits, aux = model.apply(params, batch["inputs"], batch["positions"], batch["segment_ids"])
        return objective_terms(logits, aux, batch)[0]

    residuals = ad_checkpoint.saved_residuals(objective, params, batch)
    return sum(int(np.prod(aval.shape)) * jnp.dtype(aval.dtype).itemsize
               for aval, source in residuals if not source.startswith("from the argument"))
