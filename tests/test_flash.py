"""Our Pallas Triton flash attention (ushard/kernels/flash.py) against `xla_block`, the float32 reference.

Off a GPU the kernels run in Pallas's interpreter, so these run the real kernel bodies: the online
softmax, the causal loop bounds, the document plan, the masks and the two backward kernels. Small
blocks (32 and 64 tokens, unequal on purpose so that the loop bounds of both block sizes are
exercised) keep each interpreted kernel to a second or two on two cores. `test_kernels_lower_to_triton`
checks, without a GPU, that every kernel lowers to Triton's IR; compiling that IR and the speed are
for tools/attention_bench.py on a GPU.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ushard.kernels import flash
from ushard.kernels.attention import xla_block
from ushard.kernels.flash import Blocks, Tuning

B, T, HEADS, KV_HEADS, HD = 2, 128, 4, 2, 64
# Unequal blocks: the forward's query blocks span two key blocks, the backward's the other way round.
SMALL = Tuning(forward=Blocks(64, 32, 4, 1), dkdv=Blocks(32, 64, 4, 1), dq=Blocks(32, 64, 4, 1))
EVEN = Tuning(*(Blocks(32, 32, 4, 1),) * 3)
TOLERANCE = {"atol": 1e-4, "rtol": 1e-4}


def documents(*lengths_per_row):
    """Segment ids [rows, sum of lengths]: each row's documents of the given lengths, numbered up."""
    return jnp.asarray(np.stack([np.repeat(np.arange(len(lengths)), lengths) for lengths in lengths_per_row]),
                       jnp.int32)


# Row 0: a document boundary inside a 32-token block and inside a 64-token block, and blocks of
# different documents (keys 32-63 against queries 64-95 meet nowhere); row 1 other boundaries.
PACKED = documents((40, 24, 50, 14), (16, 80, 32))
# Ids in no order: the plan's range test may skip nothing here, and the masks must do the work.
SHUFFLED = jnp.asarray(np.random.default_rng(7).integers(0, 3, size=(B, T)), jnp.int32)
LAYOUTS = {"none": None, "packed": PACKED, "shuffled": SHUFFLED}


def inputs(seed, length=T, dtype=jnp.float32):
    rng = np.random.default_rng(seed)

    def normal(*shape):
        return jnp.asarray(rng.normal(size=shape), dtype)

    q_shape, kv_shape = (B, length, HEADS, HD), (B, length, KV_HEADS, HD)
    return normal(*q_shape), normal(*kv_shape), normal(*kv_shape), normal(*q_shape), normal(B, length, HEADS)


def reference(q, k, v, q_segments, k_segments, causal, q_first=0, k_first=0):
    """xla_block with the queries at positions q_first... and the keys at k_first... of the row."""
    q_index = q_first + jnp.arange(q.shape[1])[None]
    k_index = k_first + jnp.arange(k.shape[1])[None]
    return xla_block(q, k, v, q_index, k_index if causal else jnp.zeros_like(k_index), q_segments, k_segments)


def close(got, want, what):
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), err_msg=what, **TOLERANCE)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_forward_matches_xla_block(layout, causal):
    q, k, v, _, _ = inputs(0)
    segments = LAYOUTS[layout]
    out, lse = jax.jit(lambda *a: flash.forward(*a, causal, segments, segments, tuning=SMALL))(q, k, v)
    want_out, want_lse = reference(q, k, v, segments, segments, causal)
    assert out.dtype == q.dtype and lse.dtype == jnp.float32 and lse.shape == (B, T, HEADS)
    close(out, want_out, "out")
    close(lse, want_lse, "lse")


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("layout", ["none", "packed"])
def test_backward_matches_autodiff_with_both_cotangents(layout, causal):
    """`attention`'s custom VJP, fed random cotangents of out AND lse, against autodiff of the
    reference's (out, lse)."""
    q, k, v, d_out, d_lse = inputs(1)
    segments = LAYOUTS[layout]
    (out, lse), pullback = jax.vjp(lambda *a: flash.attention(*a, segments, causal, tuning=SMALL), q, k, v)
    (want_out, want_lse), want_pullback = jax.vjp(lambda *a: reference(*a, segments, segments, causal), q, k, v)
    close(out, want_out, "out")
    close(lse, want_lse, "lse")
    for name, got, want in zip("qkv", jax.jit(pullback)((d_out, d_lse)), want_pullback((d_out, d_lse))):
        close(got, want, f"d{name}")


