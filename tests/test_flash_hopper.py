"""The Mosaic GPU flash kernels (ushard/kernels/flash_hopper.py, flash_hopper_backward.py) without a GPU.

They run only on Hopper GPUs (JAX 0.10.2's Mosaic GPU interpreter stops at the wgmma accumulators),
so their values are checked on the device: tools/attention_check.py compares ours (these kernels,
both ways) with float32 attention, with documents and grouped heads (docs/benchmarks.md). Here: the
visit plan they read, which decides what they compute, is exact for any ids; the persistent
forward's programs share out every tile once; every kernel lowers through this JAX's Mosaic GPU
lowering for every variant; and off Hopper `flash.forward` and `flash.backward` keep the Triton
kernels.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ushard.kernels import flash, flash_hopper, flash_hopper_backward

TILE, BLOCK_K, T = 32, 16, 128


def _blocks(ids, size):
    return [set(np.asarray(ids[i:i + size]).tolist()) for i in range(0, len(ids), size)]


@pytest.mark.parametrize("layout", ["packed", "shuffled", "one", "ring"])
def test_visit_range_covers_every_meeting_block_and_frees_only_one_document(layout):
    rng = np.random.default_rng(3)
    if layout in ("packed", "ring"):  # ushard's rows: ids never decrease, boundaries anywhere
        ids = np.stack([np.cumsum(rng.random(2 * T) < 0.02) for _ in range(3)])
        # A ring block's queries and keys come from different chunks of a row: the late chunk's
        # queries against the early chunk's keys, some of them of no document the keys hold.
        q_ids, k_ids = (ids[:, T:], ids[:, :T]) if layout == "ring" else (ids[:, :T], ids[:, :T])
    elif layout == "shuffled":
        q_ids = k_ids = rng.integers(0, 3, size=(3, T))
    else:
        q_ids = k_ids = np.zeros((3, T), np.int64)
    q_ids, k_ids = jnp.asarray(q_ids, jnp.int32), jnp.asarray(k_ids, jnp.int32)
    plan = np.asarray(flash_hopper.visit_range(q_ids, k_ids, TILE, BLOCK_K))
    assert plan.shape == (3, T // TILE, 4)
    skipped_tiles = 0
    for row in range(3):
        tiles, blocks = _blocks(q_ids[row], TILE), _blocks(k_ids[row], BLOCK_K)
        for t, (start, free_lo, free_hi, stop) in enumerate(plan[row]):
            assert start <= free_lo <= free_hi <= stop
            meeting = [j for j, block in enumerate(blocks) if tiles[t] & block]
            assert all(start <= j < stop for j in meeting), (row, t)  # nothing the tile needs is skipped
            if not meeting:  # a tile that sees none of these keys visits nothing
                assert start == stop, (row, t)
                skipped_tiles += 1
            elif layout != "shuffled":  # and on packed rows nothing it does not need is visited
                assert (start, stop) == (min(meeting), max(meeting) + 1)
            for j in range(free_lo, free_hi):  # unmasked blocks: one and the same document
                assert len(tiles[t]) == 1 and blocks[j] == tiles[t], (row, t, j)
    if layout == "one":
        assert (plan[..., 1:3] == [0, T // BLOCK_K]).all()
    if layout == "ring":
        assert skipped_tiles > 0  # the case the layout is for did occur


@pytest.mark.skipif(not flash_hopper._API, reason="this JAX has no Mosaic GPU Pallas API")
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("segments", [False, True])
@pytest.mark.parametrize("head_dim,kv_heads", [(128, 2), (64, 4)])
@pytest.mark.parametrize("order", ["tiles", "heads"])
def test_kernel_traces_for_every_variant(causal, segments, head_dim, kv_heads, order, monkeypatch):
    monkeypatch.setattr(flash_hopper, "ORDER", order)
    q = jax.ShapeDtypeStruct((2, 512, 4, head_dim), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 512, kv_heads, head_dim), jnp.bfloat16)
    ids = jax.ShapeDtypeStruct((2, 512), jnp.int32) if segments else None

    def forward(q, k, v, ids):
        return flash_hopper.forward(q, k, v, causal, ids, ids)

    out, lse = jax.eval_shape(forward, q, kv, kv, ids)
    assert (out.shape, out.dtype, lse.shape, lse.dtype) == (q.shape, q.dtype, (2, 512, 4), jnp.float32)
    assert "wgmma" in str(jax.make_jaxpr(forward)(q, kv, kv, ids))  # the kernel body was traced
    assert "mosaic_gpu" in _lowered_for_gpu(forward, q, kv, kv, ids)  # and Mosaic GPU took all of it


def _lowered_for_gpu(fn, *args) -> str:
    """`fn` lowered for CUDA on this CPU: runs Pallas's Mosaic GPU lowering of each kernel (its
    layouts, copies and barriers), which tracing alone does not."""
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("order", ["tiles", "heads"])
@pytest.mark.parametrize("programs,heads,n_tiles,rows", [(132, 16, 16, 16), (132, 16, 256, 1), (132, 32, 64, 1),
                                                         (132, 4, 2, 2), (7, 3, 5, 2)])
def test_persistent_programs_compute_every_tile_once(programs, heads, n_tiles, rows, order):
    n_work = rows * n_tiles * heads
    programs = min(programs, n_work)

    def blocks(tile_index):
        return flash_hopper.tile_blocks(tile_index, causal=True, n_k=n_tiles, tile=128, block_k=128)

    table = flash_hopper.schedule(programs, rows, heads, n_tiles, blocks, order)
    assert table.shape[1] % flash_hopper.PLAN_WIDTH == 0  # whole 128-byte copies
    seen, loads = [], []
    for program in range(programs):
        mine = [tuple(int(x) for x in flash_hopper.tile_of_work(w, heads=heads, n_tiles=n_tiles))
                for w in table[program, 1:1 + table[program, 0]]]
        assert mine  # every program has work
        for row, head in {tile[:2] for tile in mine}:
            tile_order = [tile for r, h, tile in mine if (r, h) == (row, head)]
            assert tile_order == sorted(tile_order, reverse=True)  # a row's longest causal tiles first
        seen += mine
        loads.append(sum(blocks(tile) + 1 for _, _, tile in mine))
    assert sorted(seen) == sorted((r, h, t) for r in range(rows) for h in range(heads) for t in range(n_tiles))
    if order == "tiles" and n_work >= 8 * programs:  # the programs' causal work within 1% of even
        assert max(loads) <= 1.01 * np.mean(loads)


@pytest.mark.skipif(not flash_hopper._API, reason="this JAX has no Mosaic GPU Pallas API")
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("segments", [False, True])
@pytest.mark.parametrize("head_dim,kv_heads,block_k", [(128, 2, 64), (64, 4, 128)])
@pytest.mark.parametrize("grid_order", ["tiles", "heads"])
def test_backward_kernels_trace_for_every_variant(causal, segments, head_dim, kv_heads, block_k, grid_order,
                                                  monkeypatch):
    monkeypatch.setattr(flash_hopper_backward, "GRID_ORDER", grid_order)
    q = jax.ShapeDtypeStruct((2, 512, 4, head_dim), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 512, kv_heads, head_dim), jnp.bfloat16)
    rows = jax.ShapeDtypeStruct((2, 4, 512), jnp.float32)
    ids = jax.ShapeDtypeStruct((2, 512), jnp.int32) if segments else None

    def backward(q, k, v, d_out, lse2, out, d_lse, ids):  # dQ computes D (from out and d lse) for dK/dV
        dq, delta = flash_hopper_backward.dq(q, k, v, d_out, lse2, out, causal, ids, ids, d_lse=d_lse,
                                             block_k=block_k)
        dk, dv = flash_hopper_backward.dkdv(q, k, v, d_out, lse2, delta, causal, ids, ids)
        return dq, dk, dv, delta

    for d_lse in (None, rows):
        dq, dk, dv, delta = jax.eval_shape(backward, q, kv, kv, q, rows, q, d_lse, ids)
        assert (dq.shape, dk.shape, dv.shape, delta.shape) == (q.shape, kv.shape, kv.shape, rows.shape)
    jaxpr = str(jax.make_jaxpr(backward)(q, kv, kv, q, rows, q, None, ids))
    assert jaxpr.count("wgmma") >= 7  # dK/dV: 4 products, dQ: 3
    assert "mosaic_gpu" in _lowered_for_gpu(backward, q, kv, kv, q, rows, q, rows, ids)


@pytest.mark.skipif(not flash_hopper._API, reason="this JAX has no Mosaic GPU Pallas API")
@pytest.mark.parametrize("segments", [False, True])
def test_windowed_kernels_lower_for_the_gpu(segments):
    """A sliding window's bounds and masks (forward, dQ, dK/dV) through Mosaic GPU's lowering; the
    values are checked on the device (tools/attention_check.py)."""
    q = jax.ShapeDtypeStruct((1, 1024, 4, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 1024, 2, 128), jnp.bfloat16)
    ids = jax.ShapeDtypeStruct((1, 1024), jnp.int32) if segments else None

    def both(q, k, v, ids):
        out, lse = flash_hopper.forward(q, k, v, True, ids, ids, window=300)
        lse2 = jnp.swapaxes(lse, 1, 2)
        dq, delta = flash_hopper_backward.dq(q, k, v, out, lse2, out, True, ids, ids, window=300)
        return out, dq, *flash_hopper_backward.dkdv(q, k, v, out, lse2, delta, True, ids, ids, window=300)

    assert "mosaic_gpu" in _lowered_for_gpu(both, q, kv, kv, ids)


@pytest.mark.skipif(not flash_hopper._API, reason="this JAX has no Mosaic GPU Pallas API")
@pytest.mark.parametrize("causal,segments,window,block_q", [(True, False, 0, None), (True, True, 0, None),
                                                            (False, True, 0, None), (True, True, 300, 64)])
def test_latent_attention_kernels_lower_for_the_gpu(causal, segments, window, block_q):
    """Latent attention's heads (q·k over 192, values of 128) as they are, grouped, through Mosaic GPU's
    lowering: the forward (64-key blocks, the output through its own buffer), dQ, and dK/dV on
    32-query blocks (64-byte swizzle) or 64 (`block_q`); the kernels' variants as the tests above
    lower them at 64 and 128."""
    q = jax.ShapeDtypeStruct((2, 512, 4, 192), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((2, 512, 2, 192), jnp.bfloat16)
    v = jax.ShapeDtypeStruct((2, 512, 2, 128), jnp.bfloat16)
    ids = jax.ShapeDtypeStruct((2, 512), jnp.int32) if segments else None

    def both(q, k, v, ids):
        out, lse = flash_hopper.forward(q, k, v, causal, ids, ids, window=window)
        lse2 = jnp.swapaxes(lse, 1, 2)
        dq, delta = flash_hopper_backward.dq(q, k, v, out, lse2, out, causal, ids, ids, d_lse=lse2, window=window)
        return out, dq, *flash_hopper_backward.dkdv(q, k, v, out, lse2, delta, causal, ids, ids, window=window,
                                                    block_q=block_q)

    out, dq, dk, dv = jax.eval_shape(both, q, k, v, ids)
    assert (out.shape, dq.shape, dk.shape, dv.shape) == ((2, 512, 4, 128), q.shape, k.shape, v.shape)
    assert str(jax.make_jaxpr(both)(q, k, v, ids)).count("wgmma") >= 9  # forward 2, dK/dV 4, dQ 3
    assert "mosaic_gpu" in _lowered_for_gpu(both, q, k, v, ids)


def test_window_bounds_cover_the_window_and_free_only_whole_blocks():
    """The Mosaic GPU kernels' window bounds against brute force over positions: a query block's
    first visited key block holds its first query's first key; the free blocks start where every
    key is within the window of its last query; a key block's query blocks stop after the last that
    sees its last key."""
    window, block = 300, 64
    for q_first in range(0, 2048, 128):
        start = int(flash_hopper.window_start(q_first, window, block))
        assert start * block <= max(q_first - window + 1, 0) < (start + 1) * block
        q_last = q_first + 63
        free = int(flash_hopper.window_free(q_last, window, block))
        assert free * block >= q_last - window + 1 and (free - 1) * block < max(q_last - window + 1, 0) + 1
        stop = int(flash_hopper.window_stop(q_first + 127, window, block, 32))
        assert stop == min(32, (q_first + 127 + window - 1) // block + 1)


def test_supported_shapes_and_the_triton_kernels_off_hopper():
    q = jnp.zeros((1, 256, 2, 128), jnp.bfloat16)
    assert flash_hopper.supported(q, q)
    assert not flash_hopper.supported(q.astype(jnp.float32), q)  # 16-bit only
    assert not flash_hopper.supported(jnp.zeros((1, 192, 2, 128), jnp.bfloat16), q)  # not whole tiles
    assert not flash_hopper.supported(jnp.zeros((1, 256, 2, 96), jnp.bfloat16), q)
    mla_q, mla_v = jnp.zeros((1, 256, 2, 192), jnp.bfloat16), jnp.zeros((1, 256, 2, 128), jnp.bfloat16)
    assert flash_hopper.supported(mla_q, mla_q, mla_v)  # latent attention's 192 / 128 as they are
    assert not flash_hopper.supported(mla_q, mla_q)  # values of 192 do not fit in shared memory
    assert not flash_hopper.supported(q, q, q[..., :64])  # narrower values at 128: the Triton kernels
    assert not flash_hopper.available()  # no Hopper GPU here
    assert flash_hopper.jax_version("0.11.2") >= flash_hopper.CHECKED_JAX > flash_hopper.jax_version("0.10.2")
    assert flash_hopper.jax_version("0.12.0.dev20260101") == (0, 12, 0)
    q = jnp.zeros((1, 128, 2, 64), jnp.float32)
    assert "ushard_flash_forward" in str(jax.make_jaxpr(lambda q: flash.forward(q, q, q, True))(q))
    backward = jax.make_jaxpr(lambda q: flash.backward(q, q, q, q, q[..., 0], q, True))(q)
    assert "ushard_flash_dkdv" in str(backward) and "ushard_flash_dq" in str(backward)


@pytest.mark.skipif(not flash_hopper._API, reason="this JAX has no Mosaic GPU Pallas API")
def test_typed_kernels_trace_inside_a_stage_and_a_checked_ring_map():
    """Inside a pipeline stage the ring's map checks types with the kernels wrapped by
    `kernels.attention.typed` (tests/test_flash_layouts.py runs that on host callbacks); here the
    Mosaic GPU kernels themselves trace there, both halves, in two nested checked shard_maps."""
    from jax.sharding import PartitionSpec as P

    from ushard.kernels.attention import BlockKernel, typed

    def backward(q, k, v, out, lse, d_out, causal, q_segments, k_segments):
        lse2 = jnp.swapaxes(lse, 1, 2)
        dq, delta = flash_hopper_backward.dq(q, k, v, d_out, lse2, out, causal, q_segments, k_segments)
        return (dq, *flash_hopper_backward.dkdv(q, k, v, d_out, lse2, delta, causal, q_segments, k_segments))

    blocks = typed(BlockKernel(flash_hopper.forward, backward, segments=True, typed=False))

    def ring(q, k, v, ids):
        out, lse = blocks.forward(q, k, v, True, ids, ids)
        return out, blocks.backward(q, k, v, out, lse, out, True, ids, ids)[1]

    def stage(q, k, v, ids):
        split = P(None, "sequence")
        return jax.shard_map(ring, mesh=jax.sharding.get_abstract_mesh(), in_specs=(split,) * 4,
                             out_specs=(split, split), axis_names={"sequence"}, check_vma=True)(q, k, v, ids)

    mesh = jax.make_mesh((2, 2), ("pipeline", "sequence"), devices=jax.devices()[:4])
    stages = jax.shard_map(stage, mesh=mesh, in_specs=(P("pipeline"),) * 4, out_specs=(P("pipeline"),) * 2,
                           axis_names={"pipeline"}, check_vma=True)
    q = jax.ShapeDtypeStruct((4, 512, 4, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((4, 512, 2, 128), jnp.bfloat16)
    ids = jax.ShapeDtypeStruct((4, 512), jnp.int32)
    assert str(jax.make_jaxpr(stages)(q, kv, kv, ids)).count("wgmma") >= 9  # forward 2, dK/dV 4, dQ 3


def test_backward_grid_order_takes_tiles_first_only_for_grouped_heads_past_the_l2(monkeypatch):
    monkeypatch.setattr(flash_hopper, "launch", lambda *args, grid, grid_names=("head", "tile", "row"): grid_names)
    big, small = 2 * flash_hopper_backward.L2_BYTES, flash_hopper_backward.L2_BYTES // 2

    def order(group, row_bytes):
        return flash_hopper_backward._launch(None, [], [], [], [], 8, 64, 1, group, row_bytes)

    assert order(4, big) == ("tile", "head", "row")  # llama3_8b's shape: 32 heads in groups of 4 at 8k
    assert order(2, small) == order(1, big) == ("head", "tile", "row")
