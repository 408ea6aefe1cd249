"""The flash backward for Hopper GPUs on Pallas Mosaic GPU: flash.py's two-kernel backward, rewritten
with wgmma and TMA (same contract as `flash.backward`, which runs it where flash_hopper.supported
says so).

Both kernels have one shape, like flash_hopper.py's forward: a program owns a tile of 128 rows (two
compute warpgroups of 64 rows, each keeping its accumulators in registers) and a third warpgroup
streams the other side's blocks through `STAGES` shared-memory slots with TMA; a slot is refilled
once both compute warpgroups have released it.
- `dkdv`: a program owns 128 keys of one K/V head and streams, for each query head of its group in
  turn, the query blocks that see them: Q, dO, lse and D per block. dK and dV are summed over the
  group in registers, never stored per query head.
- `dq`: a program owns 128 queries of one head (with their dO, O and lse) and streams K and V
  blocks; it computes D = rowsum(dO * O) - d lse from the tiles it holds and hands it to `dkdv`,
  which runs after it.
Each recomputes P = exp2(S - lse) from the forward's final lse, so a block's gradients are its exact
share of the whole attention's (ring blocks, `kernels.attention.BlockKernel`). Which blocks a program
visits: the causal bound, a sliding window's bounds (`flash_hopper.window_start` and the like: blocks
wholly outside the window are never streamed) and, with segment ids, flash_hopper.visit_range's
per-tile range (exact for any ids; masks do the rest).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from ushard.kernels import flash_hopper
from ushard.kernels.flash_hopper import LOG2E, load_vector, mask, plan_scalars, ranges, swizzled

if flash_hopper._API:
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

ROWS = 64  # rows a compute warpgroup owns, and rows of a streamed block (a wgmma's M)
TILE = 2 * ROWS
STAGES = 2  # shared-memory slots: a third was slower for both kernels (tools/attention_bench.py sweep)
# Keys a streamed block of the dQ kernel, per head dim, as the sweep on an H200 chose them
# (docs/benchmarks.md): 128 at head dim 64; at 128 the 64-key blocks, whose [64, 64] scores leave
# registers to spare.
DQ_KEYS = {64: 128, 128: 64, 192: 64}
# Queries a streamed block of the dK/dV kernel, per q·k head dim: 64 (a warpgroup's rows) but for
# latent attention's 192 / 128, whose dK [64, 192] and dV [64, 128] accumulators take 160 of a
# thread's registers: 32-query blocks halve the scores and dP beside them.
DKDV_QUERIES = {64: 64, 128: 64, 192: 32}
# The order in which the block scheduler starts the kernels' programs: "heads", the heads of a tile
# side by side, or "tiles", a head's tiles one after another. "auto" takes "tiles" where K/V heads are
# grouped and a row's queries and output gradients over all heads exceed L2_BYTES, "heads"
# elsewhere: of the shapes measured (docs/benchmarks.md), "tiles" won only at llama3_8b's (groups of
# 4 at 8k tokens, 128 MiB), and lost without groups and with groups of 2 at 2k. A likely reason, not
# measured: without groups the programs of one head start side by side at neighbouring tiles and
# stream the same blocks at about the same time, so the L2 serves them all; a dK/dV program streams
# its group's heads one after another, and neighbouring tiles drift apart per head, until the
# programs at work at one time read every head's blocks.
GRID_ORDER = "auto"
# About what the L2 holds (an H100's is 50 MB, an H200's 60).
L2_BYTES = 48 << 20


def _launch(kernel, smem, barriers, args, out_type, heads: int, n_tiles: int, rows: int, group: int,
            row_bytes: int):
    """flash_hopper.launch over (head, tile, row), the axes in GRID_ORDER's order (the first
    fastest). `row_bytes`: a row's Q and dO over every query head."""
    order = GRID_ORDER
    if order == "auto":
        order = "tiles" if group > 1 and row_bytes > L2_BYTES else "heads"
    if order == "heads":
        return flash_hopper.launch(kernel, smem, barriers, args, out_type, grid=(heads, n_tiles, rows))
    return flash_hopper.launch(kernel, smem, barriers, args, out_type, grid=(n_tiles, heads, rows),
                               grid_names=("tile", "head", "row"))


