"""The flash forward for Hopper GPUs, written with Pallas Mosaic GPU (warp-specialised, wgmma).

Same contract as `flash.forward` ((out, lse) of causal or full attention with optional segment ids
and grouped K/V heads); `flash.forward` runs this one where `supported` says it can and the Pallas
Triton forward elsewhere. The backward stays `flash.backward`'s, fed by this forward's out and lse.

Layout of one program (a CTA of three warpgroups), after FlashAttention-3:
- the forward is persistent: one program per multiprocessor, each computing a fixed list of tiles
  in turn (`schedule`: a head's tiles one after another, so the programs at work at one time share
  its K/V in L2), so one tile's start (its queries, its first K/V blocks) and end
  (its output stores) overlap its neighbours' work instead of waiting in a fresh program;
- a *tile* is 2 · `block_q` query rows of one (row, head): each of two compute warpgroups owns
  `block_q` rows and keeps their accumulator, running max and sum in registers; it fetches its rows
  of the next tile into a second buffer during the tile's first step, and writes its results out
  through the tile's own query buffer;
- the third warpgroup only copies K/V blocks (and their segment ids) into a ring of `stages` shared
  memory slots with TMA, waiting for both compute warpgroups to release a slot before refilling it;
  the ring runs on across tiles, so the next tile's first blocks arrive while this one ends;
- the two compute warpgroups take turns on the tensor cores (a shared "schedule" barrier): while one
  runs its QKᵀ and PV matmuls the other runs its softmax, so the exponentials hide behind matmuls.

Which key blocks a tile visits, per row: without segment ids, every block up to the causal bound;
with them, the contiguous range [start, stop) of blocks whose id ranges meet the tile's, and
within it a sub-range [free_lo, free_hi) that needs no segment mask (every id one and the same).
`visit_range` computes that per tile with XLA, exact for any ids: ids outside a tile's document
are masked, so a range that covers more than needed costs time, never correctness. On ushard's
packed rows (ids never decrease) it is the tile's documents' blocks and nothing else. Both compute
warpgroups step through the same range, so their turns on the schedule barrier stay paired; one
whose causal rows end earlier releases the remaining slots without computing. With a sliding
window the range starts at the block of the tile's first row's first key (`window_start`), so
blocks wholly before the window are never copied nor computed; a warpgroup's blocks partly inside
it are masked, those wholly inside it are not (`window_free`).

Scores are kept in base 2, as in flash.py; lse is returned in natural log, [B, T, heads] float32. A
query that sees no key gets out 0 and lse -inf.
"""

from __future__ import annotations

import functools
import heapq
import inspect
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)

try:  # Mosaic GPU's Pallas API as JAX 0.11 has it; older JAX runs the Triton forward only.
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    _API = all(hasattr(plgpu, name) for name in ("kernel", "wgmma", "broadcasted_iota", "load", "layout_cast",
                                                   "set_max_registers", "transpose_ref", "ACC"))
except ImportError:  # pragma: no cover - a JAX without Mosaic GPU
    _API = False

# Per q·k head dim: query rows per compute warpgroup (a wgmma's 64-row M), keys per block, K/V slots, as
# tools/attention_bench.py --block-sweep chose them on an H200 (docs/benchmarks.md): 64-key blocks and
# a third slot were slower. Shared memory at head dim 128: 2 buffers x 2 x 64 query rows + 2 slots x
# 128 keys x (K, V) in bf16 = 192 KiB; a third slot exceeds the 227 KiB a block has. At 192 / 128
# (latent attention) the queries' two buffers take 96 KiB and the output its own 32 KiB buffer (the
# query buffer is wider than it), so 128-key slots (160 KiB) do not fit: 64-key ones (80 KiB).
BLOCKS = {64: (64, 128, 2), 128: (64, 128, 2), 192: (64, 64, 2)}
# The values' head dim the kernels take for each q·k head dim: the same but for latent attention's
# 192 / 128 (DeepSeek-V2/V3), whose output (128 wide) leaves through a buffer of its own.
VALUE_DIMS = {64: 64, 128: 128, 192: 128}
# The head dims `flash.forward` runs this forward at. At 192 it deadlocks once a program runs more
# than one tile (on an H200: B1 T1024 H4, a tile a program, matched float32; B1 T4096 H16 never
# returned; docs/dev-notes.md), so until that is found the forward at 192 runs on the Triton kernel
# while the backward kernels (not persistent: a program a tile) run here.
FORWARD_HEAD_DIMS = (64, 128)
# When the device does not say how many multiprocessors it has.
H100_MULTIPROCESSORS = 132
# With segment ids: the copying warpgroup fetches a tile's visit range PLAN_AHEAD tiles ahead, into a
# ring of PLANS buffers (a short tile must not hold up the next tiles' K/V copies).
PLAN_AHEAD, PLANS = 2, 4
# A visit range as the kernels copy it: padded to 32 int32s, since JAX 0.10's warpgroup copies move whole
# multiples of 128 bytes (0.11 lifts that; the padding keeps every kernel lowerable on both).
PLAN_WIDTH = 32


