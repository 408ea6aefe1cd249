"""The model as plain pytrees: a definition to merge params into, their logical names and shapes.

Params travel through jit as a pure dict of arrays (flattening NNX state on every call costs host
time); `ModelDef.apply` rebuilds the NNX module inside the traced function.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from ushard.models.config import ModelConfig
from ushard.models.decoder import Decoder, init_cache
from ushard.models.low_rank import LowRankAdapted
from ushard.models.moe import ExpertBias
from ushard.models.mtp import mtp_tokens
from ushard.models.registry import family
from ushard.models.stack import weight_for_compute


def _build(cfg: ModelConfig, seed: int) -> Decoder:
    # Shardings are applied by ushard from the logical names, not eagerly by Flax at construction.
    with nnx.use_eager_sharding(False):
        return family(cfg.family).build(cfg, nnx.Rngs(params=seed))


def dotted(path) -> str:
    """A pytree key path as "blocks.mlp.w_up": how messages (and the Hugging Face name map) name a parameter."""
    return ".".join(str(getattr(k, "key", k)) for k in path)


def tree_paths(tree) -> dict[str, object]:
    """{"blocks.mlp.w_up": leaf, ...}: a nested dict's leaves by dotted path."""
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, tuple))[0]
    return {dotted(path): leaf for path, leaf in leaves}


