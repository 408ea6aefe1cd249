"""A Llama-3-style decoder: embeddings, a scanned stack of pre-norm blocks, final norm, LM head.

Layers are created stacked (one array per weight with a leading `layers` axis) and run with
`jax.lax.scan`, so compile time does not grow with depth. Parameters are stored in `param_dtype` and
cast to `compute_dtype` where they are used.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ushard.models.attention import Attention
from ushard.models.config import ModelConfig
from ushard.models.layers import BTD, RMSNorm, SwiGLU, embed_lookup, fan_in_init, param
from ushard.models.stack import run_layers
from ushard.sharding import constrain, gathered


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        dtype = jnp.dtype(cfg.param_dtype)
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, dtype, rngs)
        self.attn = Attention(cfg, dtype, rngs)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, dtype, rngs)
        self.mlp = SwiGLU(cfg.d_model, cfg.d_ff, dtype, rngs, fused=cfg.fused_mlp, fp8=cfg.fp8)

    def __call__(self, x, positions, segment_ids):
        """-> (x, aux): a dense block adds no auxiliary loss terms."""
        x = constrain(x + self.attn(self.attn_norm(x), positions, segment_ids), BTD)
        return constrain(x + self.mlp(self.mlp_norm(x)), BTD), {}

    def decode(self, x, positions, k_cache, v_cache, length):
        """The block for new tokens with this layer's KV cache (see `Attention.decode`)."""
        attn, k_cache, v_cache = self.attn.decode(self.attn_norm(x), positions, k_cache, v_cache, length)
        x = constrain(x + attn, BTD)
        return constrain(x + self.mlp(self.mlp_norm(x)), BTD), k_cache, v_cache


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

        @nnx.split_rngs(splits=cfg.n_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def stacked_blocks(rngs):
            return Block(cfg, rngs)

        self.blocks = stacked_blocks(rngs)
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps, dtype, rngs)
        if not cfg.tie_embeddings:
            self.lm_head = param(rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), fan_in_init(cfg.d_model), dtype)

    # The three parts a pipeline schedule calls separately (ModelDef.embed / layers / head).
    def embed(self, tokens):
        # Vocab-parallel: each tensor rank looks up the tokens in its rows of the table (zeros for the
        # rest) and the partial rows are summed, at full length and then into the residual stream's
        # layout (a reduce-scatter with sequence parallelism). Constrained straight to the residual
        # layout, XLA would gather the whole table instead.
        table = gathered(self.embedding[...].astype(self.compute_dtype), ("vocab", "embed"))
        rows = constrain(embed_lookup(table, tokens), ("act_batch", "act_length", "act_embed"))
        return constrain(rows, BTD)

    def layers(self, x, positions, segment_ids):
        """x through the layer stack: (x, aux)."""
        cfg = self.cfg
        return run_layers(self.blocks, x, positions, segment_ids,
                          remat=cfg.remat, unroll=cfg.scan_unroll, compute_dtype=self.compute_dtype)

    def head(self, x):
        x = self.final_norm(x)
        head = self.embedding[...].T if self.tie_embeddings else self.lm_head[...]
        head = gathered(head.astype(self.compute_dtype), ("embed", "vocab"))
        logits = jnp.einsum("btd,dv->btv", x, head)
        return constrain(logits, ("act_batch", "act_length", "act_vocab"))

    def __call__(self, tokens, positions, segment_ids=None):
        """tokens, positions, segment_ids: int [batch, length] -> (logits [batch, length, vocab], aux),
        aux a dict of scalar loss terms (empty for this dense model)."""
        x, aux = self.layers(self.embed(tokens), positions, segment_ids)
        return self.head(x), aux

    def decode(self, tokens, positions, cache):
        """Inference with a KV cache: (logits [batch, T, vocab], the updated cache).

        tokens, positions: int [batch, T], the T tokens that follow the cache's `length` filled slots
        (from `init_cache`). Each attends causally to the cached tokens and to the new ones up to
        itself, as in `__call__` over the whole sequence (one document, no segment ids). Prefill is one
        call with the whole prompt on an empty cache; generation then feeds one token at a time.
        """
        x = self.embed(tokens)
        graphdef, layer_states = nnx.split(self.blocks)
        length = cache["length"]

        def one_layer(x, layer):
            layer_state, k_cache, v_cache = layer
            x, k_cache, v_cache = nnx.merge(graphdef, layer_state).decode(x, positions, k_cache, v_cache, length)
            return x, (k_cache, v_cache)

        x, (k, v) = jax.lax.scan(one_layer, x, (layer_states, cache["k"], cache["v"]))
        return self.head(x), {"k": k, "v": v, "length": length + tokens.shape[1]}
