"""Sliding-window attention (`window` w > 0: query i sees keys i - w < j <= i, its document's only)
against a plain jnp float32 reference written from that rule, on every form the kernels seam has:
XLA's whole sequence and blocks, splash in Pallas's interpreter, and context parallelism's ring and
all-gather on 8 simulated CPU devices."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import sequence_layout
from ushard.kernels import attention as kernels
from ushard.parallel import context
from ushard.sharding import use_layout

RTOL = 1e-5  # float32 throughout


def windowed_reference(q, k, v, segment_ids, window):
    """Softmax attention with the mask spelled out: key j visible to query i iff i - window < j <= i."""
    b, t, h, hd = q.shape
    k, v = (jnp.repeat(x, h // x.shape[2], axis=2) for x in (k, v))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(hd)
    i, j = np.arange(t)[:, None], np.arange(t)[None, :]
    visible = jnp.asarray((j <= i) & (j > i - window))[None, None]
    if segment_ids is not None:
        visible = visible & (segment_ids[:, None, :, None] == segment_ids[:, None, None, :])
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(jnp.where(visible, scores, -jnp.inf), axis=-1), v)


def inputs(seed, t, documents, b=2, heads=4, kv_heads=2, hd=8):
    rng = np.random.default_rng(seed)
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)  # noqa: E731
    segments = jnp.asarray(1 + np.cumsum(rng.random((b, t)) < 4 / t, axis=1), jnp.int32) if documents else None
    q_shape, kv_shape = (b, t, heads, hd), (b, t, kv_heads, hd)
    return normal(*q_shape), normal(*kv_shape), normal(*kv_shape), segments, normal(*q_shape)


def out_and_grads(attention, q, k, v, weights):
    """The output, and the gradients of q, k, v pulled back from random output weights."""
    def run(q, k, v):
        out, pull_back = jax.vjp(attention, q, k, v)
        return out, pull_back(weights)

    return jax.jit(run)(q, k, v)


def assert_matches(attention, q, k, v, segments, weights, window, rtol=RTOL):
    """Output and gradients as the reference's, each to `rtol` of its norm."""
    want = out_and_grads(lambda q, k, v: windowed_reference(q, k, v, segments, window), q, k, v, weights)
    got = out_and_grads(attention, q, k, v, weights)
    for name, g, w in zip(("out", "dq", "dk", "dv"), (got[0], *got[1]), (want[0], *want[1])):
        assert np.all(np.isfinite(g)), name
        assert np.linalg.norm(g - w) <= rtol * np.linalg.norm(w), (name, np.linalg.norm(g - w) / np.linalg.norm(w))


def test_the_reference_window_is_hugging_faces():
    """Window 1 is each token alone (out = its own value); a window as long as the row is causal."""
    q, k, v, _, _ = inputs(0, 16, False, heads=2, kv_heads=2)
    np.testing.assert_allclose(windowed_reference(q, k, v, None, 1), v, rtol=1e-6)
    causal = windowed_reference(q, k, v, None, 16)
    np.testing.assert_allclose(windowed_reference(q, k, v, None, 10**6), causal, rtol=1e-6)
    assert not np.allclose(windowed_reference(q, k, v, None, 15), causal)


@pytest.mark.parametrize("window, documents", [(1, False), (5, True), (16, False), (31, True), (64, False)])
def test_xla_whole_sequence_window(window, documents):
    q, k, v, segments, weights = inputs(window, 32, documents)
    assert_matches(lambda q, k, v: kernels.whole_sequence(q, k, v, segments, "xla", window=window),
                   q, k, v, segments, weights, window)


