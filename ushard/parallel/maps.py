"""Maps inside maps: what lets context parallelism and the experts' all-to-all run inside pipeline stages.

A pipeline stage is a `jax.shard_map` manual over the stage axis; ring/all-gather attention and the
routed experts are maps of their own, nested in it. Differentiating a nested map works, except for
one step of JAX's partial evaluation (JAX 0.10.2, still in 0.11): when a map is split into a part
that can run early and a part that cannot (`lax.scan` hoists a layer's loop-invariant work out of
the loop this way), the values handed from one part to the other are laid out over every mesh axis
they vary over, the enclosing map's manual axes included. XLA's partitioner refuses that layout
("manual axes come before free axes ... Saw manual axis 'data' after free axis 'pipeline'").

`nested_maps()` lays those values out over the inner map's own axes only: the layout JAX already
uses when `check_vma` is off, and the one a value inside the inner map has. It changes JAX while a
step is traced and puts it back after, so importing ushard changes nothing in JAX. JAX's own code
carries a TODO at this spot (`ShapedArray.nospec`); remove this module when it is resolved.
"""

from __future__ import annotations

import contextlib
import threading

from jax.sharding import PartitionSpec

_LOCK = threading.RLock()


def _inner_axes_only(original):
    def nospec(self, mesh, check_vma, all_names):
        spec = original(self, mesh, check_vma, all_names)
        if not check_vma or not len(spec) or spec[0] is None:
            return spec
        names = spec[0] if isinstance(spec[0], tuple) else (spec[0],)
        kept = tuple(name for name in names if name in all_names)  # the map's own, newly manual axes
        return PartitionSpec(kept or None, unreduced=spec.unreduced, reduced=spec.reduced)

    return nospec


@contextlib.contextmanager
def nested_maps(active: bool = True):
    """While the block runs (a step is traced), maps nested in maps differentiate into layouts XLA
    accepts (module docstring). `active=False`: a no-op, for programs without nested maps."""
    if not active:
        yield
        return
    from jax._src import core  # the one internal this module touches

    with _LOCK:
        original = core.ShapedArray.nospec
        core.ShapedArray.nospec = _inner_axes_only(original)
        try:
            yield
        finally:
            core.ShapedArray.nospec = original
