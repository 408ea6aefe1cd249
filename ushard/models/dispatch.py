"""Routed experts on one device's tokens: the assignments grouped by expert, every expert run on its own.

The computation an MoE layer's routed experts are on a single device, and the per-device part of
expert parallelism (ushard/parallel/expert.py runs it on each device's tokens, with the buffers
exchanged between devices). Tokens and their assignments are flattened token-major; an
assignment's sort key is its expert (num_experts where the drop rule dropped it, sorted last).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def experts_held(weights: dict) -> int:
    return next(iter(weights.values())).shape[0]  # every weight leads with its experts



def sort_by_expert(key, num_experts: int):
    """key int [A] in [0, num_experts] (num_experts: dropped) -> (stable order that sorts it, rows per
    expert [num_experts], each assignment's rank among its expert's assignments)."""
    order = jnp.argsort(key, stable=True)
    counts = jnp.bincount(key, length=num_experts + 1)
    starts = jnp.cumsum(counts) - counts
    rank_sorted = jnp.arange(key.shape[0]) - starts[key[order]]
    rank = jnp.zeros_like(key).at[order].set(rank_sorted)
    return order, counts[:num_experts], rank



def inverse_of(order):
    """The permutation that undoes `order` (a permutation of range(len(order)))."""
    return jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0]), unique_indices=True)


# Rows moved by a permutation, differentiated by the inverse permutation. Autodiff would transpose each
# gather into a scatter-add over the whole [assignments, d] array, which on GPUs costs more than the
# gather (docs/dev-notes.md); every index here is a permutation, so the gradient is a gather too.


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def assignment_rows(tokens, order, inverse, k: int):
    """tokens [n, d] -> [n * k, d]: assignment order[i]'s token in row i (assignments token-major, k a
    token; `inverse` undoes `order`)."""
    return tokens[order // k]


def _assignment_rows_forward(tokens, order, inverse, k):
    return tokens[order // k], (inverse, tokens.shape)


def _assignment_rows_backward(k, residuals, d_rows):
    inverse, (n, d) = residuals
    d_tokens = jnp.sum(d_rows[inverse].reshape(n, k, d).astype(jnp.float32), axis=1).astype(d_rows.dtype)
    return d_tokens, None, None


assignment_rows.defvjp(_assignment_rows_forward, _assignment_rows_backward)


@jax.custom_vjp
def permuted(rows, index, inverse):
    """rows[index], with `inverse` undoing the permutation `index`."""
    return rows[index]


def _permuted_forward(rows, index, inverse):
    return rows[index], inverse


def _permuted_backward(inverse, d_out):
    return d_out[inverse], None, None


permuted.defvjp(_permuted_forward, _permuted_backward)


def combine(outputs, gates, dtype):
    """outputs [tokens, k, d] of each assignment -> [tokens, d]: summed by gates in float32."""
    return jnp.einsum("nk,nkd->nd", gates, outputs.astype(jnp.float32)).astype(dtype)



def flat(x, experts, gates, keep, num_experts: int):
    """Tokens [n, d], and per assignment (token-major): the sort key (num_experts where dropped) and gates [n, k]."""
    batch, length, d = x.shape
    key = jnp.where(keep, experts, num_experts).reshape(-1).astype(jnp.int32)
    return x.reshape(batch * length, d), key, gates.reshape(batch * length, -1)



def grouped(x, experts, gates, keep, weights, expert_fn):
    """All experts on this device, dropless: the assignments sorted by expert through the grouped form."""
    num_experts, k = experts_held(weights), experts.shape[-1]
    tokens, key, gates = flat(x, experts, gates, keep, num_experts)
    order, sizes, _ = sort_by_expert(key, num_experts)
    inverse = inverse_of(order)
    out_sorted = expert_fn(weights, assignment_rows(tokens, order, inverse, k), sizes)  # dropped rows (last): zeros
    return unsort_and_combine(out_sorted, order, inverse, gates, x)



def unsort_and_combine(out_sorted, order, inverse, gates, x):
    """Each assignment's output, in the `order` that sorted the assignments by expert (`inverse` undoes
    it) -> the tokens' outputs [batch, length, d], combined by gates."""
    outputs = permuted(out_sorted, inverse, order).reshape(gates.shape[0], gates.shape[1], -1)
    return combine(outputs, gates, x.dtype).reshape(x.shape)



def buffered(x, experts, gates, keep, weights, expert_fn, capacity: int, groups: int = 1, exchange=None):
    """Fixed-capacity dispatch: each kept assignment's token in slot (expert, rank among that expert's
    assignments here) of a [E, capacity, d] buffer, each expert run batched over its rows. With the
    experts split over `groups` devices, `exchange(buffer [groups, ...])` sends row block g to device
    g of the group and returns what it received (ushard/parallel/expert.py: an all-to-all)."""
    local_experts, k = experts_held(weights), experts.shape[-1]
    num_experts, d = local_experts * groups, x.shape[-1]
    tokens, key, gates = flat(x, experts, gates, keep, num_experts)
    _, _, rank = sort_by_expert(key, num_experts)
    slot = jnp.where(key < num_experts, key * capacity + rank, num_experts * capacity)  # past the end: dropped
    rows = tokens[jnp.arange(key.shape[0]) // k]
    send = jnp.zeros((num_experts * capacity, d), x.dtype).at[slot].set(rows, mode="drop")

    exchange = exchange or (lambda buffer: buffer)
    received = exchange(send.reshape(groups, local_experts, capacity, d))
    batched = received.swapaxes(0, 1).reshape(local_experts, groups * capacity, d)
    computed = expert_fn(weights, batched).reshape(local_experts, groups, capacity, d).swapaxes(0, 1)
    returned = exchange(computed).reshape(num_experts * capacity, d)
    outputs = jnp.take(returned, slot, axis=0, mode="fill", fill_value=0).reshape(tokens.shape[0], k, d)
    return combine(outputs, gates, x.dtype).reshape(x.shape)



def on_device(x, experts, gates, keep, weights, expert_fn, row_capacity: int, groups: int = 1, exchange=None):
    """One device's tokens through their experts: grouped if dropless with every expert here, else
    through fixed-capacity buffers (`exchange`d when the experts are split `groups` ways). The
    capacity is the most one device can hold for one expert under the drop rule
    (ushard/models/moe.py): local rows x min(row capacity, local row length)."""
    if groups == 1 and row_capacity >= x.shape[1]:
        return grouped(x, experts, gates, keep, weights, expert_fn)
    capacity = x.shape[0] * min(row_capacity, x.shape[1])
    return buffered(x, experts, gates, keep, weights, expert_fn, capacity, groups, exchange)
