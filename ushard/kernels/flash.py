"""Flash attention of our own for GPUs (Hopper first), written with Pallas Triton.

On Hopper GPUs the same three kernels run on Mosaic GPU instead (flash_hopper.py's forward,
flash_hopper_backward.py's dK/dV and dQ: same contract, wgmma and TMA, faster); elsewhere, and with a
`tuning` given, the Triton kernels here. Three kernels, each a grid of programs that own
one block of rows and loop over the blocks of the other side, never materialising the [T, T] scores:
- `forward`: a program per (query block, head, row) runs the online softmax over key blocks and
  writes out and the float32 log-sum-exp (lse);
- `dkdv`: a program per (key block, kv head, row) keeps its keys, values and the dK, dV accumulators
  and loops over the query blocks of every query head of its group, so dK and dV are summed over
  the group in registers and never exist per query head;
- `dq`: a program per (query block, head, row), like the forward, accumulates dQ.
The two backward kernels each recompute QKᵀ and dO·Vᵀ. One kernel whose dK/dV programs also add
their share of dQ atomically (FlashAttention-2's way) saves that, but its atomics measured slower on
Hopper (docs/benchmarks.md, seventh session), so it was removed.
The backward takes the queries' *final* out and lse (over every block of keys, merged by the ring of
context parallelism), so each block's gradients are its exact share (`kernels.attention.BlockKernel`).
The one cotangent of lse is folded into D = rowsum(dO * O) - d lse, computed once by XLA before the
two backward kernels (on Hopper by the dQ kernel, which runs first): with lse = logsumexp(s),
d lse / d s = P, so dS = P * (dP - D).

Blocks a program never visits: with `causal`, key blocks wholly after its queries (a loop bound);
with segment ids (packed documents), blocks whose id ranges [min, max] do not meet. The second is a
plan, `visit_plan`, computed by XLA before each kernel from the blocks' id ranges: per owned block,
the blocks it visits, in order, and how many of them need no mask. It is exact for any ids (a range
test is a safe skip whatever their order), and on ushard's packed rows, whose ids never decrease
along the row, it leaves out every block of another document. Each program runs two loops: the
blocks that need no mask (causality and documents both trivially satisfied), then those that do,
where a query that sees no key of the block gets exp(-inf) = 0 and never a NaN. A query that sees no
key at all gets out 0 and lse -inf (as `xla_block`), and zero gradients.

Scores are kept in base 2 (scaled by log2(e)) so that the exponentials are `exp2`; dots take the
inputs' dtype (bf16, float16, or float32 for the CPU tests) and accumulate in float32. Off a GPU the
kernels run in Pallas's interpreter, which is how the CPU tests check the real kernel bodies.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_derivatives import SymbolicZero, custom_vjp_primal_tree_values
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ushard.kernels import flash_hopper, flash_hopper_backward
from ushard.kernels.attention import BlockKernel, diagonal_only

LOG2E = math.log2(math.e)


class Blocks(NamedTuple):
    """One kernel's launch shape: rows of queries and of keys per block, warps per program and
    software-pipelining depth. In `dkdv` a program owns a key block and loops over query blocks;
    in `forward` and `dq` the other way round."""

    block_q: int
    block_k: int
    num_warps: int
    num_stages: int


class Tuning(NamedTuple):
    """The launch shapes of the three kernels (module docstring)."""

    forward: Blocks
    dkdv: Blocks
    dq: Blocks


# Per head dim, for Hopper: head dim 128 as the block sweep on an H200 chose them (tools/attention_bench.py
# --block-sweep, docs/benchmarks.md); 64 starting points, not yet swept. Hopper's matrix instructions
# run on warpgroups of 4 warps, 64 rows each: the forward's 128 query rows take two warpgroups at
# head dim 128 and one (fewer registers for a smaller tile) at 64; the 64-row backward blocks one.
TUNING = {
    64: Tuning(forward=Blocks(128, 64, 4, 3), dkdv=Blocks(64, 64, 4, 3), dq=Blocks(64, 64, 4, 3)),
    128: Tuning(forward=Blocks(128, 128, 8, 3), dkdv=Blocks(32, 64, 4, 3), dq=Blocks(64, 64, 4, 2)),
    # Head dim 256 (Gemma's): the Triton kernels only (the Mosaic GPU ones have no slots for it).
    # The block sweep at Gemma 3 1B's attention with documents and its 512-token window chose them
    # (docs/benchmarks.md): the forward's 128 query rows on two warpgroups, 64-row backward blocks
    # (one warpgroup's wgmma M); dQ at 128 x 64 blocks overflows shared memory.
    256: Tuning(forward=Blocks(128, 64, 8, 2), dkdv=Blocks(64, 32, 4, 2), dq=Blocks(64, 64, 4, 2)),
    # Latent attention's q·k heads of 192 (values of 128; on Hopper the Mosaic GPU kernels run them):
    # head dim 256's blocks, which hold more; computed as 128 + 64 wide pieces (`_parts`). Not yet
    # run nor swept on a GPU.
    192: Tuning(forward=Blocks(128, 64, 8, 2), dkdv=Blocks(64, 32, 4, 2), dq=Blocks(64, 64, 4, 2)),
}


def _interpret() -> bool:
    return jax.default_backend() != "gpu"


def on_hopper(q, k, tuning: Tuning | None = None, v=None) -> bool:
    """Whether the Mosaic GPU kernels run (flash_hopper*.py): on Hopper, for shapes they take (`v`
    None: values as wide as q·k), unless a `tuning` asks for the Triton kernels' blocks."""
    return tuning is None and flash_hopper.available() and flash_hopper.supported(q, k, v)


