"""LoRA: the model's weights frozen, low-rank adapters on the projections `model.lora.targets` names.

The trained parameters are the adapters alone, a tree nested like the model's parameters with
`{"lora_a": A, "lora_b": B}` at each adapted weight's place (as peft's names go: W + (alpha / rank)
B A). The optimizer, its state, the gradients and their all-reduce are the adapters'; the frozen base
is stored in the compute dtype (`model.lora.base_dtype`), sharded like the parameters, and travels in
the training state beside them (`TrainState.frozen`), never in a checkpoint: a run rebuilds it from
`checkpoint.init_from` (or the seed) and checks it against the checkpoint's fingerprint.

An adapter's logical names are its base weight's (ushard/models/low_rank.py, `adapter_names`), so
every layout shards it with the base's rules; the rank axis is unnamed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from ushard.errors import UserError
from ushard.models.config import LoraConfig
from ushard.models.definition import ModelDef, tree_paths
from ushard.models.low_rank import LowRankAdapted, adapter_names, input_axes, quantized, scale_names

# The projections a target may name: attention's (latent attention's too), the MLPs' and the experts'.
PROJECTIONS = ("wq", "wk", "wv", "wo", "wq_a", "wq_b", "wkv_a", "wkv_b", "w_gate", "w_up", "w_down", "w_gate_up")


@dataclass(frozen=True)
class AdaptedWeight:
    path: str  # the base weight's dotted path, "blocks.attn.wq"
    names: tuple  # the base's logical names
    shape: tuple
    stacked: int  # leading `layers` axes (a stack's)
    lead: int  # axes after those that neither side of the product has (the experts')
    ins: int  # the input axes after those

    def shapes(self, rank: int) -> dict:
        ahead = self.stacked + self.lead
        a = (*self.shape[:ahead + self.ins], rank)
        b = (*self.shape[:ahead], rank, *self.shape[ahead + self.ins:])
        return {"lora_a": a, "lora_b": b}

    def logical(self) -> dict:
        a, b = adapter_names(self.names, self.stacked + self.lead, self.ins)
        return {"lora_a": a, "lora_b": b}


def _set(tree: dict, path: str, value) -> None:
    *parents, last = path.split(".")
    for key in parents:
        tree = tree.setdefault(key, {})
    tree[last] = value


def _get(tree: dict, path: str):
    for key in path.split("."):
        tree = tree[key]
    return tree


def _copy_nested(tree):
    return {k: _copy_nested(v) if isinstance(v, dict) else v for k, v in tree.items()}


class Adapters:
    """Which weights of `model` carry adapters (`cfg.targets`), the adapters' shapes and names, and
    how they are joined to the frozen weights."""

    def __init__(self, model: ModelDef, cfg: LoraConfig):
        self.model, self.cfg = model, cfg
        names, shapes = tree_paths(model.logical), tree_paths(model.shapes)
        wanted = [t.strip() for t in cfg.targets.split(",") if t.strip()]
        projections = [p for p in names if p.split(".")[-1] in PROJECTIONS]
        if wanted == ["all"]:
            chosen = projections
        else:
            chosen = []
            for target in wanted:
                matches = [p for p in projections if p == target or p.endswith("." + target)]
                if not matches:
                    found = sorted({p.split(".")[-1] for p in projections})
                    raise UserError(f"model.lora.targets names {target!r}, which is no projection of this model; "
                                    f"its projections are {', '.join(found)} (or 'all').")
                chosen += [p for p in matches if p not in chosen]
        self.weights = []
        for path in sorted(chosen, key=list(names).index):
            logical = names[path]
            stacked = 0
            while logical[stacked] == "layers":
                stacked += 1
            lead = 1 if logical[stacked] == "experts" else 0
            self.weights.append(AdaptedWeight(path, logical, shapes[path].shape, stacked, lead,
                                              input_axes(logical, stacked + lead)))
        dtype = jnp.dtype(model.cfg.param_dtype)
        self.logical, self.shapes = {}, {}
        for w in self.weights:
            _set(self.logical, w.path, w.logical())
            _set(self.shapes, w.path, {k: jax.ShapeDtypeStruct(s, dtype) for k, s in w.shapes(cfg.rank).items()})
        self.float8 = cfg.base_dtype == "float8"
        self.base_dtype = jnp.dtype(model.cfg.param_dtype if cfg.base_dtype == "param" else model.cfg.compute_dtype)
        # A float8 base's per-output-channel scales, nested like the parameters (empty otherwise).
        self.scale_logical = {}
        for w in self.weights if self.float8 else ():
            _set(self.scale_logical, w.path, scale_names(w.names, w.stacked + w.lead, w.ins))

    def num_params(self) -> int:
        return sum(x.size for x in jax.tree.leaves(self.shapes))

    def init(self, seed: int) -> dict:
        """Fresh adapters, as peft makes them: A uniform in +-1 / sqrt(fan-in) (Kaiming's uniform with
        a = sqrt(5), torch's Linear default), B zeros, so the adapted model starts as the base."""
        key = jax.random.key(seed)
        out = {}
        for i, w in enumerate(self.weights):
            shape_a, shape_b = _get(self.shapes, w.path)["lora_a"], _get(self.shapes, w.path)["lora_b"]
            fan_in = math.prod(w.shape[w.stacked + w.lead:w.stacked + w.lead + w.ins])
            bound = fan_in ** -0.5
            a = jax.random.uniform(jax.random.fold_in(key, i), shape_a.shape, shape_a.dtype, -bound, bound)
            _set(out, w.path, {"lora_a": a, "lora_b": jnp.zeros(shape_b.shape, shape_b.dtype)})
        return out

    def frozen(self, params) -> dict:
        """The base as the run keeps it, {"weights": nested like the parameters, "scales": ...}: matmul
        weights in `base_dtype`, norm scales and routing biases as they are; with `float8`, the adapted
        weights quantized (ushard/models/low_rank.py, `quantized`) and their scales."""
        names = jax.tree.leaves(self.model.logical, is_leaf=lambda x: isinstance(x, tuple))
        leaves, tree = jax.tree.flatten(params)
        cast = [w if n[-1] == "norm" or w.ndim < 2 else w.astype(self.base_dtype) for w, n in zip(leaves, names)]
        weights, scales = jax.tree.unflatten(tree, cast), {}
        for w in self.weights if self.float8 else ():
            q, scale = quantized(_get(params, w.path), w.stacked + w.lead, w.ins)
            _set(weights, w.path, q)
            _set(scales, w.path, scale)
        return {"weights": weights, "scales": scales}

    def frozen_logical(self) -> dict:
        """The logical names of `frozen`'s result."""
        return {"weights": self.model.logical, "scales": self.scale_logical}

    def attach(self, frozen, adapters, step=None):
        """The model's parameters with each adapted weight a `LowRankAdapted` of its frozen base and
        adapters; with dropout, its masks drawn from `step` (a different mask each step and layer)."""
        params = _copy_nested(frozen["weights"])
        for i, w in enumerate(self.weights):
            ad = _get(adapters, w.path)
            seed_shape = w.shape[:w.stacked]
            seed = jnp.zeros(seed_shape, jnp.float32)
            if self.cfg.dropout and step is not None:
                # Distinct per step, weight and layer, below 2**24 so that float32 holds it exactly.
                layer = jnp.arange(math.prod(seed_shape), dtype=jnp.int32).reshape(seed_shape)
                mixed = (step.astype(jnp.int32) * 7919 + i * 104729 + layer * 15485863) % (1 << 24)
                seed = mixed.astype(jnp.float32)
            base_scale = _get(frozen["scales"], w.path) if self.float8 else None
            _set(params, w.path, LowRankAdapted(_get(frozen["weights"], w.path), ad["lora_a"], ad["lora_b"], seed,
                                                base_scale=base_scale, scale=self.cfg.scale, lead=w.lead,
                                                dropout=self.cfg.dropout))
        return params

    def base_params(self, frozen: dict):
        """The model's parameters of the frozen base alone (DPO's reference policy under LoRA): its
        weights as they are, a float8 weight as a rank-0 `LowRankAdapted` that applies its scales."""
        if not self.float8:
            return frozen["weights"]
        params = _copy_nested(frozen["weights"])
        for w in self.weights:
            base = _get(frozen["weights"], w.path)
            ahead = w.stacked + w.lead
            a = jnp.zeros((*base.shape[:ahead + w.ins], 0), jnp.float32)
            b = jnp.zeros((*base.shape[:ahead], 0, *base.shape[ahead + w.ins:]), jnp.float32)
            _set(params, w.path, LowRankAdapted(base, a, b, jnp.zeros(base.shape[:w.stacked], jnp.float32),
                                                base_scale=_get(frozen["scales"], w.path), lead=w.lead))
        return params

    def grads_of(self, grads) -> dict:
        """The adapters' gradients out of a gradient of `attach`'s tree (a 1F1B pipeline differentiates
        every weight it is handed; the base's entries are zeros)."""
        out = {}
        for w in self.weights:
            g = _get(grads, w.path)
            _set(out, w.path, {"lora_a": g.a, "lora_b": g.b})
        return out

    def merge(self, params, adapters):
        """The model's parameters `params` (the base as loaded, not `frozen`'s) with every adapter folded
        into its weight (export, sampling), in the parameters' dtype."""
        params = _copy_nested(params)
        for w in self.weights:
            ad = _get(adapters, w.path)
            node = LowRankAdapted(_get(params, w.path), ad["lora_a"], ad["lora_b"], jnp.zeros(()),
                                  scale=self.cfg.scale, lead=w.stacked + w.lead)
            _set(params, w.path, node.merged())
        return params


def fingerprint(frozen: dict) -> jax.Array:
    """[weights, 2] float32: each frozen weight's sum and sum of squares (`Adapters.frozen`'s result). A
    checkpoint keeps it, and a resume on another base (another `checkpoint.init_from`, or its files
    changed) is refused."""
    return jnp.stack([jnp.stack([jnp.sum(w.astype(jnp.float32)), jnp.sum(jnp.square(w.astype(jnp.float32)))])
                      for w in jax.tree.leaves(frozen["weights"])])


def same_base(saved, now) -> bool:
    saved, now = jnp.asarray(saved), jnp.asarray(now)
    return saved.shape == now.shape and bool(jnp.allclose(saved, now, rtol=1e-3, atol=1e-3))


def base_check_shape(model: ModelDef) -> jax.ShapeDtypeStruct:
    """The shape of `fingerprint`'s result for `model`'s parameters."""
    return jax.ShapeDtypeStruct((len(jax.tree.leaves(model.shapes)), 2), jnp.float32)
