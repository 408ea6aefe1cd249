"""The optimizers (`optim.name`, a registry) and the learning-rate schedules, global-norm clipping.

Each registry entry declares its own settings (the `optim.<name>` group; the keys directly under
`optim` are AdamW's, which Muon uses for the parameters it does not take), which parameters it takes
(by their logical axis names), and for the planner's step time the float32 words it reads and writes
per parameter per step. The planner's state bytes are the entry's own: the shapes its `init` gives,
laid out by `opt_state_shardings` (ushard/training/step.py), exact for every entry. Every optimizer
is built on optax's transformation of that name and sees the schedule of `train` (lr, warmup, decay).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import ml_collections
import optax

from ushard.errors import UserError
from ushard.training import muon as muon_lib

SCHEDULES = ("cosine", "linear", "constant", "wsd")
WSD_DECAYS = ("linear", "cosine", "sqrt")
# AdamW's keys lived in `train` before the `optim` group: a config that still sets one is refused
# with a sentence naming its new key (ushard/config.py), rather than mapped silently.
MOVED_KEYS = {f"train.{k}": f"optim.{k}" for k in ("weight_decay", "b1", "b2", "eps")}


def learning_rate_schedule(train_cfg) -> optax.Schedule:
    """Linear warm-up from 0 to lr, then `train.schedule`: cosine or linear to lr * min_lr_ratio at
    train.steps, constant, or WSD (warmup-stable-decay: lr until the last train.decay_fraction of
    the steps, then down to lr * min_lr_ratio, by train.wsd_decay). Every shape is a function of the
    step and train.steps alone, so a run resumed with a longer train.steps follows the longer
    schedule from its step on (a WSD run is extended this way from a checkpoint of its stable phase)."""
    t = train_cfg
    warmup = min(t.warmup_steps, t.steps)
    decay_steps = max(t.steps - warmup, 1)
    end = t.lr * t.min_lr_ratio
    if t.schedule == "cosine":
        decay = optax.cosine_decay_schedule(t.lr, decay_steps, alpha=t.min_lr_ratio)
    elif t.schedule == "linear":
        decay = optax.linear_schedule(t.lr, end, decay_steps)
    elif t.schedule == "wsd":
        return wsd_schedule(t.lr, end, t.steps, warmup, t.decay_fraction, t.wsd_decay)
    else:
        decay = optax.constant_schedule(t.lr)
    if warmup == 0:
        return decay
    return optax.join_schedules([optax.linear_schedule(0.0, t.lr, warmup), decay], [warmup])


# The train.* keys that shape the learning-rate schedule (ushard/training/optim.py).
SCHEDULE_KEYS = ("steps", "lr", "min_lr_ratio", "warmup_steps", "schedule", "decay_fraction", "wsd_decay")


def schedule_change(saved_config: dict, train_cfg, step: int) -> str | None:
    """A one-line note where a resumed run's learning-rate schedule is not its checkpoint's (a larger
    train.steps stretches a cosine decay, for one): what changed, and the rate at `step` under both."""
    saved = {**train_cfg.to_dict(), **saved_config.get("train", {})}
    changed = [f"train.{k} {saved[k]!r} -> {train_cfg[k]!r}" for k in SCHEDULE_KEYS if saved[k] != train_cfg[k]]
    if not changed:
        return None
    before = float(learning_rate_schedule(ml_collections.ConfigDict(saved))(step))
    now = float(learning_rate_schedule(train_cfg)(step))
    return (f"note: the learning-rate schedule is not the checkpoint's ({', '.join(changed)}): at step {step} the "
            f"rate is {now:.3g} (the checkpoint's schedule had {before:.3g}), and the new schedule holds from here.")


def wsd_schedule(peak: float, end: float, steps: int, warmup: int, fraction: float, shape: str) -> optax.Schedule:
    """Warm-up to `peak` over `warmup` steps, `peak` until the last round(fraction * steps) steps,
    then down to `end` at `steps`: linearly, by a half cosine, or by 1 - sqrt(progress) (Hägele et
    al. 2024, "Scaling Laws and Compute-Optimal Training Beyond Fixed Training Durations")."""
    decay = max(1, round(fraction * steps)) if fraction > 0 else 0
    start = max(steps - decay, warmup)

    def schedule(step):
        step = jnp.asarray(step, jnp.float32)
        up = peak * step / warmup if warmup else peak
        progress = jnp.clip((step - start) / max(steps - start, 1), 0.0, 1.0)
        if shape == "linear":
            down = 1.0 - progress
        elif shape == "cosine":
            down = 0.5 * (1.0 + jnp.cos(math.pi * progress))
        else:
            down = 1.0 - jnp.sqrt(progress)
        value = jnp.where(step < start, peak, end + (peak - end) * down)
        return jnp.where(step < warmup, up, value)

    return schedule


def weight_decay_mask(logical_params):
    """Decay matrices and embeddings; leave norm scales alone (recognised by their `norm` axis)."""
    return jax.tree.map(lambda names: names[-1] != "norm", logical_params, is_leaf=lambda x: isinstance(x, tuple))


def _adamw(o, schedule, logical, layout):
    return optax.adamw(schedule, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay,
                       mask=weight_decay_mask(logical))


def _lion(o, schedule, logical, layout):
    return optax.lion(schedule, b1=o.lion.b1, b2=o.lion.b2, weight_decay=o.weight_decay,
                      mask=weight_decay_mask(logical))


def _adafactor(o, schedule, logical, layout):
    a = o.adafactor
    return optax.adafactor(schedule, min_dim_size_to_factor=a.min_dim_size_to_factor, decay_rate=a.decay_rate,
                           multiply_by_parameter_scale=a.parameter_scale,
                           clipping_threshold=a.clipping_threshold or None,
                           weight_decay_rate=a.weight_decay_rate or None, weight_decay_mask=weight_decay_mask(logical))


def muon_labels(logical):
    """"muon" for each parameter Muon takes (ushard/training/muon.py's rules), else "adamw"."""
    return jax.tree.map(lambda a: "muon" if a is not None else "adamw", muon_lib.matrix_layouts(logical),
                        is_leaf=lambda v: v is None or isinstance(v, muon_lib.MatrixAxes))


def _muon(o, schedule, logical, layout):
    m = o.muon
    layouts = muon_lib.matrix_layouts(logical)
    is_axes = lambda v: v is None or isinstance(v, muon_lib.MatrixAxes)  # noqa: E731
    # The Muon partition sees optax's MaskedNode where a parameter is AdamW's.
    seen = jax.tree.map(lambda a: a if a is not None else optax.MaskedNode(), layouts, is_leaf=is_axes)
    owners = None
    if layout is not None:
        axes = layout.plan.muon_owners if layout.plan is not None else muon_owner_axes(layout, logical, m.layout)
        owners = muon_lib.Owners(layout.mesh, axes) if axes else None
    core = muon_lib.scale_by_muon(seen, beta=m.momentum, steps=m.ns_steps, dtype=jnp.dtype(m.ns_dtype),
                                  scale=m.scale, rms=m.rms, owners=owners)
    matrices = optax.chain(core, optax.add_decayed_weights(o.weight_decay), optax.scale_by_learning_rate(schedule))
    return optax.partition({"muon": matrices, "adamw": _adamw(o, schedule, logical, layout)}, muon_labels(logical))


def muon_owner_axes(layout, logical, mode: str) -> tuple[str, ...]:
    """The mesh axes Muon's matrices are spread over, whole, for their iterations (optim.muon.layout):
    none for "gspmd" (each iteration on the sharded momentum, XLA's partitioner adding the collectives
    of every product), else the axes that split any Muon parameter's optimizer state ("owners"; "auto"
    too: where the state is split the iteration needs whole matrices anyway, and moving each once
    there and back costs less than gathering pieces in every product; where it is whole on every
    device there is nothing to move)."""
    if mode == "gspmd":
        return ()
    layouts = muon_lib.matrix_layouts(logical)
    is_axes = lambda v: v is None or isinstance(v, muon_lib.MatrixAxes)  # noqa: E731
    used = set()
    for names, a in zip(jax.tree.leaves(logical, is_leaf=lambda x: isinstance(x, tuple)),
                        jax.tree.leaves(layouts, is_leaf=is_axes)):
        if a is not None:
            for name in names:
                used.update(axis for axis in layout.axes(name, "opt_state") if layout.mesh.shape[axis] > 1)
    return tuple(a for a in layout.mesh.axis_names if a in used)


def plan_optimizer(config, model, layout) -> dict:
    """The plan's optimizer fields (ushard/plan.py): the name, Muon's owner axes, and the report's line."""
    o = config.optim
    if o.name != "muon":
        return {"optimizer": o.name, "muon_owners": (), "optimizer_why": o.name}
    m = o.muon
    axes = muon_owner_axes(layout, model.logical, m.layout)
    layouts = jax.tree.leaves(muon_lib.matrix_layouts(model.logical),
                              is_leaf=lambda v: v is None or isinstance(v, muon_lib.MatrixAxes))
    shapes = [muon_lib.matrix_shape(x.shape, a) for x, a in zip(jax.tree.leaves(model.shapes), layouts)
              if a is not None]
    count = sum(shape[0] for shape in shapes)
    buckets = len({tuple(sorted(shape[1:])) for shape in shapes})
    what = f"muon: {count} matrices (Newton-Schulz, {m.ns_steps} steps in {m.ns_dtype}), AdamW for the rest; "
    if axes:
        ways = math.prod(layout.mesh.shape[a] for a in axes)
        where = (f"each matrix whole on one of {ways} owners over {' x '.join(axes)}, in {buckets} buckets by "
                 f"shape (an all-to-all in and out)")
    elif m.layout == "gspmd":
        where = "each iteration on the sharded momentum, XLA's collectives in every product (optim.muon.layout)"
    else:
        where = "the iterations where the momentum is: its state is whole on every device"
    return {"optimizer": "muon", "muon_owners": axes, "optimizer_why": what + where}


@dataclass(frozen=True)
class Optimizer:
    """One registry entry."""

    name: str
    build: Callable  # (optim config, schedule, logical params, layout or None) -> GradientTransformation
    settings: dict = field(default_factory=dict)  # its own group, optim.<name>: key -> default
    # Which parameters it updates itself (logical names -> bool); the others go to AdamW.
    takes: Callable[[tuple], bool] = lambda names: True
    update_words: int = 7  # float32 words read and written per parameter per update (AdamW: p, g, m, v; p, m, v)


OPTIMIZERS = {
    "adamw": Optimizer("adamw", _adamw),
    "lion": Optimizer("lion", _lion, {"b1": 0.9, "b2": 0.99}, update_words=5),
    "adafactor": Optimizer("adafactor", _adafactor,
                           {"decay_rate": 0.8, "clipping_threshold": 1.0, "min_dim_size_to_factor": 128,
                            "parameter_scale": False, "weight_decay_rate": 0.0},
                           update_words=4),
    "muon": Optimizer("muon", _muon,
                      {"momentum": 0.95, "ns_steps": 5, "ns_dtype": "bfloat16", "scale": "moonlight", "rms": 0.2,
                       "layout": "auto"},
                      takes=lambda names: muon_lib.matrix_axes(names) is not None, update_words=5),
}
MUON_LAYOUTS = ("auto", "gspmd", "owners")


def check_same_optimizer(saved_config: dict, config, where: str) -> None:
    """A checkpoint's optimizer state is its optimizer's: resuming it under another one is refused
    (a checkpoint from before the optim group was AdamW's)."""
    saved = (saved_config.get("optim") or {}).get("name", "adamw")
    if saved != config.optim.name:
        raise UserError(f"the checkpoints in {where} were trained with optim.name={saved!r}, not "
                        f"{config.optim.name!r}; resume with optim.name={saved!r}, or start a new run from these "
                        f"parameters with a fresh optimizer: another workdir and "
                        f"--config.checkpoint.init_from=<this workdir>.")


def make_optimizer(config, logical_params, layout=None) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """The optimizer of `config` (optim.name) for parameters with these logical names, and the
    schedule; `layout` (a sharding Layout) places Muon's iterations (without one: where XLA puts them)."""
    schedule = learning_rate_schedule(config.train)
    o = config.optim
    tx = OPTIMIZERS[o.name].build(o, schedule, logical_params, layout)
    # identity() and clip_by_global_norm() carry the same (empty) state, so a checkpoint restores
    # whether or not clipping is on.
    grad_clip = config.train.grad_clip
    clip = optax.clip_by_global_norm(grad_clip) if grad_clip > 0 else optax.identity()
    return optax.chain(clip, tx), schedule
