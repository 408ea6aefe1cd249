"""A Pallas kernel sealed as one primitive, so that `shard_map`'s type check sees only its operands and
its result.

`call(fn, *args)` runs `fn(*args)` (a Pallas kernel and the XLA ops around it, such as megablox's group
metadata) as one `ushard_sealed_kernel` operation whose result is typed as varying over every manual
axis any operand varies over. `fn` is traced only to find its output shape and when the operation is
lowered, both with the type check off and on operands stripped of their manual-axis types.

Why: JAX's Pallas kernels give their outputs no manual-axis type, which a checking `shard_map` refuses
(JAX 0.10: "manual_axis_type ... must not be None"); and megablox's metadata concatenates constants
with the per-device group sizes, which the check refuses too. Turning the check off while the kernel
is traced is not enough: `jax.checkpoint` and `jax.jit`'s partial evaluation re-trace the recorded
operations later, outside any such context, and the check runs again (docs/dev-notes.md). Sealed, the
inner operations are never recorded in the model's program until it is lowered.

Not differentiable: callers wrap it in a custom VJP (ushard/kernels/grouped_matmul.py). Under
`jax.vmap` (the pipeline's per-group maps) it runs once per batch element.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax._src import config as jax_config
from jax._src import core
from jax._src.interpreters import batching, mlir

from ushard.sharding import varying_alike

sealed_kernel_p = core.Primitive("ushard_sealed_kernel")


def call(fn, *args):
    """`fn(*args)` (one array out) as one sealed operation; hashable `fn` (a function or partial of one)."""
    # Operands typed alike, so that the first one's type carries the result's manual axes.
    return sealed_kernel_p.bind(*varying_alike(*args), fn=fn)


def _unchecked():
    return jax_config._check_vma(False)


def _plain(avals):
    """The avals without manual-axis types or shardings: as the kernel sees its operands."""
    return [core.ShapedArray(a.shape, a.dtype) for a in avals]


def _abstract_eval(*avals, fn):
    with _unchecked():
        out = jax.eval_shape(fn, *(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals))
    return avals[0].update(shape=out.shape, dtype=out.dtype, weak_type=False, sharding=core.get_cur_mesh_sharding())


def _lowering(ctx, *args, fn):
    with _unchecked():
        ctx = ctx.replace(avals_in=_plain(ctx.avals_in), avals_out=_plain(ctx.avals_out))
        return mlir.lower_fun(fn, multiple_results=False)(ctx, *args)


def _batched(args, dims, fn):
    """One call per batch element (a pipeline's per-group map has one element per device); operands
    without a batch dimension (`dims` None) go to every call whole."""
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    moved = [a if d is None else jnp.moveaxis(a, d, 0) for a, d in zip(args, dims)]
    outs = [call(fn, *(a if d is None else a[i] for a, d in zip(moved, dims))) for i in range(size)]
    return jnp.stack(outs), 0


sealed_kernel_p.def_impl(lambda *args, fn: fn(*args))  # outside any trace: the kernel as it is
sealed_kernel_p.def_abstract_eval(_abstract_eval)
mlir.register_lowering(sealed_kernel_p, _lowering)
batching.primitive_batchers[sealed_kernel_p] = _batched