@pytest.mark.parametrize("used", ["out", "lse"])
def test_an_output_without_a_cotangent_is_skipped_not_zero_filled(monkeypatch, used):
    """A caller using only one of `attention`'s outputs: the unused one's cotangent reaches the
    backward as nothing (lse's: `d_lse` None, no zero array for the kernels to load), and the
    gradients are autodiff's of the used output."""
    q, k, v, d_out, d_lse = inputs(3)
    segments = LAYOUTS["packed"]
    given = []

    def spy(*args, **kwargs):
        given.append(args[9])  # d_lse
        return backward(*args, **kwargs)

    backward = flash.backward
    monkeypatch.setattr(flash, "backward", spy)
    index, cotangent = (0, d_out) if used == "out" else (1, d_lse)
    _, pullback = jax.vjp(lambda *a: flash.attention(*a, segments, True, tuning=SMALL)[index], q, k, v)
    _, want_pullback = jax.vjp(lambda *a: reference(*a, segments, segments, True)[index], q, k, v)
    for name, got, want in zip("qkv", jax.jit(pullback)(cotangent), want_pullback(cotangent)):
        close(got, want, f"d{name}")
    assert (given[0] is None) == (used == "out")


def test_backward_with_shuffled_ids():
    """Ids in no order (the range test skips little): BlockKernel's backward without an lse cotangent."""
    q, k, v, d_out, _ = inputs(2)
    (out, lse), pullback = jax.vjp(lambda *a: reference(*a, SHUFFLED, SHUFFLED, True), q, k, v)
    want = pullback((d_out, jnp.zeros_like(lse)))
    got = jax.jit(lambda *a: flash.backward(*a, True, SHUFFLED, SHUFFLED, tuning=SMALL))(q, k, v, out, lse, d_out)
    for name, g, w in zip("qkv", got, want):
        close(g, w, f"d{name}")


def test_blocks_merged_by_lse_give_the_whole_gradient():
    """As the ring uses it: the late half of the queries over the early keys (a full block) and over
    the late keys (the diagonal, causal), merged by lse, each block's backward fed the merged out
    and lse; the gradients summed equal those of attention over all the keys at once. With
    documents, so that some queries see no key of the early block."""
    q, k, v, d_out, _ = inputs(3)
    half = T // 2
    segments = documents((20, 60, 48), (64, 10, 54))  # row 1: the late queries' documents start at 64 and 74
    q_late, seg_late, seg_early = q[:, half:], segments[:, half:], segments[:, :half]
    early = (k[:, :half], v[:, :half], False, seg_late, seg_early)
    late = (k[:, half:], v[:, half:], True, seg_late, seg_late)

    @jax.jit
    def split(q_late, d_out):
        (o1, l1), (o2, l2) = (flash.forward(q_late, *block, tuning=EVEN) for block in (early, late))
        lse = jnp.logaddexp(l1, l2)
        out = o1 * jnp.exp(l1 - lse)[..., None] + o2 * jnp.exp(l2 - lse)[..., None]
        g1, g2 = (flash.backward(q_late, *block[:2], out, lse, d_out, *block[2:], tuning=EVEN)
                  for block in (early, late))
        dk, dv = (jnp.concatenate([g1[i], g2[i]], 1) for i in (1, 2))
        return out, lse, l1, (g1[0] + g2[0], dk, dv)

    out, lse, early_lse, grads = split(q_late, d_out[:, half:])
    assert bool(jnp.any(jnp.isneginf(early_lse)))  # some queries see no key of the early block
    whole = lambda q, k, v: reference(q, k, v, seg_late, segments, True, q_first=half)[0]  # noqa: E731
    want_out, pullback = jax.vjp(whole, q_late, k, v)
    close(out, want_out, "out")
    close(lse, reference(q_late, k, v, seg_late, segments, True, q_first=half)[1], "lse")
    for name, got, want in zip("qkv", grads, pullback(d_out[:, half:])):
        close(got, want, f"d{name}")