def takes_value_widths(q, k, v) -> bool:
    """Whether `forward` and `backward` take these values, narrower than q·k, as they are: the Mosaic
    GPU kernels at their `flash_hopper.VALUE_DIMS` (latent attention's 192 / 128), the Triton ones at
    any of TUNING's head dims."""
    return on_hopper(q, k, None, v) or q.shape[-1] in TUNING


def _params(blocks: Blocks):
    # CompilerParams is the Triton class's name in both JAX 0.10.2 and 0.11.x (checked in both).
    return plgpu.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages)


def _fit(blocks: Blocks, length: int, kernel: str) -> Blocks:
    """`blocks` for a `length`-token sequence: a block longer than the sequence shrinks to it when the
    length is a power of two (Triton's tiles are); else ValueError."""
    sizes = []
    for name, size in (("block_q", blocks.block_q), ("block_k", blocks.block_k)):
        fitted = min(size, length)
        if length % fitted or fitted & (fitted - 1) or fitted < 16:
            raise ValueError(f"flash attention's {kernel} kernel runs in blocks of {size} tokens ({name}): the "
                             f"sequence length must be a multiple of {size} (or a power of two from 16 below it); "
                             f"it is {length}.")
        sizes.append(fitted)
    return blocks._replace(block_q=sizes[0], block_k=sizes[1])


def _check(q, k, v, q_segments, k_segments, tuning: Tuning | None, causal: bool = True, window: int = 0,
           hopper: bool = False) -> Tuning | None:
    """The tuning for these inputs, after refusing what the kernels cannot take (None for the Mosaic
    GPU kernels, `hopper`, at a head dim the Triton kernels have no blocks for)."""
    diagonal_only(causal, window)
    b, t, heads, hd = q.shape
    if (k.shape[:3] != v.shape[:3] or k.shape[:2] != (b, t) or k.shape[3] != hd or v.shape[3] > hd
            or heads % k.shape[2]):
        raise ValueError(f"flash attention takes q [B, T, heads, hd], k [B, T, kv_heads, hd] and v [B, T, kv_heads, "
                         f"vd] with vd <= hd and heads a multiple of kv_heads; got q {q.shape}, k {k.shape}, "
                         f"v {v.shape}.")
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"flash attention takes q, k and v of one dtype; got {q.dtype}, {k.dtype}, {v.dtype}.")
    if (q_segments is None) != (k_segments is None):
        raise ValueError("flash attention takes segment ids for both queries and keys, or for neither.")
    if tuning is None:
        if hd not in TUNING and hopper:
            return None
        if hd not in TUNING:
            raise ValueError(f"flash attention has block sizes for head dims {sorted(TUNING)}; got {hd} "
                             f"(pass tuning= for another power of two).")
        tuning = TUNING[hd]
    return tuning


# --- which blocks a program visits -------------------------------------------------------------------


def _causal_ranges(own, causal: bool, by_key: bool, own_size: int, loop_size: int, n_loop: int, window: int = 0):
    """Without segment ids: the (start, stop, masked) loops over blocks of `loop_size` for the
    program owning block `own` (a query block, or a key block if `by_key`). The causal ones: keys
    up to the first query need no mask; keys after the last are never visited. With a `window`,
    neither are keys w or more before the last query (queries w or more after the last key), and
    keys within w of every query need no window mask (`window_bounds`)."""
    if not causal:
        return ((0, n_loop, False),)
    start, free_lo, free_hi, stop = window_bounds(own * own_size, own_size, loop_size, n_loop, by_key, window)
    return (free_lo, free_hi, False), (start, free_lo, True), (free_hi, stop, True)


