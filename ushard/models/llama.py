"""A Llama-3-style decoder: embeddings, a scanned stack of pre-norm blocks, final norm, LM head.

Layers are created stacked (one array per weight with a leading `layers` axis) and run with
`jax.lax.scan`, so compile time does not grow with depth. Parameters are stored in `param_dtype` and
cast to `compute_dtype` where they are used.

With `model.moe.num_experts` > 0, MoE blocks (ushard/models/moe.py) take the dense MLP's place on
the layers `model.moe` names: `dense_blocks` stacks the `first_dense_layers` leading dense layers,
`blocks` the rest, each item one period of `every` layers (an MoE layer, then every-1 dense ones).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ushard.models.attention import Attention
from ushard.models.config import ModelConfig
from ushard.models.layers import BTD, RMSNorm, SwiGLU, embed_lookup, fan_in_init, param
from ushard.models.moe import MoE
from ushard.models.stack import run_layers
from ushard.sharding import LOGITS_NAMES, constrain, gathered


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, moe: bool = False):
        dtype = jnp.dtype(cfg.param_dtype)
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, dtype, rngs)
        self.attn = Attention(cfg, dtype, rngs)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, dtype, rngs)
        if moe:
            self.mlp = MoE(cfg, dtype, rngs)
        else:
            self.mlp = SwiGLU(cfg.d_model, cfg.d_ff, dtype, rngs, fused=cfg.fused_mlp, fp8=cfg.fp8)

    def _feed_forward(self, x):
        """x + the MLP's output, and the MLP's aux terms (an MoE block's; a dense MLP adds none)."""
        out = self.mlp(self.mlp_norm(x))
        y, aux = out if isinstance(out, tuple) else (out, {})
        return constrain(x + y, BTD), aux

    def __call__(self, x, positions, segment_ids):
        """-> (x, aux)."""
        x = constrain(x + self.attn(self.attn_norm(x), positions, segment_ids), BTD)
        return self._feed_forward(x)

    def decode(self, x, positions, k_cache, v_cache, length):
        """The block for new tokens with this layer's KV cache (see `Attention.decode`)."""
        attn, k_cache, v_cache = self.attn.decode(self.attn_norm(x), positions, k_cache, v_cache, length)
        x = constrain(x + attn, BTD)
        return self._feed_forward(x)[0], k_cache, v_cache


class MoEPeriod(nnx.Module):
    """One item of an MoE model's stack when `model.moe.every` > 1: an MoE layer, then every-1 dense ones."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.names = tuple(f"layer{j}" for j in range(cfg.moe.every))
        for j, name in enumerate(self.names):
            setattr(self, name, Block(cfg, rngs, moe=j == 0))

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
    """x through a stack for new tokens (see `Llama.decode`); caches [its layers, ...] -> (x, k, v)."""
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


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=None) -> dict:
    """An empty KV cache for `Llama.decode`: keys and values [n_layers, batch, max_len, n_kv_heads,
    head_dim] in the compute dtype (unless `dtype` is given), and `length`, the slots filled so far."""
    shape = (cfg.n_layers, batch, max_len, cfg.n_kv_heads, cfg.head_dim)
    dtype = jnp.dtype(cfg.compute_dtype if dtype is None else dtype)
    return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype), "length": jnp.zeros((), jnp.int32)}


class Llama(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        dtype = jnp.dtype(cfg.param_dtype)
        self.cfg = cfg
        self.compute_dtype = jnp.dtype(cfg.compute_dtype)
        self.tie_embeddings = cfg.tie_embeddings
        self.embedding = param(
            rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), jax.nn.initializers.normal(0.02), dtype
        )
        moe = cfg.moe
        if not moe.num_experts:
            self.blocks = stacked(cfg.n_layers, lambda r: Block(cfg, r), rngs)
        else:
            if moe.first_dense_layers:
                self.dense_blocks = stacked(moe.first_dense_layers, lambda r: Block(cfg, r), rngs)
            period = (lambda r: Block(cfg, r, moe=True)) if moe.every == 1 else (lambda r: MoEPeriod(cfg, r))
            self.blocks = stacked(cfg.moe_layers, period, rngs)
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps, dtype, rngs)
        if not cfg.tie_embeddings:
            self.lm_head = param(rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), fan_in_init(cfg.d_model),
                                 dtype)

    # The three parts a pipeline schedule calls separately (ModelDef.embed / layers / head).
    def embed(self, tokens):
        # Vocab-parallel: each tensor rank looks up the tokens in its rows of the table (zeros for the
        # rest) and the partial rows are summed, at full length and then into the residual stream's
        # layout (a reduce-scatter with sequence parallelism). Constrained straight to the residual
        # layout, XLA would gather the whole table instead.
        table = gathered(self.embedding[...].astype(self.compute_dtype), ("vocab", "embed"))
        rows = constrain(embed_lookup(table, tokens), ("act_batch", "act_length", "act_embed"))
        return constrain(rows, BTD)

    def head(self, x):
        x = self.final_norm(x)
        head = self.embedding[...].T if self.tie_embeddings else self.lm_head[...]
        head = gathered(head.astype(self.compute_dtype), ("embed", "vocab"))
        logits = jnp.einsum("btd,dv->btv", x, head)
        return constrain(logits, LOGITS_NAMES)

    def _stacks(self) -> list[tuple[nnx.Module, int, int]]:
        """The stacked layers in order: (stack, layers it holds, layers one of its items holds)."""
        moe = self.cfg.moe
        if not moe.num_experts:
            return [(self.blocks, self.cfg.n_layers, 1)]
        dense = [(self.dense_blocks, moe.first_dense_layers, 1)] if moe.first_dense_layers else []
        return dense + [(self.blocks, self.cfg.n_layers - moe.first_dense_layers, moe.every)]

    def layers(self, x, positions, segment_ids):
        """x through the layer stacks in order: (x, aux summed over layers)."""
        cfg, aux = self.cfg, {}
        for stack, _, _ in self._stacks():
            x, stack_aux = run_layers(stack, x, positions, segment_ids,
                                      remat=cfg.remat, unroll=cfg.scan_unroll, compute_dtype=self.compute_dtype)
            aux = sum_aux(aux, stack_aux)
        return x, aux

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