def test_a_query_that_sees_no_key_gets_lse_minus_infinity_and_zero_gradients():
    """Queries of a document the block's keys do not hold: out 0, lse -inf, and, fed that out and
    lse back (nothing elsewhere either), zero gradients and no NaN, even with an lse cotangent."""
    q, k, v, d_out, d_lse = inputs(4)
    q_segments = documents((32, 48, 48), (64, 64))
    k_segments = jnp.where(q_segments == 1, 0, q_segments)  # no key of document 1
    alone = np.asarray(q_segments == 1)  # [B, T]: the queries that see no key
    for causal in (True, False):
        out, lse = flash.forward(q, k, v, causal, q_segments, k_segments, tuning=EVEN)
        assert np.all(np.isneginf(np.asarray(lse)[alone])) and np.all(np.asarray(out)[alone] == 0)
        assert np.all(np.isfinite(np.asarray(lse)[~alone]))
        dq, dk, dv = flash.backward(q, k, v, out, lse, d_out, causal, q_segments, k_segments, d_lse, tuning=EVEN)
        assert all(np.all(np.isfinite(np.asarray(g))) for g in (dq, dk, dv))
        assert np.all(np.asarray(dq)[alone] == 0)
        _, pullback = jax.vjp(lambda *a: reference(*a, q_segments, k_segments, causal), q, k, v)
        for name, got, want in zip("qkv", (dq, dk, dv), pullback((d_out, d_lse))):
            close(got, want, f"d{name} causal={causal}")


