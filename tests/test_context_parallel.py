"""Context-parallel attention (ushard/parallel/context.py) against a plain jnp causal attention.

Each case runs the attention on a mesh that splits only the sequence, over n of the 8 CPU devices,
with the batch in zig-zag order as the train step feeds it, and compares the output and the
gradients of q, k and v (mapped back to the original order) with the reference on one device.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import RTOL, assert_matches_reference, loss_and_grads, reference_attention, sequence_layout, split_on
from ushard.aot import collectives_per_step
from ushard.kernels.attention import BlockKernel, expansion_padded, xla_block
from ushard.models.attention import causal_attention, expanded_attention
from ushard.models.mla import LATENT_NAMES, WKV_B_NAMES, expand_latent
from ushard.parallel import context
from ushard.sharding import Q_NAMES, TOKEN_NAMES, Expansion, use_layout


def random_inputs(seed: int, n: int, documents: bool):
    """q, k, v, segment ids (documents of uneven lengths, or None) and output weights, of a shape drawn from `seed`."""
    rng = np.random.default_rng(seed)
    b, chunk, hd = rng.integers(1, 3), rng.integers(1, 5), 2 * rng.integers(2, 5)
    heads, kv_heads = [(4, 2), (2, 2), (4, 1)][rng.integers(3)]
    t = 2 * n * chunk
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)  # noqa: E731
    segments = jnp.asarray(1 + np.cumsum(rng.random((b, t)) < 0.25, axis=1), jnp.int32) if documents else None
    q_shape, kv_shape = (b, t, heads, hd), (b, t, kv_heads, hd)
    return normal(*q_shape), normal(*kv_shape), normal(*kv_shape), segments, normal(*q_shape)


# (mode, sequence ways, seed, documents, zig-zag order)
CASES = [
    ("ring", 2, 0, True, True),
    ("ring", 4, 1, True, True),
    ("all_gather", 2, 2, True, True),
    ("all_gather", 4, 3, True, True),
    ("ring", 8, 4, False, True),  # no document mask: causal alone
    ("ring", 4, 5, True, False),  # a model applied without the train step's reordering: original order
]


@pytest.mark.parametrize("mode,n,seed,documents,zigzag", CASES)
def test_context_attention_matches_plain_attention(mode, n, seed, documents, zigzag):
    q, k, v, segments, weights = random_inputs(seed, n, documents)
    layout = sequence_layout(n, mode, zigzag=zigzag)

    def split_attention(q, k, v, segments):
        with use_layout(layout):
            if not zigzag:
                return causal_attention(q, k, v, segments, "xla")
            # As the train step does: the inputs reordered once, attention told so; back to the original order.
            q, k, v, segments = context.reordered((q, k, v, segments), layout)
            out = causal_attention(q, k, v, segments, "xla")
            return context.zigzag(out, n, inverse=True)

    assert_matches_reference(split_attention, q, k, v, segments, weights)


def _flash_forward(q, k, v, causal, q_segments, k_segments):
    """A block's (out, float32 lse) through the XLA block kernel, queries and keys aligned."""
    index = jnp.arange(q.shape[1])[None]
    return xla_block(q, k, v, index, index if causal else jnp.full_like(index, -1), q_segments, k_segments)


def _flash_backward(q, k, v, out, lse, d_out, causal, q_segments, k_segments):
    """Flash attention's backward of one block from the queries' final out and lse, in plain jnp:
    the contract cuDNN's and splash's backward kernels keep (ushard/kernels/cudnn.py)."""
    b, t, h, hd = q.shape
    copies = h // k.shape[2]
    k_all, v_all = (jnp.repeat(x, copies, axis=2) for x in (k, v))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k_all) / np.sqrt(hd)
    visible = jnp.tril(jnp.ones((t, t), bool)) if causal else jnp.ones((t, t), bool)
    if q_segments is not None:
        visible = visible & (q_segments[:, None, :, None] == k_segments[:, None, None, :])
    scores = jnp.where(visible, scores, -jnp.inf)
    p = jnp.exp(scores - jnp.moveaxis(lse, 1, 2)[..., None])
    d_p = jnp.einsum("bqhd,bkhd->bhqk", d_out, v_all)
    d_s = p * (d_p - jnp.moveaxis(jnp.sum(d_out * out, axis=-1), 1, 2)[..., None]) / np.sqrt(hd)
    fold = lambda x: x.reshape(b, t, k.shape[2], copies, hd).sum(axis=3)  # noqa: E731  (GQA: heads sharing a K/V head)
    return (jnp.einsum("bhqk,bkhd->bqhd", d_s, k_all), fold(jnp.einsum("bhqk,bqhd->bkhd", d_s, q)),
            fold(jnp.einsum("bhqk,bqhd->bkhd", p, d_out)))


