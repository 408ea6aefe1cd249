"""Grouped matmul: rows sorted by group, each group times its own weight matrix (the routed experts' matmul).

Contract: `grouped_matmul(x, w, group_sizes, impl)` with x [rows, k] sorted by group, w [groups, k, n]
and group_sizes int32 [groups] (group g owns the next group_sizes[g] rows; rows past the last group
give zeros, and no gradient) returns [rows, n] in x's dtype, differentiable in x and w. Groups may be
empty, and neither the rows nor the feature sizes k and n need fill a kernel's blocks (the padding
happens here: zero columns of x and zero rows and columns of w change no product).

Implementations (`model.grouped_matmul_impl`; `resolve` picks for "auto", `why` says why):
- "xla": `jax.lax.ragged_dot`, every platform, differentiated by JAX. On GPUs XLA lowers it to a loop
  over groups far below a dense matmul's speed (measured in docs/benchmarks.md).
- "mosaic_gpu": the Pallas Mosaic-GPU kernels JAX ships for Hopper (sm_90) GPUs: `ragged_dot_mgpu`
  for the forward pass and, with the weights transposed, the rows' gradient; `transposed_ragged_dot_mgpu`
  for the weights' gradient (per group xᵀ · dy). Block sizes come from `MOSAIC_BLOCKS` by shape class.
- "megablox": the Pallas TPU kernels JAX ships (megablox's gmm, and tgmm for the weights' gradient),
  tiles from `MEGABLOX_TILING` (tested on CPU in Pallas's interpreter, `megablox_kernels`).
The Pallas kernels run under one custom VJP (`_with_vjp`, which JAX's kernels lack), each product
sealed as one operation for `shard_map`'s type check (ushard/kernels/sealed.py).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from ushard.errors import UserError
from ushard.kernels import sealed
from ushard.sharding import varying_alike

IMPLS = ("auto", "xla", "mosaic_gpu", "megablox")
NAMES = {"xla": "XLA's ragged_dot", "mosaic_gpu": "Pallas Mosaic-GPU grouped matmul",
         "megablox": "Pallas megablox grouped matmul"}
PLATFORMS = {"mosaic_gpu": "gpu", "megablox": "tpu"}
# The feature sizes (k and n) the Pallas kernels take: multiples of their column blocks. Others are
# padded with zeros up to one (`_padded_features`); `auto` picks a kernel only where that adds at most
# `MAX_FEATURE_PADDING` of the work (a tenth for an expert 704 wide, as bench_moe's split four ways).
FEATURE_MULTIPLE = 128
MAX_FEATURE_PADDING = 0.25


@dataclass(frozen=True)
class MosaicBlocks:
    """One Mosaic-GPU kernel call's tiling: rows (block_m) x columns (block_n), block_k deep, with
    `steps` loads in flight and `grid_block_n` column blocks visited together (L2 reuse)."""

    block_m: int
    block_n: int
    block_k: int
    steps: int
    grid_block_n: int

    def kwargs(self) -> dict:
        return dict(block_m=self.block_m, block_n=self.block_n, block_k=self.block_k,
                    max_concurrent_steps=self.steps, grid_block_n=self.grid_block_n)


# Per product, by shape class: few groups with wide outputs (bench_moe's 8 experts) and many groups
# with narrow ones (DeepSeek-style fine-grained experts). The best of a sweep on an H200
# (tools/grouped_matmul_bench.py --sweep; the figures are in docs/benchmarks.md).
MOSAIC_BLOCKS = {
    ("forward", "few"): MosaicBlocks(192, 128, 64, 4, 4),
    ("rows_grad", "few"): MosaicBlocks(192, 128, 64, 4, 4),
    ("weights", "few"): MosaicBlocks(128, 128, 64, 4, 4),
    ("forward", "many"): MosaicBlocks(128, 128, 64, 5, 4),
    ("rows_grad", "many"): MosaicBlocks(128, 128, 64, 5, 8),
    ("weights", "many"): MosaicBlocks(128, 128, 64, 5, 8),
}
MANY_GROUPS = 32


def shape_class(groups: int) -> str:
    return "many" if groups >= MANY_GROUPS else "few"


def resolve(impl: str, platform: str, dtype, features: tuple[int, ...], device_kind: str = "") -> str:
    """The implementation `impl` means on `platform` (`device_kind`, e.g. "NVIDIA H100 80GB HBM3") for
    `dtype` and the matmuls' feature sizes (`features`: the experts' d_model and d_ff)."""
    if impl != "auto":
        return impl
    sixteen_bit = jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16)
    if platform == "gpu" and _hopper(device_kind) and sixteen_bit and _fits(features):
        return "mosaic_gpu"
    if platform == "tpu" and _fits(features):
        return "megablox"
    return "xla"


def why(impl: str, resolved: str, platform: str, features: tuple[int, ...]) -> str:
    """`resolved` in words, with the reason it runs (the start-up report prints it)."""
    name = NAMES[resolved]
    if impl != "auto":
        return f"{name} (model.grouped_matmul_impl={impl!r})"
    if resolved == "xla" and platform in ("gpu", "tpu"):
        if not _fits(features):
            return (f"{name} (the Pallas kernels take feature sizes that are multiples of {FEATURE_MULTIPLE}: "
                    f"padding {features} to them would add more than {MAX_FEATURE_PADDING:.0%} of the work)")
        if platform == "gpu":
            return f"{name} (the Mosaic-GPU kernel runs on Hopper GPUs in 16-bit compute only)"
    return f"{name} (auto on {platform})"


def check(impl: str, platform: str) -> None:
    """UserError for a kernel asked for on a platform that lacks it (any feature sizes are padded)."""
    if impl not in PLATFORMS:
        return
    if platform != PLATFORMS[impl]:
        raise UserError(f"model.grouped_matmul_impl={impl!r} is {NAMES[impl]}, which runs on "
                        f"{PLATFORMS[impl].upper()}s only, and these devices are {platform}; use 'auto' or 'xla'.")


def _fits(features: tuple[int, ...]) -> bool:
    """Whether padding `features` to the kernels' multiples adds at most MAX_FEATURE_PADDING of the work."""
    return padding_growth(features) <= 1 + MAX_FEATURE_PADDING


