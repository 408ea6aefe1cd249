"""Next-token cross-entropy over the full vocabulary, with a hand-written backward pass.

Autodiff of `logsumexp - take_along_axis` in float32 writes a float32 gradient of the logits
([batch, length, vocab], 4 bytes per entry), scatters the target's -1 into it and only then rounds it
to the logits' 16-bit dtype: three passes over the largest tensor of the step. The backward below
computes softmax - one_hot and rounds it in one pass, from the 16-bit logits kept for it anyway.

Under tensor parallelism the logits arrive split over `vocab` (the LM head is column-parallel), and no
device ever holds a [batch, length, vocab] slab: the max, the sum of exponentials and the target's
logit are each a reduction over the vocabulary axis (the target is picked by comparing with a vocab
iota, not by indexing), which XLA partitions into a local reduction and a [batch, length] all-reduce;
the backward pass is elementwise on each device's vocab shard.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ushard.sharding import LOGITS_NAMES, constrain


@jax.custom_vjp
def token_cross_entropy(logits, targets):
    """-log softmax(logits)[target] per token, in float32: logits [..., vocab], targets int [...]."""
    return _forward(logits, targets)[0]


def _is_target(logits, targets):
    """[..., vocab] booleans, true at each token's target: elementwise, so it stays on the vocab shards."""
    return jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1) == targets[..., None]


def _forward(logits, targets):
    logits = constrain(logits, LOGITS_NAMES)
    logits32 = logits.astype(jnp.float32)
    log_z = jax.nn.logsumexp(logits32, axis=-1)
    target_logit = jnp.sum(jnp.where(_is_target(logits, targets), logits32, 0.0), axis=-1)
    return log_z - target_logit, log_z


def _token_cross_entropy_fwd(logits, targets):
    losses, log_z = _forward(logits, targets)
    return losses, (logits, targets, log_z)


def _token_cross_entropy_bwd(residuals, grad):
    logits, targets, log_z = residuals
    probs = jnp.exp(logits.astype(jnp.float32) - log_z[..., None])
    d_logits = ((probs - _is_target(logits, targets)) * grad[..., None]).astype(logits.dtype)
    return constrain(d_logits, LOGITS_NAMES), None


token_cross_entropy.defvjp(_token_cross_entropy_fwd, _token_cross_entropy_bwd)


def cross_entropy_sums(logits, targets, loss_mask):
    """Sum of next-token cross-entropy (in float32) over unmasked targets, and their count."""
    mask = loss_mask.astype(jnp.float32)
    return jnp.sum(token_cross_entropy(logits, targets) * mask), jnp.sum(mask)