FLASH_BLOCKS = BlockKernel(forward=_flash_forward, backward=_flash_backward, segments=True)


@pytest.mark.parametrize("mode,n,seed,documents,keep_kv", [
    ("ring", 2, 6, False, False), ("ring", 4, 7, False, False), ("ring", 8, 8, False, False),
    ("ring", 2, 9, True, False), ("ring", 4, 10, True, False), ("all_gather", 2, 11, False, False),
    ("all_gather", 4, 12, True, False), ("ring", 4, 13, True, True), ("all_gather", 4, 14, True, True),
])
def test_fused_blocks_match_plain_attention(mode, n, seed, documents, keep_kv):
    """Context parallelism on a fused kernel's blocks (cuDNN on GPUs, splash on TPUs), here a jnp
    kernel with the same contract: its output and gradients against the reference. `keep_kv`: the
    backward pass reuses the forward's blocks."""
    q, k, v, segments, weights = random_inputs(seed, n, documents)
    assert_matches_reference(split_on(FLASH_BLOCKS, n, mode, keep_kv), q, k, v, segments, weights)


def test_ring_on_xla_blocks_with_kept_kv_matches_plain_attention():
    q, k, v, segments, weights = random_inputs(16, 4, documents=True)
    assert_matches_reference(split_on(None, 4, "ring", keep_kv=True), q, k, v, segments, weights)


def test_zigzag_gives_device_i_chunks_i_and_its_mirror():
    row = jnp.arange(16)[None]
    np.testing.assert_array_equal(context.zigzag(row, 4)[0], [0, 1, 14, 15, 2, 3, 12, 13, 4, 5, 10, 11, 6, 7, 8, 9])
    np.testing.assert_array_equal(context.zigzag(context.zigzag(row, 4), 4, inverse=True), row)


def backward_temp_bytes(mode: str, n: int, local_length: int = 64, keep_kv: bool = False) -> int:
    """Temporary memory per device of attention's forward and backward, `local_length` tokens per device."""
    layout = sequence_layout(n, mode, keep_kv, zigzag=True)

    def loss(q, k, v, segments):
        with use_layout(layout):
            return jnp.sum(causal_attention(q, k, v, segments, "xla"))

    shape = (1, n * local_length, 4, 16)
    qkv = jax.ShapeDtypeStruct(shape, jnp.float32, sharding=layout.sharding(Q_NAMES))
    segments = jax.ShapeDtypeStruct(shape[:2], jnp.int32, sharding=layout.sharding(TOKEN_NAMES))
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(qkv, qkv, qkv, segments).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_ring_backward_memory_does_not_grow_with_the_ring():
    ring = [backward_temp_bytes("ring", n) for n in (2, 4)]
    gathered = [backward_temp_bytes("all_gather", n) for n in (2, 4)]
    assert ring[1] <= 1.05 * ring[0], ring
    # The measurement can see growth: all-gather holds every device's keys and values.
    assert gathered[1] >= 1.5 * gathered[0], gathered


def test_kept_kv_holds_the_blocks_that_reached_the_device():
    """keep_kv: the ring holds its n - 1 received K and V blocks (64 tokens x 4 heads x 16 float32 each)
    from the forward pass to the backward pass: 4 more devices, 8 more blocks (measured 132 KB)."""
    kept = [backward_temp_bytes("ring", n, keep_kv=True) for n in (4, 8)]
    assert kept[1] - kept[0] >= 0.9 * 8 * 64 * 4 * 16 * 4, kept


@pytest.mark.parametrize("mode, kind", [("ring", "collective-permute"), ("all_gather", "all-gather")])
def test_the_backward_pass_sends_kv_again_as_its_own_transfers_unless_kept(mode, kind):
    """Without keep_kv the fused blocks' backward pass moves K and V again, packed into one array
    [B, T, kv_heads, 2 hd] per step (n - 1 = 3 ring steps, or one gather): transfers of their own, which
    XLA cannot merge with the forward pass's (it did, holding every block until the backward pass).
    With keep_kv it moves none. Around the ring dK and dV take n - 1 = 3 steps home (each device
    visits its own block last), K and V 3 steps in the forward pass: 6 + 3 + 6 transfers, or 12 kept."""
    q, k, v, _, weights = random_inputs(15, 4, documents=False)

    def transfers(keep_kv):
        attention = split_on(FLASH_BLOCKS, 4, mode, keep_kv)
        grads = jax.jit(jax.grad(lambda q, k, v: jnp.sum(attention(q, k, v, None) * weights), argnums=(0, 1, 2)))
        hlo = grads.lower(q, k, v).compile().as_text()
        packed = len(re.findall(rf"= f32\[\d+,\d+,\d+,{2 * k.shape[-1]}\]\S* {kind}(?:-start)?\(", hlo))
        return packed, len(re.findall(rf"= \S+ {kind}(?:-start)?\(", hlo))

    assert transfers(keep_kv=False) == ((3, 15) if mode == "ring" else (1, 3))
    assert transfers(keep_kv=True) == ((0, 12) if mode == "ring" else (0, 2))