def padding_growth(features: tuple[int, ...]) -> float:
    """How many times the work a grouped matmul of these feature sizes (k, n) does once the Pallas
    kernels run it padded to their multiple (`_padded_features`): 1 where nothing is padded."""
    grown = 1.0
    for f in features:
        grown *= _round_up(f, FEATURE_MULTIPLE) / f
    return grown


def _round_up(size: int, multiple: int) -> int:
    return -(-size // multiple) * multiple


def _hopper(device_kind: str) -> bool:
    return any(name in device_kind for name in ("H100", "H200", "H800", "H20", "GH200"))


def grouped_matmul(x, w, group_sizes, impl: str = "xla", row_buckets: int = 1):
    """x [rows, k] (sorted by group) @ w[group] for each row's group -> [rows, n] (module docstring),
    by the resolved implementation `impl`. `row_buckets` > 1: the groups may fill far fewer rows than
    x has (a receive buffer), and the Pallas kernels run on the fewest of `row_buckets` evenly spaced
    row counts that holds them (`_on_rows_in_use`), unless they skip idle row blocks themselves
    (`GroupedKernels.skips_idle_rows`: the Mosaic-GPU kernels)."""
    if impl == "xla":
        return jax.lax.ragged_dot(x, w, group_sizes)
    if impl in KERNELS:
        return pallas_grouped_matmul(KERNELS[impl], x, w, group_sizes, row_buckets)
    raise ValueError(f"grouped matmul implementation {impl!r} is not one of {IMPLS[1:]}")


def pallas_grouped_matmul(kernels: "GroupedKernels", x, w, group_sizes, row_buckets: int = 1):
    """The contract on Pallas `kernels`, under the shared custom VJP, on feature sizes padded to the
    kernels' multiple (outside the VJP: autodiff slices the padding's gradients off)."""
    # Operands typed alike, as JAX's own ops broadcast them (inside a `shard_map`), so that each
    # gradient the VJP returns has its operand's type.
    x, w, group_sizes = varying_alike(x, w, group_sizes)
    n = w.shape[2]
    x, w = _padded_features(x, w, kernels.feature_multiple)
    y = _with_vjp(kernels, 1 if kernels.skips_idle_rows() else row_buckets, x, w, group_sizes)
    return y[:, :n] if y.shape[1] != n else y


def _padded_features(x, w, multiple: int):
    """x [m, k] and w [g, k, n] with k and n padded with zeros to multiples of `multiple`."""
    k, n = w.shape[1:]
    more_k, more_n = _round_up(k, multiple) - k, _round_up(n, multiple) - n
    if more_k:
        x = jnp.pad(x, ((0, 0), (0, more_k)))
    if more_k or more_n:
        w = jnp.pad(w, ((0, 0), (0, more_k), (0, more_n)))
    return x, w


@dataclass(frozen=True)
class GroupedKernels:
    """The three products a grouped matmul and its gradient need, on rows padded to `row_multiple`:
    `forward(x [m, k], w [g, k, n], sizes) -> [m, n]`, `rows_grad(dy [m, n], w [g, k, n], sizes) ->
    [m, k]` (dy · wᵀ per group) and `weights_grad(x [m, k], dy [m, n], sizes) -> [g, k, n]` (xᵀ · dy
    per group). Rows past the groups may come out as anything: `_with_vjp` masks them."""

    forward: Callable
    rows_grad: Callable
    weights_grad: Callable
    row_multiple: int = 1
    feature_multiple: int = 1  # k and n reach the kernels padded to multiples of this
    # Whether `forward` and `rows_grad` cost nothing on row blocks past the groups (as
    # `weights_grad`'s kernels do): then the row buckets are not needed, and one compile serves.
    skips_idle_rows: Callable[[], bool] = lambda: False


def _rows_in_groups(rows: int, group_sizes):
    """[rows, 1] bool: whether each row belongs to a group."""
    return (jnp.arange(rows) < jnp.sum(group_sizes))[:, None]


def _masked(y, group_sizes):
    return jnp.where(_rows_in_groups(y.shape[0], group_sizes), y, jnp.zeros((), y.dtype))


def _fit(a, rows: int):
    """a's first `rows` rows, zeros added where it has fewer."""
    if a.shape[0] >= rows:
        return a[:rows]
    return jnp.pad(a, ((0, rows - a.shape[0]), *((0, 0),) * (a.ndim - 1)))


def _row_cuts(rows: int, buckets: int, multiple: int) -> list[int]:
    """`buckets` evenly spaced row counts up to `rows`, each a whole number of `multiple`s."""
    return sorted({_round_up(-(-rows * i // buckets), multiple) for i in range(1, buckets + 1)})


def _on_rows_in_use(run, row_operands, group_sizes, buckets: int, multiple: int):
    """`run(*row_operands)` on their first rows only: the smallest of `_row_cuts` that holds every row
    in a group. A ragged receive buffer's rows past its groups are idle, and a kernel computes every
    block of the rows it is given; `buckets` > 1 (compiled once each, one picked per call) spares
    most of that. `run`'s result has the same shape whatever the cut."""
    cuts = _row_cuts(row_operands[0].shape[0], buckets, multiple)
    branches = [lambda *operands, cut=cut: run(*(_fit(a, cut) for a in operands)) for cut in cuts]
    if len(branches) == 1:
        return branches[0](*row_operands)
    which = jnp.searchsorted(jnp.asarray(cuts, jnp.int32), jnp.sum(group_sizes))
    return jax.lax.switch(which, branches, *row_operands)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _with_vjp(kernels: GroupedKernels, buckets: int, x, w, group_sizes):
    return _forward(kernels, buckets, x, w, group_sizes)[0]


def _forward(kernels, buckets, x, w, group_sizes):
    rows = x.shape[0]

    def forward(x_cut):
        return _fit(sealed.call(kernels.forward, x_cut, w, group_sizes), rows)

    y = _on_rows_in_use(forward, (x,), group_sizes, buckets, kernels.row_multiple)
    return _masked(y, group_sizes), (x, w, group_sizes)


def _backward(kernels, buckets, residuals, d_y):
    x, w, group_sizes = residuals
    rows = x.shape[0]
    in_use = functools.partial(_on_rows_in_use, group_sizes=group_sizes, buckets=buckets,
                               multiple=kernels.row_multiple)
    # Rows past the groups gave zeros whatever their input: they pass no gradient, and their inputs
    # (a buffer's unused rows, anything) must not reach the weights' gradient.
    d_y = _masked(d_y.astype(x.dtype), group_sizes)

    def rows_grad(d_y_cut):
        return _fit(sealed.call(kernels.rows_grad, d_y_cut, w, group_sizes), rows)

    def weights_grad(x_cut, d_y_cut):
        return sealed.call(kernels.weights_grad, x_cut, d_y_cut, group_sizes)

    d_x = _masked(in_use(rows_grad, (d_y,)), group_sizes)
    d_w = in_use(weights_grad, (_masked(x, group_sizes), d_y))
    return d_x, d_w.astype(w.dtype), None


_with_vjp.defvjp(_forward, _backward)


# --------------------------------------------------------------------------- Mosaic GPU (Hopper)


def _mosaic_module(name: str):
    return importlib.import_module(f"jax.experimental.pallas.ops.gpu.{name}")


# JAX's `ragged_dot_mgpu` visits a fixed grid of row blocks (the rows it is given, plus one per group
# boundary) and runs the whole K loop in every one, also in the blocks past the groups that store
# nothing. In a ragged receive buffer most of those are idle (ushard/parallel/expert.py sizes it for
# `dispatch_headroom` times an even load). `_skip_idle_blocks` is the same kernel with each block's work
# under `pl.when(rows in the block > 0)`: the work follows the rows in use, with one compile, where
# row buckets (`_on_rows_in_use`) need a compile per bucket and still round up to a bucket.
_IDLE_ANCHOR = "group_info = GroupInfo.create("


def _skip_idle_source(module) -> str | None:
    """`module`'s source (JAX's ragged_dot_mgpu) with its block body under `pl.when(group_info.actual_size
    > 0)`; None where the source does not have the expected shape."""
    import inspect

    try:
        lines = inspect.getsource(module).splitlines()
    except (OSError, TypeError):
        return None
    at = [i for i, line in enumerate(lines) if _IDLE_ANCHOR in line]
    if len(at) != 1:
        return None
    i = at[0]
    indent = lines[i][:len(lines[i]) - len(lines[i].lstrip())]
    end = i + 1
    while end < len(lines) and (not lines[end].strip() or lines[end].startswith(indent)):
        end += 1
    body = ["  " + line if line.strip() else line for line in lines[i + 1:end]]
    guard = [f"{indent}@pl.when(group_info.actual_size > 0)", f"{indent}def _rows_in_block():"]
    return "\n".join(lines[:i + 1] + guard + body + lines[end:]) + "\n"


def _skip_idle_blocks(module):
    """`_skip_idle_source`'s kernel as a new module; None where it does not apply."""
    import types

    source = _skip_idle_source(module)
    if source is None:
        return None
    patched = types.ModuleType(module.__name__ + "_skip_idle")
    patched.__file__ = getattr(module, "__file__", None)
    try:
        exec(compile(source, f"<{patched.__name__}>", "exec"), patched.__dict__)  # noqa: S102
    except Exception:  # noqa: BLE001  (another JAX's source: keep its kernel as it is)
        return None
    return patched if callable(getattr(patched, "ragged_dot", None)) else None


@functools.cache
def _mosaic_ragged_dot():
    """(ragged_dot, whether it skips idle row blocks): `_skip_idle_blocks`'s kernel where it applies,
    else JAX's own."""
    module = _mosaic_module("ragged_dot_mgpu")
    patched = _skip_idle_blocks(module)
    return (patched.ragged_dot, True) if patched is not None else (module.ragged_dot, False)


def _mosaic_forward(x, w, group_sizes, transpose_rhs: bool = False):
    blocks = MOSAIC_BLOCKS[("rows_grad" if transpose_rhs else "forward", shape_class(w.shape[0]))]
    ragged_dot = _mosaic_ragged_dot()[0]
    return ragged_dot(x, w, group_sizes=group_sizes, transpose_rhs=transpose_rhs, **blocks.kwargs())


def _mosaic_weights_grad(x, d_y, group_sizes):
    blocks = MOSAIC_BLOCKS[("weights", shape_class(group_sizes.shape[0]))]
    return _mosaic_module("transposed_ragged_dot_mgpu").transposed_ragged_dot(x, d_y, group_sizes=group_sizes,
                                                                             **blocks.kwargs())


_MOSAIC = GroupedKernels(
    forward=_mosaic_forward,
    rows_grad=functools.partial(_mosaic_forward, transpose_rhs=True),
    weights_grad=_mosaic_weights_grad,
    feature_multiple=FEATURE_MULTIPLE,
    skips_idle_rows=lambda: _mosaic_ragged_dot()[1],
)


# --------------------------------------------------------------------------- megablox (TPU)

MEGABLOX_TILING = (512, 1024, 1024)  # rows, k, n: megablox's tiles (clipped to the operands' sizes)


def _megablox_module():
    return importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")


def _tiling(m: int, k: int, n: int) -> tuple[int, int, int]:
    rows, depth, cols = MEGABLOX_TILING
    return (min(rows, m), _largest_divisor_tile(k, depth), _largest_divisor_tile(n, cols))


def _largest_divisor_tile(size: int, cap: int) -> int:
    """The largest multiple of 128 up to `cap` that divides `size`; a size that is no multiple of 128
    (only tests' small models reach the kernels with one) is one whole tile."""
    if size % FEATURE_MULTIPLE:
        return size
    return max(t for t in range(FEATURE_MULTIPLE, min(cap, size) + 1, FEATURE_MULTIPLE) if size % t == 0)


def megablox_kernels(interpret: bool = False) -> GroupedKernels:
    """The megablox kernels under the contract; `interpret`: Pallas's interpreter (tests on CPU)."""

    def forward(x, w, group_sizes, transpose_rhs=False):
        k, n = (w.shape[2], w.shape[1]) if transpose_rhs else w.shape[1:]
        tiling = _tiling(x.shape[0], k, n)
        return _megablox_module().gmm(x, w, group_sizes, preferred_element_type=x.dtype, tiling=tiling,
                                      transpose_rhs=transpose_rhs, interpret=interpret)

    def weights_grad(x, d_y, group_sizes):
        tiling = _tiling(x.shape[0], x.shape[1], d_y.shape[1])
        return _megablox_module().tgmm(x.T, d_y, group_sizes, preferred_element_type=x.dtype, tiling=tiling,
                                       num_actual_groups=group_sizes.shape[0], interpret=interpret)

    return GroupedKernels(forward, functools.partial(forward, transpose_rhs=True), weights_grad,
                          row_multiple=MEGABLOX_TILING[0], feature_multiple=FEATURE_MULTIPLE)


# The Pallas kernels by implementation name (tests swap in megablox under Pallas's interpreter).
KERNELS = {"mosaic_gpu": _MOSAIC, "megablox": megablox_kernels()}
