"""AdamW with linear warmup and a cosine (or linear / constant) decay, global-norm clipping."""

from __future__ import annotations

import jax
import optax


def learning_rate_schedule(train_cfg) -> optax.Schedule:
    t = train_cfg
    warmup = min(t.warmup_steps, t.steps)
    decay_steps = max(t.steps - warmup, 1)
    end = t.lr * t.min_lr_ratio
    if t.schedule == "cosine":
        decay = optax.cosine_decay_schedule(t.lr, decay_steps, alpha=t.min_lr_ratio)
    elif t.schedule == "linear":
        decay = optax.linear_schedule(t.lr, end, decay_steps)
    else:
        decay = optax.constant_schedule(t.lr)
    if warmup == 0:
        return decay
    return optax.join_schedules([optax.linear_schedule(0.0, t.lr, warmup), decay], [warmup])


def weight_decay_mask(logical_params):
    """Decay matrices and embeddings; leave norm scales alone (recognised by their `norm` axis)."""
    return jax.tree.map(lambda names: names[-1] != "norm", logical_params, is_leaf=lambda x: isinstance(x, tuple))


def make_optimizer(train_cfg, logical_params) -> tuple[optax.GradientTransformation, optax.Schedule]:
    t = train_cfg
    schedule = learning_rate_schedule(t)
    adamw = optax.adamw(
        schedule, b1=t.b1, b2=t.b2, eps=t.eps, weight_decay=t.weight_decay, mask=weight_decay_mask(logical_params)
    )
    # identity() and clip_by_global_norm() carry the same (empty) state, so a checkpoint restores
    # whether or not clipping is on.
    clip = optax.clip_by_global_norm(t.grad_clip) if t.grad_clip > 0 else optax.identity()
    return optax.chain(clip, adamw), schedule