def load_vector(ref, layout):
    """A vector from shared memory in `layout`: JAX 0.10 takes the index apart, 0.11 deprecates that."""
    if inspect.signature(plgpu.load).parameters["idx"].default is inspect.Parameter.empty:
        return plgpu.load(ref, (), layout=layout)
    return plgpu.load(ref, layout=layout)


# The JAX the kernels were compiled and checked with on GPUs; older ones (0.10.x traces them, but its
# Mosaic GPU lowering was never run here) keep the Triton kernels.
CHECKED_JAX = (0, 11)


def jax_version(text: str) -> tuple[int, ...]:
    """(major, minor, ...) of a version string such as "0.11.2" or "0.12.0.dev20260101"."""
    parts = []
    for part in text.split("."):
        if not part.isdigit():
            break
        parts.append(int(part))
    return tuple(parts)


def available() -> bool:
    """Whether this process runs the kernels: a JAX from CHECKED_JAX on with Mosaic GPU's API, and a
    Hopper (sm_90) GPU."""
    if not _API or jax_version(jax.__version__) < CHECKED_JAX or jax.default_backend() != "gpu":
        return False
    return getattr(jax.local_devices()[0], "compute_capability", "") == "9.0"


def supported(q, k, v=None) -> bool:
    """Whether the kernels take these inputs (on a device where `available`); `v` None: values as
    wide as q·k."""
    b, t, heads, hd = q.shape
    if hd not in BLOCKS or q.dtype not in (jnp.bfloat16, jnp.float16):
        return False
    if (hd if v is None else v.shape[-1]) != VALUE_DIMS[hd]:
        return False
    block_q, block_k, _ = BLOCKS[hd]
    # Whole 128-row tiles and 128-key blocks (every kernel's, the backward's too), and a program's
    # list of tiles (`schedule`) in shared memory beside the tiles' buffers (a list can be longer
    # than the mean: up to 1.35 times it was seen).
    per_program = -(-b * heads * (t // (2 * block_q)) // multiprocessors())
    return (t % (2 * block_q) == 0 and t % block_k == 0 and t % 128 == 0 and k.shape[1] == t
            and 2 * per_program < max_schedule(hd))


def blocks_meet(q_segments, k_segments, block_q: int, block_k: int):
    """Between blocks of `block_q` queries and `block_k` keys of each row, from their segment ids'
    ranges [min, max]: (meet, one_id), both [B, query blocks, key blocks] bool. `meet`: the ranges
    overlap (some query may see some key; a safe test whatever the ids' order); `one_id`: both blocks
    hold one and the same id (every query sees every key, before any causal mask). Shared by this
    module's per-tile ranges and flash.py's visit plans."""
    b, t = q_segments.shape
    qs = q_segments.reshape(b, t // block_q, block_q)
    ks = k_segments.reshape(b, t // block_k, block_k)
    q_lo, q_hi, k_lo, k_hi = qs.min(-1), qs.max(-1), ks.min(-1), ks.max(-1)
    meet = (q_lo[:, :, None] <= k_hi[:, None, :]) & (k_lo[:, None, :] <= q_hi[:, :, None])
    one_id = (q_lo == q_hi)[:, :, None] & (k_lo == k_hi)[:, None, :] & (q_lo[:, :, None] == k_lo[:, None, :])
    return meet, one_id


def visit_range(q_segments, k_segments, tile: int, block_k: int):
    """Per (row, query tile): int32 [start, free_lo, free_hi, stop] over key blocks (module
    docstring), before any causal bound (the kernel applies that per warpgroup)."""
    meet, one_id = blocks_meet(q_segments, k_segments, tile, block_k)  # [B, n_tiles, n_k]
    n_k = meet.shape[-1]
    index = jnp.arange(n_k)
    start = jnp.min(jnp.where(meet, index, n_k), axis=-1)
    stop = jnp.max(jnp.where(meet, index + 1, 0), axis=-1)
    stop = jnp.maximum(stop, start)
    start = jnp.minimum(start, stop)
    # The free blocks as one contiguous run [free_lo, free_hi): the first free block and as many as
    # follow it without a gap; free blocks after a gap are simply masked (exact, a little slower).
    free_lo = jnp.min(jnp.where(one_id, index, n_k), axis=-1)
    after = index[None, None, :] >= free_lo[..., None]
    gap = after & ~one_id
    free_hi = jnp.min(jnp.where(gap, index, n_k), axis=-1)
    free_lo = jnp.clip(free_lo, start, stop)
    free_hi = jnp.clip(free_hi, free_lo, stop)
    return jnp.stack([start, free_lo, free_hi, stop], axis=-1).astype(jnp.int32)


def kernel_plan(plan):
    """`visit_range`'s plan padded to PLAN_WIDTH per tile, as the kernels copy it."""
    return jnp.pad(plan, [(0, 0), (0, 0), (0, PLAN_WIDTH - plan.shape[-1])])


def swizzled(swizzle: int = 128):
    """Shared memory's layout for a 16-bit wgmma operand tile: 8 x 64 tiles, 128-byte swizzle (or
    8 x swizzle / 2 tiles: a wgmma's operands share one swizzle, and its smem operand's K is a
    multiple of swizzle / 2)."""
    return (plgpu.TilingTransform((8, swizzle // 2)), plgpu.SwizzleTransform(swizzle))


def ranges(start, free_lo, free_hi, stop, causal_free, causal_after: bool, masks: bool):
    """(first, last, masked) loops over a program's visited blocks for one warpgroup. `causal_free`:
    with `causal_after`, the first block wholly after the warpgroup's rows that needs no causal mask
    (keys owned, queries streamed); else the end of those wholly before them (queries owned).
    Without `masks` (neither causal nor segment ids) only the unmasked loop."""
    if causal_after:
        lo = jnp.clip(jnp.maximum(free_lo, causal_free), start, stop)
        hi = jnp.clip(free_hi, lo, stop)
    else:
        lo = jnp.clip(free_lo, start, stop)
        hi = jnp.clip(jnp.minimum(free_hi, causal_free), lo, stop)
    loops = ((start, lo, True), (lo, hi, False), (hi, stop, True))
    return loops if masks else loops[1:2]


def window_start(q_first, window: int, block_k: int):
    """The first key block a query from `q_first` on sees within `window` (0: the first block)."""
    return lax.div(jnp.maximum(q_first - window + 1, 0), block_k) if window else 0


def window_free(q_last, window: int, block_k: int):
    """The first key block whose every key is within `window` of a query at `q_last` and before it
    (0 without a window): the free blocks of queries up to `q_last` start there or later."""
    return lax.div(jnp.maximum(q_last - window + 1, 0) + block_k - 1, block_k) if window else 0


def window_stop(k_last, window: int, block_q: int, n_q: int):
    """One past the last query block that sees a key at `k_last` or before within `window`."""
    return jnp.minimum(n_q, lax.div(k_last + window - 1, block_q) + 1) if window else n_q


def mask(causal, segments, q_first, k_first, shape, q_axis, q_seg, k_seg, window: int = 0):
    """Which query sees which key in a [rows, columns] block, queries along `q_axis` (within
    `window` keys if > 0)."""
    seen = None
    if causal:
        queries = q_first + plgpu.broadcasted_iota(jnp.int32, shape, q_axis, layout=plgpu.Layout.WGMMA)
        keys = k_first + plgpu.broadcasted_iota(jnp.int32, shape, 1 - q_axis, layout=plgpu.Layout.WGMMA)
        seen = queries >= keys
        if window:
            seen = seen & (queries - keys < window)
    if segments:
        same = (lax.broadcast_in_dim(q_seg, shape, [q_axis]) == lax.broadcast_in_dim(k_seg, shape, [1 - q_axis]))
        seen = same if seen is None else seen & same
    return seen


def plan_scalars(plan_ref, plan_smem, ready, wg, row, tile, n_blocks, segments):
    """(start, free_lo, free_hi, stop) of this program's tile: from the plan with segment ids (the
    copying warpgroup fetches it, every warpgroup reads it), else every block."""
    if not segments:
        return 0, 0, n_blocks, n_blocks

    @pl.when(wg == 2)
    def _():
        plgpu.copy_gmem_to_smem(plan_ref.at[row, tile], plan_smem, ready)

    plgpu.barrier_wait(ready)
    return tuple(plan_smem[i] for i in range(4))


def forward(q, k, v, causal: bool, q_segments=None, k_segments=None, *, blocks: tuple[int, int, int] | None = None,
            window: int = 0):
    """(out [B, T, heads, vd] in q's dtype, lse [B, T, heads] float32): `flash.forward`'s contract (v's
    head dim vd as VALUE_DIMS has it).
    `blocks`: (query rows a warpgroup, keys a block, slots) other than BLOCKS's (the bench's sweep)."""
    b, t, heads, hd = q.shape
    block_q, block_k, stages = blocks or BLOCKS[hd]
    plan = None
    if q_segments is not None:
        plan = kernel_plan(visit_range(q_segments.astype(jnp.int32), k_segments.astype(jnp.int32), 2 * block_q,
                                       block_k))
    out, lse = _call(q, k, v, plan, q_segments, k_segments, causal=causal, block_q=block_q, block_k=block_k,
                     stages=min(stages, t // block_k), programs=multiprocessors(), window=window)
    return out, jnp.swapaxes(lse, 1, 2)


def multiprocessors() -> int:
    """The GPU's streaming multiprocessors: the persistent forward runs one program on each."""
    return getattr(jax.local_devices()[0], "core_count", None) or H100_MULTIPROCESSORS


# The persistent forward's order of tiles (`schedule`): "tiles", a head's tiles one after another, or
# "heads", the heads of a tile index side by side (the order before); "auto" takes "heads" with
# segment ids, whose tiles' work `schedule` cannot know ("tiles" was slower with 4 documents,
# docs/benchmarks.md), and "tiles" elsewhere.
ORDER = "auto"
# The most tiles a program's list (`schedule`) holds: 16 KiB of int32s, within the 227 KiB of shared
# memory a block has beside the tiles' 192 KiB; 8 KiB beside latent attention's 211 KiB.
MAX_SCHEDULE = 4096


def max_schedule(head_dim: int) -> int:
    """MAX_SCHEDULE for q·k heads of `head_dim` (less where the tiles' buffers take more)."""
    return MAX_SCHEDULE if head_dim <= 128 else MAX_SCHEDULE // 2
# With ORDER "tiles", the tiles per program that the last heads, taken side by side, hold at least.
TAIL_TILES = 4


def tile_blocks(tile_index, *, causal: bool, n_k: int, tile: int, block_k: int, window: int = 0) -> int:
    """Key blocks a tile of `tile` query rows visits without segment ids (the copying warpgroup's range)."""
    if not causal:
        return n_k
    stop = min(n_k, -(-(tile_index + 1) * tile // block_k))
    start = min(max(tile_index * tile - window + 1, 0) // block_k if window else 0, stop)
    return stop - start


def schedule(programs: int, rows: int, heads: int, n_tiles: int, blocks, order: str = "tiles",
             limit: int = MAX_SCHEDULE):
    """int32 [programs, width]: program p computes the tiles `table[p, 1:1 + table[p, 0]]` in turn, each
    numbered `(row · heads + head) · n_tiles + n_tiles - 1 - tile index` (`tile_of_work`). `blocks(tile
    index)`: the key blocks a tile visits, its cost.

    Order "tiles": the tiles in that numbering, each given to the program that would be free first
    (list scheduling, a tile costing its blocks and one more for its start and end), which is what a
    block scheduler would do. So the programs at work at one time hold a window of consecutive
    tiles, of one head or two: they share that head's K/V in L2 (16 MiB at 32k tokens, where every
    head's would be 256 MiB), and each head's tiles go from the longest causal rows down. The last
    heads (TAIL_TILES tiles a program) go side by side, longest tiles first, so that the short
    ones come last, where they even out the programs' ends. Order "heads": tiles numbered
    heads fastest, then a row's tiles from the longest down, dealt out in turn (the earlier order).
    The width is a multiple of PLAN_WIDTH (whole 128-byte copies)."""
    n_work = rows * heads * n_tiles
    mine = [[] for _ in range(programs)]
    if order == "heads":
        for work in range(n_work):
            rest, head = divmod(work, heads)
            row, back = divmod(rest, n_tiles)
            mine[work % programs].append((row * heads + head) * n_tiles + back)
    else:
        # The last row's last `tail` heads side by side, their longest tiles first: a single head's
        # longest tiles at the very end would leave the other programs idle while they finish.
        tail = min(heads, -(-TAIL_TILES * programs // n_tiles))
        last = (rows - 1) * heads + heads - tail
        order = list(range(last * n_tiles)) + sorted(range(last * n_tiles, n_work),
                                                      key=lambda work: (work % n_tiles, work))
        cost = [blocks(n_tiles - 1 - back) + 1 for back in range(n_tiles)]
        free = [(0, p) for p in range(programs)]  # (time free, program): a heap
        for work in order:
            at, p = heapq.heappop(free)
            mine[p].append(work)
            heapq.heappush(free, (at + cost[work % n_tiles], p))
    width = -(-(1 + max(len(m) for m in mine)) // PLAN_WIDTH) * PLAN_WIDTH
    if width > limit:
        raise ValueError(f"a program's list of {width} tiles exceeds its limit ({limit}, `max_schedule`): use fewer "
                         f"tiles")
    table = np.zeros((programs, width), np.int32)
    for p, m in enumerate(mine):
        table[p, 0] = len(m)
        table[p, 1:1 + len(m)] = m
    return table


def tile_of_work(work, *, heads: int, n_tiles: int):
    """(row, head, tile index) of a tile numbered as `schedule` numbers them."""
    rest = lax.div(work, n_tiles)
    return lax.div(rest, heads), lax.rem(rest, heads), n_tiles - 1 - lax.rem(work, n_tiles)


def _call(q, k, v, plan, q_segments, k_segments, *, causal, block_q, block_k, stages, programs, window=0):
    b, t, heads, hd = q.shape
    vd = v.shape[-1]
    # Values narrower than q·k: the output leaves through a buffer of its own (one per warpgroup),
    # not the tile's query buffer.
    own_out = vd != hd
    group = heads // k.shape[2]
    dtype = q.dtype
    tile = 2 * block_q
    n_tiles, n_k = t // tile, t // block_k
    n_work = b * n_tiles * heads
    programs = min(programs, n_work)
    scale = LOG2E / math.sqrt(hd)  # scores to base 2 in one multiply
    segments = plan is not None
    order = ORDER if ORDER != "auto" else ("heads" if segments else "tiles")
    table = schedule(programs, b, heads, n_tiles, functools.partial(
        tile_blocks, causal=causal, n_k=n_k, tile=tile, block_k=block_k, window=window), order, max_schedule(hd))

    def kernel(q_ref, k_ref, v_ref, table_ref, *refs, scoped):
        if segments:
            plan_ref, q_seg_ref, k_seg_ref, out_ref, lse_ref = refs
        else:
            plan_ref = q_seg_ref = k_seg_ref = None
            out_ref, lse_ref = refs
        (qo_smem, k_smem, v_smem, lse_smem, q_seg_smem, k_seg_smem, plan_smem, table_smem, *o_smem), barriers = scoped
        (k_ready, v_ready, k_seg_ready, q_ready, q_seg_ready, plan_ready, k_free, v_free, plan_free,
         turn, table_ready) = barriers
        program = lax.axis_index("program")
        wg = lax.axis_index("wg")

        @pl.when(wg == 2)  # this program's tiles (`schedule`), read by every warpgroup
        def _():
            plgpu.copy_gmem_to_smem(table_ref.at[program], table_smem, table_ready)

        plgpu.barrier_wait(table_ready)
        n_mine = table_smem[0]

        def tile_of(i):
            return tile_of_work(table_smem[1 + i], heads=heads, n_tiles=n_tiles)

        def fetch_plan(i):  # by the copying warpgroup, PLAN_AHEAD tiles ahead
            row, _, tile_index = tile_of(i)
            buf = lax.rem(i, PLANS)
            pl.when(i >= PLANS)(lambda: plgpu.barrier_wait(plan_free.at[buf]))
            plgpu.copy_gmem_to_smem(plan_ref.at[row, tile_index], plan_smem.at[buf], plan_ready.at[buf])

        def blocks_of(i, tile_index, reader):
            """(start, free_lo, free_hi, stop) of the i-th tile; a compute warpgroup (`reader`)
            releases the plan's buffer once read."""
            start, free_lo, free_hi, stop = 0, 0, n_k, n_k
            if segments:
                buf = lax.rem(i, PLANS)
                plgpu.barrier_wait(plan_ready.at[buf])
                start, free_lo, free_hi, stop = (plan_smem.at[buf][n] for n in range(4))
                if reader:
                    plgpu.barrier_arrive(plan_free.at[buf])
            if causal:  # the tile's last row sees keys up to itself, its first w - 1 keys back
                stop = jnp.minimum(stop, lax.div((tile_index + 1) * tile + block_k - 1, block_k))
                start = jnp.minimum(jnp.maximum(start, window_start(tile_index * tile, window, block_k)), stop)
            return start, free_lo, free_hi, stop

        def take_turn():
            plgpu.barrier_arrive(turn)
            plgpu.barrier_wait(turn)

        @pl.when(wg < 2)
        def _compute():
            plgpu.set_max_registers(232, action="increase")

            def fetch_queries(i):
                """The i-th tile's query rows (and ids) of this warpgroup into buffer i % 2."""
                row, head, tile_index = tile_of(i)
                buf = lax.rem(i, 2)
                q_first = tile_index * tile + wg * block_q
                plgpu.copy_gmem_to_smem(q_ref.at[row, pl.ds(q_first, block_q), head], qo_smem.at[buf, wg],
                                        q_ready.at[2 * buf + wg])
                if segments:
                    plgpu.copy_gmem_to_smem(q_seg_ref.at[row, pl.ds(q_first, block_q)], q_seg_smem.at[buf, wg],
                                            q_seg_ready.at[2 * buf + wg])

            def prefetch(i):
                """The next tile's queries, into the buffer of the tile before this one, once the
                stores of that tile's results have read it."""
                @pl.when(i + 1 < n_mine)
                def _():
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    fetch_queries(i + 1)

            def one_tile(i, first_step):
                row, head, tile_index = tile_of(i)
                buf = lax.rem(i, 2)
                start, free_lo, free_hi, stop = blocks_of(i, tile_index, reader=True)
                q_smem, lse_out = qo_smem.at[buf, wg], lse_smem.at[buf, wg]
                q_first = tile_index * tile + wg * block_q
                q_seg = None
                if segments:
                    plgpu.barrier_wait(q_seg_ready.at[2 * buf + wg])
                    q_seg = load_vector(q_seg_smem.at[buf, wg], plgpu.Layout.WGMMA.reduce(1))
                plgpu.barrier_wait(q_ready.at[2 * buf + wg])

                # This warpgroup's own bounds inside the tile's range: its last row's causal stop, and
                # the blocks wholly before its first row, which need no causal mask.
                my_stop = stop
                causal_free = n_k
                if causal:
                    my_stop = jnp.clip(lax.div(q_first + block_q + block_k - 1, block_k), start, stop)
                    causal_free = lax.div(q_first + 1, block_k)
                    free_lo = jnp.maximum(free_lo, window_free(q_first + block_q - 1, window, block_k))

                def slot_of(j):  # key blocks go through the slots in turn, across tiles
                    return lax.rem(first_step + j - start, stages)

                def wait_keys(j):
                    plgpu.barrier_wait(k_ready.at[slot_of(j)])
                    if segments:
                        plgpu.barrier_wait(k_seg_ready.at[slot_of(j)])

                def step(j, carry, masked):
                    acc, peak, total = carry
                    slot = slot_of(j)

                    def scores(acc_ref):
                        plgpu.wgmma(acc_ref, q_smem, plgpu.transpose_ref(k_smem.at[slot], (1, 0)))
                        take_turn()
                        return acc_ref[...]

                    s = pl.run_scoped(scores, plgpu.ACC((block_q, block_k), jnp.float32))
                    pl.when(j == start)(lambda: prefetch(i))
                    if masked:
                        k_seg = load_vector(k_seg_smem.at[slot], plgpu.Layout.WGMMA.reduce(0)) if segments else None
                        seen = mask(causal, segments, q_first, j * block_k, (block_q, block_k), 0, q_seg, k_seg,
                                    window)
                        s = jnp.where(seen, s, -jnp.inf)
                    plgpu.barrier_arrive(k_free.at[slot])
                    new_peak = jnp.maximum(peak, s.max(axis=1) * scale)
                    # Only a masked block can leave a row's peak at -inf (unmasked blocks see every key).
                    shift = jnp.where(new_peak == -jnp.inf, 0.0, new_peak) if masked else new_peak
                    rescale = jnp.exp2(peak - shift)
                    p = jnp.exp2(s * scale - lax.broadcast_in_dim(shift, s.shape, [0]))
                    acc = acc * lax.broadcast_in_dim(rescale, acc.shape, [0])
                    total = total * rescale + p.sum(axis=1)
                    p16 = p.astype(dtype)
                    acc, total, new_peak, p16 = lax.optimization_barrier((acc, total, new_peak, p16))
                    plgpu.barrier_arrive(turn)  # softmax done
                    plgpu.barrier_wait(v_ready.at[slot])
                    plgpu.barrier_wait(turn)  # the tensor cores are ours again

                    def values(acc_ref):
                        plgpu.wgmma(acc_ref, p16, v_smem.at[slot])

                        @pl.when(j + 1 < my_stop)
                        def _():
                            wait_keys(j + 1)

                    acc = pl.run_state(values)(plgpu.ACC.init(acc))
                    plgpu.barrier_arrive(v_free.at[slot])
                    return acc, new_peak, total

                acc = plgpu.layout_cast(jnp.zeros((block_q, vd), jnp.float32), plgpu.Layout.WGMMA)
                peak = plgpu.layout_cast(jnp.full((block_q,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
                total = plgpu.layout_cast(jnp.zeros((block_q,), jnp.float32), plgpu.Layout.WGMMA.reduce(1))
                carry = (acc, peak, total)

                @pl.when(my_stop > start)
                def _():
                    wait_keys(start)

                pl.when(wg == 1)(take_turn)  # offset the two warpgroups by half a step
                for first, last, masked in ranges(start, free_lo, free_hi, my_stop, causal_free, causal_after=False,
                                                  masks=causal or segments):
                    carry = lax.fori_loop(first, last, functools.partial(step, masked=masked), carry)
                pl.when(my_stop == start)(lambda: prefetch(i))  # no step of this tile did it

                def release(j, _):  # slots this warpgroup's rows do not need: free them, keep turns paired
                    plgpu.barrier_arrive(k_free.at[slot_of(j)])
                    plgpu.barrier_arrive(v_free.at[slot_of(j)])
                    take_turn()
                    take_turn()

                if causal:
                    lax.fori_loop(my_stop, stop, release, None)
                pl.when(wg == 0)(take_turn)

                # The results go out through this tile's query buffer (its last product has read it);
                # the next tile but one waits for these stores to have read it (`prefetch`). Narrower
                # values go through their own buffer, once the last tile's stores have read it.
                acc, peak, total = carry
                seen = total > 0
                total = jnp.where(seen, total, 1.0)
                acc = acc * lax.broadcast_in_dim(1.0 / total, acc.shape, [0])
                out_smem = q_smem
                if own_out:
                    out_smem = o_smem[0].at[wg]
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                out_smem[...] = acc.astype(dtype)
                lse_out[...] = jnp.where(seen, peak * LN2 + jnp.log(total), -jnp.inf)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(out_smem, out_ref.at[row, pl.ds(q_first, block_q), head])
                plgpu.copy_smem_to_gmem(lse_out, lse_ref.at[row, head, pl.ds(q_first, block_q)])
                return first_step + stop - start

            fetch_queries(0)
            lax.fori_loop(0, n_mine, one_tile, jnp.int32(0))
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == 2)
        def _copy():
            plgpu.set_max_registers(40, action="decrease")

            def fetch(fetched, row, kv_head, j):
                # The program's `fetched`-th key block goes to slot fetched % stages. A refill waits
                # for the slot's K, then its V, to be released: K and V are released apart, so K's
                # copy can start while V is still being read.
                slot = lax.rem(fetched, stages)
                refill = fetched >= stages
                keys = (row, pl.ds(j * block_k, block_k), kv_head)
                pl.when(refill)(lambda: plgpu.barrier_wait(k_free.at[slot]))
                plgpu.copy_gmem_to_smem(k_ref.at[keys], k_smem.at[slot], k_ready.at[slot])
                if segments:
                    plgpu.copy_gmem_to_smem(k_seg_ref.at[row, pl.ds(j * block_k, block_k)], k_seg_smem.at[slot],
                                            k_seg_ready.at[slot])
                pl.when(refill)(lambda: plgpu.barrier_wait(v_free.at[slot]))
                plgpu.copy_gmem_to_smem(v_ref.at[keys], v_smem.at[slot], v_ready.at[slot])

            def one_tile(i, fetched):
                row, head, tile_index = tile_of(i)
                if segments:
                    pl.when(i + PLAN_AHEAD < n_mine)(lambda: fetch_plan(i + PLAN_AHEAD))
                start, _, _, stop = blocks_of(i, tile_index, reader=False)

                @pl.loop(start, stop)
                def _(j):
                    fetch(fetched + j - start, row, lax.div(head, group), j)

                return fetched + stop - start

            if segments:
                for i in range(PLAN_AHEAD):
                    pl.when(i < n_mine)(functools.partial(fetch_plan, i))
            lax.fori_loop(0, n_mine, one_tile, jnp.int32(0))

    smem = [plgpu.SMEM((2, 2, block_q, hd), dtype, transforms=swizzled()),  # [buffer, warpgroup]: Q, then out
            plgpu.SMEM((stages, block_k, hd), dtype, transforms=swizzled()),
            plgpu.SMEM((stages, block_k, vd), dtype, transforms=swizzled()),
            plgpu.SMEM((2, 2, block_q), jnp.float32),
            plgpu.SMEM((2, 2, block_q), jnp.int32),
            plgpu.SMEM((stages, block_k), jnp.int32),
            plgpu.SMEM((PLANS, PLAN_WIDTH), jnp.int32),
            plgpu.SMEM(table.shape[1:], jnp.int32)]
    if own_out:
        smem.append(plgpu.SMEM((2, block_q, vd), dtype, transforms=swizzled()))  # [warpgroup]
    barriers = [plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages),
                plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=4), plgpu.Barrier(num_barriers=4),
                plgpu.Barrier(num_barriers=PLANS),
                plgpu.Barrier(num_arrivals=2, num_barriers=stages),
                plgpu.Barrier(num_arrivals=2, num_barriers=stages),
                plgpu.Barrier(num_arrivals=2, num_barriers=PLANS),
                plgpu.Barrier(num_arrivals=2), plgpu.Barrier()]
    args = [q, k, v, jnp.asarray(table)]
    if segments:
        args += [plan, q_segments.astype(jnp.int32), k_segments.astype(jnp.int32)]
    out_type = [jax.ShapeDtypeStruct((b, t, heads, vd), dtype), jax.ShapeDtypeStruct((b, heads, t), jnp.float32)]
    return launch(kernel, smem, barriers, args, out_type, grid=(programs,), grid_names=("program",))


def launch(kernel, smem, barriers, args, out_type, grid, grid_names=("head", "tile", "row")):
    """Runs `kernel(*in_refs, *out_refs, scoped=(smem refs, barrier refs))` as a program of three
    warpgroups ("wg": two computing, one copying) per point of `grid` (axes `grid_names`)."""
    def entry(*refs):
        pl.run_scoped(lambda *scoped: kernel(*refs, scoped=(scoped[:len(smem)], scoped[len(smem):])), *smem,
                      *barriers, collective_axes="wg")

    return plgpu.kernel(entry, out_type=out_type, grid=grid, grid_names=grid_names, num_threads=3,
                        thread_name="wg", compiler_params=plgpu.CompilerParams(approx_math=True))(*args)