def test_xla_block_window_counts_from_absolute_positions():
    """A block of queries at positions 40.. against keys at 20..: the window spans the gap."""
    q, k, v, _, _ = inputs(1, 16, False)
    q_index, k_index = 40 + jnp.arange(16)[None], 20 + jnp.arange(16)[None]
    window = 10
    out, lse = kernels.xla_block(q, k, v, q_index, k_index, None, None, window)
    visible = (q_index[0][:, None] - k_index[0][None, :] < window)  # every key is before every query
    k_all, v_all = (jnp.repeat(x, 2, axis=2) for x in (k, v))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k_all) / np.sqrt(8)
    scores = jnp.where(visible[None, None], scores, -jnp.inf)
    want = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v_all)
    seen = np.asarray(visible.any(axis=1))
    np.testing.assert_allclose(np.asarray(out)[:, seen], np.asarray(want)[:, seen], rtol=1e-5, atol=1e-6)
    assert np.all(np.asarray(lse)[:, ~seen] == -np.inf) and np.all(np.asarray(out)[:, ~seen] == 0)
    assert seen.sum() == 5  # queries 40..44 see keys after 30, 35 at the latest; 45.. see none


def test_splash_window_in_the_interpreter():
    """Splash's LocalMask: three 128-token blocks, a window that leaves whole blocks out."""
    from ushard.kernels.splash import splash_attention

    q, k, v, segments, weights = inputs(2, 384, True, b=1, heads=2, kv_heads=1, hd=16)
    assert_matches(lambda q, k, v: splash_attention(q, k, v, segments, interpret=True, window=100),
                   q, k, v, segments, weights, 100)


def split_windowed(n, mode, window, keep_kv=False, zigzag=True, fused=None):
    layout = sequence_layout(n, mode, keep_kv, zigzag=zigzag)

    def split_attention(q, k, v, segments):
        with use_layout(layout):
            if zigzag:
                q, k, v, segments = context.reordered((q, k, v, segments), layout)
            out = context.attention(q, (k, v), segments, kernels.xla_block, fused, window=window)
        return context.zigzag(out, n, inverse=True) if zigzag else out

    return split_attention


# (mode, sequence ways, window, documents, keep_kv, zig-zag): windows shorter than a chunk (4 tokens
# a chunk at n = 8), spanning chunks, and longer than the row.
SPLIT_CASES = [
    ("ring", 2, 3, True, False, True),
    ("ring", 4, 5, False, False, True),
    ("ring", 8, 3, True, False, True),
    ("ring", 8, 9, False, True, True),
    ("ring", 8, 6, True, False, False),
    ("ring", 4, 1000, False, False, True),
    ("all_gather", 4, 5, True, False, True),
    ("all_gather", 8, 3, False, False, True),
]


@pytest.mark.parametrize("mode, n, window, documents, keep_kv, zigzag", SPLIT_CASES)
def test_context_parallel_window_matches_the_unsplit_reference(mode, n, window, documents, keep_kv, zigzag):
    q, k, v, segments, weights = inputs(n + window, 8 * n, documents)
    attention = split_windowed(n, mode, window, keep_kv, zigzag)
    assert_matches(lambda q, k, v: attention(q, k, v, segments), q, k, v, segments, weights, window)


def test_fused_blocks_fall_back_to_xla_blocks_with_a_window():
    """The ring's fused blocks take no window: given one, the XLA blocks run (and are exact)."""
    from test_context_parallel import FLASH_BLOCKS

    q, k, v, segments, weights = inputs(3, 64, True)
    attention = split_windowed(4, "ring", 7, fused=FLASH_BLOCKS)
    assert_matches(lambda q, k, v: attention(q, k, v, segments), q, k, v, segments, weights, 7)


