"""Muon: momentum orthogonalised by a Newton-Schulz iteration, matrix by matrix.

Which dimensions of a parameter form its matrix is read from its logical axis names (the model's
convention: `x @ W`, input dimensions first, output dimensions last):

- `layers` and `experts` are batch dimensions: a stack of layers or experts is that many matrices,
  each orthogonalised on its own (not one flattened matrix);
- the output is the last dimension, or the trailing (`heads` | `kv_heads`, `head_dim`) pair of a
  projection into attention heads;
- an unnamed dimension between the input and the output is a fused projection's index (the gate and
  up halves of `w_gate_up`), so each projection is its own matrix; an unnamed dimension that leads the
  input (MTP's `proj`, one matmul over a concatenation) is part of the input;
- every other dimension is the input (the reduction).

Parameters without two such dimensions (norm scales, routing biases) and the embedding and LM head
(`vocab`) are not Muon's: they go to AdamW, as in Moonlight (Liu et al. 2025, "Muon is Scalable for LLM
Training").

The update follows optax.contrib.scale_by_muon step for step (bias-corrected Nesterov momentum, the
quintic iteration with Keller Jordan's coefficients after a Frobenius normalisation, the iteration on
the transpose of a tall matrix), so that ushard's Muon can be checked against it; what is ushard's own
is where each matrix's iteration runs (`orthogonalise`) and its dtype.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

NS_COEFFS = (3.4445, -4.7750, 2.0315)  # Keller Jordan's quintic: optax.contrib's default
NS_EPS = 1e-7
BATCH_NAMES = ("layers", "experts")
HEAD_NAMES = ("heads", "kv_heads")
SCALES = ("moonlight", "jordan", "none")


class MatrixAxes(NamedTuple):
    """Which dimensions of one parameter are its matrices' batch, input (reduction) and output dims."""

    batch: tuple[int, ...]
    reduction: tuple[int, ...]
    output: tuple[int, ...]


def matrix_axes(names: tuple) -> MatrixAxes | None:
    """The matrix layout of a parameter with logical axis `names`, or None when Muon does not take it."""
    if "vocab" in names or "norm" in names:
        return None
    batch = [i for i, n in enumerate(names) if n in BATCH_NAMES]
    rest = [i for i, n in enumerate(names) if n not in BATCH_NAMES]
    if len(rest) < 2:
        return None
    if names[rest[-1]] == "head_dim" and len(rest) >= 3 and names[rest[-2]] in HEAD_NAMES:
        output, rest = rest[-2:], rest[:-2]
    else:
        output, rest = rest[-1:], rest[:-1]
    if len(rest) >= 2 and names[rest[-1]] is None:  # a fused projection's index
        batch, rest = sorted(batch + rest[-1:]), rest[:-1]
    if not rest:
        return None
    return MatrixAxes(tuple(batch), tuple(rest), tuple(output))


def matrix_layouts(logical) -> Any:
    """`matrix_axes` of every parameter: a tree of MatrixAxes or None."""
    return jax.tree.map(matrix_axes, logical, is_leaf=lambda x: isinstance(x, tuple))


def _shape(x_shape, dims) -> int:
    return math.prod(x_shape[d] for d in dims)


def matrix_shape(shape: tuple[int, ...], axes: MatrixAxes) -> tuple[int, int, int]:
    """(matrices, fan_in, fan_out) of a parameter of `shape`."""
    return _shape(shape, axes.batch), _shape(shape, axes.reduction), _shape(shape, axes.output)


def as_matrices(x: jax.Array, axes: MatrixAxes) -> jax.Array:
    """x as [matrices, fan_in, fan_out]."""
    order = axes.batch + axes.reduction + axes.output
    return x.transpose(order).reshape(matrix_shape(x.shape, axes))


def from_matrices(m: jax.Array, axes: MatrixAxes, shape: tuple[int, ...]) -> jax.Array:
    order = axes.batch + axes.reduction + axes.output
    inverse = sorted(range(len(order)), key=order.__getitem__)
    return m.reshape(tuple(shape[d] for d in order)).transpose(inverse)


def newton_schulz(x: jax.Array, steps: int, dtype) -> jax.Array:
    """The quintic Newton-Schulz iteration on a batch of matrices [b, m, n], in `dtype` (the
    normalisation in float32), the result in `dtype`; a tall matrix is iterated as its transpose (the
    smaller Gram matrix)."""
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = x.swapaxes(-1, -2)
    x = x.astype(jnp.float32)
    x = (x / (jnp.linalg.norm(x, axis=(-2, -1), keepdims=True) + NS_EPS)).astype(dtype)
    a, b, c = NS_COEFFS
    for _ in range(steps):
        gram = x @ x.swapaxes(-1, -2)
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.swapaxes(-1, -2) if tall else x


def update_scale(fan_in: int, fan_out: int, scale: str, rms: float) -> float:
    """The factor on an orthogonalised update: "moonlight" makes its RMS `rms` whatever the shape
    (0.2: AdamW's typical update RMS, so AdamW's learning rate and weight decay carry over),
    "jordan" is Keller Jordan's sqrt(max(1, fan_out / fan_in)), "none" leaves it (RMS 1/sqrt(max))."""
    if scale == "moonlight":
        return rms * math.sqrt(max(fan_in, fan_out))
    if scale == "jordan":
        return math.sqrt(max(1.0, fan_out / fan_in))
    return 1.0


