"""The decoder every family builds: embeddings, scanned stacks of blocks, final norm, LM head.

A family (ushard/models/registry.py) says which blocks make the layers, as `Stack`s in order: each
stack is created stacked (one array per weight with a leading `layers` axis) and run with
`jax.lax.scan`, so compile time does not grow with depth. A stack whose layers differ in kind (an
MoE layer then dense ones, five local-attention layers then a global one) is a stack of `Period`s,
each item one period of its layers. Parameters are stored in `param_dtype` and cast to
`compute_dtype` where they are used. A block is called `block(x, positions, segment_ids) -> (x,
aux)` and, for inference, `block.decode(x, positions, k_cache, v_cache, length) -> (x, k, v)`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from ushard.errors import UserError
from ushard.models.config import ModelConfig
from ushard.models.family import AttentionShape
from ushard.models.layers import BTD, RMSNorm, embed_lookup, fan_in_init, param
from ushard.models.mtp import MTPModule, mtp_names
from ushard.models.stack import run_layers
from ushard.sharding import LOGITS_NAMES, constrain, gathered


@dataclass(frozen=True)
class Stack:
    """One stack of the decoder: its params' key, its items, the layers one item holds, and
    `make(rngs)`, which creates one item (a block, or a `Period` of `per_item` blocks)."""

    name: str
    items: int
    per_item: int
    make: Callable


class Period(nnx.Module):
    """One item of a stack whose layers repeat a pattern: the blocks `makers` create, run in order."""

    def __init__(self, makers, rngs: nnx.Rngs):
        self.names = tuple(f"layer{j}" for j in range(len(makers)))
        for name, make in zip(self.names, makers):
            setattr(self, name, make(rngs))

    def __call__(self, x, positions, segment_ids):
        total = {}
        for name in self.names:
            x, aux = getattr(self, name)(x, positions, segment_ids)
            total = sum_aux(total, aux)
        return x, total

    def decode(self, x, positions, k_cache, v_cache, length):
        """As `Block.decode`, with caches [every, ...] for the period's layers."""
        ks, vs = [], []
        for j, name in enumerate(self.names):
            x, k, v = getattr(self, name).decode(x, positions, k_cache[j], v_cache[j], length)
            ks.append(k)
            vs.append(v)
        return x, jnp.stack(ks), jnp.stack(vs)


def sum_aux(a: dict, b: dict) -> dict:
    """Two dicts of aux terms added key by key (a key missing from one counts as 0)."""
    return {key: a.get(key, 0.0) + b.get(key, 0.0) for key in {**a, **b}}


def _decode_stack(stack, per_item: int, x, positions, k_cache, v_cache, length):
    """x through a stack for new tokens (see `Decoder.decode`); caches [its layers, ...] -> (x, k, v)."""
    graphdef, item_states = nnx.split(stack)
    by_item = lambda c: c.reshape(-1, per_item, *c.shape[1:]) if per_item > 1 else c  # noqa: E731

    def one_item(x, item):
        item_state, k, v = item
        x, k, v = nnx.merge(graphdef, item_state).decode(x, positions, k, v, length)
        return x, (k, v)

    x, (k, v) = jax.lax.scan(one_item, x, (item_states, by_item(k_cache), by_item(v_cache)))
    return x, k.reshape(k_cache.shape), v.reshape(v_cache.shape)


def stacked(count: int, make, rngs: nnx.Rngs):
    """`count` layers made by `make(rngs)`, created at once with a leading `layers` axis on every weight."""

    @nnx.split_rngs(splits=count)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def build(rngs):
        return make(rngs)

    return build(rngs)


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=None, shape: AttentionShape | None = None) -> dict:
    """An empty KV cache for `Decoder.decode`: "k" [n_layers, batch, max_len, heads, k size] and "v"
    [..., v size] in the compute dtype (unless `dtype` is given), and `length`, the slots filled so
    far. The sizes are `shape`'s (the family's `AttentionShape.cache_dims`: latent attention's keys
    are wider than its values, and it caches its latent instead), by default model.n_kv_heads heads
    of model.head_dim."""
    shape = shape or AttentionShape(cfg.n_heads, cfg.head_dim, cfg.head_dim, ())
    heads, k_dim, v_dim = shape.cache_dims(cfg.n_kv_heads)
    rows = (cfg.n_layers, batch, max_len, heads)
    dtype = jnp.dtype(cfg.compute_dtype if dtype is None else dtype)
    return {"k": jnp.zeros((*rows, k_dim), dtype), "v": jnp.zeros((*rows, v_dim), dtype),
            "length": jnp.zeros((), jnp.int32)}