class ModelDef:
    """Everything about the model that is not its weights."""

    STACK = "blocks"  # the stacked layers' subtree of the params: what a pipeline splits into stages

    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg
        self.family = family(cfg.family)
        self.family.check(cfg)
        abstract = self._abstract_module = nnx.eval_shape(lambda: _build(cfg, 0))
        self.graphdef, self._abstract_state = nnx.split(abstract)
        variables = nnx.to_pure_dict(self._abstract_state, extract_fn=lambda v: v)
        is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
        self.logical = jax.tree.map(lambda v: tuple(v.get_metadata()["out_sharding"]), variables, is_leaf=is_var)
        self.shapes = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), variables, is_leaf=is_var)
        # Which leaves are trained by the optimizer, and which are MoE routing biases (moved by load).
        self.trained = jax.tree.map(lambda v: isinstance(v, nnx.Param), variables, is_leaf=is_var)
        self.expert_biases = jax.tree.map(lambda v: isinstance(v, ExpertBias), variables, is_leaf=is_var)

    def named_shapes(self) -> dict[str, tuple]:
        """{"parameter <path>": (logical names, shape)}: what the divisibility check takes."""
        names, shapes = tree_paths(self.logical), tree_paths(self.shapes)
        return {f"parameter {path}": (names[path], shapes[path].shape) for path in names}

    def init(self, seed: int):
        """Fresh parameters as a pure dict (call under jit with out_shardings to create them sharded)."""
        return nnx.to_pure_dict(nnx.split(_build(self.cfg, seed))[1])

    def module(self, params) -> Decoder:
        """The NNX model holding `params` (inside a traced function)."""
        state = jax.tree.map(lambda x: x, self._abstract_state)  # a fresh container to fill
        nnx.replace_by_pure_dict(state, params)
        return nnx.merge(self.graphdef, state)

    def apply(self, params, tokens, positions, segment_ids=None):
        """-> (logits [batch, length, vocab], aux: dict of scalar loss terms)."""
        return self.module(params)(tokens, positions, segment_ids)

    def apply_for_training(self, params, batch):
        """What training computes of a batch (`with_mtp_fields`'s, ushard/models/mtp.py): (logits, aux,
        the multi-token prediction modules' logits, one [batch, length, vocab] per depth)."""
        module = self.module(params)
        x, aux = module.layers(module.embed(batch["inputs"]), batch["positions"], batch["segment_ids"])
        return module.head(x), aux, self._mtp_logits(module, x, batch)

    def apply_before_mtp(self, params, batch):
        """`apply_for_training` without the MTP modules: (logits, aux, the layers' output x, which the
        modules take: `mtp_states`)."""
        module = self.module(params)
        x, aux = module.layers(module.embed(batch["inputs"]), batch["positions"], batch["segment_ids"])
        return module.head(x), aux, x

    # A pipeline's last stage (1F1B) runs `apply_for_training`'s end in two parts: the MTP modules
    # inside its slots (`mtp_states`, on the embeddings `mtp_embeddings` looks up outside them), then
    # `head_for_training` on the layers' output and the modules' states.
    def split_mtp(self, others) -> tuple[dict, dict]:
        """(the MTP modules' params, every other param of `others`)."""
        names = self._abstract_module.mtp_names
        return {k: v for k, v in others.items() if k in names}, {k: v for k, v in others.items() if k not in names}

    def mtp_embeddings(self, others, batch) -> list:
        """The embeddings of the tokens each MTP depth takes ([batch, length, d_model] each)."""
        module = self.module(others)
        return [module.embed(tokens) for tokens in mtp_tokens(batch, self.cfg.mtp.depth)]

    def mtp_states(self, mtp, x, embedded, batch) -> list:
        """The MTP modules' normed representations (`Decoder.mtp_states`) from their params `mtp` alone."""
        return self.module(mtp).mtp_states(x, batch["positions"], batch["segment_ids"], embedded)

    def head_for_training(self, others, x, states):
        """(logits of the layers' output x, the MTP modules' logits of their `states`)."""
        module = self.module(others)
        return module.head(x), [module.logits(s) for s in states]

    def mtp_head(self, others, states) -> list:
        """The MTP modules' logits of their `states` (the shared head alone)."""
        module = self.module(others)
        return [module.logits(s) for s in states]

    def _mtp_logits(self, module, x, batch) -> list:
        tokens = mtp_tokens(batch, self.cfg.mtp.depth)
        return module.mtp_logits(x, batch["positions"], batch["segment_ids"], tokens)

    # The model in three parts, for a pipeline schedule that runs them per microbatch on different
    # stages (1F1B): apply = head(layers(embed(tokens))). Each takes only the params it uses.
    def split_stack(self, params) -> tuple[dict, dict]:
        """(the stacked layers' params, every other param)."""
        return params[self.STACK], {k: v for k, v in params.items() if k != self.STACK}

    def join_stack(self, stack, others) -> dict:
        return {**others, self.STACK: stack}

    def embed(self, others, tokens):
        return self.module(others).embed(tokens)

    def layers(self, stack, x, positions, segment_ids=None):
        """-> (x, aux). `stack` may hold any number of consecutive layers (a pipeline stage's)."""
        return self.module({self.STACK: stack}).layers(x, positions, segment_ids, only=self.STACK)

    def stack_for_compute(self, stack):
        """The stacked layers' weights as a microbatch uses them (matmul weights in the compute dtype,
        gathered): a pipeline stage prepares them once per slot, outside what it differentiates, so
        that each microbatch's saved residuals refer to them instead of holding copies."""
        dtype = jnp.dtype(self.cfg.compute_dtype)
        return jax.tree.map(lambda w, names: weight_for_compute(w, names, dtype), stack, self.logical[self.STACK],
                            is_leaf=lambda x: isinstance(x, (tuple, LowRankAdapted)))

    def head(self, others, x):
        return self.module(others).head(x)

    def init_cache(self, batch: int, max_len: int) -> dict:
        """An empty KV cache for `decode` (see ushard.models.decoder.init_cache)."""
        return init_cache(self.cfg, batch, max_len, shape=self.family.attention_shape(self.cfg))

    def decode(self, params, tokens, positions, cache):
        """Inference with a KV cache: (logits, updated cache); see `Decoder.decode`."""
        return self.module(params).decode(tokens, positions, cache)

    def stacks(self) -> tuple[tuple[str, int, int], ...]:
        """The layer stacks in order: (params key, layers, layers an item holds)."""
        return self._abstract_module.stack_layout

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (ushard/metrics.py's convention): 6 per matmul parameter (an MTP
        module's included, and the output head once more for each of them), plus attention's."""
        head_again = self.cfg.mtp.depth * self.cfg.d_model * self.cfg.vocab_size
        return 6 * (self.num_matmul_params() + head_again) + self.attention_flops_per_token(seq_len)

    def attention_flops_per_token(self, seq_len: int) -> float:
        """Attention's share of `flops_per_token`, as the family states its shape (ushard/models/family.py);
        an MTP module's block attends to the whole context."""
        shape = self.family.attention_shape(self.cfg)
        shape = dataclasses.replace(shape, windows=shape.windows + (0,) * self.cfg.mtp.depth)
        return shape.flops_per_token(seq_len)

    def num_params(self) -> int:
        return sum(x.size for x in jax.tree.leaves(self.shapes))

    def num_matmul_params(self) -> int:
        """Parameters that multiply one token's activations in a matmul: not norm scales, not an untied
        input table, not routing biases, and of the routed experts' weights (logical axis `experts`)
        only the top_k of num_experts experts a token is sent to. FLOPs and MFU count these
        (ushard/metrics.py)."""
        names = jax.tree.leaves(self.logical, is_leaf=lambda x: isinstance(x, tuple))
        sizes, trained = jax.tree.leaves(self.shapes), jax.tree.leaves(self.trained)
        moe = self.cfg.moe
        active = lambda n, size: size // moe.num_experts * moe.top_k if "experts" in n else size  # noqa: E731
        total = sum(active(n, s.size) for n, s, t in zip(names, sizes, trained) if t and n[-1] != "norm")
        return total if self.cfg.tie_embeddings else total - self.shapes["embedding"].size

    def without_expert_loads(self, grads):
        """`grads` with the MoE routing biases' entries zeroed: what they hold is each expert's observed
        load (ushard/models/moe.py, `load_signal`), not a gradient to clip or descend."""
        return jax.tree.map(lambda is_bias, g: jnp.zeros_like(g) if is_bias else g, self.expert_biases, grads)

    def balance_experts(self, params, before, grads):
        """`params` after an optimizer update, with every MoE routing bias set to its value `before` the
        update moved by model.moe.bias_update_rate against the sign of its entry in `grads` (its
        experts' load above the mean): auxiliary-loss-free balancing. Unchanged for a dense model."""
        rate = self.cfg.moe.bias_update_rate

        def update(is_bias, new, old, load):
            return old - rate * jnp.sign(load) if is_bias else new

        return jax.tree.map(update, self.expert_biases, params, before, grads)


@functools.lru_cache(maxsize=8)
def model_definition(cfg: ModelConfig) -> ModelDef:
    """The ModelDef of `cfg`, built once (tracing the model's construction takes a moment)."""
    return ModelDef(cfg)