def ring_reach(n, t, window, zigzag=True):
    return context._reach(context._Ring(("sequence",), n, zigzag), t // n, window)


def test_the_ring_visits_only_the_devices_within_reach():
    # Zig-zag over 8 devices, 4 tokens a chunk: a window within one chunk's distance needs the
    # neighbours on either side (the early chunks' previous device, the late chunks' next one).
    assert ring_reach(8, 64, 3) == (1, 7)
    assert ring_reach(8, 64, 5) == (1, 7)  # a query 5 back can be one chunk over, never two
    assert ring_reach(8, 64, 6) == (1, 2, 6, 7)
    assert ring_reach(8, 64, 1000) is None  # every step
    # In the original order only earlier devices, as far as the window reaches.
    assert ring_reach(8, 64, 8, zigzag=False) == (1,)
    assert ring_reach(8, 64, 10, zigzag=False) == (1, 2)


def test_the_windowed_ring_sends_only_the_blocks_within_reach():
    """n = 8, window 3: the forward pass sends K, V to two devices (steps 1 and 7, each one transfer of
    k and of v), the backward pass packed K/V twice and dK, dV home three times (after the home visit,
    step 1 and step 7): 4 + 2 + 6 collective-permutes, against 7 + 7 + 7 x 2 unwindowed."""
    q, k, v, segments, weights = inputs(4, 64, False)
    attention = split_windowed(8, "ring", 3)
    grads = jax.jit(jax.grad(lambda q, k, v: jnp.sum(attention(q, k, v, None) * weights), argnums=(0, 1, 2)))
    hlo = grads.lower(q, k, v).compile().as_text()
    assert len(re.findall(r"= \S+ collective-permute(?:-start)?\(", hlo)) == 12


def test_resolve_and_block_kernel_take_the_window():
    bf16 = jnp.bfloat16
    # On GPUs ours where its Mosaic GPU kernels run (measured faster than cuDNN's window), cuDNN at
    # head dim 256 (ours on Triton there) unless documents make cuDNN compute every block.
    assert kernels.resolve("auto", "gpu", bf16, 8192, window=1024) == "flash"
    assert "sliding window" in kernels.why("auto", "flash", "gpu", window=1024)
    assert kernels.resolve("auto", "gpu", bf16, 8192, head_dim=256, window=1024) == "cudnn"
    assert kernels.resolve("auto", "gpu", bf16, 8192, head_dim=256, documents=True, window=1024) == "flash"
    # Gemma 3 1B's shape (hd 256, documents): ours measured faster than cuDNN with its window and without.
    assert kernels.resolve("auto", "gpu", bf16, 8192, head_dim=256, documents=True, window=512) == "flash"
    assert kernels.resolve("auto", "gpu", bf16, 8192, head_dim=256, documents=True) == "flash"
    assert "Gemma 3 1B" in kernels.why("auto", "flash", "gpu", documents=True, window=512, head_dim=256)
    assert "Gemma 3 1B" not in kernels.why("auto", "flash", "gpu", documents=True)
    assert kernels.resolve("auto", "gpu", bf16, 8192, head_dim=96, window=1024) == "cudnn"
    assert kernels.resolve("auto", "gpu", bf16, 8192) == "cudnn"
    assert kernels.resolve("auto", "tpu", bf16, 8192, window=1024) == "splash"
    assert kernels.resolve("auto", "cpu", jnp.float32, 8192, window=1024) == "xla"
    block, says = kernels.block_kernel("cudnn", bf16, 8192, 4, False, window=1024)
    assert block is None and "sliding window" in says
    block, _ = kernels.block_kernel("cudnn", bf16, 8192, 4, False)
    assert block is not None


def test_splash_leaves_the_blocks_outside_the_window_out():
    """Splash's block info at 8k tokens in blocks of 512: causal visits 136 block pairs; window 1024
    visits 45 (each query block its diagonal, the block before whole, and the window's edge two back)."""
    from ushard.kernels.splash import _kernel

    def visited(window):
        mask = np.asarray(_kernel(2, 8192, True, True, window=window).fwd_mask_info.block_mask)
        return int((mask > 0).sum()), int((mask == 2).sum())  # 2: no mask needed

    assert visited(0) == (136, 120)
    assert visited(1024) == (16 + 15 + 14, 15)


def test_windowed_splash_compiles_for_a_tpu():
    """Forward and backward of windowed splash through libtpu for one v5p chip (skips without it)."""
    from conftest import tpu_devices
    from ushard.kernels.splash import splash_attention

    chip = jax.sharding.SingleDeviceSharding(tpu_devices("v5p:2x2x2")[0])
    q = jax.ShapeDtypeStruct((1, 8192, 8, 128), jnp.bfloat16, sharding=chip)
    kv = jax.ShapeDtypeStruct((1, 8192, 2, 128), jnp.bfloat16, sharding=chip)

    def forward_backward(q, k, v):
        out, pull_back = jax.vjp(lambda *a: splash_attention(*a, None, window=1024), q, k, v)
        return out, pull_back(out)

    hlo = jax.jit(forward_backward).lower(q, kv, kv).compile().as_text()
    assert hlo.count("tpu_custom_call") == 3  # forward, dq, dkv
