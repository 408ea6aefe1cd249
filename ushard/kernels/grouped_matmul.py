"""Grouped matmul: rows sorted by group, each group times its own weight matrix (the routed experts' matmul).

Contract: `grouped_matmul(x, w, group_sizes, impl)` with x [rows, k] sorted by group, w [groups, k, n]
and group_sizes int32 [groups] (group g owns the next group_sizes[g] rows; rows past the last group
give zeros, and no gradient) returns [rows, n] in x's dtype, differentiable in x and w. Groups may be
empty, and the rows need not fill a kernel's blocks (the padding happens here).

Implementations (`model.grouped_matmul_impl`; `resolve` picks for "auto", `why` says why):
- "xla": `jax.lax.ragged_dot`, every platform, differentiated by JAX. On GPUs XLA lowers it to a loop
  over groups far below a dense matmul's speed (measured in docs/benchmarks.md).
- "mosaic_gpu": the Pallas Mosaic-GPU kernels JAX ships for Hopper (sm_90) GPUs: `ragged_dot_mgpu`
  for the forward pass and, with the weights transposed, the rows' gradient; `transposed_ragged_dot_mgpu`
  for the weights' gradient (per group xᵀ · dy). Block sizes come from `MOSAIC_BLOCKS` by shape class.
Both run under one custom VJP (`_with_vjp`, which JAX's Mosaic-GPU kernels lack), as do the Pallas
TPU kernels JAX ships (megablox's gmm and tgmm, `megablox_kernels`, tested in Pallas's interpreter).
Those are not offered to configs yet: inside the model's `shard_map`s megablox's group metadata mixes
a constant with the per-device group sizes in one `concatenate`, which JAX's type check refuses
(JAX 0.10.2; docs/dev-notes.md), so TPUs run "xla".
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax._src import config as jax_config

from ushard.errors import UserError
from ushard.sharding import varying, varying_axes

IMPLS = ("auto", "xla", "mosaic_gpu")
NAMES = {"xla": "XLA's ragged_dot", "mosaic_gpu": "Pallas Mosaic-GPU grouped matmul"}
PLATFORMS = {"mosaic_gpu": "gpu"}
# The feature sizes (k and n) the Pallas kernels take: multiples of their column blocks.
FEATURE_MULTIPLE = 128


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
    return "xla"


def why(impl: str, resolved: str, platform: str, features: tuple[int, ...]) -> str:
    """`resolved` in words, with the reason it runs (the start-up report prints it)."""
    name = NAMES[resolved]
    if impl != "auto":
        return f"{name} (model.grouped_matmul_impl={impl!r})"
    if resolved == "xla" and platform == "gpu":
        if not _fits(features):
            return f"{name} (the Pallas kernels take feature sizes that are multiples of {FEATURE_MULTIPLE})"
        return f"{name} (the Mosaic-GPU kernel runs on Hopper GPUs in 16-bit compute only)"
    if resolved == "xla" and platform == "tpu":
        return f"{name} (megablox does not yet type-check inside the model's shard_maps)"
    return f"{name} (auto on {platform})"


def check(impl: str, platform: str, features: tuple[int, ...]) -> None:
    """UserError for a kernel asked for on a platform that lacks it, or sizes it cannot take."""
    if impl not in PLATFORMS:
        return
    if platform != PLATFORMS[impl]:
        raise UserError(f"model.grouped_matmul_impl={impl!r} is {NAMES[impl]}, which runs on "
                        f"{PLATFORMS[impl].upper()}s only, and these devices are {platform}; use 'auto' or 'xla'.")
    if not _fits(features):
        raise UserError(f"model.grouped_matmul_impl={impl!r} needs model.d_model and the experts' d_ff to be "
                        f"multiples of {FEATURE_MULTIPLE} (its column blocks); they are {features}.")


def _fits(features: tuple[int, ...]) -> bool:
    return all(f % FEATURE_MULTIPLE == 0 for f in features)


def _hopper(device_kind: str) -> bool:
    return any(name in device_kind for name in ("H100", "H200", "H800", "H20", "GH200"))


def grouped_matmul(x, w, group_sizes, impl: str = "xla"):
    """x [rows, k] (sorted by group) @ w[group] for each row's group -> [rows, n] (module docstring),
    by the resolved implementation `impl`."""
    if impl == "xla":
        return jax.lax.ragged_dot(x, w, group_sizes)
    if impl == "mosaic_gpu":
        return pallas_grouped_matmul(_MOSAIC, x, w, group_sizes)
    raise ValueError(f"grouped matmul implementation {impl!r} is not one of {IMPLS[1:]}")


def pallas_grouped_matmul(kernels: "GroupedKernels", x, w, group_sizes):
    """The contract on Pallas `kernels`, under the shared custom VJP."""
    # Operands typed alike, as JAX's own ops broadcast them (inside a `shard_map`), so that each
    # gradient the VJP returns has its operand's type.
    x, w, group_sizes = varying((x, w, group_sizes), _varying_over(x, w, group_sizes))
    return _with_vjp(kernels, x, w, group_sizes)


def _varying_over(*arrays) -> frozenset:
    """The manual axes any of `arrays` is typed as varying over."""
    return frozenset().union(*(varying_axes(a) for a in arrays))


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


def _rows_in_groups(rows: int, group_sizes):
    """[rows, 1] bool: whether each row belongs to a group."""
    return (jnp.arange(rows) < jnp.sum(group_sizes))[:, None]


def _masked(y, group_sizes):
    return jnp.where(_rows_in_groups(y.shape[0], group_sizes), y, jnp.zeros((), y.dtype))


def _padded(x, multiple: int):
    extra = -x.shape[0] % multiple
    return jnp.pad(x, ((0, extra), (0, 0))) if extra else x


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _with_vjp(kernels: GroupedKernels, x, w, group_sizes):
    return _forward(kernels, x, w, group_sizes)[0]


def _kernel_call(fn, *args):
    """`fn(*args)` (a Pallas kernel) with `shard_map`'s type check off while it is traced, its output
    then typed as varying over the axes its operands vary over. JAX's own kernels give their output
    shapes no manual-axis types: JAX 0.10's `pallas_call` refuses that inside a map that checks them,
    and autodiff refuses the untyped outputs."""
    check = getattr(jax_config, "_check_vma", None)
    with check(False) if check is not None else contextlib.nullcontext():
        out = fn(*args)
    return varying(out, _varying_over(*args))


def _forward(kernels, x, w, group_sizes):
    rows = x.shape[0]
    y = _kernel_call(kernels.forward, _padded(x, kernels.row_multiple), w, group_sizes)[:rows]
    return _masked(y, group_sizes), (x, w, group_sizes)


def _backward(kernels, residuals, d_y):
    x, w, group_sizes = residuals
    rows, pad = x.shape[0], functools.partial(_padded, multiple=kernels.row_multiple)
    # Rows past the groups gave zeros whatever their input: they pass no gradient, and their inputs
    # (a buffer's unused rows, anything) must not reach the weights' gradient.
    d_y = pad(_masked(d_y.astype(x.dtype), group_sizes))
    d_x = _masked(_kernel_call(kernels.rows_grad, d_y, w, group_sizes)[:rows], group_sizes)
    d_w = _kernel_call(kernels.weights_grad, pad(_masked(x, group_sizes)), d_y, group_sizes)
    return d_x, d_w.astype(w.dtype), None


_with_vjp.defvjp(_forward, _backward)


# --------------------------------------------------------------------------- Mosaic GPU (Hopper)


def _mosaic_module(name: str):
    return importlib.import_module(f"jax.experimental.pallas.ops.gpu.{name}")


def _mosaic_forward(x, w, group_sizes, transpose_rhs: bool = False):
    blocks = MOSAIC_BLOCKS[("rows_grad" if transpose_rhs else "forward", shape_class(w.shape[0]))]
    return _mosaic_module("ragged_dot_mgpu").ragged_dot(x, w, group_sizes=group_sizes, transpose_rhs=transpose_rhs,
                                                         **blocks.kwargs())


def _mosaic_weights_grad(x, d_y, group_sizes):
    blocks = MOSAIC_BLOCKS[("weights", shape_class(group_sizes.shape[0]))]
    return _mosaic_module("transposed_ragged_dot_mgpu").transposed_ragged_dot(x, d_y, group_sizes=group_sizes,
                                                                             **blocks.kwargs())


_MOSAIC = GroupedKernels(
    forward=_mosaic_forward,
    rows_grad=functools.partial(_mosaic_forward, transpose_rhs=True),
    weights_grad=_mosaic_weights_grad,
)


# --------------------------------------------------------------------------- megablox (TPU)

MEGABLOX_TILING = (512, 1024, 1024)  # rows, k, n: megablox's tiles (clipped to the operands' sizes)


def _megablox_module():
    return importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")


def _tiling(m: int, k: int, n: int) -> tuple[int, int, int]:
    rows, depth, cols = MEGABLOX_TILING
    return (min(rows, m), _largest_divisor_tile(k, depth), _largest_divisor_tile(n, cols))


def _largest_divisor_tile(size: int, cap: int) -> int:
    """The largest multiple of 128 up to `cap` that divides `size` (a multiple of 128)."""
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
                          row_multiple=MEGABLOX_TILING[0])
