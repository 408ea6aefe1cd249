"""Context parallelism on cuDNN blocks (ushard/kernels/cudnn.py) on GPUs: skipped elsewhere (CI has none).

On a machine with two or more GPUs: `JAX_PLATFORMS=cuda python -m pytest tests/test_cudnn_blocks.py -n 0`.
The sequence split over the GPUs (ring and all-gather), bfloat16 inputs, against plain float32
attention on one device. The CPU suite proves the plumbing with a jnp kernel of the same contract
(test_context_parallel.py); this proves cuDNN keeps that contract. Both modes passed on 4 H200s
(2026-11-27, the local blocks as one causal call).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import loss_and_grads, reference_attention, sequence_layout
from ushard.models.attention import causal_attention
from ushard.parallel import context
from ushard.sharding import use_layout

GPUS = [d for d in jax.devices() if d.platform == "gpu"]
pytestmark = pytest.mark.skipif(len(GPUS) < 2, reason="needs two or more GPUs")
TOLERANCE = 2e-2  # bfloat16 inputs and outputs, float32 statistics


@pytest.mark.parametrize("mode", ["ring", "all_gather"])
def test_cudnn_blocks_of_a_split_sequence_match_float32_attention(mode):
    n = 4 if len(GPUS) >= 4 else 2
    rng = np.random.default_rng(0)
    b, t, heads, kv_heads, hd = 2, 2 * n * 256, 8, 2, 128
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)  # noqa: E731
    q_shape, kv_shape = (b, t, heads, hd), (b, t, kv_heads, hd)
    q, k, v, weights = normal(*q_shape), normal(*kv_shape), normal(*kv_shape), normal(*q_shape)
    layout = sequence_layout(n, mode, zigzag=True, impl="cudnn")

    def split_attention(q, k, v, segments):
        with use_layout(layout):
            q, k, v = context.reordered((q, k, v), layout)
            q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
            out = causal_attention(q, k, v, None, "cudnn")
        return context.zigzag(out.astype(jnp.float32), n, inverse=True)

    hlo = jax.jit(split_attention).lower(q, k, v, None).as_text()
    assert "cudnn" in hlo, "the blocks did not run on cuDNN"
    outputs = [jax.jit(attention)(q, k, v, None) for attention in (split_attention, reference_attention)]
    _, want_grads = loss_and_grads(reference_attention, q, k, v, None, weights)
    _, got_grads = loss_and_grads(split_attention, q, k, v, None, weights)
    for name, got, want in zip(("out", "q", "k", "v"), (outputs[0], *got_grads), (outputs[1], *want_grads)):
        assert np.linalg.norm(got - want) <= TOLERANCE * np.linalg.norm(want), name