def window_bounds(first, own_size: int, loop_size: int, n_loop: int, by_key: bool, window: int = 0):
    """(start, free_lo, free_hi, stop), start <= free_lo <= free_hi <= stop, over the blocks of
    `loop_size` that a causal owner of `own_size` rows from `first` visits: [start, stop) holds every
    block some pair of it sees, [free_lo, free_hi) those whose every pair is seen (no mask). Queries
    own (keys loop) unless `by_key`; `window` 0: no window. Blocks outside [start, stop) are never
    visited, which is what makes a window cheap: a query block visits about w / loop_size + 1 blocks."""
    last = first + own_size - 1
    if by_key:  # keys [first, last] own; the queries that see one of them are in [first, last + w - 1]
        start, free_lo = lax.div(first, loop_size), lax.div(last + loop_size - 1, loop_size)
        stop = free_hi = n_loop
        if window:
            stop = jnp.minimum(n_loop, lax.div(last + window - 1, loop_size) + 1)
            free_hi = jnp.minimum(n_loop, lax.div(first + window, loop_size))  # query blocks wholly < first + w
    else:  # queries [first, last] own; the keys one of them sees are in [first - w + 1, last]
        start = free_lo = 0
        free_hi, stop = lax.div(first + 1, loop_size), lax.div(last, loop_size) + 1
        if window:
            start = lax.div(jnp.maximum(first - window + 1, 0), loop_size)
            free_lo = lax.div(jnp.maximum(last - window + 1, 0) + loop_size - 1, loop_size)  # key blocks > last - w
    free_lo = jnp.clip(free_lo, start, stop)
    return start, free_lo, jnp.clip(free_hi, free_lo, stop), stop


def visit_plan(q_segments, k_segments, causal: bool, block_q: int, block_k: int, by_key: bool = False,
               window: int = 0):
    """The blocks each program visits when segment ids are given: (order [B, n_own, n_loop] int32,
    counts [B, n_own, 2] int32). A program owns a query block (a key block if `by_key`) and visits,
    in order, `order[..., :counts[..., 1]]`, of which the first `counts[..., 0]` need no mask. A
    block is visited when the two blocks' id ranges meet and (causal) some key is not after some
    query; it needs no mask when both blocks hold one and the same id and (causal) every key is
    before every query. With a `window` (causal only) a block is visited if some query - key
    distance is under it, and needs no mask only if every one is. The kernels load this plan; the
    tests read it back."""
    meet, one_id = flash_hopper.blocks_meet(q_segments, k_segments, block_q, block_k)  # [B, nq, nk]
    nq, nk = meet.shape[1:]
    if causal:
        q_first = jnp.arange(nq)[:, None] * block_q
        k_first = jnp.arange(nk)[None, :] * block_k
        meet = meet & (k_first <= q_first + block_q - 1)
        one_id = one_id & (k_first + block_k - 1 <= q_first)
        if window:
            meet = meet & (q_first - (k_first + block_k - 1) < window)
            one_id = one_id & (q_first + block_q - 1 - k_first < window)
    free = meet & one_id
    if by_key:
        meet, free = jnp.swapaxes(meet, 1, 2), jnp.swapaxes(free, 1, 2)
    n_loop = meet.shape[-1]
    rank = jnp.where(free, 0, jnp.where(meet, 1, 2)) * n_loop + jnp.arange(n_loop)
    order = jnp.argsort(rank, axis=-1).astype(jnp.int32)
    counts = jnp.stack([free.sum(-1), meet.sum(-1)], axis=-1).astype(jnp.int32)
    return order, counts


def _run_loops(step, carry, ranges, order_ref):
    """`carry` through `step(block, carry, masked)` for each block of `ranges` ((start, stop, masked)
    over the plan's positions when `order_ref` holds a plan, else over block indices)."""
    for start, stop, masked in ranges:
        def body(i, carry, masked=masked):
            return step(i if order_ref is None else order_ref[i], carry, masked)

        carry = lax.fori_loop(start, stop, body, carry)
    return carry