class Decoder(nnx.Module):
    """`stacks` (`Stack`s, in order) between the embedding and the head. `norm_offset`: the final
    norm's (RMSNorm's `offset`); `embed_scale`: the embedding's rows are multiplied by sqrt(d_model)
    (Gemma's), in the compute dtype; `mtp_block(rngs)`: the block of a multi-token prediction module
    (ushard/models/mtp.py), where the family has one."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, stacks: list[Stack], norm_offset: float = 0.0,
                 embed_scale: bool = False, mtp_block=None):
        dtype = jnp.dtype(cfg.param_dtype)
        self.cfg = cfg
        self.compute_dtype = jnp.dtype(cfg.compute_dtype)
        self.tie_embeddings = cfg.tie_embeddings
        self.embed_scale = cfg.d_model**0.5 if embed_scale else None
        self.embedding = param(
            rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), jax.nn.initializers.normal(0.02), dtype
        )
        self.stack_layout = tuple((s.name, s.items * s.per_item, s.per_item) for s in stacks)
        for s in stacks:
            setattr(self, s.name, stacked(s.items, s.make, rngs))
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps, dtype, rngs, offset=norm_offset)
        if not cfg.tie_embeddings:
            self.lm_head = param(rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), fan_in_init(cfg.d_model),
                                 dtype)
        if cfg.mtp.depth and mtp_block is None:
            raise UserError(f"model.mtp.depth={cfg.mtp.depth}: model.family={cfg.family!r} has no multi-token "
                            "prediction; use model.family 'deepseek', 'llama' or 'qwen3', or set model.mtp.depth=0.")
        self.mtp_names = mtp_names(cfg.mtp.depth)
        for name in self.mtp_names:
            setattr(self, name, MTPModule(cfg, rngs, mtp_block, norm_offset))

    # The three parts a pipeline schedule calls separately (ModelDef.embed / layers / head).
    def embed(self, tokens):
        # Vocab-parallel: each tensor rank looks up the tokens in its rows of the table (zeros for the
        # rest) and the partial rows are summed, at full length and then into the residual stream's
        # layout (a reduce-scatter with sequence parallelism). Constrained straight to the residual
        # layout, XLA would gather the whole table instead.
        table = gathered(self.embedding[...].astype(self.compute_dtype), ("vocab", "embed"))
        rows = constrain(embed_lookup(table, tokens), ("act_batch", "act_length", "act_embed"))
        if self.embed_scale is not None:
            rows = rows * jnp.asarray(self.embed_scale, rows.dtype)
        return constrain(rows, BTD)

    def head(self, x):
        """Logits of the layers' output x, through the final norm."""
        return self.logits(self.final_norm(x))

    def logits(self, x):
        """Logits of a normed representation x (the final norm's output, or an MTP module's)."""
        head = self.embedding[...].T if self.tie_embeddings else self.lm_head[...]
        head = gathered(head.astype(self.compute_dtype), ("embed", "vocab"))
        logits = jnp.einsum("btd,dv->btv", x, head)
        return constrain(logits, LOGITS_NAMES)

    def _stacks(self) -> list[tuple[nnx.Module, int, int]]:
        """The stacked layers in order: (stack, layers it holds, layers one of its items holds)."""
        return [(getattr(self, name), layers, per_item) for name, layers, per_item in self.stack_layout]

    def layers(self, x, positions, segment_ids, only: str | None = None):
        """x through the layer stacks in order (`only`: through that one alone, a pipeline stage's):
        (x, aux summed over layers)."""
        cfg, aux = self.cfg, {}
        for name, _, _ in self.stack_layout:
            if only is not None and name != only:
                continue
            stack = getattr(self, name)
            x, stack_aux = run_layers(stack, x, positions, segment_ids,
                                      remat=cfg.remat, unroll=cfg.scan_unroll, compute_dtype=self.compute_dtype)
            aux = sum_aux(aux, stack_aux)
        return x, aux

    def mtp_logits(self, x, positions, segment_ids, next_tokens) -> list:
        """Each MTP module's logits (ushard/models/mtp.py): x the layers' output (before the final norm),
        `next_tokens` the tokens each depth embeds, in order of depth ([batch, length] each)."""
        embedded = [self.embed(tokens) for tokens in next_tokens]
        return [self.logits(state) for state in self.mtp_states(x, positions, segment_ids, embedded)]

    def mtp_states(self, x, positions, segment_ids, embedded) -> list:
        """Each MTP module's representation through its own final norm (what the head takes): x the
        layers' output, `embedded` the embeddings of the tokens each depth takes, in order of depth.
        Uses the modules' weights only (a pipeline's last stage runs this inside its slots)."""
        states = []
        for name, rows in zip(self.mtp_names, embedded, strict=True):
            module = getattr(self, name)
            x = module(x, rows, positions, segment_ids)
            states.append(module.final_norm(x))
        return states

    def __call__(self, tokens, positions, segment_ids=None):
        """tokens, positions, segment_ids: int [batch, length] -> (logits [batch, length, vocab], aux),
        aux a dict of scalar loss terms (empty for a dense model; an MoE model's: ushard/models/moe.py)."""
        x, aux = self.layers(self.embed(tokens), positions, segment_ids)
        return self.head(x), aux

    def decode(self, tokens, positions, cache):
        """Inference with a KV cache: (logits [batch, T, vocab], the updated cache).

        tokens, positions: int [batch, T], the T tokens that follow the cache's `length` filled slots
        (from `init_cache`). Each attends causally to the cached tokens and to the new ones up to
        itself, as in `__call__` over the whole sequence (one document, no segment ids). Prefill is one
        call with the whole prompt on an empty cache; generation then feeds one token at a time.
        """
        x, length = self.embed(tokens), cache["length"]
        ks, vs, first = [], [], 0
        for stack, count, per_item in self._stacks():
            layers = slice(first, first + count)
            first += count
            x, k, v = _decode_stack(stack, per_item, x, positions, cache["k"][layers], cache["v"][layers], length)
            ks.append(k)
            vs.append(v)
        k, v = jnp.concatenate(ks), jnp.concatenate(vs)
        return self.head(x), {"k": k, "v": v, "length": length + tokens.shape[1]}
