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
from ushard.models.layers import BTD, RMSNorm, SwiGLU, embed_lookup, fan_in_init, param
from ushard.sharding import constrain, gathered, keep_gathered_weights



def _is_fused_attention(prim, *_, **__) -> bool:
    # The forward of a fused attention kernel (cuDNN's is `dot_product_attention_fwd`): its output and
    # softmax statistics are small next to what recomputing it costs.
    return "attention" in prim.name


# What the backward pass may keep from the forward; everything else is recomputed.
REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_saveable,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "dots_attention": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable, _is_fused_attention
    ),
}
# ...and also the norm outputs and the SwiGLU product (tagged in models/layers.py): only rotary
# embeddings and activation functions are recomputed.
REMAT_POLICIES["dots_attention_norms"] = jax.checkpoint_policies.save_from_both_policies(
    REMAT_POLICIES["dots_attention"], jax.checkpoint_policies.save_only_these_names("norm_out", "mlp_hidden")
)


class Block(nnx.Module):
    def __init__(self, cfg, rngs: nnx.Rngs):
        dtype = jnp.dtype(cfg.param_dtype)
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, dtype, rngs)
        self.attn = Attention(cfg, dtype, rngs)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, dtype, rngs)
        self.mlp = SwiGLU(cfg.d_model, cfg.d_ff, dtype, rngs, fused=cfg.fused_mlp, fp8=cfg.fp8)

    def __call__(self, x, positions, segment_ids):
        x = constrain(x + self.attn(self.attn_norm(x), positions, segment_ids), BTD)
        return constrain(x + self.mlp(self.mlp_norm(x)), BTD)

    def decode(self, x, positions, k_cache, v_cache, length):
        """The block for new tokens with this layer's KV cache (see `Attention.decode`)."""
        attn, k_cache, v_cache = self.attn.decode(self.attn_norm(x), positions, k_cache, v_cache, length)
        x = constrain(x + attn, BTD)
        return constrain(x + self.mlp(self.mlp_norm(x)), BTD), k_cache, v_cache


def init_cache(cfg, batch: int, max_len: int, dtype=None) -> dict:
    """An empty KV cache for `Llama.decode`: keys and values [n_layers, batch, max_len, n_kv_heads,
    head_dim] in the compute dtype (unless `dtype` is given), and `length`, the slots filled so far."""
    shape = (cfg.n_layers, batch, max_len, cfg.n_kv_heads, cfg.d_model // cfg.n_heads)
    dtype = jnp.dtype(cfg.compute_dtype if dtype is None else dtype)
    return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype), "length": jnp.zeros((), jnp.int32)}


class Llama(nnx.Module):
    def __init__(self, cfg, rngs: nnx.Rngs):
        dtype = jnp.dtype(cfg.param_dtype)
        self.compute_dtype = jnp.dtype(cfg.compute_dtype)
        self.remat = cfg.remat
        self.scan_unroll = cfg.scan_unroll
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

    def _embed(self, tokens):
        return constrain(embed_lookup(self.embedding[...].astype(self.compute_dtype), tokens), BTD)

    def _logits(self, x):
        x = self.final_norm(x)
        head = self.embedding[...].T if self.tie_embeddings else self.lm_head[...]
        logits = jnp.einsum("btd,dv->btv", x, head.astype(self.compute_dtype))
        return constrain(logits, ("act_batch", "act_length", "act_vocab"))

    def __call__(self, tokens, positions, segment_ids=None):
        """tokens, positions, segment_ids: int [batch, length] -> logits [batch, length, vocab]."""
        x = self._embed(tokens)

        graphdef, layer_states = nnx.split(self.blocks)

        def one_layer(x, layer_state):
            return nnx.merge(graphdef, layer_state)(x, positions, segment_ids), None

        if self.remat != "none":
            # Unrolled layers are one graph: unless CSE is blocked there, XLA merges the backward pass's
            # recomputation with the forward pass and keeps every activation, as if remat were off
            # (bench_1b on an H100: 49.3 GiB with any policy; 41.3 with dots_attention, 20.4 with full
            # once blocked). A rolled scan keeps the two apart itself, and blocking costs speed there.
            one_layer = jax.checkpoint(one_layer, policy=REMAT_POLICIES[self.remat], prevent_cse=self.scan_unroll > 1)
        if keep_gathered_weights():
            # Gathered outside the remat boundary, the weights become inputs the backward pass keeps.
            layer_body = one_layer
            one_layer = lambda x, layer_state: layer_body(x, self._weights_for_compute(layer_state))  # noqa: E731
        x, _ = jax.lax.scan(one_layer, x, layer_states, unroll=self.scan_unroll)
        return self._logits(x)

    def _weights_for_compute(self, layer_state):
        """One layer's matmul weights cast to the compute dtype and gathered (norm scales as they are)."""

        def prepare(variable):
            names = variable.get_metadata()["out_sharding"][1:]  # without the stacked `layers` axis
            if "norm" in names:
                return variable
            return variable.replace(gathered(variable[...].astype(self.compute_dtype), names))

        return jax.tree.map(prepare, layer_state, is_leaf=lambda v: isinstance(v, nnx.Variable))

    def decode(self, tokens, positions, cache):
        """Inference with a KV cache: (logits [batch, T, vocab], the updated cache).

        tokens, positions: int [batch, T], the T tokens that follow the cache's `length` filled slots
        (from `init_cache`). Each attends causally to the cached tokens and to the new ones up to
        itself, as in `__call__` over the whole sequence (one document, no segment ids). Prefill is one
        call with the whole prompt on an empty cache; generation then feeds one token at a time.
        """
        x = self._embed(tokens)
        graphdef, layer_states = nnx.split(self.blocks)
        length = cache["length"]

        def one_layer(x, layer):
            layer_state, k_cache, v_cache = layer
            x, k_cache, v_cache = nnx.merge(graphdef, layer_state).decode(x, positions, k_cache, v_cache, length)
            return x, (k_cache, v_cache)

        x, (k, v) = jax.lax.scan(one_layer, x, (layer_states, cache["k"], cache["v"]))
        return self._logits(x), {"k": k, "v": v, "length": length + tokens.shape[1]}