def test_skipped_blocks_are_not_visited():
    """Documents of one block each: every kernel visits only the diagonal block of each of its
    blocks (with documents even without causality), as each kernel's own count of the blocks it
    ran says. Without documents, the causal loop bound alone: query block i visits i + 1 blocks."""
    q, k, v, d_out, _ = inputs(5)
    one_block_each = documents(*[(32,) * (T // 32)] * B)
    n, group = T // 32, HEADS // KV_HEADS
    diagonal_only = np.ones(n, np.int32)
    for causal in (True, False):
        out, lse, visits = flash._forward_call(q, k, v, causal, one_block_each, one_block_each, EVEN, count=True)
        np.testing.assert_array_equal(visits, np.broadcast_to(diagonal_only, (B, HEADS, n)), f"forward {causal}")
        _, (dkdv_visits, dq_visits) = flash._backward_call(q, k, v, out, lse, d_out, causal, one_block_each,
                                                           one_block_each, None, EVEN, count=True)
        np.testing.assert_array_equal(dkdv_visits, np.broadcast_to(group * diagonal_only, (B, KV_HEADS, n)))
        np.testing.assert_array_equal(dq_visits, np.broadcast_to(diagonal_only, (B, HEADS, n)))
        order, counts = flash.visit_plan(one_block_each, one_block_each, causal, 32, 32)
        np.testing.assert_array_equal(order[..., 0], np.broadcast_to(np.arange(n), (B, n)))
        # One block each, needing a mask only for causality (the diagonal).
        np.testing.assert_array_equal(counts, np.broadcast_to([0 if causal else 1, 1], (B, n, 2)))
    _, _, visits = flash._forward_call(q, k, v, True, None, None, EVEN, count=True)
    np.testing.assert_array_equal(visits, np.broadcast_to(np.arange(1, n + 1), (B, HEADS, n)))


def test_visit_plan_puts_blocks_that_need_no_mask_first():
    segments = PACKED[:1]  # documents of 40, 24, 50 and 14 tokens
    order, counts = flash.visit_plan(segments, segments, True, 32, 32)
    # Query block 3 (tokens 96-127: documents 2 and 3) meets key blocks 2 and 3, both needing masks;
    # query block 2 (tokens 64-95, document 2 only) meets key block 2 alone, on the diagonal.
    assert counts[0, 3].tolist() == [0, 2] and order[0, 3, :2].tolist() == [2, 3]
    assert counts[0, 2].tolist() == [0, 1] and order[0, 2, 0] == 2
    order, counts = flash.visit_plan(jnp.zeros((1, T), jnp.int32), jnp.zeros((1, T), jnp.int32), True, 32, 32)
    assert counts[0, 3].tolist() == [3, 4] and order[0, 3].tolist() == [0, 1, 2, 3]  # the diagonal last
    _, counts = flash.visit_plan(jnp.zeros((1, T), jnp.int32), jnp.zeros((1, T), jnp.int32), True, 32, 32,
                                 by_key=True)
    assert counts[0, 0].tolist() == [3, 4]  # key block 0: query blocks 1-3 free, the diagonal masked


def test_bfloat16_inputs_accumulate_in_float32():
    q, k, v, d_out, d_lse = inputs(6, dtype=jnp.bfloat16)
    d_lse = d_lse.astype(jnp.float32)
    (out, lse), pullback = jax.vjp(lambda *a: flash.attention(*a, PACKED, True, tuning=SMALL), q, k, v)
    grads = jax.jit(pullback)((d_out, d_lse))
    as32 = [x.astype(jnp.float32) for x in (q, k, v, d_out)]
    (want_out, want_lse), want_pullback = jax.vjp(lambda *a: reference(*a, PACKED, PACKED, True), *as32[:3])
    assert out.dtype == jnp.bfloat16 and [g.dtype for g in grads] == [jnp.bfloat16] * 3
    for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads),
                               (want_out, want_lse, *want_pullback((as32[3], d_lse)))):
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        assert np.linalg.norm(got - want) <= 1e-2 * np.linalg.norm(want), name


def test_a_length_that_is_not_a_multiple_of_the_blocks_is_refused():
    q, k, v, _, _ = inputs(7, length=96)
    with pytest.raises(ValueError, match="multiple of 64"):
        flash.forward(q, k, v, True, tuning=SMALL)
    with pytest.raises(ValueError, match="head dims"):
        flash.forward(q[..., :48], k[..., :48], v[..., :48], True)


@pytest.mark.parametrize("hd,vd,dtype,window", [(128, 128, jnp.bfloat16, 0), (64, 64, jnp.float16, 0),
                                                (256, 256, jnp.bfloat16, 0), (128, 128, jnp.bfloat16, 100),
                                                (192, 128, jnp.bfloat16, 0), (192, 192, jnp.bfloat16, 0)])
def test_kernels_lower_to_triton(monkeypatch, hd, vd, dtype, window):
    """Every kernel, with and without documents, lowers to Triton's IR for a CUDA GPU, at the table's
    block sizes (the Triton compiler itself runs only on a GPU); with a window too; latent attention's
    192 / 128 in 128 + 64 wide pieces (Triton's arrays are powers of two), and its values padded to 192 (a
    split sequence's blocks, `values_padded`)."""
    monkeypatch.setattr(flash, "_interpret", lambda: False)
    q = jax.ShapeDtypeStruct((B, 256, HEADS, hd), dtype)
    k = jax.ShapeDtypeStruct((B, 256, KV_HEADS, hd), dtype)
    v = jax.ShapeDtypeStruct((B, 256, KV_HEADS, vd), dtype)
    d_out = jax.ShapeDtypeStruct((B, 256, HEADS, vd), dtype)
    lse = jax.ShapeDtypeStruct((B, 256, HEADS), jnp.float32)
    for segments in (None, jax.ShapeDtypeStruct((B, 256), jnp.int32)):
        def step(q, k, v, segments, d_out, d_lse):
            outputs, pullback = jax.vjp(lambda *a: flash.attention(*a, segments, window=window), q, k, v)
            return outputs, pullback((d_out, d_lse))

        text = jax.jit(step).trace(q, k, v, segments, d_out, lse).lower(lowering_platforms=("cuda",)).as_text()
        assert text.count("xla.gpu.triton") == 3  # forward, dkdv, dq


def test_remat_dots_attention_keeps_our_forward_instead_of_recomputing_it():
    """Under `model.remat=dots_attention` a layer's fused attention is kept for the backward pass.
    cuDNN's is found by its primitive's name; ours is a Pallas call, so `by_halves` names its outputs
    (FUSED_ATTENTION) for the policy. Compiled, the step then runs our forward kernel once, as
    without remat, where unnamed it ran it twice (the backward recomputed it)."""
    from ushard.kernels.attention import by_halves
    from ushard.models.stack import REMAT_POLICIES

    x = jnp.ones((1, 128, 2, 64), jnp.float32)
    weight = jnp.ones((64, 64), jnp.float32)

    def layer(q, k, v):
        return jnp.tanh(by_halves(flash.FLASH_BLOCKS, q, k, v, None) @ weight)

    def forward_kernels(policy) -> int:
        fn = layer if policy is None else jax.checkpoint(layer, policy=policy)
        step = jax.jit(jax.grad(lambda *a: fn(*a).sum(), argnums=(0, 1, 2)))
        return step.lower(x, x, x).compile().as_text().count("ushard_flash_forward")

    once = forward_kernels(None)
    assert once > 0 and forward_kernels(REMAT_POLICIES["dots_attention"]) < 1.5 * once
    # The same policy without the name (as before it) ran the forward twice.
    unnamed = jax.checkpoint_policies.save_from_both_policies(REMAT_POLICIES["dots_no_batch"],
                                                              lambda prim, *_, **__: "attention" in prim.name)
    assert forward_kernels(unnamed) > 1.5 * once


# --- sliding windows ---------------------------------------------------------------------------------


def windowed_reference(q, k, v, segments, window):
    index = jnp.arange(q.shape[1])[None]
    return xla_block(q, k, v, index, index, segments, segments, window)


@pytest.mark.parametrize("window", [1, 20, 33, 64, 100])
@pytest.mark.parametrize("layout", ["none", "packed", "shuffled"])
def test_window_forward_and_backward_match_xla_block(layout, window):
    """Windows inside one block, across block boundaries, a block's length and most of the row; with
    documents packed and shuffled. Both cotangents, as `test_backward_matches_autodiff_with_both_cotangents`."""
    q, k, v, d_out, d_lse = inputs(10 + window)
    segments = LAYOUTS[layout]
    (out, lse), pullback = jax.vjp(lambda *a: flash.attention(*a, segments, True, tuning=SMALL, window=window),
                                   q, k, v)
    (want_out, want_lse), want_pullback = jax.vjp(lambda *a: windowed_reference(*a, segments, window), q, k, v)
    close(out, want_out, "out")
    close(lse, want_lse, "lse")
    for name, got, want in zip("qkv", jax.jit(pullback)((d_out, d_lse)), want_pullback((d_out, d_lse))):
        close(got, want, f"d{name}")


def test_window_blocks_outside_it_are_not_visited():
    """32-token blocks, window 33: a query block sees its own block and the one before (the window's
    first key is 32 back from its first query, in the block before), never two back; a key block the
    same two query blocks. The visit plan with documents of the whole row gives the same counts."""
    q, k, v, d_out, _ = inputs(6)
    n, group = T // 32, HEADS // KV_HEADS
    two = np.minimum(np.arange(1, n + 1), 2)
    whole_row = jnp.zeros((B, T), jnp.int32)
    for segments in (None, whole_row):
        out, lse, visits = flash._forward_call(q, k, v, True, segments, segments, EVEN, count=True, window=33)
        np.testing.assert_array_equal(visits, np.broadcast_to(two, (B, HEADS, n)))
        _, (dkdv_visits, dq_visits) = flash._backward_call(q, k, v, out, lse, d_out, True, segments, segments, None,
                                                           EVEN, count=True, window=33)
        np.testing.assert_array_equal(dq_visits, np.broadcast_to(two, (B, HEADS, n)))
        np.testing.assert_array_equal(dkdv_visits, np.broadcast_to(group * two[::-1], (B, KV_HEADS, n)))
    # A window of one block's length inside each block's diagonal: one block each, the diagonal.
    _, _, visits = flash._forward_call(q, k, v, True, None, None, EVEN, count=True, window=1)
    np.testing.assert_array_equal(visits, np.ones((B, HEADS, n)))


@pytest.mark.parametrize("dtype,length,documents,window", [(jnp.float32, 128, False, 0), (jnp.bfloat16, 128, False, 0),
                                                         (jnp.float32, 256, True, 100)])
def test_head_dim_256_forward_and_backward(dtype, length, documents, window):
    """Head dim 256 on TUNING's blocks (the Triton kernels; the Mosaic GPU ones take 64 and 128); at
    256 tokens with ragged documents and a window, as Gemma's local layers, over several blocks of
    each kernel (the forward's 128 queries, dK/dV's 32 keys, dQ's 64 queries and keys)."""
    assert 256 in flash.TUNING
    rng = np.random.default_rng(11)
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), dtype)  # noqa: E731
    t = length
    q, k, v, d_out = normal(1, t, 2, 256), normal(1, t, 1, 256), normal(1, t, 1, 256), normal(1, t, 2, 256)
    ids = jnp.asarray(np.searchsorted([70, 200], np.arange(t), side="right")[None], jnp.int32)
    segments = ids if documents else None
    (out, lse), pullback = jax.vjp(lambda *a: flash.attention(*a, segments, True, window=window), q, k, v)
    upcast = [x.astype(jnp.float32) for x in (q, k, v)]
    (want_out, want_lse), want_pullback = jax.vjp(lambda *a: windowed_reference(*a, segments, window), *upcast)
    got_grads = jax.jit(pullback)((d_out, jnp.zeros_like(lse)))
    want_grads = want_pullback((d_out.astype(jnp.float32), jnp.zeros_like(want_lse)))
    tolerance = 1e-5 if dtype == jnp.float32 else 2e-2
    for name, got, want in zip(["out", "dq", "dk", "dv"], [out, *got_grads], [want_out, *want_grads]):
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        assert np.linalg.norm(got - want) <= tolerance * np.linalg.norm(want), name