@pytest.mark.parametrize("impl, dtype, length, ways, documents, fused, says", [
    ("cudnn", jnp.bfloat16, 8192, 4, False, True, "cuDNN flash attention"),
    ("cudnn", jnp.bfloat16, 8192, 4, True, False, "cuDNN's blocks take no document mask"),
    ("cudnn", jnp.float32, 8192, 4, False, False, "16-bit inputs only"),
    ("splash", jnp.bfloat16, 8192, 4, True, True, "splash attention"),
    ("splash", jnp.bfloat16, 4096 + 512, 4, False, False, "train.seq_len / 8, to be a multiple of 128"),
    ("xla", jnp.bfloat16, 8192, 4, False, False, "XLA attention"),
])
def test_split_blocks_say_which_kernel_runs_them_and_why_not(impl, dtype, length, ways, documents, fused, says):
    from ushard.kernels.attention import block_kernel as split_blocks

    kernel, description = split_blocks(impl, dtype, length, ways, documents)
    assert (kernel is not None) == fused and says in description


def test_the_start_up_report_says_what_runs_a_split_sequences_blocks():
    from conftest import small_config
    from ushard.build import build

    setup = build(small_config(**{"mesh.sequence": 2, "mesh.fsdp": 1}), devices=jax.devices()[:2])
    assert "context parallelism: ring over 2 devices, blocks on XLA attention\n" in setup.describe()
    kept = build(small_config(**{"mesh.sequence": 2, "mesh.fsdp": 1, "parallel.context_keep_kv": True}),
                 devices=jax.devices()[:2])
    assert "blocks on XLA attention, K/V kept for the backward pass\n" in kept.describe()


# --------------------------------------------------------------------------- latent attention

# Latent attention's sizes, small: q·k heads of NOPE + ROPE, values of V_DIM, a latent of RANK.
HEADS, NOPE, ROPE, V_DIM, RANK = 4, 8, 4, 6, 10


def latent_inputs(seed: int, n: int, documents: bool, b: int = 2, chunk: int = 2):
    """q [b, T, heads, nope + rope], the travelling latent [b, T, rank + rope] (latent, rotated key), the
    up-projection [rank, heads, nope + v], segment ids (or None) and output weights."""
    rng = np.random.default_rng(seed)
    t = 2 * n * chunk
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)  # noqa: E731
    segments = jnp.asarray(1 + np.cumsum(rng.random((b, t)) < 0.25, axis=1), jnp.int32) if documents else None
    return (normal(b, t, HEADS, NOPE + ROPE), normal(b, t, RANK + ROPE), normal(RANK, HEADS, NOPE + V_DIM) / 3,
            segments, normal(b, t, HEADS, V_DIM))


def latent_expansion(w):
    return Expansion(functools.partial(expand_latent, NOPE, False), w, WKV_B_NAMES, (LATENT_NAMES,))


def latent_reference(q, latent, w, segments):
    return reference_attention(q, *expand_latent(NOPE, False, w, (latent,)), segments)


def latent_split(n, mode, blocks, keep_kv=False, tensor=1):
    """Context-parallel latent attention: the latent travels, each device expands its blocks."""
    layout = sequence_layout(n, mode, keep_kv, zigzag=True, tensor=tensor)

    def attention(q, latent, w, segments):
        with use_layout(layout):
            q, latent, segments = context.reordered((q, latent, segments), layout)
            expansion = latent_expansion(w)
            if blocks is not None:  # as `expanded_attention` runs a fused kernel: values padded to q·k's size
                expansion = expansion_padded(expansion, q.shape[-1])
            out = context.attention(q, (latent,), segments, xla_block, blocks, expansion=expansion)
        return context.zigzag(out[..., :V_DIM], n, inverse=True)

    return attention