def _ranges(own, causal, by_key, blocks: Blocks, length: int, counts_ref, window: int = 0):
    own_size, loop_size = (blocks.block_k, blocks.block_q) if by_key else (blocks.block_q, blocks.block_k)
    if counts_ref is None:
        return _causal_ranges(own, causal, by_key, own_size, loop_size, length // loop_size, window)
    free, visited = counts_ref[0], counts_ref[1]
    return (0, free, False), (free, visited, True)


def _mask(q_first, k_first, block_q: int, block_k: int, causal: bool, q_seg, k_seg, by_key: bool = False,
          window: int = 0):
    """Which query of the block sees which key (positions from `q_first`, `k_first`): [block_q,
    block_k], or [block_k, block_q] if `by_key` (the dkdv kernel's scores are transposed)."""
    shape, q_axis = ((block_k, block_q), 1) if by_key else ((block_q, block_k), 0)
    seen = None
    if causal:
        queries = q_first + lax.broadcasted_iota(jnp.int32, shape, q_axis)
        keys = k_first + lax.broadcasted_iota(jnp.int32, shape, 1 - q_axis)
        seen = queries >= keys
        if window:
            seen = seen & (queries - keys < window)
    if q_seg is not None:
        same = (k_seg[:, None] == q_seg[None, :]) if by_key else (q_seg[:, None] == k_seg[None, :])
        seen = same if seen is None else seen & same
    return seen


def _dot(a, b, contract=(1, 0)):
    """a @ b with float32 accumulation; `contract` names the dims summed over ((1, 1): a @ b.T)."""
    dims = (((contract[0],), (contract[1],)), ((), ()))
    return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def _parts(width: int) -> tuple[tuple[int, int], ...]:
    """(start, size) pieces of a head `width` wide, each a power of two, the largest first: Triton's
    arrays take power-of-two sizes only, so latent attention's q·k heads of 192 are computed as
    128 + 64 (every other head dim in TUNING is one piece)."""
    parts, start = [], 0
    while start < width:
        size = 1 << ((width - start).bit_length() - 1)
        parts.append((start, size))
        start += size
    return tuple(parts)


def _load(ref, index, parts):
    """`ref[*index, :]` cut along its last dim into `parts`, one array each (`index` None: the whole ref)."""
    if index is None:
        index = (slice(None),) * (len(ref.shape) - 1)
        if len(parts) == 1:
            return [ref[...]]
    if len(parts) == 1:
        return [ref[(*index, slice(None))]]
    return [ref[(*index, pl.ds(start, size))] for start, size in parts]


def _store(ref, pieces, parts):
    """The whole of `ref` (2-D) from one array per piece of `parts` (`_load`'s inverse)."""
    if len(parts) == 1:
        ref[...] = pieces[0]
        return
    for (start, size), piece in zip(parts, pieces):
        ref[:, pl.ds(start, size)] = piece


def _scores(a_pieces, b_pieces):
    """a @ b.T summed over the pieces of their last dim, in float32."""
    s = _dot(a_pieces[0], b_pieces[0], (1, 1))
    for a, b in zip(a_pieces[1:], b_pieces[1:]):
        s = s + _dot(a, b, (1, 1))
    return s


def _plan_refs(refs, segments: bool):
    """(query ids, key ids, visit order, visit counts, the refs after them): the kernels' optional
    inputs, present with segment ids, None without."""
    if segments:
        return (*refs[:4], refs[4:])
    return None, None, None, None, refs


# --- forward -------------------------------------------------------------------------------------------


def _forward_kernel(q_ref, k_ref, v_ref, *refs, causal, blocks: Blocks, length, segments, count, window):
    q_seg_ref, k_seg_ref, order_ref, counts_ref, refs = _plan_refs(refs, segments)
    o_ref, lse_ref, *visits_ref = refs
    bq, bk = blocks.block_q, blocks.block_k
    qb = pl.num_programs(0) - 1 - pl.program_id(0)  # the longest causal rows first
    scale = LOG2E / math.sqrt(q_ref.shape[-1])
    parts, value_parts = _parts(q_ref.shape[-1]), _parts(v_ref.shape[-1])
    q = _load(q_ref, None, parts)
    q_seg = None if q_seg_ref is None else q_seg_ref[...]

    def step(kb, carry, masked):
        acc, peak, total, n = carry
        k_first = pl.multiple_of(kb * bk, bk)
        k = _load(k_ref, (pl.ds(k_first, bk),), parts)
        s = _scores(q, k) * scale  # [bq, bk], base 2
        if masked:
            k_seg = None if k_seg_ref is None else k_seg_ref[pl.ds(k_first, bk)]
            s = jnp.where(_mask(qb * bq, k_first, bq, bk, causal, q_seg, k_seg, window=window), s, -jnp.inf)
        new_peak = jnp.maximum(peak, jnp.max(s, axis=1))
        # Unmasked blocks see every key, so only a masked block can leave a row's peak at -inf.
        shift = jnp.where(new_peak == -jnp.inf, 0.0, new_peak) if masked else new_peak
        rescale = jnp.exp2(peak - shift)
        p = jnp.exp2(s - shift[:, None])
        total = total * rescale + jnp.sum(p, axis=1)
        v = _load(v_ref, (pl.ds(k_first, bk),), value_parts)
        acc = tuple(acc_part * rescale[:, None] + _dot(p.astype(part.dtype), part) for acc_part, part in zip(acc, v))
        return acc, new_peak, total, n + 1

    acc = tuple(jnp.zeros((bq, size), jnp.float32) for _, size in value_parts)
    carry = (acc, jnp.full((bq,), -jnp.inf, jnp.float32),
             jnp.zeros((bq,), jnp.float32), jnp.int32(0))
    ranges = _ranges(qb, causal, False, blocks, length, counts_ref, window)
    acc, peak, total, n = _run_loops(step, carry, ranges, order_ref)
    seen = total > 0
    total = jnp.where(seen, total, 1.0)
    _store(o_ref, [(part / total[:, None]).astype(o_ref.dtype) for part in acc], value_parts)
    lse_ref[...] = jnp.where(seen, peak / LOG2E + jnp.log(total), -jnp.inf)
    if count:
        visits_ref[0][...] = n


def _query_block_plan(q_segments, k_segments, causal, bq, bk, t, own, window=0):
    """(BlockSpecs, arrays) of the segment ids and the visit plan, for kernels whose programs own a
    query block (`own(i)`: the block program i owns) on a grid (query blocks, heads, rows)."""
    order, counts = visit_plan(q_segments, k_segments, causal, bq, bk, window=window)
    specs = [pl.BlockSpec((None, bq), lambda i, h, r: (r, own(i))),
             pl.BlockSpec((None, t), lambda i, h, r: (r, 0)),
             pl.BlockSpec((None, None, order.shape[-1]), lambda i, h, r: (r, own(i), 0)),
             pl.BlockSpec((None, None, 2), lambda i, h, r: (r, own(i), 0))]
    return specs, [q_segments.astype(jnp.int32), k_segments.astype(jnp.int32), order, counts]


def _forward_call(q, k, v, causal, q_segments, k_segments, tuning: Tuning | None = None, count: bool = False,
                  window: int = 0):
    """(out, lse), plus the number of key blocks each (row, head, query block) visited if `count`."""
    tuning = _check(q, k, v, q_segments, k_segments, tuning, causal, window)
    b, t, heads, hd = q.shape
    vd = v.shape[-1]
    group = heads // k.shape[2]
    blocks = _fit(tuning.forward, t, "forward")
    bq, bk = blocks.block_q, blocks.block_k
    nq = t // bq
    segments = q_segments is not None

    def own(i):
        return nq - 1 - i  # program 0 takes the last query block (see the kernel)

    in_specs = [pl.BlockSpec((None, bq, None, hd), lambda i, h, r: (r, own(i), h, 0)),
                pl.BlockSpec((None, t, None, hd), lambda i, h, r: (r, 0, lax.div(h, group), 0)),
                pl.BlockSpec((None, t, None, vd), lambda i, h, r: (r, 0, lax.div(h, group), 0))]
    args = [q, k, v]
    if segments:
        more_specs, more_args = _query_block_plan(q_segments, k_segments, causal, bq, bk, t, own, window)
        in_specs, args = in_specs + more_specs, args + more_args
    out_shape = [jax.ShapeDtypeStruct((b, t, heads, vd), q.dtype), jax.ShapeDtypeStruct((b, t, heads), jnp.float32)]
    out_specs = [pl.BlockSpec((None, bq, None, vd), lambda i, h, r: (r, own(i), h, 0)),
                 pl.BlockSpec((None, bq, None), lambda i, h, r: (r, own(i), h))]
    if count:
        out_shape.append(jax.ShapeDtypeStruct((b, heads, nq), jnp.int32))
        out_specs.append(pl.BlockSpec((None, None, None), lambda i, h, r: (r, h, own(i))))
    kernel = functools.partial(_forward_kernel, causal=causal, blocks=blocks, length=t, segments=segments,
                               count=count, window=window)
    return pl.pallas_call(kernel, grid=(nq, heads, b), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
                          compiler_params=_params(blocks), interpret=_interpret(), name="ushard_flash_forward")(*args)


def forward(q, k, v, causal, q_segments=None, k_segments=None, window=0, *, tuning: Tuning | None = None):
    """(out [B, T, heads, hd] in q's dtype, lse [B, T, heads] float32) of queries q [B, T, heads, hd]
    over keys and values [B, T, kv_heads, hd] (`kernels.attention.BlockKernel.forward`). On Hopper
    GPUs the Mosaic GPU forward (flash_hopper.py) runs where it takes the shapes; elsewhere, and
    whenever `tuning` is given, the Triton forward here. `tuning`: block sizes other than TUNING's
    (the tests' small ones, the bench's sweep). `window` > 0: causal attention within a sliding window
    (kernels.attention), whose out-of-window blocks are never visited."""
    if on_hopper(q, k, tuning, v) and q.shape[-1] in flash_hopper.FORWARD_HEAD_DIMS:
        _check(q, k, v, q_segments, k_segments, None, causal, window, hopper=True)
        return flash_hopper.forward(q, k, v, causal, q_segments, k_segments, window=window)
    out, lse = _forward_call(q, k, v, causal, q_segments, k_segments, tuning, window=window)
    return out, lse


# --- backward ------------------------------------------------------------------------------------------


def _dkdv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, causal, blocks: Blocks, length, group,
                 segments, count, window):
    q_seg_ref, k_seg_ref, order_ref, counts_ref, refs = _plan_refs(refs, segments)
    dk_ref, dv_ref, *visits_ref = refs
    bq, bk = blocks.block_q, blocks.block_k
    kb = pl.program_id(0)
    scale = 1 / math.sqrt(k_ref.shape[-1])
    parts, value_parts = _parts(k_ref.shape[-1]), _parts(v_ref.shape[-1])
    k, v = _load(k_ref, None, parts), _load(v_ref, None, value_parts)
    k_seg = None if k_seg_ref is None else k_seg_ref[...]
    ranges = _ranges(kb, causal, True, blocks, length, counts_ref, window)

    def head(h, carry):  # the query heads of this kv head's group, one after another
        def step(qb, carry, masked):
            dk, dv, n = carry
            q_first = pl.multiple_of(qb * bq, bq)
            rows = pl.ds(q_first, bq)
            q, do = _load(q_ref, (rows, h), parts), _load(do_ref, (rows, h), value_parts)
            s = _scores(k, q) * (scale * LOG2E)  # [bk, bq]: scores transposed, base 2
            if masked:
                q_seg = None if q_seg_ref is None else q_seg_ref[rows]
                seen = _mask(q_first, kb * bk, bq, bk, causal, q_seg, k_seg, by_key=True, window=window)
                s = jnp.where(seen, s, -jnp.inf)
            p = jnp.exp2(s - lse_ref[rows, h][None, :])
            p16 = p.astype(do[0].dtype)
            dv = tuple(dv_part + _dot(p16, do_part) for dv_part, do_part in zip(dv, do))
            dp = _scores(v, do)
            ds = p * (dp - delta_ref[rows, h][None, :])
            dk = tuple(dk_part + _dot(ds.astype(q_part.dtype), q_part) for dk_part, q_part in zip(dk, q))
            return dk, dv, n + 1

        return _run_loops(step, carry, ranges, order_ref)

    dk = tuple(jnp.zeros(part.shape, jnp.float32) for part in k)
    dv = dk if k_ref.shape == v_ref.shape else tuple(jnp.zeros(part.shape, jnp.float32) for part in v)
    dk, dv, n = lax.fori_loop(0, group, head, (dk, dv, jnp.int32(0)))
    _store(dk_ref, [(part * scale).astype(dk_ref.dtype) for part in dk], parts)
    _store(dv_ref, [part.astype(dv_ref.dtype) for part in dv], value_parts)
    if count:
        visits_ref[0][...] = n


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, causal, blocks: Blocks, length, segments,
               count, window):
    q_seg_ref, k_seg_ref, order_ref, counts_ref, refs = _plan_refs(refs, segments)
    dq_ref, *visits_ref = refs
    bq, bk = blocks.block_q, blocks.block_k
    qb = pl.num_programs(0) - 1 - pl.program_id(0)
    scale = 1 / math.sqrt(q_ref.shape[-1])
    parts, value_parts = _parts(q_ref.shape[-1]), _parts(v_ref.shape[-1])
    q, do, lse, delta = _load(q_ref, None, parts), _load(do_ref, None, value_parts), lse_ref[...], delta_ref[...]
    q_seg = None if q_seg_ref is None else q_seg_ref[...]

    def step(kb, carry, masked):
        dq, n = carry
        k_first = pl.multiple_of(kb * bk, bk)
        k, v = _load(k_ref, (pl.ds(k_first, bk),), parts), _load(v_ref, (pl.ds(k_first, bk),), value_parts)
        s = _scores(q, k) * (scale * LOG2E)
        if masked:
            k_seg = None if k_seg_ref is None else k_seg_ref[pl.ds(k_first, bk)]
            s = jnp.where(_mask(qb * bq, k_first, bq, bk, causal, q_seg, k_seg, window=window), s, -jnp.inf)
        p = jnp.exp2(s - lse[:, None])
        ds = p * (_scores(do, v) - delta[:, None])
        ds = ds.astype(k[0].dtype)
        return tuple(dq_part + _dot(ds, k_part) for dq_part, k_part in zip(dq, k)), n + 1

    ranges = _ranges(qb, causal, False, blocks, length, counts_ref, window)
    dq = tuple(jnp.zeros(part.shape, jnp.float32) for part in q)
    dq, n = _run_loops(step, (dq, jnp.int32(0)), ranges, order_ref)
    _store(dq_ref, [(part * scale).astype(dq_ref.dtype) for part in dq], parts)
    if count:
        visits_ref[0][...] = n