def _stream(fetch, free, steps, stages):
    """The copying warpgroup: `fetch(step, slot)` for each step, waiting for a slot's release by both
    compute warpgroups before refilling it."""
    for i in range(stages):
        pl.when(i < steps)(functools.partial(fetch, i, i))

    @pl.loop(0, jnp.maximum(steps - stages, 0))
    def _(i):
        slot = lax.rem(i, stages)
        plgpu.barrier_wait(free.at[slot])
        fetch(i + stages, slot)


def dkdv(q, k, v, d_out, lse2, delta, causal, q_segments=None, k_segments=None, *, stages: int = STAGES,
         window: int = 0, block_q: int | None = None):
    """(dk, dv) in k's and v's dtype. lse2, delta: [B, heads, T] float32 (base-2 lse, -inf as 0; D).
    `block_q`: queries a streamed block (default DKDV_QUERIES's)."""
    b, t, heads, hd = q.shape
    vd = v.shape[-1]
    bq = block_q or DKDV_QUERIES[hd]
    kv_heads = k.shape[2]
    group = heads // kv_heads
    dtype = q.dtype
    n_tiles, n_q = t // TILE, t // bq
    scale = 1 / math.sqrt(hd)
    segments = q_segments is not None
    plan = None
    if segments:  # per key tile, the query blocks that meet it
        q_segments, k_segments = q_segments.astype(jnp.int32), k_segments.astype(jnp.int32)
        plan = flash_hopper.kernel_plan(flash_hopper.visit_range(k_segments, q_segments, TILE, bq))

    def kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, scoped):
        if segments:
            plan_ref, q_seg_ref, k_seg_ref, dk_ref, dv_ref = refs
        else:
            plan_ref = q_seg_ref = k_seg_ref = None
            dk_ref, dv_ref = refs
        smem, (own_ready, ready, free) = scoped
        k_own, v_own, k_seg_own, q_in, do_in, lse_in, delta_in, q_seg_in, plan_smem = smem
        row, kv_head = lax.axis_index("row"), lax.axis_index("head")
        # The keys that most queries see first (under a causal mask the first keys: queries from the
        # tile's own on see it), so the last programs to start are the shortest.
        tile = lax.axis_index("tile")
        wg = lax.axis_index("wg")
        start, free_lo, free_hi, stop = plan_scalars(plan_ref, plan_smem, own_ready.at[4], wg, row, tile, n_q,
                                                      segments)
        if causal:  # queries before the tile's first key see none of it, nor w or more after its last
            start = jnp.maximum(start, lax.div(tile * TILE, bq))
            stop = jnp.minimum(stop, flash_hopper.window_stop(tile * TILE + TILE - 1, window, bq, n_q))
            stop = jnp.maximum(stop, start)
        per_head = stop - start
        steps = group * per_head

        def block_of(step):  # (query head, query block) of a step
            return kv_head * group + lax.div(step, per_head), start + lax.rem(step, per_head)

        @pl.when(wg < 2)
        def _compute():
            plgpu.set_max_registers(232, action="increase")
            k_first = tile * TILE + wg * ROWS
            keys = (row, pl.ds(k_first, ROWS), kv_head)
            plgpu.copy_gmem_to_smem(k_ref.at[keys], k_own.at[wg], own_ready.at[wg])
            plgpu.copy_gmem_to_smem(v_ref.at[keys], v_own.at[wg], own_ready.at[wg + 2])
            k_seg = None
            if segments:
                plgpu.copy_gmem_to_smem(k_seg_ref.at[row, pl.ds(k_first, ROWS)], k_seg_own.at[wg],
                                        own_ready.at[5 + wg])
                plgpu.barrier_wait(own_ready.at[5 + wg])
                k_seg = load_vector(k_seg_own.at[wg], plgpu.Layout.WGMMA.reduce(1))
            plgpu.barrier_wait(own_ready.at[wg])
            plgpu.barrier_wait(own_ready.at[wg + 2])
            k_smem, v_smem = k_own.at[wg], v_own.at[wg]

            def step(i, carry, masked, head_step):
                dk, dv = carry
                s_index = head_step + i - start
                slot = lax.rem(s_index, stages)
                for stream in range(5 if segments else 4):
                    plgpu.barrier_wait(ready.at[stream, slot])
                q_smem, do_smem = q_in.at[slot], do_in.at[slot]

                def scores(acc_ref):  # Sᵀ = K Qᵀ, [keys, queries]
                    plgpu.wgmma(acc_ref, k_smem, plgpu.transpose_ref(q_smem, (1, 0)))
                    return acc_ref[...]

                s = pl.run_scoped(scores, plgpu.ACC((ROWS, bq), jnp.float32))
                lse = load_vector(lse_in.at[slot], plgpu.Layout.WGMMA.reduce(0))
                if masked:
                    q_seg = load_vector(q_seg_in.at[slot], plgpu.Layout.WGMMA.reduce(0)) if segments else None
                    seen = mask(causal, segments, i * bq, k_first, (ROWS, bq), 1, q_seg, k_seg, window)
                    s = jnp.where(seen, s, -jnp.inf)
                p = jnp.exp2(s * (scale * LOG2E) - lax.broadcast_in_dim(lse, s.shape, [1]))

                def dv_and_dp(refs):  # dV += Pᵀ dO; dPᵀ = V dOᵀ (one wait for both)
                    dv_ref, dp_ref = refs
                    plgpu.wgmma(dv_ref, p.astype(dtype), do_smem)
                    plgpu.wgmma(dp_ref, v_smem, plgpu.transpose_ref(do_smem, (1, 0)))

                zeros = plgpu.layout_cast(jnp.zeros((ROWS, bq), jnp.float32), plgpu.Layout.WGMMA)
                dv, dp = pl.run_state(dv_and_dp)((plgpu.ACC.init(dv), plgpu.ACC.init(zeros)))
                d = load_vector(delta_in.at[slot], plgpu.Layout.WGMMA.reduce(0))
                ds = p * (dp - lax.broadcast_in_dim(d, dp.shape, [1]))

                def dk_update(dk_ref):  # dK += dSᵀ Q
                    plgpu.wgmma(dk_ref, ds.astype(dtype), q_smem)

                dk = pl.run_state(dk_update)(plgpu.ACC.init(dk))
                plgpu.barrier_arrive(free.at[slot])
                return dk, dv

            causal_free = lax.div(k_first + ROWS - 1 + bq - 1, bq) if causal else 0
            my_free_hi = free_hi
            if causal and window:  # query blocks wholly within w of this warpgroup's first key need no mask
                my_free_hi = jnp.minimum(free_hi, lax.div(k_first + window, bq))
            loops = ranges(start, free_lo, my_free_hi, stop, causal_free, causal_after=True, masks=causal or segments)

            def head(g, carry):
                head_step = g * per_head
                for first, last, masked in loops:
                    carry = lax.fori_loop(first, last, functools.partial(step, masked=masked, head_step=head_step),
                                          carry)
                return carry

            dk = plgpu.layout_cast(jnp.zeros((ROWS, hd), jnp.float32), plgpu.Layout.WGMMA)
            dv = dk if vd == hd else plgpu.layout_cast(jnp.zeros((ROWS, vd), jnp.float32), plgpu.Layout.WGMMA)
            dk, dv = lax.fori_loop(0, group, head, (dk, dv))
            k_smem[...] = (dk * scale).astype(dtype)
            v_smem[...] = dv.astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(k_smem, dk_ref.at[keys], commit_group=False)
            plgpu.copy_smem_to_gmem(v_smem, dv_ref.at[keys], commit_group=False)
            plgpu.commit_smem_to_gmem_group()
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == 2)
        def _copy():
            plgpu.set_max_registers(40, action="decrease")

            def fetch(step, slot):
                h, qb = block_of(step)
                rows = pl.ds(qb * bq, bq)
                plgpu.copy_gmem_to_smem(q_ref.at[row, rows, h], q_in.at[slot], ready.at[0, slot])
                plgpu.copy_gmem_to_smem(do_ref.at[row, rows, h], do_in.at[slot], ready.at[1, slot])
                plgpu.copy_gmem_to_smem(lse_ref.at[row, h, rows], lse_in.at[slot], ready.at[2, slot])
                plgpu.copy_gmem_to_smem(delta_ref.at[row, h, rows], delta_in.at[slot], ready.at[3, slot])
                if segments:
                    plgpu.copy_gmem_to_smem(q_seg_ref.at[row, rows], q_seg_in.at[slot], ready.at[4, slot])

            _stream(fetch, free, steps, stages)

    # Blocks of 32 queries are a wgmma's K in dK and dV: a 64-byte swizzle, for all four operands.
    swizzle = min(128, 2 * bq)
    smem = [plgpu.SMEM((2, ROWS, hd), dtype, transforms=swizzled(swizzle)),
            plgpu.SMEM((2, ROWS, vd), dtype, transforms=swizzled(swizzle)),
            plgpu.SMEM((2, ROWS), jnp.int32),
            plgpu.SMEM((stages, bq, hd), dtype, transforms=swizzled(swizzle)),
            plgpu.SMEM((stages, bq, vd), dtype, transforms=swizzled(swizzle)),
            plgpu.SMEM((stages, bq), jnp.float32),
            plgpu.SMEM((stages, bq), jnp.float32),
            plgpu.SMEM((stages, bq), jnp.int32),
            plgpu.SMEM((flash_hopper.PLAN_WIDTH,), jnp.int32)]
    barriers = [plgpu.Barrier(num_barriers=7), plgpu.Barrier(num_barriers=(5, stages)),
                plgpu.Barrier(num_arrivals=2, num_barriers=stages)]
    args = [q, k, v, d_out, lse2, delta]
    if segments:
        args += [plan, q_segments, k_segments]
    out_type = [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)]
    row_bytes = (q.size + d_out.size) // b * q.dtype.itemsize  # a row's Q and dO
    return _launch(kernel, smem, barriers, args, out_type, kv_heads, n_tiles, b, group, row_bytes)