@pytest.mark.parametrize("mode, n, tensor, fused, keep_kv, documents", [
    # In the default tier: each mode on each kind of block, once with the heads split over tensor (the
    # ring on XLA blocks also runs in tests/test_family_layouts.py's DeepSeek ring).
    ("all_gather", 2, 2, False, False, True), ("ring", 2, 2, True, False, False),
    ("all_gather", 4, 1, True, True, True),
    pytest.param("ring", 4, 1, False, False, True, marks=pytest.mark.slow),
    pytest.param("ring", 2, 2, False, False, False, marks=pytest.mark.slow),
    pytest.param("ring", 4, 1, False, True, True, marks=pytest.mark.slow),
    pytest.param("all_gather", 4, 1, False, False, False, marks=pytest.mark.slow),
    pytest.param("ring", 4, 1, True, False, True, marks=pytest.mark.slow),
    pytest.param("ring", 2, 2, True, True, True, marks=pytest.mark.slow),
    pytest.param("all_gather", 2, 2, True, False, False, marks=pytest.mark.slow),
])
def test_latent_attention_travels_as_its_latent_and_matches_plain_attention(mode, n, tensor, fused, keep_kv, documents):
    """Latent attention split over the sequence (and its heads over `tensor`): the latent and rotated
    key travel (ring, all-gather; XLA or fused blocks; kept or sent again for the backward pass) and
    each device expands its heads' keys and values from them. The output and the gradients of the
    queries, the latent and the up-projection (the expansion's weights, through the custom VJP) equal
    plain attention's over the expanded keys and values on one device."""
    q, latent, w, segments, weights = latent_inputs(30 + n + tensor, n, documents)
    split = latent_split(n, mode, FLASH_BLOCKS if fused else None, keep_kv, tensor)
    want_loss, want = loss_and_grads(latent_reference, q, latent, w, segments, weights)
    got_loss, got = loss_and_grads(split, q, latent, w, segments, weights)
    np.testing.assert_allclose(got_loss, want_loss, rtol=RTOL)
    for name, g, r in zip(("q", "latent", "w_kv"), got, want):
        assert np.linalg.norm(g - r) <= RTOL * np.linalg.norm(r), name


def attention_layer_collectives(mode: str, latent_travels: bool, n: int = 4) -> dict:
    """{kind: (count, bytes)} of the compiled forward and backward pass of one latent attention layer
    (`expanded_attention`, as ushard/models/mla.py calls it; XLA blocks, no documents), the sequence
    split n ways; or, not `latent_travels`, of attention over the keys and values expanded before
    it, what every head's keys and values cost (how the layer ran before its latent travelled)."""
    q, latent, w, _, weights = latent_inputs(40, n, documents=False)
    layout = sequence_layout(n, mode, zigzag=True)

    def loss(q, latent, w):
        with use_layout(layout):
            if latent_travels:
                out = expanded_attention(q, (latent,), latent_expansion(w), None, "xla")
            else:
                out = causal_attention(q, *expand_latent(NOPE, False, w, (latent,)), None, "xla")
        return jnp.sum(out * weights)

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    return collectives_per_step(grads.lower(q, latent, w).compile().as_text())


@pytest.mark.parametrize("mode", ["ring", "all_gather"])
def test_context_parallel_latent_attention_moves_latents_not_heads(mode):
    """The bytes one latent attention layer moves over the sequence axis, forward and backward, against
    the latent's: one device's block of latents is B x (T / n) x (kv_lora_rank + qk_rope_head_dim)
    numbers (here 2 x 4 x 14 float32, 448 bytes; DeepSeek-V3: 576 numbers a token). Around the ring
    (collective-permute) a layer moves 3n - 2 such blocks: n - 1 in the forward pass, n - 1 again in
    the backward and the latents' gradients n (each block's travels on with it after every visit).
    The all-gather mode gathers n blocks once (the forward's gather serves the backward) and
    reduce-scatters their gradients to one block each (`collectives_per_step` counts a result's
    bytes). Each within 1.2 x that and not below it (below, XLA would have merged the backward pass's
    transfers with the forward's, `_sent_again`); with every head's keys and values travelling
    instead (heads x (nope + rope + v) = 72 numbers a token against 14) each is over 4 x it, so the
    count can tell."""
    n = 4
    block = 2 * 4 * (RANK + ROPE) * 4
    kinds = {"ring": [("collective-permute", 3 * n - 2)], "all_gather": [("all-gather", n), ("reduce-scatter", 1)]}
    for kind, blocks in kinds[mode]:
        latent_bytes = blocks * block
        moved = attention_layer_collectives(mode, latent_travels=True, n=n)[kind][1]
        assert latent_bytes <= moved <= 1.2 * latent_bytes, (kind, moved, latent_bytes)
        expanded = attention_layer_collectives(mode, latent_travels=False, n=n)[kind][1]
        assert expanded >= 4 * latent_bytes, (kind, expanded, latent_bytes)