def _backward_call(q, k, v, out, lse, d_out, causal, q_segments, k_segments, d_lse=None,
                   tuning: Tuning | None = None, count: bool = False, window: int = 0):
    """(dq, dk, dv), plus each program's visited blocks if `count`: (dkdv's [B, kv_heads, nk] summed
    over the group's heads, dq's [B, heads, nq]). The Mosaic GPU kernels where `on_hopper`."""
    hopper = on_hopper(q, k, tuning, v) and not count
    tuning = _check(q, k, v, q_segments, k_segments, tuning, causal, window, hopper)
    b, t, heads, hd = q.shape
    vd = v.shape[-1]
    kv_heads = k.shape[2]
    group = heads // kv_heads
    segments = q_segments is not None
    d_out = d_out.astype(q.dtype)  # the kernels' dots take one dtype
    # Per query: lse in base 2 (-inf, a query that sees no key anywhere, as 0: its scores are all -inf
    # here, so P = exp2(-inf) = 0 rather than NaN), and D = rowsum(dO * O) - d lse.
    lse = lse.astype(jnp.float32)
    lse2 = jnp.where(lse == -jnp.inf, 0.0, lse * LOG2E)
    if segments:
        q_segments, k_segments = q_segments.astype(jnp.int32), k_segments.astype(jnp.int32)
    if hopper:  # the Mosaic GPU kernels take lse and D with the sequence minor-most (1-D TMA copies); D
        # comes out of the dQ kernel
        lse2 = jnp.swapaxes(lse2, 1, 2)
        d_lse = None if d_lse is None else jnp.swapaxes(d_lse, 1, 2)
        dq, delta = flash_hopper_backward.dq(q, k, v, d_out, lse2, out, causal, q_segments, k_segments, d_lse=d_lse,
                                             window=window)
        dk, dv = flash_hopper_backward.dkdv(q, k, v, d_out, lse2, delta, causal, q_segments, k_segments,
                                            window=window)
        return dq, dk, dv
    delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
    if d_lse is not None:
        delta = delta - d_lse.astype(jnp.float32)

    # dK, dV: a program per (key block, kv head, row), over its group's query heads.
    blocks = _fit(tuning.dkdv, t, "dkdv")
    bq, bk = blocks.block_q, blocks.block_k
    nk = t // bk
    whole_group = pl.BlockSpec((None, t, group, hd), lambda i, g, r: (r, 0, g, 0))
    whole_group_out = pl.BlockSpec((None, t, group, vd), lambda i, g, r: (r, 0, g, 0))
    group_rows = pl.BlockSpec((None, t, group), lambda i, g, r: (r, 0, g))
    key_block = pl.BlockSpec((None, bk, None, hd), lambda i, g, r: (r, i, g, 0))
    value_block = pl.BlockSpec((None, bk, None, vd), lambda i, g, r: (r, i, g, 0))
    in_specs = [whole_group, key_block, value_block, whole_group_out, group_rows, group_rows]
    args = [q, k, v, d_out, lse2, delta]
    if segments:
        order, counts = visit_plan(q_segments, k_segments, causal, bq, bk, by_key=True, window=window)
        in_specs += [pl.BlockSpec((None, t), lambda i, g, r: (r, 0)),
                     pl.BlockSpec((None, bk), lambda i, g, r: (r, i)),
                     pl.BlockSpec((None, None, order.shape[-1]), lambda i, g, r: (r, i, 0)),
                     pl.BlockSpec((None, None, 2), lambda i, g, r: (r, i, 0))]
        args += [q_segments, k_segments, order, counts]
    out_shape = [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)]
    out_specs = [key_block, value_block]
    if count:
        out_shape.append(jax.ShapeDtypeStruct((b, kv_heads, nk), jnp.int32))
        out_specs.append(pl.BlockSpec((None, None, None), lambda i, g, r: (r, g, i)))
    kernel = functools.partial(_dkdv_kernel, causal=causal, blocks=blocks, length=t, group=group,
                               segments=segments, count=count, window=window)
    dk, dv, *dkdv_visits = pl.pallas_call(
        kernel, grid=(nk, kv_heads, b), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        compiler_params=_params(blocks), interpret=_interpret(), name="ushard_flash_dkdv")(*args)

    # dQ: a program per (query block, head, row), over key blocks.
    blocks = _fit(tuning.dq, t, "dq")
    bq, bk = blocks.block_q, blocks.block_k
    nq = t // bq

    def own(i):
        return nq - 1 - i

    query_block = pl.BlockSpec((None, bq, None, hd), lambda i, h, r: (r, own(i), h, 0))
    out_block = pl.BlockSpec((None, bq, None, vd), lambda i, h, r: (r, own(i), h, 0))
    query_rows = pl.BlockSpec((None, bq, None), lambda i, h, r: (r, own(i), h))
    whole_k = pl.BlockSpec((None, t, None, hd), lambda i, h, r: (r, 0, lax.div(h, group), 0))
    whole_v = pl.BlockSpec((None, t, None, vd), lambda i, h, r: (r, 0, lax.div(h, group), 0))
    in_specs = [query_block, whole_k, whole_v, out_block, query_rows, query_rows]
    args = [q, k, v, d_out, lse2, delta]
    if segments:
        more_specs, more_args = _query_block_plan(q_segments, k_segments, causal, bq, bk, t, own, window)
        in_specs, args = in_specs + more_specs, args + more_args
    out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype)]
    out_specs = [query_block]
    if count:
        out_shape.append(jax.ShapeDtypeStruct((b, heads, nq), jnp.int32))
        out_specs.append(pl.BlockSpec((None, None, None), lambda i, h, r: (r, h, own(i))))
    kernel = functools.partial(_dq_kernel, causal=causal, blocks=blocks, length=t, segments=segments, count=count,
                               window=window)
    dq, *dq_visits = pl.pallas_call(
        kernel, grid=(nq, heads, b), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        compiler_params=_params(blocks), interpret=_interpret(), name="ushard_flash_dq")(*args)
    if count:
        return (dq, dk, dv), (dkdv_visits[0], dq_visits[0])
    return dq, dk, dv


