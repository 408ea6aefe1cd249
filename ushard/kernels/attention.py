"""Attention kernels: the contract, the XLA implementation, and the one place that picks a kernel.

Causal attention of q [B, T, heads, hd] over k [B, T, kv_heads, hd] and v [B, T, kv_heads, vd]
(grouped-query heads as they are; vd = hd but for latent attention's values: cuDNN and ours
(`flash.takes_value_widths`) take them as they are, other kernels padded, `values_padded`); with
segment ids [B, T] a token sees only keys of its own document; with a `window` w > 0
(sliding-window attention, Hugging Face's `sliding_window`: Mistral, Gemma 3) the query at position i
sees key j only if i - w < j <= i, itself and the w - 1 keys before it (0: no window). Two forms:
- whole sequence (`whole_sequence`): what a layer runs when its sequence is on one device;
- block (`BlockKernel`, `xla_block`): a block of queries against a block of keys from anywhere in the
  sequence, with the log-sum-exp of each query's visible scores, so that context parallelism
  (ushard/parallel/context.py) can combine blocks held by different devices.

`model.attention_impl`: "auto" picks cuDNN flash attention on GPUs in 16-bit compute, splash
attention on TPUs (sequences a multiple of 128 tokens), XLA elsewhere. "flash" is ushard's own
kernel for GPUs (ushard/kernels/flash.py, with flash_hopper.py's forward on Hopper: documents, GQA,
an exact log-sum-exp for the ring's blocks); "auto" picks it inside pipeline stages, where cuDNN
cannot run (XLA's GPU compiler crashes on it there): faster than cuDNN's kernels alone on Hopper,
level with them inside a step at the GPU's power limit, far faster than XLA's attention
(docs/benchmarks.md). A document mask runs ours too under "auto": on a split sequence cuDNN's blocks
take no mask (and XLA's hold every block's scores), and on whole sequences cuDNN takes the mask as a
dense [T, T] array and computes every block while ours skips other documents' blocks (measured
faster in a whole step, docs/benchmarks.md). Inside pipeline stages ours also runs a split
sequence's blocks, their map's types checked (`typed`). `resolve` decides, `why` says why, `check`
refuses a kernel the platform lacks; the `ParallelPlan` records the choice once per run.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec

from ushard.errors import UserError
from ushard.sharding import KV_NAMES, Q_NAMES, TOKEN_NAMES, current_layout, varying, varying_axes

IMPLS = ("auto", "xla", "cudnn", "splash", "flash")
# The kernels that exist on one platform only.
PLATFORMS = {"cudnn": ("gpu", "cuDNN flash attention"), "splash": ("tpu", "Pallas splash attention"),
             "flash": ("gpu", "ushard's flash attention (Pallas)")}
LANES = 128  # splash's key blocks are multiples of the TPU's 128 lanes; flash's forward blocks too
NAMES = {"xla": "XLA attention", "cudnn": "cuDNN flash attention", "splash": "splash attention",
         "flash": "ushard's flash attention (Pallas: Mosaic GPU on Hopper, Triton elsewhere)"}


@dataclass(frozen=True)
class BlockKernel:
    """A fused attention kernel for blocks of equal length, given as its two halves.

    `forward(q, k, v, causal, q_segments, k_segments) -> (out, lse)`: out in q's dtype, lse [B, T,
    heads] float32 (the log-sum-exp of each query's scaled scores); `causal`: query i sees keys 0..i,
    else every key; segment ids [B, T] (None: no document mask) restrict each query to its own
    document's keys. `backward(q, k, v, out, lse, d_out, causal, q_segments, k_segments) -> (dq, dk,
    dv)`: flash attention's backward, where out and lse are the queries' final ones over all blocks,
    so the block's gradients are its exact share of the whole attention's. A query that sees no key
    of a block must get an lse far below any real one (its weight in the merge is then 0).
    Both halves take `window` (keyword, 0: none; module docstring), and raise NotImplementedError for
    one they cannot mask (`windows` says whether they can).
    `segments`: whether it takes segment ids (else it runs only without a document mask). `typed`:
    whether its outputs carry `shard_map`'s varying-axes types (cuDNN's do; a Pallas kernel's do
    not, and the ring's shard_map then skips that check).
    """

    forward: Callable
    backward: Callable
    segments: bool = False
    typed: bool = True
    windows: bool = False


def windowed(window: int) -> dict:
    """The keyword a block kernel's half takes for `window`: none without one, so that kernels written
    before windows existed (the tests' stand-ins) keep working."""
    return {"window": window} if window else {}


def diagonal_only(causal: bool, window: int) -> None:
    """ValueError for a window on a block that is not causal: a block kernel counts the window from
    its diagonal (query i and key i at one position), which only a causal block has."""
    if window and not causal:
        raise ValueError("a block kernel takes a sliding window on causal (diagonal) blocks only")


def typed(blocks: BlockKernel) -> BlockKernel:
    """`blocks` for a shard_map whose types are checked, inside another one's manual axes (a pipeline
    stage's): a kernel's operands brought to one varying-axes type (JAX does not broadcast a kernel's
    operands) and its untyped outputs typed as varying over the axes its inputs vary over."""
    if blocks.typed:
        return blocks

    def call(half, *args, causal, window):
        axes = frozenset().union(*(varying_axes(a) for a in args if a is not None))
        args = varying(args, axes)
        return varying(half(*args[:-2], causal, *args[-2:], **windowed(window)), axes)

    def forward(q, k, v, causal, q_segments, k_segments, window=0):
        return call(blocks.forward, q, k, v, q_segments, k_segments, causal=causal, window=window)

    def backward(q, k, v, out, lse, d_out, causal, q_segments, k_segments, window=0):
        return call(blocks.backward, q, k, v, out, lse, d_out, q_segments, k_segments, causal=causal, window=window)

    return BlockKernel(forward, backward, segments=blocks.segments, typed=True, windows=blocks.windows)


# The kernels whose whole-sequence form takes a sliding window (`whole_sequence`'s `window`).
WINDOWED = ("xla", "cudnn", "splash", "flash")
# q·k head dims at which `auto` prefers cuDNN to ours where both can run: latent attention's 192
# (values 128), where ours (exact) measured slower than cuDNN's own two-width kernels
# (docs/benchmarks.md). Where cuDNN cannot run (pipeline stages, a split sequence with documents)
# ours runs there as at every head dim it fits.
AUTO_SKIPS_FLASH = (192,)


def resolve(impl: str, platform: str, dtype, length: int, in_stage: bool = False, head_dim: int = 128,
            split: bool = False, documents: bool = False, window: int = 0) -> str:
    """The kernel `impl` means on `platform` for `dtype`, sequences of `length` tokens and heads of
    `head_dim`, inside a pipeline stage or not, with the sequence split by context parallelism or not,
    with a document mask or not, with a sliding `window` or not (module docstring)."""
    if impl != "auto":
        return impl
    if platform == "gpu" and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16):
        # Where cuDNN cannot run, ours if it can: far faster than XLA's, whose blocks hold every
        # block's scores (a split 32k sequence with documents asked for 356 GiB; docs/benchmarks.md).
        # With documents ours also beats cuDNN on whole sequences: cuDNN takes the mask as a dense
        # [T, T] array and computes every block, ours skips other documents' blocks. That holds at
        # head dim 256 too, where ours runs on the Triton kernels (measured at Gemma 3 1B's shape,
        # with and without its window). With a sliding window and no documents both skip the
        # blocks outside it, and ours measured faster on the Mosaic GPU kernels' head dims
        # (Hopper); at head dim 256 the Triton kernels trail cuDNN's there (docs/benchmarks.md).
        fits = flash_fits(length, head_dim, window)
        preferred = fits and head_dim not in AUTO_SKIPS_FLASH  # over cuDNN, where both run
        if not in_stage and not split and documents:
            return "flash" if preferred else "cudnn"
        if not in_stage and not split and window:
            from ushard.kernels.flash_hopper import BLOCKS as MOSAIC_HEAD_DIMS

            return "flash" if preferred and head_dim in MOSAIC_HEAD_DIMS else "cudnn"
        if not in_stage and not documents:
            return "cudnn"
        return "flash" if fits else "xla"
    if platform == "tpu" and length % LANES == 0 and (not window or "splash" in WINDOWED):
        return "splash"
    return "xla"


def flash_fits(length: int, head_dim: int, window: int = 0) -> bool:
    """Whether ushard's flash kernel has blocks for this sequence length and q·k head dim (and masks
    this `window`); it takes values of that head dim or narrower (latent attention's 192 / 128 as
    they are on Hopper, `flash.takes_value_widths`)."""
    from ushard.kernels.flash import TUNING

    return length % LANES == 0 and head_dim in TUNING and (not window or "flash" in WINDOWED)


def why(impl: str, resolved: str, platform: str, in_stage: bool = False, split: bool = False,
        documents: bool = False, window: int = 0, head_dim: int = 128) -> str:
    """`resolved` in words, with the reason it runs (the start-up report prints it)."""
    name = NAMES[resolved]
    if impl != "auto":
        return f"{name} (model.attention_impl={impl!r})"
    if window and resolved == "xla" and platform in ("gpu", "tpu"):
        fused = [NAMES[k] for k in WINDOWED if k != "xla" and PLATFORMS[k][0] == platform]
        if not fused:
            return f"{name} (no fused kernel of this platform takes a sliding window yet)"
    if platform == "gpu" and resolved in ("xla", "flash"):
        if in_stage:
            reason = "cuDNN cannot run inside pipeline stages: XLA's GPU compiler crashes on it"
        elif split and documents:
            reason = "cuDNN's blocks of a split sequence take no document mask"
        elif documents:
            reason = "cuDNN computes every block of a document mask, ours skips other documents' blocks"
            if head_dim == 256:
                reason += (" (head dim 256, on ours' Triton kernels: measured faster than cuDNN at Gemma 3 1B's "
                           "attention, with and without its window)")
        elif window and resolved == "flash":
            reason = "a sliding window: ours skips the blocks outside it, measured faster than cuDNN's window"
        else:
            return f"{name} (cuDNN takes 16-bit compute only)"
        if resolved == "xla":
            from ushard.kernels.flash import TUNING

            reason += (f"; ushard's flash needs 16-bit compute, sequences a multiple of {LANES} tokens and head "
                       f"dims of {' or '.join(str(d) for d in sorted(TUNING))}")
        return f"{name} ({reason})"
    if resolved == "xla" and platform == "tpu":
        return f"{name} (splash needs sequences a multiple of {LANES} tokens)"
    return f"{name} (auto on {platform})"


def check(impl: str, platform: str, seq_len: int, pipeline_stages: int = 1) -> None:
    """UserError for a kernel asked for on a platform that lacks it, or a layout it cannot take."""
    if impl not in PLATFORMS:
        return
    if impl == "cudnn" and pipeline_stages > 1:  # whatever the platform: the config cannot run anywhere
        raise UserError(f"model.attention_impl='cudnn' cannot run inside pipeline stages "
                        f"(mesh.pipeline={pipeline_stages}): XLA's GPU compiler crashes on it there; use "
                        f"attention_impl='auto', which runs ushard's flash attention there (XLA's where it cannot).")
    needs, name = PLATFORMS[impl]
    if platform != needs:
        raise UserError(f"model.attention_impl={impl!r} is {name}, which runs on {needs.upper()}s only, and these "
                        f"devices are {platform}; use 'auto' (the best kernel of each platform) or 'xla'.")
    if impl in ("splash", "flash") and seq_len % LANES:
        raise UserError(f"model.attention_impl={impl!r} needs train.seq_len to be a multiple of {LANES} (its "
                        f"blocks' size); it is {seq_len}.")


def block_kernel(impl: str, dtype, length: int, ways: int, documents: bool,
                 window: int = 0) -> tuple[BlockKernel | None, str]:
    """The fused kernel that runs the blocks of a `length`-token sequence split `ways` ways, for the
    resolved `impl`, or None for XLA blocks (`xla_block`); and what runs them, in words (the start-up
    report says it, so a fallback is never silent)."""
    if window and impl != "xla":
        # The ring's fused blocks are called without their tokens' positions (a block of another
        # device's keys is one full block to them), so they cannot place a window in it; XLA's
        # blocks take the positions (`xla_block`), and the ring skips the devices out of reach.
        return None, f"XLA attention ({NAMES[impl]}'s blocks of a split sequence take no sliding window yet)"
    if impl == "cudnn":
        if jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16):
            return None, "XLA attention (cuDNN takes 16-bit inputs only)"
        if documents:
            return None, "XLA attention (cuDNN's blocks take no document mask; model.document_mask=true)"
        from ushard.kernels.cudnn import CUDNN_BLOCKS

        return CUDNN_BLOCKS, "cuDNN flash attention"
    if impl in ("splash", "flash") and (length // (2 * ways)) % LANES:
        return None, (f"XLA attention ({impl} needs each device's two chunks, train.seq_len / {2 * ways}, "
                      f"to be a multiple of {LANES} tokens)")
    if impl == "flash":
        from ushard.kernels.flash import FLASH_BLOCKS

        return FLASH_BLOCKS, NAMES["flash"]
    if impl == "splash":
        from ushard.kernels.splash import splash_blocks

        return splash_blocks(), "splash attention"
    return None, "XLA attention"


def whole_sequence(q, k, v, segment_ids, impl: str, window: int = 0):
    """Causal attention over whole sequences by the resolved kernel `impl` ("xla", "cudnn", "splash",
    "flash"), within a sliding `window` if > 0 (module docstring)."""
    if window < 0:
        raise ValueError(f"attention's window is a number of keys, 0 for none; got {window}.")
    if v.shape[-1] != q.shape[-1]:
        if impl == "xla":  # JAX's attention takes one head size; its XLA form is this einsum anyway
            index = jnp.arange(q.shape[1])[None]
            out, _ = xla_block(q, k, v, index, index, segment_ids, segment_ids, window)
            return out.astype(q.dtype)
        if impl == "cudnn" and segment_ids is None and not _traced_off_the_chip and cudnn_takes_value_widths():
            from ushard.kernels.cudnn import CUDNN_BLOCKS

            return by_halves(CUDNN_BLOCKS, q, k, v, None, window)
        if impl == "flash":
            from ushard.kernels.flash import FLASH_BLOCKS, takes_value_widths

            if takes_value_widths(q, k, v):
                return by_halves(FLASH_BLOCKS, q, k, v, segment_ids, window)
        return values_padded(lambda v: whole_sequence(q, k, v, segment_ids, impl, window), q, v)
    if impl == "cudnn" and _traced_off_the_chip:
        return by_halves(FLASH_SHAPES, q, k, v, segment_ids, window)
    if impl == "splash":
        from ushard.kernels.splash import splash_attention

        return splash_attention(q, k, v, segment_ids, window=window)
    if impl == "flash":
        from ushard.kernels.flash import FLASH_BLOCKS

        return by_halves(FLASH_BLOCKS, q, k, v, segment_ids, window)
    mask = None
    if segment_ids is not None:
        mask = (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]  # [B, 1, T, T]
    # JAX's window (left, right) counts the keys on either side of the query; cuDNN's is the same
    # (pos - w, pos] as ours.
    local = (window - 1, 0) if window else None
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, local_window_size=local,
                                        implementation=impl)


def cudnn_takes_value_widths() -> bool:
    """Whether this process's cuDNN computes values narrower than q·k as they are (latent attention's
    192 / 128): cuDNN 9.10 and later do (JAX's cuDNN module checks the same), through the internal
    forward and backward that `ushard.kernels.cudnn`'s blocks call; JAX's public function takes one
    head size, so before that the values are padded (`values_padded`)."""
    from ushard.kernels.cudnn import cudnn_version

    return cudnn_version() >= 91000


def values_padded(attend, q, v):
    """`attend(v)` for values with fewer dimensions than q·k (latent attention's: DeepSeek-V3's heads
    are 192 in q·k and 128 in values), run on a kernel that takes one head size: v padded with zeros to
    q's size and the output's padding sliced off. Exact, forward and backward: the scores and their
    softmax never see v, the padded columns of the output are zeros, and the gradient of the padding is
    dropped by the slice's transpose. It costs the kernel's value matmuls the padding (half again at
    192 / 128), the price of one contract for every kernel until one takes two head sizes: cuDNN's
    do from 9.10 (`cudnn_takes_value_widths`), on whole sequences without documents, and ours
    (`flash.takes_value_widths`) on whole sequences; a split sequence's blocks are still padded (the
    ring on cuDNN's blocks needs two GPUs to check).
    The one place values are padded (`padded_values`): `whole_sequence` and the blocks of a split
    sequence call it, and a split sequence's expansion (`Expansion`) pads the values it makes."""
    width, size = q.shape[-1], v.shape[-1]
    if size == width:
        return attend(v)
    return attend(padded_values(v, width))[..., :size]


def expansion_padded(expansion, width: int):
    """A split sequence's `Expansion` (ushard/sharding.py) that makes its values padded to `width`
    (`values_padded`, where the values are made: on each device, from what travels)."""
    made = expansion.expand

    def padded(weights, kv):
        k, v = made(weights, kv)
        return k, padded_values(v, width)

    return expansion._replace(expand=padded)


def padded_values(v, width: int):
    """Values [..., size] padded with zeros to `width` (`values_padded`)."""
    size = v.shape[-1]
    if size > width:
        raise NotImplementedError(f"attention kernels take values at most as wide as q·k's heads ({size} > {width})")
    return v if size == width else jnp.pad(v, [(0, 0)] * (v.ndim - 1) + [(0, width - size)])


def by_halves(blocks: BlockKernel, q, k, v, segment_ids, window: int = 0):
    """Causal attention over whole sequences by a fused kernel's forward and backward halves (`blocks`),
    joined by a custom VJP rather than by autodiff through the kernel. Under a layout each half runs in
    a shard_map of its own, each device on its rows and heads (a Pallas kernel is not partitioned by
    XLA). Inside another shard_map, a pipeline stage's, the halves' results are typed as varying over
    its manual axes here: a Pallas kernel's outputs carry no type, and autodiff never transposes an
    untyped map (it lost the stage axis from the gradients' types, docs/dev-notes.md)."""
    layout = current_layout()

    if window and not blocks.windows:
        raise NotImplementedError("this attention kernel takes no sliding window yet")

    def forward(q, k, v, segments):
        return blocks.forward(q, k, v, True, segments, segments, **windowed(window))

    def backward(q, k, v, out, lse, d_out, segments):
        return blocks.backward(q, k, v, out, lse, d_out, True, segments, segments, **windowed(window))

    if layout is not None:
        q_spec, kv_spec, tokens = layout.spec(Q_NAMES), layout.spec(KV_NAMES), layout.spec(TOKEN_NAMES)
        lse_spec = PartitionSpec(*tuple(q_spec)[:3])  # [B, T, heads]
        on_devices = functools.partial(jax.shard_map, mesh=layout.mesh, check_vma=False)
        forward = on_devices(forward, in_specs=(q_spec, kv_spec, kv_spec, tokens), out_specs=(q_spec, lse_spec))
        backward = on_devices(backward, in_specs=(q_spec, kv_spec, kv_spec, q_spec, lse_spec, q_spec, tokens),
                              out_specs=(q_spec, kv_spec, kv_spec))
    stage_axes = tuple(sorted(varying_axes(q) | varying_axes(k) | varying_axes(v)))  # none outside a shard_map

    @jax.custom_vjp
    def attend(q, k, v, segments):
        return attend_forward(q, k, v, segments)[0]

    def attend_forward(q, k, v, segments):
        out, lse = varying(forward(q, k, v, segments), stage_axes)
        # Named, so that a remat policy can keep them (models/stack.py's dots_attention): a Pallas
        # kernel's primitive is no "attention" one, and unnamed they were recomputed in the backward.
        # The memory estimate's stand-in for cuDNN (FLASH_SHAPES) is named too, so its trace keeps
        # what cuDNN's own primitive keeps under that policy: the output and softmax statistics.
        out, lse = checkpoint_name(out, FUSED_ATTENTION), checkpoint_name(lse, FUSED_ATTENTION)
        return out, (q, k, v, segments, out, lse)

    def attend_backward(residuals, d_out):
        q, k, v, segments, out, lse = residuals
        return (*varying(backward(q, k, v, out, lse, d_out, segments), stage_axes), None)

    attend.defvjp(attend_forward, attend_backward)
    return attend(q, k, v, segment_ids)


# The name of a fused kernel's outputs (out, lse) in `by_halves`, for remat policies to keep.
FUSED_ATTENTION = "fused_attention"

# While true, cuDNN attention is traced as `FLASH_SHAPES` (`traced_off_the_chip`).
_traced_off_the_chip = False


@contextlib.contextmanager
def traced_off_the_chip():
    """cuDNN attention cannot be traced without a GPU. Inside this, it is traced as a stand-in with
    flash attention's shapes: XLA blocks forward, a backward that is never run, and the residuals a
    flash kernel keeps (queries, keys, values, output, log-sum-exp). For the planner's memory
    estimate of a GPU cluster laid out on simulated CPU devices; never for a step that runs."""
    global _traced_off_the_chip
    before, _traced_off_the_chip = _traced_off_the_chip, True
    try:
        yield
    finally:
        _traced_off_the_chip = before


def _flash_shapes_forward(q, k, v, causal, q_segments, k_segments, window=0):
    diagonal_only(causal, window)
    length = jnp.arange(q.shape[1])[None]
    out, lse = xla_block(q, k, v, length, length if causal else jnp.zeros_like(length), q_segments, k_segments,
                         window)
    return out.astype(q.dtype), lse


def _flash_shapes_backward(q, k, v, out, lse, d_out, causal, q_segments, k_segments, window=0):
    return jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v)


FLASH_SHAPES = BlockKernel(_flash_shapes_forward, _flash_shapes_backward, segments=True, windows=True)


def xla_block(q, k, v, q_index, k_index, q_segments, k_segments, window: int = 0):
    """Queries q [B, Tq, heads, hd] over keys [B, Tk, kv_heads, hd] and values [B, Tk, kv_heads, vd]
    from anywhere in the sequence: (out [B, Tq, heads, vd], lse [B, Tq, heads]), both float32, lse the
    log-sum-exp of each query's visible scores. Differentiable in both outputs (the ring's XLA path differentiates lse).

    A query sees a key whose index in the unsplit row (`q_index` [1, Tq], `k_index` [1, Tk]) is not
    after its own, with a `window` w > 0 fewer than w before it, and, unless the segments are None,
    whose segment id ([B, Tq], [B, Tk]) is its own. A
    query that sees no key here gets out = 0 and lse = -inf, so combining blocks ignores it.
    """
    b, tq, h, hd = q.shape
    kv_heads = k.shape[2]
    grouped = q.reshape(b, tq, kv_heads, h // kv_heads, hd)
    scores = jnp.einsum("bqkgd,bskd->bkgqs", grouped, k, preferred_element_type=jnp.float32) / math.sqrt(hd)
    visible = q_index[:, :, None] >= k_index[:, None, :]
    if window:
        visible = visible & (q_index[:, :, None] - k_index[:, None, :] < window)
    if q_segments is not None:
        visible = visible & (q_segments[:, :, None] == k_segments[:, None, :])
    scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
    # The max only keeps exp() in range; it cancels out of lse, so no gradient flows through it.
    peak = jax.lax.stop_gradient(jnp.max(scores, axis=-1, keepdims=True))
    peak = jnp.where(jnp.isfinite(peak), peak, 0.0)
    weights = jnp.exp(scores - peak)
    total = jnp.sum(weights, axis=-1)
    seen = total > 0
    total = jnp.where(seen, total, 1.0)  # rows that see nothing: out 0, and no log(0) in the gradient
    out = jnp.einsum("bkgqs,bskd->bqkgd", weights.astype(v.dtype), v, preferred_element_type=jnp.float32)
    out = out / jnp.moveaxis(total, -1, 1)[..., None]
    lse = jnp.where(seen, peak[..., 0] + jnp.log(total), -jnp.inf)
    return out.reshape(b, tq, h, v.shape[-1]), jnp.moveaxis(lse, -1, 1).reshape(b, tq, h)
