"""Context parallelism: causal attention over a sequence split across devices, as explicit `shard_map` code.

The sequence is split over the mesh axes the layout maps `act_length` to (the `sequence` axis), `n`
ways. Attention is the only layer that mixes tokens, so it is the only place that communicates; it
wraps the model's per-chunk kernel `kernel(q, k, v, q_index, k_index, q_segments, k_segments) ->
(out, lse)`, which attends any block of queries to any block of keys given each token's index in the
unsplit row (causality) and its document (`segment_ids`, packed data), and returns the softmax's
log-sum-exp beside the output so that blocks can be combined.

`parallel.context_parallel`:
- "all_gather": every device gathers all keys and values (and segment ids) and attends its own
  queries to them in one kernel call. Simple; K/V memory and attention work grow with `n`.
- "ring": keys and values travel around the ring of `n` devices (`ppermute`), one block per step;
  each step's transfer is issued before the current block is used, so it can overlap the compute.
  Blocks are combined by an online softmax (running log-sum-exp). The backward pass is a custom VJP
  that runs the ring again: it recomputes each block, and the keys' and values' gradients travel
  with them, arriving home after the last step, so memory does not grow with `n`.
With `keep_kv` (`parallel.context_keep_kv`) the backward pass reuses the blocks that reached each device in
the forward pass: only the gradients travel (ring) or are reduce-scattered (all-gather), a third of
the traffic less, for K/V memory that grows with `n`.

What travels. Keys and values, or, where the model hands an `Expansion` (ushard/sharding.py), the
arrays it makes them from: latent attention's latent and shared RoPE key, kv_lora_rank +
qk_rope_head_dim numbers a token (DeepSeek-V3: 576, against 128 heads x (192 + 128) = 40,960 keys and
values). Each device then expands every block that reaches it (`expand(weights, block) -> (k, v)`,
its own heads under tensor parallelism: the latent is whole on every tensor rank) and runs the same
blocks on them. In the backward pass it expands a block again, and pulls the block's dK, dV back
through the expansion (`jax.vjp`): the latent's gradient travels home as dK, dV do, and the
expansion's weights' gradient adds up on the device (the weights are arguments of the custom VJPs,
typed as varying like q, so the shard_map's transpose sums them over the sequence and the batch).
The all-gather mode gathers the latents and expands all of them; autodiff does the rest.

Load balance. With a causal mask, the device holding the end of the sequence has the most work. The
batch is therefore reordered once per step, before the model (`reordered` below): the length
is cut into 2n chunks and device i holds chunks i and 2n-1-i ("zig-zag"), a permutation of the length
axis that changes no loss. Attention computes each token's original index from its device and half,
so the masks follow the original order. With zig-zag, every ring step after the first needs exactly
two of the four quarter blocks (which two depends on whether the visiting block comes from an earlier
device), and both are computed branch-free; the first step skips the fully masked quarter.

Sliding windows (`window` w > 0: a query sees itself and the w - 1 keys before it). The kernel masks
them by the tokens' original indices, as it masks causality. Around the ring only the steps whose
block some device's queries can reach are visited (`_reach`, from the static chunk layout): each of
those blocks comes by one `ppermute` over as many devices as it must jump, and in the backward pass
its dK, dV jump with it and then home. "all_gather" mode masks only. The fused blocks take no window
yet (they are called without their tokens' positions): with one, the ring runs XLA blocks.

Packed data: a query sees a key when the key's original index is not after the query's and both
carry the same segment id; the segment ids travel with the keys. A block in which a query sees no
key gives that query lse = -inf and adds nothing.

Fused kernels. The ring above differentiates through `kernel`, which must give a differentiable lse;
JAX's fused kernels do not. A `BlockKernel` (ushard/kernels: cuDNN's flash attention on GPUs, splash attention on
TPUs) is used instead in the zig-zag order, where every block is a causal diagonal or a full block
of equal halves: its forward returns the block's float32 lse, and its backward is flash attention's,
fed the *final* output and lse of the queries, which makes each block's gradients exact on their
own (`_fused_attention`). The blocks come around the ring, or in "all_gather" mode out of one
all-gather (then the blocks' dK, dV are reduce-scattered). Around the ring their backward pass
visits a device's own block last, so each block's dK, dV reach home in n-1 steps, not n. Splash also
takes document masks; cuDNN's blocks run without one.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from ushard.errors import UserError
from ushard.kernels.attention import FUSED_ATTENTION, BlockKernel, typed
from ushard.sharding import KV_NAMES, Q_NAMES, TOKEN_NAMES, Expansion, current_layout, varying, varying_axes

MODES = ("ring", "all_gather")


def check_length(seq_len: int, n: int) -> None:
    """UserError unless a sequence of `seq_len` tokens cuts into the 2n chunks of the zig-zag order."""
    if n > 1 and seq_len % (2 * n):
        raise UserError(
            f"train.seq_len={seq_len} must be a multiple of {2 * n} when the sequence is split {n} ways: "
            f"context parallelism gives each device two chunks (one early, one late) to balance causal attention."
        )


def reordered(batch, layout):
    """`batch` ([batch, length, ...] arrays) with its length axis in zig-zag order where `layout`
    splits the sequence (else as it is): the train step reorders a batch once, so per-token losses are
    unchanged and only their order differs, and traces under a layout that says so (`Layout.zigzag`)."""
    n = layout.size("act_length")
    return jax.tree.map(lambda x: zigzag(x, n), batch) if n > 1 else batch


def zigzag_chunks(n: int) -> np.ndarray:
    """The order of the 2n chunks of a row after reordering: device i's two are i and 2n-1-i."""
    return np.array([c for i in range(n) for c in (i, 2 * n - 1 - i)])