def backward(q, k, v, out, lse, d_out, causal, q_segments=None, k_segments=None, d_lse=None, window=0, *,
             tuning: Tuning | None = None):
    """(dq, dk, dv) of one block of keys, given the queries' final out and lse over every block
    (`kernels.attention.BlockKernel.backward`), and `d_lse`, the cotangent of lse, if it has one;
    `window` as the forward's."""
    return _backward_call(q, k, v, out, lse, d_out, causal, q_segments, k_segments, d_lse, tuning, window=window)


FLASH_BLOCKS = BlockKernel(forward, backward, segments=True, typed=False, windows=True)


# --- whole sequences -----------------------------------------------------------------------------------


def attention(q, k, v, segment_ids=None, causal=True, *, tuning: Tuning | None = None, window: int = 0):
    """(out, lse) of attention over whole sequences, differentiable in both: the backward takes the
    cotangents of out and of lse (flash kernels both ways, never autodiff through a kernel)."""
    return _attention(q, k, v, segment_ids, causal, tuning, window)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _attention(q, k, v, segment_ids, causal, tuning, window):
    return forward(q, k, v, causal, segment_ids, segment_ids, window, tuning=tuning)


def _attention_forward(q, k, v, segment_ids, causal, tuning, window):
    q, k, v, segment_ids = custom_vjp_primal_tree_values((q, k, v, segment_ids))
    out, lse = forward(q, k, v, causal, segment_ids, segment_ids, window, tuning=tuning)
    return (out, lse), (q, k, v, segment_ids, out, lse)


def _attention_backward(causal, tuning, window, residuals, cotangents):
    q, k, v, segment_ids, out, lse = residuals
    d_out, d_lse = cotangents
    # A caller that uses out only gives lse no cotangent: the kernels then skip it (a zero array
    # would be transposed and loaded for nothing).
    d_lse = None if isinstance(d_lse, SymbolicZero) else d_lse
    d_out = jnp.zeros_like(out) if isinstance(d_out, SymbolicZero) else d_out
    dq, dk, dv = backward(q, k, v, out, lse, d_out, causal, segment_ids, segment_ids, d_lse, window, tuning=tuning)
    return dq, dk, dv, None


_attention.defvjp(_attention_forward, _attention_backward, symbolic_zeros=True)