def dq(q, k, v, d_out, lse2, out, causal, q_segments=None, k_segments=None, *, d_lse=None, stages: int = STAGES,
       block_k: int | None = None, window: int = 0):
    """(dq in q's dtype, D [B, heads, T] float32 for the dK/dV kernel). lse2: [B, heads, T] float32
    (base-2 lse, -inf as 0); out: the forward's; d_lse: lse's cotangent [B, heads, T], or None. The
    kernel computes D = rowsum(dO * out) - d_lse from the tiles it holds anyway (measured faster than
    XLA computing it first). `block_k`: keys a streamed block (default DQ_KEYS's)."""
    b, t, heads, hd = q.shape
    vd = v.shape[-1]
    block_k = block_k or DQ_KEYS[hd]
    group = heads // k.shape[2]
    dtype = q.dtype
    n_tiles, n_k = t // TILE, t // block_k
    scale = 1 / math.sqrt(hd)
    segments = q_segments is not None
    plan = None
    if segments:
        q_segments, k_segments = q_segments.astype(jnp.int32), k_segments.astype(jnp.int32)
        plan = flash_hopper.kernel_plan(flash_hopper.visit_range(q_segments, k_segments, TILE, block_k))

    def kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, o_ref, *refs, scoped):
        refs = list(refs)
        d_lse_ref = refs.pop(0) if d_lse is not None else None
        plan_ref, q_seg_ref, k_seg_ref = refs[:3] if segments else (None, None, None)
        dq_ref, delta_ref = refs[3:] if segments else refs
        smem, (own_ready, ready, free) = scoped
        q_own, do_own, lse_own, delta_own, q_seg_own, k_in, v_in, k_seg_in, plan_smem, o_own = smem
        row, head = lax.axis_index("row"), lax.axis_index("head")
        tile = n_tiles - 1 - lax.axis_index("tile")  # the longest causal rows first
        wg = lax.axis_index("wg")
        start, free_lo, free_hi, stop = plan_scalars(plan_ref, plan_smem, own_ready.at[10], wg, row, tile, n_k,
                                                      segments)
        if causal:  # keys after the tile's last query are seen by none of it, nor w or more before its first
            stop = jnp.minimum(stop, lax.div((tile + 1) * TILE + block_k - 1, block_k))
            start = jnp.minimum(jnp.maximum(start, flash_hopper.window_start(tile * TILE, window, block_k)), stop)
        steps = stop - start

        @pl.when(wg < 2)
        def _compute():
            plgpu.set_max_registers(232, action="increase")
            q_first = tile * TILE + wg * ROWS
            rows = (row, pl.ds(q_first, ROWS), head)
            vectors = (row, head, pl.ds(q_first, ROWS))
            plgpu.copy_gmem_to_smem(q_ref.at[rows], q_own.at[wg], own_ready.at[wg])
            plgpu.copy_gmem_to_smem(do_ref.at[rows], do_own.at[wg], own_ready.at[2 + wg])
            plgpu.copy_gmem_to_smem(lse_ref.at[vectors], lse_own.at[wg], own_ready.at[4 + wg])
            plgpu.copy_gmem_to_smem(o_ref.at[rows], o_own.at[wg], own_ready.at[6 + wg])
            if d_lse_ref is not None:
                plgpu.copy_gmem_to_smem(d_lse_ref.at[vectors], delta_own.at[wg], own_ready.at[11 + wg])
                plgpu.barrier_wait(own_ready.at[11 + wg])
            q_seg = None
            if segments:
                plgpu.copy_gmem_to_smem(q_seg_ref.at[row, pl.ds(q_first, ROWS)], q_seg_own.at[wg],
                                        own_ready.at[8 + wg])
                plgpu.barrier_wait(own_ready.at[8 + wg])
                q_seg = load_vector(q_seg_own.at[wg], plgpu.Layout.WGMMA.reduce(1))
            for i in range(4):
                plgpu.barrier_wait(own_ready.at[2 * i + wg])
            lse = load_vector(lse_own.at[wg], plgpu.Layout.WGMMA.reduce(1))
            q_smem, do_smem = q_own.at[wg], do_own.at[wg]
            # D = rowsum(dO * O) - d lse, written out for the dK/dV kernel too.
            d = (do_smem[...].astype(jnp.float32) * o_own.at[wg][...].astype(jnp.float32)).sum(axis=1)
            if d_lse_ref is not None:
                d = d - load_vector(delta_own.at[wg], plgpu.Layout.WGMMA.reduce(1))
            delta_own.at[wg][...] = d
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(delta_own.at[wg], delta_ref.at[vectors])
            # This warpgroup's rows' causal stop, and the blocks wholly before its first row.
            my_stop, causal_free = stop, n_k
            if causal:
                my_stop = jnp.clip(lax.div(q_first + ROWS + block_k - 1, block_k), start, stop)
                causal_free = lax.div(q_first + 1, block_k)
            my_free_lo = jnp.maximum(free_lo, flash_hopper.window_free(q_first + ROWS - 1, window, block_k))

            def step(j, dq, masked):
                slot = lax.rem(j - start, stages)
                for stream in range(3 if segments else 2):
                    plgpu.barrier_wait(ready.at[stream, slot])
                k_smem, v_smem = k_in.at[slot], v_in.at[slot]

                def scores_and_dp(refs):  # S = Q Kᵀ, dP = dO Vᵀ (one wait for both)
                    s_ref, dp_ref = refs
                    plgpu.wgmma(s_ref, q_smem, plgpu.transpose_ref(k_smem, (1, 0)))
                    plgpu.wgmma(dp_ref, do_smem, plgpu.transpose_ref(v_smem, (1, 0)))

                zeros = plgpu.layout_cast(jnp.zeros((ROWS, block_k), jnp.float32), plgpu.Layout.WGMMA)
                s, dp = pl.run_state(scores_and_dp)((plgpu.ACC.init(zeros), plgpu.ACC.init(zeros)))
                if masked:
                    k_seg = load_vector(k_seg_in.at[slot], plgpu.Layout.WGMMA.reduce(0)) if segments else None
                    seen = mask(causal, segments, q_first, j * block_k, (ROWS, block_k), 0, q_seg, k_seg, window)
                    s = jnp.where(seen, s, -jnp.inf)
                p = jnp.exp2(s * (scale * LOG2E) - lax.broadcast_in_dim(lse, s.shape, [0]))
                ds = p * (dp - lax.broadcast_in_dim(d, dp.shape, [0]))

                def dq_update(dq_ref):  # dQ += dS K
                    plgpu.wgmma(dq_ref, ds.astype(dtype), k_smem)

                dq = pl.run_state(dq_update)(plgpu.ACC.init(dq))
                plgpu.barrier_arrive(free.at[slot])
                return dq

            dq = plgpu.layout_cast(jnp.zeros((ROWS, hd), jnp.float32), plgpu.Layout.WGMMA)
            for first, last, masked in ranges(start, my_free_lo, free_hi, my_stop, causal_free,
                                              causal_after=False, masks=causal or segments):
                dq = lax.fori_loop(first, last, functools.partial(step, masked=masked), dq)

            def release(j, _):  # blocks this warpgroup's rows do not see: wait for them, then free them
                slot = lax.rem(j - start, stages)
                for stream in range(3 if segments else 2):
                    plgpu.barrier_wait(ready.at[stream, slot])
                plgpu.barrier_arrive(free.at[slot])

            lax.fori_loop(my_stop, stop, release, None)
            q_smem[...] = (dq * scale).astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(q_smem, dq_ref.at[rows])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == 2)
        def _copy():
            plgpu.set_max_registers(40, action="decrease")
            kv_head = lax.div(head, group)

            def fetch(step, slot):
                keys = pl.ds((start + step) * block_k, block_k)
                plgpu.copy_gmem_to_smem(k_ref.at[row, keys, kv_head], k_in.at[slot], ready.at[0, slot])
                plgpu.copy_gmem_to_smem(v_ref.at[row, keys, kv_head], v_in.at[slot], ready.at[1, slot])
                if segments:
                    plgpu.copy_gmem_to_smem(k_seg_ref.at[row, keys], k_seg_in.at[slot], ready.at[2, slot])

            _stream(fetch, free, steps, stages)

    smem = [plgpu.SMEM((2, ROWS, hd), dtype, transforms=swizzled()),
            plgpu.SMEM((2, ROWS, vd), dtype, transforms=swizzled()),
            plgpu.SMEM((2, ROWS), jnp.float32),
            plgpu.SMEM((2, ROWS), jnp.float32),
            plgpu.SMEM((2, ROWS), jnp.int32),
            plgpu.SMEM((stages, block_k, hd), dtype, transforms=swizzled()),
            plgpu.SMEM((stages, block_k, vd), dtype, transforms=swizzled()),
            plgpu.SMEM((stages, block_k), jnp.int32),
            plgpu.SMEM((flash_hopper.PLAN_WIDTH,), jnp.int32),
            plgpu.SMEM((2, ROWS, vd), dtype, transforms=swizzled())]
    barriers = [plgpu.Barrier(num_barriers=13), plgpu.Barrier(num_barriers=(3, stages)),
                plgpu.Barrier(num_arrivals=2, num_barriers=stages)]
    args = [q, k, v, d_out, lse2, out.astype(dtype)]
    if d_lse is not None:
        args.append(d_lse.astype(jnp.float32))
    if segments:
        args += [plan, q_segments, k_segments]
    out_type = [jax.ShapeDtypeStruct(q.shape, dtype), jax.ShapeDtypeStruct((b, heads, t), jnp.float32)]
    row_bytes = (q.size + d_out.size) // b * q.dtype.itemsize  # a row's Q and dO
    return tuple(_launch(kernel, smem, barriers, args, out_type, heads, n_tiles, b, group, row_bytes))