def test_latent_attention_heads_through_whole_sequence_match_float32():
    """Latent attention's heads (q·k over 192, values of 128) through `whole_sequence(..., "flash")`,
    the values as they are (not padded), forward and backward against float32 attention: on this CPU
    the Triton kernels in Pallas's interpreter, at TUNING's 192 blocks (q·k in 128 + 64 wide pieces),
    grouped heads, two documents (a boundary inside dK/dV's 32-key blocks)."""
    from ushard.kernels.attention import whole_sequence

    rng = np.random.default_rng(12)
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)  # noqa: E731
    t = 64
    q, k, v, d_out = normal(1, t, 2, 192), normal(1, t, 1, 192), normal(1, t, 1, 128), normal(1, t, 2, 128)
    ids = jnp.asarray(np.searchsorted([23], np.arange(t), side="right")[None], jnp.int32)
    assert flash.takes_value_widths(q, k, v)
    assert "pad" not in str(jax.make_jaxpr(lambda *a: whole_sequence(*a, ids, "flash"))(q, k, v))  # as they are

    def out_and_grads(attend, *inputs):
        out, pullback = jax.vjp(attend, *inputs)
        return (out, *pullback(d_out))

    got = jax.jit(lambda *a: out_and_grads(lambda *b: whole_sequence(*b, ids, "flash"), *a))(q, k, v)
    want = out_and_grads(lambda *a: windowed_reference(*a, ids, 0)[0], q, k, v)
    for name, g, w in zip(["out", "dq", "dk", "dv"], got, want):
        assert g.shape == w.shape, name
        close(g, w, name)


def test_head_pieces_are_powers_of_two_covering_the_head():
    assert flash._parts(192) == ((0, 128), (128, 64))
    assert flash._parts(128) == ((0, 128),)
    assert flash._parts(96) == ((0, 64), (64, 32))
