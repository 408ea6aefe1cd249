"""cuDNN flash attention as the blocks of context parallelism's ring (`kernels.attention.BlockKernel`, GPUs).

The ring needs two things `jax.nn.dot_product_attention` does not give: each block's float32
log-sum-exp, to combine blocks, and a backward pass fed the *final* output and log-sum-exp of the
queries over all blocks (flash attention's own backward, which makes a block's gradients exact
without the others). JAX's cuDNN module has both one level below its public function: the forward
with `return_residual=True`, and the backward primitive, which takes the statistics and output it is
given. They are JAX internals: the signatures used here are the same in JAX 0.10.2 and 0.11.2, and
the recipe was checked against a float32 reference on an H200 (docs/dev-notes.md).
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from ushard.kernels.attention import BlockKernel, diagonal_only


def _cudnn():
    from jax._src.cudnn import fused_attention_stablehlo  # imported on use: internal, GPU-only

    return fused_attention_stablehlo


def cudnn_version() -> int:
    """cuDNN's version as JAX reads it (9.10.0 is 91000); 0 where there is none (no GPU build)."""
    try:
        return int(_cudnn().check_cudnn_version())
    except (ImportError, RuntimeError):
        return 0


def _mask(causal: bool):
    mask_type = _cudnn().MaskType
    return mask_type.CAUSAL if causal else mask_type.NO_MASK


def _no_documents(*segments):
    if any(s is not None for s in segments):  # the ring passes none: CUDNN_BLOCKS says segments=False
        raise ValueError("the ring's cuDNN blocks take no segment ids")


def _forward(q, k, v, causal, q_segments=None, k_segments=None, window=0):
    """(out [B, T, heads, hd] in q's dtype, lse [B, T, heads] float32) of one block; `window`: cuDNN's
    `sliding_window_length`, the same (pos - w, pos] as ours."""
    _no_documents(q_segments, k_segments)
    diagonal_only(causal, window)
    out, lse = _cudnn().dot_product_attention(q, k, v, scale=1 / math.sqrt(q.shape[-1]), mask_type=_mask(causal),
                                              qkv_layout="BTNH", return_residual=True,
                                              sliding_window_length=window or None)
    return out, jnp.swapaxes(lse, 1, 2)  # cuDNN's statistics are [B, heads, T]


def _backward(q, k, v, out, lse, d_out, causal, q_segments=None, k_segments=None, window=0):
    """(dq, dk, dv) of one block, given the queries' final output and lse over every block."""
    _no_documents(q_segments, k_segments)
    diagonal_only(causal, window)
    fa = _cudnn()
    unused = jnp.zeros(0, q.dtype)  # no bias, sequence lengths, offsets or page tables
    # The primitive gives a list; the callers' maps (`by_halves`' shard_map) expect the tuple they name.
    return tuple(fa._dot_product_attention_bwd_p_wrapper.bind(
        q, k, v, unused, unused, unused, unused, unused, unused, unused,
        jnp.swapaxes(lse, 1, 2), out.astype(q.dtype), d_out.astype(q.dtype),
        scale=1 / math.sqrt(q.shape[-1]), seed=0, dropout_rate=0.0, variadic_args=(False, False),
        mask_type=_mask(causal), layout=fa.AttentionLayout.BTNH.value, sliding_window_length=window or None))


CUDNN_BLOCKS = BlockKernel(forward=_forward, backward=_backward, windows=True)