# --------------------------------------------------------------------------- where the iteration runs


class Owners(NamedTuple):
    """Whole matrices on owner devices: every matrix of one shape (fan_in, fan_out) from every Muon
    parameter joins one bucket, whose matrix index is split over the `axes` that shard the
    optimizer state, so each device holds whole matrices, its share of them, and iterates them alone."""

    mesh: Any
    axes: tuple[str, ...]

    @property
    def ways(self) -> int:
        return math.prod(self.mesh.shape[a] for a in self.axes)


def orthogonalise(mats: list[jax.Array], steps: int, dtype, owners: Owners | None) -> list[jax.Array]:
    """Newton-Schulz on each [b, m, n] of `mats`. Without `owners` each runs where its operand is
    (XLA's partitioner adds the collectives every matrix product needs); with them the matrices are
    first bucketed by shape and moved whole onto their owners (one all-to-all in, one out)."""
    if owners is None:
        return [newton_schulz(m, steps, dtype) for m in mats]
    tall = [m.shape[-2] > m.shape[-1] for m in mats]  # iterated as their transposes: one bucket with those
    mats = [m.swapaxes(-1, -2) if t else m for m, t in zip(mats, tall)]
    buckets: dict[tuple[int, int], list[int]] = {}
    for i, m in enumerate(mats):
        buckets.setdefault(m.shape[1:], []).append(i)
    out: list[jax.Array | None] = [None] * len(mats)
    whole = NamedSharding(owners.mesh, PartitionSpec(owners.axes, None, None))
    for indices in buckets.values():
        joined = jnp.concatenate([mats[i] for i in indices]) if len(indices) > 1 else mats[indices[0]]
        count = joined.shape[0]
        pad = -count % owners.ways
        if pad:  # zero matrices stay zero (their norm is 0) and are dropped afterwards
            joined = jnp.pad(joined, ((0, pad), (0, 0), (0, 0)))
        # Moved in the iteration's dtype both ways: bfloat16 halves the bytes of each all-to-all.
        joined = jax.lax.with_sharding_constraint(joined.astype(dtype), whole)
        done = jax.lax.with_sharding_constraint(newton_schulz(joined, steps, dtype), whole)[:count]
        start = 0
        for i in indices:
            piece = done[start:start + mats[i].shape[0]]
            out[i] = piece.swapaxes(-1, -2) if tall[i] else piece
            start += mats[i].shape[0]
    return out


# --------------------------------------------------------------------------- the transformation


class MuonState(NamedTuple):
    count: jax.Array  # int32 scalar
    mu: Any  # the momentum, shaped like the parameters Muon takes


def scale_by_muon(layouts, beta: float, steps: int, dtype, scale: str, rms: float,
                  owners: Owners | None = None) -> optax.GradientTransformation:
    """Orthogonalised Nesterov momentum, scaled by `update_scale`. `layouts`: a tree of MatrixAxes
    over the parameters this transformation sees (a prefix-compatible tree with optax's MaskedNode
    where the parameter is another optimizer's)."""

    def init(params):
        return MuonState(count=jnp.zeros([], jnp.int32), mu=optax.tree.zeros_like(params))

    def update(updates, state, params=None):
        del params
        mu = optax.tree.update_moment(updates, state.mu, beta, 1)
        count = optax.safe_increment(state.count)
        # Nesterov as optax.contrib.scale_by_muon writes it: both terms bias-corrected.
        mu_hat = jax.tree.map(lambda m, g: beta * m + (1 - beta) * g,
                              optax.tree.bias_correction(mu, beta, optax.safe_increment(count)),
                              optax.tree.bias_correction(updates, beta, count))
        leaves, treedef = jax.tree.flatten(mu_hat)
        axes = treedef.flatten_up_to(layouts)
        mats = [as_matrices(x, a) for x, a in zip(leaves, axes)]
        done = orthogonalise(mats, steps, dtype, owners)
        out = []
        for x, a, m in zip(leaves, axes, done):
            factor = update_scale(_shape(x.shape, a.reduction), _shape(x.shape, a.output), scale, rms)
            out.append((factor * from_matrices(m.astype(jnp.float32), a, x.shape)).astype(x.dtype))
        return jax.tree.unflatten(treedef, out), MuonState(count=count, mu=mu)

    return optax.GradientTransformation(init, update)


def newton_schulz_flops(shapes, layouts, steps: int) -> float:
    """FLOPs of one step's iterations over every Muon matrix (per matrix [m, n], m <= n: each
    iteration's three products, 2m²n + 2m³ + 2m²n)."""
    total = 0.0
    is_leaf = lambda v: v is None or isinstance(v, MatrixAxes)  # noqa: E731
    for x, a in zip(jax.tree.leaves(shapes), jax.tree.leaves(layouts, is_leaf=is_leaf)):
        if a is None:
            continue
        count, fan_in, fan_out = matrix_shape(x.shape, a)
        m, n = min(fan_in, fan_out), max(fan_in, fan_out)
        total += count * steps * (4 * m * m * n + 2 * m ** 3)
    return total