def zigzag(x, n: int, inverse: bool = False):
    """x [batch, length, ...] with its length axis in zig-zag order for `n` devices (`inverse`: back)."""
    b, t = x.shape[:2]
    chunks = x.reshape(b, 2 * n, t // (2 * n), *x.shape[2:])
    order = zigzag_chunks(n)
    return chunks[:, np.argsort(order) if inverse else order].reshape(x.shape)


@dataclass(frozen=True)
class _Ring:
    """The devices that split the sequence, and the order their tokens are in."""

    axes: tuple[str, ...]
    size: int
    zigzag: bool

    def index(self):
        return jax.lax.axis_index(self.axes)

    def token_index(self, device, length: int):
        """[1, length]: the original index in the row of each of `device`'s `length` local tokens."""
        t = jnp.arange(length)
        if not self.zigzag:
            return (device * length + t)[None]
        half = length // 2
        chunk = jnp.where(t < half, device, 2 * self.size - 1 - device)
        return (chunk * half + t % half)[None]

    def shift(self, tree, hops: int = 1):
        """Every array of `tree` sent `hops` devices on around the ring."""
        perm = [(j, (j + hops) % self.size) for j in range(self.size)]
        return jax.tree.map(lambda x: jax.lax.ppermute(x, self.axes, perm), tree)

    def chunks(self, device: int, length: int):
        """The (first, last) original token indices of each contiguous run of a device's `length`
        local tokens (`device` a Python int: for static planning)."""
        if not self.zigzag:
            return [(device * length, (device + 1) * length - 1)]
        half = length // 2
        return [(c * half, (c + 1) * half - 1) for c in (device, 2 * self.size - 1 - device)]

    def gather(self, tree):
        """Every array of `tree` [B, T, ...] (None stays None) gathered from all devices, [B, n T, ...]."""
        return jax.tree.map(lambda x: jax.lax.all_gather(x, self.axes, axis=1, tiled=True), tree)


def attention(q, kv, segment_ids, kernel, fused: BlockKernel | None = None, window: int = 0,
              expansion: Expansion | None = None):
    """Causal attention of q [B, T, heads, hd] over keys and values [B, T, kv_heads, hd], the sequence
    split over the active layout's `act_length` axes, each device running `kernel` on its blocks.

    `kv`: what travels between the devices, the keys and values (k, v), or with `expansion` the
    arrays [B, T, ...] (logical names `expansion.names`) that each device makes a block's keys and
    values from, `expansion.expand(expansion.weights, block) -> (k, v)`, where the block is (latent
    attention: a token's latent and shared RoPE key, not every head's keys and values). The weights'
    gradient is returned as well as the travelling arrays'.

    `segment_ids` [B, T] (or None: no document masking). The other dimensions keep the layout's
    shardings (batch over data/fsdp, heads over tensor), so this composes with those axes. `fused`,
    where given, runs the blocks in the zig-zag order instead, in either mode (with a document mask
    only if it takes segment ids); everything else runs on `kernel`. `window` > 0: sliding-window
    attention (module docstring); `kernel` then takes it (`xla_block`'s `window`), `fused` is unused.
    """
    layout = current_layout()
    mode, keep_kv = (layout.plan.context_mode, layout.plan.context_keep_kv) if layout.plan else ("ring", False)
    ring = _Ring(layout.axes("act_length"), layout.size("act_length"), layout.zigzag)
    steps = None
    if window:
        kernel, fused = functools.partial(kernel, window=window), None
        steps = _reach(ring, q.shape[1] // ring.size, window)
    body = functools.partial(_ring_attention, keep=keep_kv, steps=steps) if mode == "ring" else _gathered_attention
    check_vma = True
    q_spec, kv_spec = layout.spec(Q_NAMES), layout.spec(KV_NAMES)
    if expansion is None:
        expand, weights, kv_specs, weight_specs = None, (), (kv_spec,) * len(kv), ()
    else:
        expand, weights = expansion.expand, expansion.weights
        kv_specs = tuple(layout.spec(names) for names in expansion.names)
        weight_specs = jax.tree.map(layout.spec, expansion.weight_names, is_leaf=lambda x: isinstance(x, tuple))
    if fused is not None and layout.zigzag and (segment_ids is None or fused.segments):
        body = functools.partial(_fused_attention, gather=mode == "all_gather", keep=keep_kv)
        kernel, check_vma = fused, fused.typed
        if not fused.typed and frozenset().union(*map(varying_axes, jax.tree.leaves((q, kv, weights)))):
            # Inside another shard_map (a pipeline stage) this map's types must be checked: unchecked,
            # the custom VJP's gradients could not carry the stage's axes that q, k and v carry.
            kernel, check_vma = typed(fused), True
    operands, specs = (q, weights, tuple(kv)), (q_spec, weight_specs, kv_specs)
    if segment_ids is not None:
        operands, specs = operands + (segment_ids,), specs + (layout.spec(TOKEN_NAMES),)

    def local(q, weights, kv, segments=None):
        # One type for all that enters the custom VJPs: the weights (split over heads only) and a
        # latent (not split over heads) meet q's heads, so their gradients differ between the devices
        # that q's do, and the casts' transposes add them up (over the sequence, the batch, the heads).
        axes = frozenset().union(*map(varying_axes, jax.tree.leaves((q, weights, kv))))
        q, weights, kv = varying((q, weights, kv), axes)
        return body(kernel, ring, q, weights, kv, segments, expand)

    return jax.shard_map(local, mesh=layout.mesh, in_specs=specs, out_specs=q_spec, check_vma=check_vma)(*operands)


def _keys_values(expand, weights, kv):
    """A block's (k, v): the travelling block itself, or made from it by the model's `expand`."""
    return tuple(kv) if expand is None else expand(weights, kv)


# --------------------------------------------------------------------------- all-gather


def _gathered_attention(kernel, ring, q, weights, kv, segments, expand=None):
    """Local queries over every device's keys and values, gathered (or made from the gathered arrays
    that travel); autodiff reduce-scatters their gradients."""
    t = q.shape[1]
    k_index = jnp.concatenate([ring.token_index(j, t) for j in range(ring.size)], axis=1)
    kv, k_segments = ring.gather((kv, segments))
    k, v = _keys_values(expand, weights, kv)
    out, _ = kernel(q, k, v, ring.token_index(ring.index(), t), k_index, segments, k_segments)
    return out.astype(q.dtype)


# --------------------------------------------------------------------------- ring


def _halves(x):
    """x [B, T, ...] cut along T into this device's early and late chunk (zig-zag order); None stays None."""
    if x is None:
        return None, None
    h = x.shape[1] // 2
    return x[:, :h], x[:, h:]


def _split(arrays):
    """A tuple of [B, T, ...] arrays (or None) as (its early halves, its late halves)."""
    return tuple(zip(*(_halves(x) for x in arrays)))


def _join(lo, hi):
    return jnp.concatenate([lo, hi], axis=1)


def _choose(before, a, b):
    """a where the visiting block comes from an earlier device, else b (trees of arrays)."""
    return jax.tree.map(lambda x, y: jnp.where(before, x, y), a, b)


def _blocks(kernel, ring, diagonal, q, segments, kv, src):
    """The local queries against the key/value block `kv` = (k, v, segments) of device `src`.

    A list of partial results (out [B, T, heads, hd], lse [B, T, heads], float32) over all local
    query rows, lse = -inf on rows a block does not reach; `_merge` combines them.
    """
    k, v, k_segments = kv
    me, t = ring.index(), q.shape[1]
    q_index, k_index = ring.token_index(me, t), ring.token_index(src, t)
    if not ring.zigzag:
        return [kernel(q, k, v, q_index, k_index, segments, k_segments)]
    queries_lo, queries_hi = _split((q, q_index, segments))
    keys_lo, keys_hi = _split((k, v, k_index, k_segments))

    def call(queries, keys):
        (q, q_index, q_segments), (k, v, k_index, k_segments) = queries, keys
        return kernel(q, k, v, q_index, k_index, q_segments, k_segments)

    if diagonal:
        # early x early is causal, late x (early, late) is too; early x late is masked: skipped.
        early, late = call(queries_lo, keys_lo), call(queries_hi, (k, v, k_index, k_segments))
        return [jax.tree.map(_join, early, late)]
    # Another device's chunks: my late chunk sees its early chunk whole. If it comes before me, my
    # early chunk sees its early chunk too; otherwise my late chunk sees its late chunk. The rest is
    # masked. Both cases are one block of the same shape, chosen by selects (no branch).
    before = src < me
    always = call(queries_hi, keys_lo)
    either = call(*_choose(before, (queries_lo, keys_lo), (queries_hi, keys_hi)))
    nothing = jax.tree.map(jnp.zeros_like, always[0]), jnp.full_like(always[1], -jnp.inf)
    return [
        jax.tree.map(_join, nothing, always),
        jax.tree.map(lambda e, n: jnp.where(before, _join(e, n), _join(n, e)), either, nothing),
    ]


def _merge(acc, partials):
    """Online softmax: (out, lse) so far combined with more partial results over the same rows."""
    for part in partials:
        if acc is None:
            acc = part
            continue
        (out_a, lse_a), (out_b, lse_b) = acc, part
        lse = jnp.logaddexp(lse_a, lse_b)
        base = jnp.where(jnp.isfinite(lse), lse, 0.0)  # rows no block has reached yet stay empty
        out = out_a * jnp.exp(lse_a - base)[..., None] + out_b * jnp.exp(lse_b - base)[..., None]
        acc = (out, lse)
    return acc


@dataclass(frozen=True)
class _Passed:
    """Blocks that travel one device on per step (`ppermute`); the transfer of the next block is issued
    before the current one is used, so they can overlap."""

    ring: _Ring

    def start(self, home):
        """(the state before step 1, the steps' stacked inputs)."""
        return self.ring.shift(home), None

    def take(self, state, src, step_input, last=False):
        """(step's block, the state after it); the last block is sent no further."""
        return state, (None if last else self.ring.shift(state))


@dataclass(frozen=True)
class _Kept:
    """The blocks an earlier walk received and kept (`keep`): steps 1 .. n-2 stacked (None for n = 2)
    and the last. Nothing travels again but what the visits send themselves."""

    received: tuple

    def start(self, home):
        return None, self.received[0]

    def take(self, state, src, step_input, last=False):
        return (self.received[1] if last else step_input), None


@dataclass(frozen=True)
class _Gathered:
    """Each block sliced out of one all-gather of them all (`everything` [B, n T, ...] over `size` devices)."""

    everything: tuple
    size: int

    def start(self, home):
        return None, None

    def take(self, state, src, step_input, last=False):
        def block(x):
            t = x.shape[1] // self.size
            return jax.lax.dynamic_slice_in_dim(x, src * t, t, axis=1)

        return jax.tree.map(block, self.everything), None


def _walk(ring, home, visit, source, carry=None, unroll: bool = False, keep: bool = False,
          home_last: bool = False):
    """carry = visit(block, src, diagonal, carry) for every device's key/value block in the ring's
    order: step s visits the block of the device s places back, the local one (`home`) at step 0, or
    last (`home_last`). `source` (`_Passed`, `_Kept`, `_Gathered`) says how the others' blocks reach
    this device; the order is the same for all of them.

    Steps 1 .. n-2 run in a `lax.scan` (program size and, on XLA's CPU backend, memory flat in n); the
    last is outside it, so no block is sent further than needed. `unroll`: no step in a while loop,
    where XLA's GPU compiler crashed on cuDNN blocks (SIGSEGV, JAX 0.11.2, n = 4; docs/dev-notes.md).
    `keep`: also returns the blocks received (steps 1 .. n-2 stacked, and the last) for a `_Kept`
    walk. `home_last`: what a visit sends on with a travelling block (its dK, dV) then reaches home
    after n - 1 steps, in time for the home block's visit, instead of one step after it.
    """
    assert not (keep and home_last), "a forward pass keeps its blocks, a backward pass goes home last"
    me, n = ring.index(), ring.size

    def src(s):
        return (me - s) % n

    state, step_inputs = source.start(home)
    if not home_last:
        carry = visit(home, me, True, carry)
    first = 1
    if home_last and n > 2:  # one step before the scan, which needs a carry (not None) of one structure
        block, state = source.take(state, src(1), jax.tree.map(lambda x: x[0], step_inputs))
        carry, step_inputs, first = visit(block, src(1), False, carry), jax.tree.map(lambda x: x[1:], step_inputs), 2

    def step(state_and_carry, step_and_input):
        (state, carry), (s, step_input) = state_and_carry, step_and_input
        block, state = source.take(state, src(s), step_input)
        return (state, visit(block, src(s), False, carry)), block if keep else None

    middle = None
    if first < n - 1:
        (state, carry), middle = jax.lax.scan(step, (state, carry), (jnp.arange(first, n - 1), step_inputs),
                                              unroll=unroll)
    last, _ = source.take(state, src(n - 1), None, last=True)
    carry = visit(last, src(n - 1), False, carry)
    if home_last:
        carry = visit(home, me, True, carry)
    return carry, ((middle, last) if keep else None)


def _sent_again(block):
    """The travelling block (its arrays, segment ids) that a backward pass passes around or gathers
    again, its arrays packed into one [B, T, ..., sum of their last dimensions] (`_unpacked` undoes
    it; keys and values: [B, T, kv_heads, hd_k + hd_v], latent attention's values being narrower than
    its keys). The transfers are then not the forward pass's: identical ones XLA reuses (CSE), which
    holds every device's blocks from the forward to the backward pass, what `keep_kv` does on
    purpose. One transfer a step instead of two. A block of one array (a latent) travels negated
    instead, exact both ways (an optimisation barrier did not keep XLA:CPU from merging them: it
    removes barriers before CSE)."""
    kv, segments = block
    if len(kv) == 1:
        return (-kv[0],), segments
    return (jnp.concatenate(kv, axis=-1),), segments


def _unpacked(visit, widths: tuple[int, ...]):
    """`visit` for blocks packed by `_sent_again`, whose arrays had `widths` last dimensions."""
    if len(widths) == 1:
        return lambda block, *args: visit(((-block[0][0],), block[1]), *args)
    bounds = np.cumsum((0, *widths))

    def unpack(packed):
        first = packed[..., :widths[0]]  # slices written as before arrays of one width (the same program)
        return (first, *(packed[..., a:] if b == bounds[-1] else packed[..., a:b]
                         for a, b in zip(bounds[1:-1], bounds[2:])))

    return lambda block, *args: visit((unpack(block[0][0]), block[1]), *args)


def _widths(kv) -> tuple[int, ...]:
    return tuple(x.shape[-1] for x in kv)


def _reach(ring, length: int, window: int) -> tuple[int, ...] | None:
    """The ring steps s (1 .. n-1) at which some device's queries can see a key of the block s
    devices back within `window`, from each device's `length` local tokens; None if that is every
    step. A static plan: the chunks' places are known at trace time, and a step is one collective
    that every device takes part in, so a step is left out only if no device needs it."""
    n = ring.size

    def sees(queries, keys):  # some query - key distance in [0, window)
        return queries[1] >= keys[0] and queries[0] - keys[1] < window

    def needed(s):
        return any(sees(qs, ks) for me in range(n) for qs in ring.chunks(me, length)
                   for ks in ring.chunks((me - s) % n, length))

    steps = tuple(s for s in range(1, n) if needed(s))
    return None if len(steps) == n - 1 else steps


def _hop_walk(ring, home, visit, steps, carry=None, received=None, send=None):
    """`_walk` over the home block and the blocks `steps` (sorted, from `_reach`) devices back only,
    unrolled: each block comes by one transfer over the devices it jumps (or from `received`, the
    blocks an earlier walk returned). `send(carry, hops)`: the part of carry that travels with the
    block (a backward pass's dK, dV) sent along with it, and home after the last. Returns (carry,
    the blocks received, in order)."""
    me, n = ring.index(), ring.size
    hops = [b - a for a, b in zip((0, *steps), (*steps, n))]
    carry = visit(home, me, True, carry)
    block, kept = home, []
    for i, s in enumerate(steps):
        if send is not None:
            carry = send(carry, hops[i])
        block = ring.shift(block, hops[i]) if received is None else received[i]
        kept.append(block)
        carry = visit(block, (me - s) % n, False, carry)
    if send is not None and steps:
        carry = send(carry, hops[-1])
    return carry, tuple(kept)


def _ring_attention(kernel, ring, q, weights, kv, segments, expand=None, keep: bool = False,
                    steps: tuple[int, ...] | None = None):
    """The ring over XLA blocks (module docstring); `steps`: only those ring steps (`_reach`), else all.
    The blocks that travel are `kv` (k, v), or the arrays that `expand` makes them from on each device
    (`attention`); their gradients travel home with them, the weights' add up where they are made."""

    def blocks(q, segments, weights, block, src, diagonal):
        kv, k_segments = block
        return _blocks(kernel, ring, diagonal, q, segments, (*_keys_values(expand, weights, kv), k_segments), src)

    @jax.custom_vjp
    def attend(q, weights, kv, segments):
        return forward(q, weights, kv, segments)[0]

    def forward(q, weights, kv, segments):
        def visit(block, src, diagonal, acc):
            return _merge(acc, blocks(q, segments, weights, block, src, diagonal))

        if steps is None:
            (out, lse), received = _walk(ring, (kv, segments), visit, _Passed(ring), keep=keep)
        else:
            (out, lse), received = _hop_walk(ring, (kv, segments), visit, steps)
            received = received if keep else None
        out = out.astype(q.dtype)
        return out, (q, weights, kv, segments, out, lse, received)

    def backward(residuals, d_out):
        q, weights, kv, segments, out, lse, received = residuals
        d_out = d_out.astype(jnp.float32)
        # The softmax backward's row term: sum over head_dim of dO * O, with the final output.
        d_lse_total = jnp.sum(d_out * out.astype(jnp.float32), axis=-1)

        def block_grads(block, src, diagonal, grads):
            """Recomputes this block's partials (and keys and values, if made) and pulls back the final
            output's gradient: a partial (o_p, lse_p) enters the output with weight w = exp(lse_p - lse),
            so its cotangents are w * dO and w * (rowsum(dO * o_p) - rowsum(dO * O)). Returns the
            queries', the weights' and the block's gradients, added to `grads`."""
            kv, k_segments = block
            partials, pull_back = jax.vjp(lambda q, w, kv: blocks(q, segments, w, (kv, k_segments), src, diagonal),
                                          q, weights, kv)
            cotangents = []
            for o_p, lse_p in partials:
                w = jnp.exp(lse_p - lse)
                cotangents.append((w[..., None] * d_out, w * (jnp.sum(d_out * o_p, axis=-1) - d_lse_total)))
            found = pull_back(cotangents)
            return found if grads is None else jax.tree.map(jnp.add, found, grads)

        def visit(block, src, diagonal, grads):
            # The block's gradients travel on with it and reach their own device after the last step.
            dq, dw, dkv = block_grads(block, src, diagonal, grads)
            return dq, dw, ring.shift(dkv)

        def send(grads, hops):
            return grads[0], grads[1], ring.shift(grads[2], hops)

        # The gradients travel with the blocks, so they ride the same ring: `visit` shifts them itself.
        widths = _widths(kv)
        if steps is not None:
            if keep:
                (dq, dw, dkv), _ = _hop_walk(ring, (kv, segments), block_grads, steps, received=received, send=send)
            else:
                (dq, dw, dkv), _ = _hop_walk(ring, _sent_again((kv, segments)), _unpacked(block_grads, widths),
                                             steps, send=send)
        elif keep:
            (dq, dw, dkv), _ = _walk(ring, (kv, segments), visit, _Kept(received))
        else:
            (dq, dw, dkv), _ = _walk(ring, _sent_again((kv, segments)), _unpacked(visit, widths), _Passed(ring))
        return dq.astype(q.dtype), _like(dw, weights), _like(dkv, kv), None

    attend.defvjp(forward, backward)
    return attend(q, weights, kv, segments)


def _like(grads, primals):
    """Gradients in their primals' dtypes."""
    return jax.tree.map(lambda g, x: g.astype(x.dtype), grads, primals)


# --------------------------------------------------------------------------- ring of fused blocks


def _fused_attention(fused, ring, q, weights, kv, segments=None, expand=None, gather: bool = False,
                     keep: bool = False):
    """Zig-zag context-parallel attention (`_blocks` says which quarter blocks are needed) on a
    `BlockKernel`; the travelling blocks (`kv`: keys and values, or the arrays `expand` makes them
    from) come around the ring, or (`gather`) out of one all-gather.

    At home the local chunks (early, late) are in token order: one causal block of both. Another
    device's block: my late chunk sees its early chunk whole; if it comes from an earlier device my
    early chunk sees its early chunk too, else my late chunk sees its late chunk, and both cases are
    one full block, picked by selects. Halves are combined in float32 by the online softmax
    (`_merge`). Queries go as (q, segment ids), keys as (k, v, segment ids); the ids are None without
    a document mask.
    """

    def visits(blocks, visit):
        """The forward pass's visits: (the visits' result, the blocks that reached this device if `keep`)."""
        if gather:
            everything = ring.gather(blocks)
            result, _ = _walk(ring, blocks, visit, _Gathered(everything, ring.size), unroll=True)
            return result, everything if keep else None
        return _walk(ring, blocks, visit, _Passed(ring), unroll=True, keep=keep)

    def block(queries, keys, causal):
        (q, q_segments), (k, v, k_segments) = queries, keys
        out, lse = fused.forward(q, k, v, causal, q_segments, k_segments)
        return out.astype(jnp.float32), lse

    def visit(queries, weights, travelling, src, diagonal, acc):
        kv, k_segments = travelling
        keys = (*_keys_values(expand, weights, kv), k_segments)
        if diagonal:  # the local chunks are in token order, so at home attention is one causal block
            return _split(block(queries, keys, True))
        (q_lo, q_hi), (k_lo, k_hi) = _split(queries), _split(keys)
        lo, hi = acc
        before = src < ring.index()
        hi = _merge(hi, [block(q_hi, k_lo, False)])
        either = block(*_choose(before, (q_lo, k_lo), (q_hi, k_hi)), False)
        return _choose(before, _merge(lo, [either]), lo), _choose(before, hi, _merge(hi, [either]))

    @jax.custom_vjp
    def attend(q, weights, kv, segments):
        return forward(q, weights, kv, segments)[0]

    def forward(q, weights, kv, segments):
        (lo, hi), received = visits((kv, segments), lambda *args: visit((q, segments), weights, *args))
        out, lse = _join(lo[0], hi[0]).astype(q.dtype), _join(lo[1], hi[1])
        # Named for remat policies that keep fused attention (models/stack.py's dots_attention), with
        # the blocks kept for the backward (`keep`): what the backward needs, so that it need not
        # run this forward again, transfers and all.
        out, lse, received = jax.tree.map(lambda x: checkpoint_name(x, FUSED_ATTENTION), (out, lse, received))
        return out, (q, weights, kv, segments, out, lse, received)

    def backward(residuals, d_out):
        q, weights, kv, segments, out, lse, received = residuals
        rows = (q, out, lse, d_out.astype(q.dtype), segments)
        rows_lo, rows_hi = _split(rows)
        t = q.shape[1]

        def grads(rows, keys, causal):
            (q, out, lse, d_out, q_segments), (k, v, k_segments) = rows, keys
            block = fused.backward(q, k, v, out, lse, d_out, causal, q_segments, k_segments)
            return [g.astype(jnp.float32) for g in block]

        def block_grads(travelling, src, diagonal, dq):
            """dQ with this block's share added (early and late halves), and the gradients of the
            weights and of the travelling block (float32): its dK, dV, or theirs pulled back through
            the expansion that made them."""
            kv, k_segments = travelling
            if expand is None:
                (k, v), pull_back = kv, None
            else:
                (k, v), pull_back = jax.vjp(expand, weights, kv)
            keys = (k, v, k_segments)
            if diagonal:
                d_home, dk, dv = grads(rows, keys, True)
                share = _halves(d_home)
            else:
                k_lo, k_hi = _split(keys)
                late_early = grads(rows_hi, k_lo, False)
                before = src < ring.index()
                either = grads(*_choose(before, (rows_lo, k_lo), (rows_hi, k_hi)), False)
                zero = jnp.zeros_like(either[0])
                share = (jnp.where(before, either[0], zero), late_early[0] + jnp.where(before, zero, either[0]))
                dk, dv = (_join(late_early[i] + jnp.where(before, either[i], 0), jnp.where(before, 0, either[i]))
                          for i in (1, 2))
            if pull_back is None:
                dw, dkv = (), (dk, dv)
            else:
                dw, dkv = pull_back((dk.astype(k.dtype), dv.astype(v.dtype)))
                dkv = tuple(g.astype(jnp.float32) for g in dkv)
            return (share if dq is None else jax.tree.map(jnp.add, dq, share)), dw, dkv

        def add(acc, found):
            return found if acc is None else jax.tree.map(lambda a, f: f + a, acc, found)

        def travel(travelling, src, diagonal, acc):
            """Around the ring, a block's gradients travel on with it and reach home for its last visit
            (as in `_ring_attention`), in the block's own dtype: in bfloat16 training half the bytes of
            float32 (the ring's largest transfer), at the cost of one rounding per hop. The weights'
            add up here."""
            dq, dw, dkv = block_grads(travelling, src, diagonal, None if acc is None else acc[0])
            if acc is not None:
                dw, dkv = add(acc[1], dw), add(acc[2], dkv)
            if diagonal:  # at home, last
                return dq, dw, dkv
            return dq, dw, ring.shift(_like(dkv, kv))

        def collect(travelling, src, diagonal, acc):
            """From the all-gather, each block's gradients add into a buffer of all of them,
            reduce-scattered after the last block (the all-gather's transpose)."""
            dq, dw, dkv = block_grads(travelling, src, diagonal, None if acc is None else acc[0])
            everything = acc[2] if acc is not None else tuple(
                jnp.zeros((x.shape[0], ring.size * t, *x.shape[2:]), jnp.float32) for x in dkv)
            put = lambda whole, part: jax.lax.dynamic_update_slice_in_dim(  # noqa: E731
                whole, jax.lax.dynamic_slice_in_dim(whole, src * t, t, axis=1) + part, src * t, axis=1)
            return dq, add(None if acc is None else acc[1], dw), tuple(map(put, everything, dkv))

        widths = _widths(kv)
        if gather:  # `received`: the forward's gather, or None to gather again
            if keep:
                blocks, gathered_visit, everything = (kv, segments), collect, received
            else:
                blocks, gathered_visit = _sent_again((kv, segments)), _unpacked(collect, widths)
                everything = ring.gather(blocks)
            (dq, dw, dkv), _ = _walk(ring, blocks, gathered_visit, _Gathered(everything, ring.size), unroll=True)
            dkv = tuple(jax.lax.psum_scatter(g.astype(x.dtype), ring.axes, scatter_dimension=1, tiled=True)
                        for g, x in zip(dkv, kv))
        elif keep:
            (dq, dw, dkv), _ = _walk(ring, (kv, segments), travel, _Kept(received), unroll=True, home_last=True)
        else:
            (dq, dw, dkv), _ = _walk(ring, _sent_again((kv, segments)), _unpacked(travel, widths),
                                     _Passed(ring), unroll=True, home_last=True)
        return _join(*dq).astype(q.dtype), _like(dw, weights), _like(dkv, kv), None

    attend.defvjp(forward, backward)
    return attend(q, weights, kv, segments)
