"""Expert parallelism: routed experts computed where their weights live, tokens moved by all-to-all.

`routed_experts` is the one call an MoE layer makes for its routed experts. It knows no layer: the
experts are `expert_fn(weights, x, group_sizes=None, row_buckets=1)`, which computes every expert on
its own tokens, either batched (x [experts, tokens, d]) or grouped (x [tokens, d] sorted by expert,
group_sizes[e] rows for expert e; `row_buckets`: the grouped-matmul seam's, for a receive buffer).
Each token's output is the sum over its assignments of gate * expert output.

Under a layout (while a step is traced) it runs in a `jax.shard_map` over the mesh axes that split
the tokens (`act_batch`, `act_length`), the experts (`experts`) and the experts' hidden dimension
(`expert_mlp`), each asked of the layout. Outside MoE layers the expert axis is one more batch axis,
so every device holds tokens of its own; per device (and the same with no layout, on one device):

- Dropless, experts not split: the device's assignments, sorted by expert, go through the grouped
  form (the grouped-matmul kernel, ushard/kernels/grouped_matmul.py): no padding, nothing moved.
- Otherwise, fixed-capacity dispatch. A device writes each kept assignment's token into slot
  (expert, rank among that expert's assignments on this device) of a [E, capacity, d] buffer and
  runs each expert batched over its rows. With the experts split over P devices (E / P each), an
  `all_to_all` over the expert axes first sends every expert's rows to the device holding it, which
  runs them for every sender, and a second brings the outputs back to the slots they came from.
  The capacity is the most one device can hold for one expert under the drop rule
  (ushard/models/moe.py): local rows x min(row capacity, local row length). Dropless, that is every
  local token, so the result is exact (buffers E / top_k times the assignments).
- Dispatch "ragged", experts split: only the kept assignments are computed, in a receive buffer of
  `dispatch_headroom` times an even load. How they travel is `exchange` (`model.moe.exchange`):
  - "all_to_all" (`_ragged` with `_padded_exchange`): each device sends every expert the rows routed
    to it, by one dense `all_to_all` of a buffer per pair of devices, also `dispatch_headroom` times
    an even share; the default on CPUs (`AUTO_EXCHANGE`).
  - "ragged_all_to_all" (`_ragged` with XLA's collective, sized by the counts; measured 19 times
    slower on 4 x H200; on CPUs a stand-in built from all-gathers): the default on TPUs.
  - "all_gather" (`_gathered`): every device of an expert group gathers the group's tokens, runs its
    experts on those routed to them, and a reduce-scatter sums the outputs back; no buffer per pair,
    and more bytes moved than the routed rows when few experts share a device. The default on GPUs:
    on 4 x H200 it ran `bench_moe` `expert=4` faster than "all_to_all" at the same headroom, and only a
    device's total rows can overflow, not a pair's (docs/benchmarks.md).

With `parallel.expert_split="width"` the expert axes split every expert's hidden width instead
(`expert_mlp` over them, `experts` over none): each device gathers its group's tokens, runs all of
their assignments through its slices, and a reduce-scatter sums the slices' outputs back
(`_width_split`); `dispatch`, `exchange` and `headroom` do not apply.

The expert weights enter the map as they are stored (ZeRO-3: split over fsdp too) and are gathered
inside it, in the compute dtype. `expert_fn`'s outputs are partial sums where `expert_mlp` is split
(tensor parallel experts: each device holds a slice of every hidden layer), so the tokens' outputs
are summed over those axes.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from ushard.models import dispatch as local_dispatch
from ushard.sharding import TOKEN_NAMES, current_layout, varying, varying_alike, varying_axes

# The name the "dots" remat policies keep (ushard/models/stack.py; models/moe.py tags the experts'
# matmul outputs with it), given here also to the exchanged rows (`KEEP_EXCHANGED`).
EXPERT_MATMUL = "expert_matmul"


def routed_experts(x, experts, gates, keep, weights: dict, weight_names: dict, expert_fn, row_capacity: int,
                   dispatch: str = "padded", headroom: float = 2.0, exchange: str = "auto",
                   width_parts: int | None = None):
    """Every token through its kept experts, weighted by its gates: x [batch, length, d], experts int /
    gates float32 / keep bool [batch, length, k], weights {name: [experts, ...]} with logical names
    `weight_names`; `row_capacity`: the drop rule's C (the most assignments an expert keeps from one
    sequence; the length when dropless); `dispatch`: "padded" or "ragged", how assignments travel to
    experts split over devices; `headroom`: the ragged receive buffer's rows, in multiples of an even
    load (`_ragged`); `exchange`: how the ragged dispatch moves rows ("auto", "all_to_all",
    "ragged_all_to_all", "all_gather"; module docstring); `width_parts`: with the width split, the
    parts a device's sequences are exchanged in (None: the plan's parallel.expert_width_parts, else 1).
    Returns (y [batch, length, d] in x's dtype,
    overflow float32: 1 where a ragged dispatch had more rows for a device than its buffer holds, and
    y is then NaN; else 0)."""
    layout = current_layout()
    if layout is None:
        return local_dispatch.on_device(x, experts, gates, keep, weights, expert_fn, row_capacity), jnp.float32(0)

    token_axes = tuple(a for name in TOKEN_NAMES for a in layout.axes(name))
    expert_axes, hidden_axes = layout.axes("experts"), layout.axes("expert_mlp")
    # Hidden-width axes that also split the tokens: parallel.expert_split="width" (`_width_split`).
    width_axes = tuple(a for a in hidden_axes if a in token_axes)
    if not set(expert_axes) <= set(token_axes) or (width_axes and expert_axes):
        raise NotImplementedError(
            f"expert parallelism needs the expert axes {expert_axes} among the token axes {token_axes}, and "
            f"no expert axes where the experts' width is split over token axes {width_axes}"
        )
    groups = layout.size("experts")
    if width_parts is None:
        width_parts = layout.plan.expert_width_parts if layout.plan is not None else 1

    stored_kind = "compute" if layout.zero.keep_gathered else "params"  # the stack may have gathered them already
    stored = {name: layout.spec(weight_names[name], stored_kind) for name in weights}
    compute = {name: layout.spec(weight_names[name]) for name in weights}

    ragged = dispatch == "ragged" and groups > 1
    how = resolved_exchange(exchange, layout.platform)
    # CPUs have no `ragged_all_to_all`: its stand-in there, when it is asked for.
    moves = _ragged_all_to_all_by_gather if layout.platform == "cpu" and how == "ragged_all_to_all" else MOVES.get(how)

    def per_device(x, experts, gates, keep, weights):
        weights = {name: _gather(w, stored[name], compute[name]) for name, w in weights.items()}
        if width_axes:
            y = _width_split(x, experts, gates, keep, weights, expert_fn, row_capacity, width_axes, width_parts)
            rest = tuple(a for a in hidden_axes if a not in width_axes)
            return (jax.lax.psum(y, rest) if rest else y), jnp.float32(0)
        if ragged:
            if how == "all_gather":
                y, overflow = _gathered(x, experts, gates, keep, weights, expert_fn, expert_axes, groups, headroom)
            else:
                y, overflow = _ragged(x, experts, gates, keep, weights, expert_fn, expert_axes, groups, moves, headroom)
            # The same on every device of an expert group (their counts table is); the most over the rest.
            every_axis = token_axes + hidden_axes
            overflow = jax.lax.pmax(varying(overflow, every_axis), every_axis)
        else:
            y = local_dispatch.on_device(x, experts, gates, keep, weights, expert_fn, row_capacity, groups,
                                   exchange=lambda buffer: jax.lax.all_to_all(buffer, expert_axes, 0, 0, tiled=True))
            overflow = jnp.float32(0)  # fixed buffers hold every assignment they keep
        # Partial sums where the experts' hidden dimension is split; summed once per token, after the
        # gates (linear), where there are fewer rows than in the expert buffers.
        return (jax.lax.psum(y, hidden_axes) if hidden_axes else y), overflow

    tokens = layout.spec((*TOKEN_NAMES, None))
    # Every other mesh axis is manual too, the values replicated over it (each device computes the
    # same): a TPU Pallas kernel (megablox) lowers only inside a map manual over every mesh axis, and
    # outside a pipeline's stages (a multi-token prediction module's block, after them) the stage
    # axis is one of those.
    already = set(jax.sharding.get_abstract_mesh().manual_axes)  # a pipeline stage's
    rest = {a for a in layout.mesh.shape if a not in already}
    return jax.shard_map(
        per_device, mesh=layout.mesh, in_specs=(tokens, tokens, tokens, tokens, stored), out_specs=(tokens, P()),
        axis_names=set(token_axes + expert_axes + hidden_axes) | rest,
    )(x, experts, gates, keep, weights)


def _axes(entry) -> tuple:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _gather(w, stored, compute):
    """A weight's local block as stored (e.g. ZeRO-3: split over fsdp) -> its block for compute, by
    all-gathers inside the map, whose transpose reduce-scatters the gradient into the stored layout
    (left to XLA, the mapped gradient was all-reduced whole, then sliced)."""
    for dim, (have, want) in enumerate(zip(stored, compute)):
        have, want = _axes(have), _axes(want)
        assert have[:len(want)] == want, (stored, compute)
        if len(have) > len(want):
            w = jax.lax.all_gather(w, have[len(want):], axis=dim, tiled=True)
    return w


# The grouped matmul runs on the fewest of this many evenly spaced row counts of the receive buffer
# that holds what arrived (ushard/kernels/grouped_matmul.py), not on every row of the buffer. Kernels
# that skip idle row blocks themselves (the Mosaic-GPU ones) ignore it: one compile, no rounding up.
RECEIVE_BUCKETS = 8
# Whether the backward pass keeps both exchanges' results (the rows received, the outputs sent back)
# under the "dots" remat policies, tagged like the experts' matmul outputs. Otherwise the recomputed
# forward runs both exchanges again: six a layer and step instead of four (keeping them measured
# faster for a little more memory: docs/benchmarks.md, expert parallelism on four H200s).
KEEP_EXCHANGED = True
# How the ragged dispatch moves rows between devices with `exchange="auto"`, per platform
# ("all_to_all" where not named). On GPUs XLA's `ragged_all_to_all` moved a small fraction of the
# dense all_to_all's bytes a second, and "all_gather" (`_gathered`) ran faster than the dense exchange
# at the same headroom (docs/benchmarks.md, expert parallelism on four H200s), so GPUs take
# "all_gather"; TPUs keep `ragged_all_to_all`: their compiles were checked with it, and the other
# exchanges were measured on GPUs only.
AUTO_EXCHANGE = {"tpu": "ragged_all_to_all", "gpu": "all_gather"}


def resolved_exchange(exchange: str, platform: str) -> str:
    """The exchange `model.moe.exchange` names on `platform`: "auto" as `AUTO_EXCHANGE` says."""
    return AUTO_EXCHANGE.get(platform, "all_to_all") if exchange == "auto" else exchange


def receive_rows(assignments: int, groups: int, local_experts: int, k: int, headroom: float) -> int:
    """The ragged receive buffer's rows on a device that sends `assignments` rows: `headroom` times
    what it receives when every device gets as many as it sends (an even load), never more than the
    most it can be sent (every sender's assignments to this device's experts). The grouped matmul
    runs on the part of the buffer in use (`RECEIVE_BUCKETS`); the memory is the whole buffer's."""
    most = groups * (assignments // k) * min(k, local_experts)
    return min(most, math.ceil(headroom * assignments))


def _ragged(x, experts, gates, keep, weights, expert_fn, axes, groups: int, exchange, headroom: float):
    """Experts split over `groups` devices, moving only the kept assignments: each device sends every
    expert the rows sorted for it, written where the receiver wants them (grouped by its local expert,
    senders in order), runs its experts grouped, and sends the outputs back to the rows they came from.
    `exchange` is `jax.lax.ragged_all_to_all` or its stand-in for CPUs. The receive buffer holds
    `receive_rows`; where one device's rows exceed it (the same verdict on every device: all hold
    the counts table), nothing is sent, and the output is NaN with overflow 1 (the step is not used;
    the training loop stops with a sentence). Returns (y, overflow)."""
    local_experts, k = local_dispatch.experts_held(weights), experts.shape[-1]
    num_experts, d = local_experts * groups, x.shape[-1]
    tokens, key, gates = local_dispatch.flat(x, experts, gates, keep, num_experts)
    order, sizes, _ = local_dispatch.sort_by_expert(key, num_experts)
    inverse = local_dispatch.inverse_of(order)
    rows = local_dispatch.assignment_rows(tokens, order, inverse, k)
    counts = jax.lax.all_gather(sizes, axes)  # [senders, experts]
    most = receive_rows(rows.shape[0], groups, local_experts, k, headroom)
    over = jnp.max(jnp.sum(counts.reshape(groups, groups, local_experts), axis=(0, 2))) > most
    if getattr(exchange, "pair_capacity", False):  # a buffer per pair of devices: each must hold its rows
        pair = pair_rows(rows.shape[0], groups, headroom)
        over = over | (jnp.max(jnp.sum(counts.reshape(groups, groups, local_experts), axis=2)) > pair)
        exchange = functools.partial(exchange, capacity=pair)
    plan = _ragged_plan(jnp.where(over, 0, counts), jax.lax.axis_index(axes), local_experts)
    # The result of `ragged_all_to_all` takes the type of its output buffer: zeros typed as differing
    # between devices like the rows, or JAX takes what each device received for the same on all of
    # them, and the transpose of its implicit broadcast sums the devices' gradients together.
    buffer = lambda shape: varying(jnp.zeros(shape, rows.dtype), varying_axes(rows))  # noqa: E731
    received = _kept(exchange(rows, buffer((most, d)), *plan["there"], axis_name=axes))
    computed = expert_fn(weights, received, plan["group_sizes"], row_buckets=RECEIVE_BUCKETS)
    out_sorted = _kept(exchange(computed, buffer(rows.shape), *plan["back"], axis_name=axes))
    y = local_dispatch.unsort_and_combine(out_sorted, order, inverse, gates, x)
    return jnp.where(over, jnp.asarray(jnp.nan, y.dtype), y), over.astype(jnp.float32)


def _gathered(x, experts, gates, keep, weights, expert_fn, axes, groups: int, headroom: float):
    """The ragged dispatch by all-gather: every device of the expert group gathers the group's tokens
    and their routing, runs its own experts on the assignments routed to them (sorted by local expert,
    in a buffer of `receive_rows`), combines them by gates into partial outputs for every token of the
    group, and a reduce-scatter sums each token's partial outputs on the device that holds it. Nothing
    is sized per pair of devices, and the transposes (reduce-scatter, all-gather) are the backward
    pass's exchanges. Where a device's rows exceed its buffer, its outputs are NaN with overflow 1,
    as in `_ragged`. Returns (y, overflow)."""
    local_experts, k = local_dispatch.experts_held(weights), experts.shape[-1]
    gather = lambda a: jax.lax.all_gather(a, axes, axis=0, tiled=True)  # noqa: E731
    every = _kept(gather(x))  # [groups * batch, length, d]
    local = gather(experts) - jax.lax.axis_index(axes) * local_experts
    mine = gather(keep) & (local >= 0) & (local < local_experts)
    tokens, key, gates = local_dispatch.flat(every, local, gather(gates), mine, local_experts)
    order, sizes, _ = local_dispatch.sort_by_expert(key, local_experts)
    inverse = local_dispatch.inverse_of(order)
    most = receive_rows(x.shape[0] * x.shape[1] * k, groups, local_experts, k, headroom)
    over = jnp.sum(sizes) > most
    rows = local_dispatch.assignment_rows(tokens, order, inverse, k)[:most]  # the routed rows come first
    computed = expert_fn(weights, rows, jnp.where(over, 0, sizes), row_buckets=RECEIVE_BUCKETS)
    computed = jnp.pad(computed, ((0, key.shape[0] - most), (0, 0)))  # the assignments routed elsewhere: zero
    partial = local_dispatch.unsort_and_combine(computed, order, inverse, gates, every)
    y = _kept(jax.lax.psum_scatter(partial, axes, scatter_dimension=0, tiled=True))
    over = jax.lax.pmax(varying(over, axes), axes)  # a NaN anywhere in the group reaches every device's sums
    return jnp.where(over, jnp.asarray(jnp.nan, y.dtype), y), over.astype(jnp.float32)


def _width_split(x, experts, gates, keep, weights, expert_fn, row_capacity: int, axes, parts: int = 1):
    """Every expert's hidden width split over `axes` (parallel.expert_split="width"): each device
    gathers the tokens and routing of the devices that share its experts, runs every assignment
    through its slice of every expert (as one device would, `models.dispatch.on_device`: grouped
    when dropless, the drop rule per sequence otherwise), and a reduce-scatter sums the slices'
    partial outputs on the device that holds each token. The work per device does not depend on
    where the router sends the tokens, and nothing is sized by a headroom.

    In `parts` (whole sequences each; at most as many as the device holds sequences) each part is
    gathered, computed and reduce-scattered on its own: the parts' chains share nothing, so the
    compiler may run one part's collectives while another's experts compute. The drop rule is per
    sequence, so the result does not depend on `parts`."""
    gather = lambda a: jax.lax.all_gather(a, axes, axis=0, tiled=True)  # noqa: E731

    def one_part(x, experts, gates, keep):
        every = _kept(gather(x))  # [devices * rows, length, d]
        partial = local_dispatch.on_device(every, gather(experts), gather(gates), gather(keep), weights, expert_fn,
                                           row_capacity)
        return _kept(jax.lax.psum_scatter(partial, axes, scatter_dimension=0, tiled=True))

    parts = math.gcd(parts, x.shape[0])  # config validation refuses a training batch it does not divide
    if parts == 1:
        return one_part(x, experts, gates, keep)
    pieces = [jnp.split(a, parts) for a in (x, experts, gates, keep)]
    return jnp.concatenate([one_part(*piece) for piece in zip(*pieces)])


def _kept(exchanged):
    """Exchanged rows tagged as the "dots" remat policies keep them, where `KEEP_EXCHANGED` says so."""
    return checkpoint_name(exchanged, EXPERT_MATMUL) if KEEP_EXCHANGED else exchanged


def pair_rows(assignments: int, groups: int, headroom: float) -> int:
    """The rows one device may send another through `_padded_exchange`: `headroom` times an even share
    of the `assignments` it sends, never more than all of them."""
    return min(assignments, math.ceil(headroom * assignments / groups))


def _ragged_plan(counts, me, local_experts: int) -> dict:
    """Offsets and sizes of both ragged exchanges, from counts [senders, experts] (rows each device
    sends each expert: the same table on every device) and this device's index `me`. A slice is one
    (device, expert) pair: on the way there, slice e carries this device's rows for expert e; on the way
    back, slice (s, j) carries sender s's rows for this device's local expert j."""
    groups = counts.shape[0]
    starts = jnp.cumsum(counts, axis=1) - counts  # where each expert's rows start on their sender
    to = counts.reshape(groups, groups, local_experts)  # [sender, receiver, local expert]
    totals = jnp.sum(to, axis=0)  # [receiver, local expert]
    blocks = jnp.cumsum(totals, axis=1) - totals  # where a local expert's rows start on the receiver
    lands = blocks[None] + jnp.cumsum(to, axis=0) - to  # [sender, receiver, j]: after earlier senders'
    mine = lambda a: a[:, me].reshape(-1)  # noqa: E731  (slices (sender, my local expert))
    return {
        "there": (starts[me], counts[me], lands.reshape(groups, -1)[me], mine(to)),
        "back": (mine(lands), mine(to), mine(starts.reshape(groups, groups, local_experts)), counts[me]),
        "group_sizes": totals[me],
    }


def _ragged_all_to_all_by_gather(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                                 axis_name):
    """`jax.lax.ragged_all_to_all`'s documented result, built from all-gathers (it has no CPU
    implementation): every device gathers every operand and offset table and copies the slices sent
    to it. Exact, and slow: for tests and CPU runs."""
    del recv_sizes  # implied by the senders' tables
    groups = jax.lax.axis_size(axis_name)
    per_device = input_offsets.shape[0] // groups
    me = jax.lax.axis_index(axis_name)
    operands = jax.lax.all_gather(operand, axis_name)  # [groups, rows, ...]
    def mine(a):
        gathered = jax.lax.all_gather(a, axis_name)
        return jax.lax.dynamic_slice_in_dim(gathered, me * per_device, per_device, axis=1).reshape(-1)

    starts, sizes, lands = mine(input_offsets), mine(send_sizes), mine(output_offsets)  # [groups * per_device]
    row = jnp.arange(output.shape[0])
    inside = (lands[:, None] <= row) & (row < lands[:, None] + sizes[:, None])  # [slices, output rows]
    slice_of_row = jnp.argmax(inside, axis=0)
    source_row = jnp.clip(starts[slice_of_row] + row - lands[slice_of_row], 0, operand.shape[0] - 1)
    copied = operands[slice_of_row // per_device, source_row]
    written = jnp.any(inside, axis=0).reshape(-1, *(1,) * (output.ndim - 1))
    return jnp.where(written, copied, output)


def _arriving(table, axis_name, per: int):
    """[senders, per]: each device's entries of `table` (per device: `per` slices) for the slices it
    sends this device."""
    gathered = jax.lax.all_gather(table, axis_name)  # [senders, devices * per]
    return jax.lax.dynamic_slice_in_dim(gathered, jax.lax.axis_index(axis_name) * per, per, axis=1)


def _landing(send_sizes, output_offsets, axis_name, capacity: int, rows: int):
    """Where each of this device's `rows` output rows comes from in what `_padded_move` receives
    ([senders * capacity] rows, each sender's slices packed one after another), and whether any
    slice lands there (else the output buffer keeps its row)."""
    groups = jax.lax.axis_size(axis_name)
    per = send_sizes.shape[0] // groups
    sizes_in, lands = _arriving(send_sizes, axis_name, per), _arriving(output_offsets, axis_name, per)
    packed_at = (jnp.arange(groups)[:, None] * capacity + jnp.cumsum(sizes_in, axis=1) - sizes_in).reshape(-1)
    lands, sizes_in = lands.reshape(-1), sizes_in.reshape(-1)
    row = jnp.arange(rows)
    inside = (lands[:, None] <= row) & (row < lands[:, None] + sizes_in[:, None])  # [slices, rows]
    which = jnp.argmax(inside, axis=0)
    source = jnp.clip(packed_at[which] + row - lands[which], 0, groups * capacity - 1)
    return source, jnp.any(inside, axis=0)[:, None]


def _padded_move(operand, input_offsets, send_sizes, output_offsets, axis_name, capacity: int, rows: int):
    """`jax.lax.ragged_all_to_all`'s result by one dense `all_to_all`, into `rows` rows that are zero
    where nothing lands: each device packs the slices it sends each other device into that pair's
    `capacity` rows (slice after slice), and unpacks what it receives to the offsets each sender gave.
    Rows past `capacity` for a pair are lost: the caller checks the counts first (`pair_rows`)."""
    groups = jax.lax.axis_size(axis_name)
    per = input_offsets.shape[0] // groups
    sizes = send_sizes.reshape(groups, per)
    ends = jnp.cumsum(sizes, axis=1)
    slot = jnp.arange(capacity)
    piece = jnp.sum(ends[:, :, None] <= slot, axis=1)  # [devices, capacity]: which of its slices fills the slot
    used = piece < per
    piece = jnp.minimum(piece, per - 1)
    offset = jnp.take_along_axis(input_offsets.reshape(groups, per) - (ends - sizes), piece, axis=1)
    source = jnp.clip(offset + slot, 0, operand.shape[0] - 1)
    packed = jnp.where(used[..., None], operand[source], jnp.zeros((), operand.dtype))  # [devices, capacity, d]
    received = jax.lax.all_to_all(packed, axis_name, 0, 0, tiled=True)  # [senders, capacity, d]
    received = received.reshape(groups * capacity, *operand.shape[1:])
    source, written = _landing(send_sizes, output_offsets, axis_name, capacity, rows)
    return jnp.where(written, received[source], jnp.zeros((), operand.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _padded(operand, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name, capacity, rows):
    return _padded_move(operand, input_offsets, send_sizes, output_offsets, axis_name, capacity, rows)


def _padded_forward(operand, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name, capacity, rows):
    out = _padded_move(operand, input_offsets, send_sizes, output_offsets, axis_name, capacity, rows)
    return out, (operand.shape[0], input_offsets, output_offsets, recv_sizes)


def _padded_backward(axis_name, capacity, rows, residuals, d_out):
    """The same exchange the other way (as `ragged_all_to_all` transposes): each received slice's
    gradient goes back to the rows it came from."""
    operand_rows, input_offsets, output_offsets, recv_sizes = residuals
    per = input_offsets.shape[0] // jax.lax.axis_size(axis_name)
    back_from = _arriving(output_offsets, axis_name, per).reshape(-1)  # where they landed here
    back_to = _arriving(input_offsets, axis_name, per).reshape(-1)  # where they came from there
    d_operand = _padded_move(d_out, back_from, recv_sizes, back_to, axis_name, capacity, operand_rows)
    return d_operand, None, None, None, None


_padded.defvjp(_padded_forward, _padded_backward)


def _padded_exchange(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name,
                     capacity: int):
    """`jax.lax.ragged_all_to_all`'s signature and result, through one fixed buffer of `capacity`
    rows per pair of devices and a dense `all_to_all` (`_padded_move`), differentiated the same way."""
    operand, input_offsets, send_sizes, output_offsets, recv_sizes = varying_alike(
        operand, input_offsets, send_sizes, output_offsets, recv_sizes)
    rows = output.shape[0]
    moved = _padded(operand, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name, capacity, rows)
    written = _landing(send_sizes, output_offsets, axis_name, capacity, rows)[1]
    return jnp.where(written, moved, output)


_padded_exchange.pair_capacity = True
MOVES = {"all_to_all": _padded_exchange, "ragged_all_to_all": jax.lax.ragged_all_to_all}  # "all_gather": `_gathered`
