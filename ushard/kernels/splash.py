"""Causal attention on TPUs through Pallas splash attention, each device on its own rows and heads.

Splash attention (jax.experimental.pallas.ops.tpu.splash_attention) is a flash-attention kernel for
TPUs: it never materialises the [T, T] scores, skips the blocks a causal mask hides, and masks
documents by segment ids. A Mosaic kernel is not partitioned by XLA, so it runs inside a
`jax.shard_map` whose specs come from the active layout: rows split over the batch axes (data, fsdp,
expert), heads over `tensor` (K/V heads too, or their per-rank copies), the sequence whole on every
device (a split sequence goes through ushard/parallel/context.py, which runs `splash_blocks`). Inside, the kernel sees
one device's [rows, T, heads, head_dim] and runs once per row (vmapped), with grouped-query K/V heads
as they are.

On a machine without a TPU the kernel runs only in Pallas's interpreter (`interpret=True`), which
is how the tests check it against plain attention.

`splash_blocks` is the same kernel as the blocks of context parallelism's ring
(`kernels.attention.BlockKernel`): its forward keeps the log-sum-exp it computes anyway, and its backward
kernels are called with the queries' final output and log-sum-exp over all blocks.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from ushard.kernels.attention import BlockKernel, by_halves, diagonal_only

BLOCKS = (512, 256, 128)  # block sizes tried, largest first: 512 compiles at T=8192, d=128 in 16 MiB VMEM


def block_size(length: int) -> int:
    """The largest of BLOCKS that divides a sequence of `length` tokens (a multiple of LANES)."""
    return next(b for b in BLOCKS if length % b == 0)


def _splash():
    # Imported where used: only TPU programs need Pallas's TPU kernels.
    from jax.experimental.pallas.ops.tpu import splash_attention

    return splash_attention


def _mask(length: int, causal: bool, window: int):
    """One head's mask: causal, full, or (`window` > 0) causal within the window, which splash's
    LocalMask gives as the w - 1 keys left of the query and none right of it. Its block info then
    leaves the blocks wholly outside the window out of the loops, as the causal mask does above it."""
    splash, shape = _splash(), (length, length)
    if window:
        return splash.LocalMask(shape, window_size=(window - 1, 0), offset=0)
    return splash.CausalMask(shape) if causal else splash.FullMask(shape)


def _kernel(heads: int, length: int, interpret: bool, causal: bool = True, save_residuals: bool = False,
            window: int = 0):
    """The splash kernel for one row: q [heads, T, hd], k and v [kv_heads, T, hd], causal (within a
    `window` if > 0) or full."""
    splash, b = _splash(), block_size(length)
    sizes = splash.BlockSizes(block_q=b, block_kv=b, block_kv_compute=b, block_q_dkv=b, block_kv_dkv=b,
                              block_kv_dkv_compute=b, block_q_dq=b, block_kv_dq=b)
    mask = splash.MultiHeadMask([_mask(length, causal, window)] * heads)
    return splash.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, save_residuals=save_residuals,
                                  interpret=interpret)


def _heads_major(x):
    return jnp.swapaxes(x, 1, 2)  # [B, T, h, ...] <-> [B, h, T, ...], the kernel's order


def splash_blocks(interpret: bool = False) -> BlockKernel:
    """Splash attention as the ring's block kernel (see `context.BlockKernel`); `interpret`: run in
    Pallas's interpreter (no TPU). The backward calls splash's own backward kernels through its
    internal `_splash_attention_bwd` (JAX 0.10.2), handing them the final output and lse."""

    def documents(q_segments, k_segments):
        return None if q_segments is None else _splash().SegmentIds(q=q_segments, kv=k_segments)

    def forward(q, k, v, causal, q_segments=None, k_segments=None, window=0):
        diagonal_only(causal, window)
        heads, length, head_dim = q.shape[2], q.shape[1], q.shape[3]
        kernel = _kernel(heads, length, interpret, causal, save_residuals=True, window=window)
        q = q * (1.0 / math.sqrt(head_dim))  # the kernel does not scale the scores

        def row(q, k, v, q_segments, k_segments):
            return kernel(q, k, v, segment_ids=documents(q_segments, k_segments))

        out, (lse,) = jax.vmap(row)(_heads_major(q), _heads_major(k), _heads_major(v), q_segments, k_segments)
        return _heads_major(out).astype(q.dtype), jnp.swapaxes(lse, 1, 2)

    def backward(q, k, v, out, lse, d_out, causal, q_segments=None, k_segments=None, window=0):
        from jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_kernel import _splash_attention_bwd

        diagonal_only(causal, window)
        heads, length, head_dim = q.shape[2], q.shape[1], q.shape[3]
        kernel = _kernel(heads, length, interpret, causal, window=window)
        options = kernel.kwargs
        scale = 1.0 / math.sqrt(head_dim)

        def row(q, k, v, out, lse, d_out, q_segments, k_segments):
            residuals = (q, k, v, documents(q_segments, k_segments), None, out, lse, kernel.dq_mask_info,
                         kernel.dkv_mask_info)
            grads = _splash_attention_bwd(False, options["mask_value"], options["is_mqa"], options["block_sizes"], None,
                                          options["mask_function"], options["attn_logits_soft_cap"], interpret,
                                          residuals, d_out)
            return grads[3:6]  # after the three mask infos: dq, dk, dv

        dq, dk, dv = jax.vmap(row)(_heads_major(q * scale), _heads_major(k), _heads_major(v),
                                   _heads_major(out.astype(q.dtype)), jnp.swapaxes(lse, 1, 2), _heads_major(d_out),
                                   q_segments, k_segments)
        return tuple(_heads_major(g) for g in (dq * scale, dk, dv))

    return BlockKernel(forward=forward, backward=backward, segments=True, typed=False, windows=True)


def splash_attention(q, k, v, segment_ids=None, interpret: bool = False, window: int = 0):
    """Causal attention of q [B, T, heads, hd] over k, v [B, T, kv_heads, hd] by splash attention,
    tokens attending only within their segment (`segment_ids` [B, T]; None: no document masking) and,
    with `window` > 0, to the window's keys only (kernels.attention).
    Under a layout, each device runs the kernel on its rows and heads; without one, on everything
    (`kernels.attention.by_halves`)."""
    return by_halves(splash_blocks(interpret), q, k, v, segment_ids, window)
