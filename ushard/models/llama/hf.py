"""Llama 2, Llama 3 and 3.1-3.3, Mistral (without a sliding window) and Mixtral checkpoints.

ushard's Llama computes the same function as transformers' `LlamaForCausalLM` given the same weights
(rotate-half RoPE, 1/sqrt(head_dim) scale, RMSNorm weight after normalising). Mixtral is that model
with an MoE block (ushard/models/moe.py) in every layer, routed as transformers'
`MixtralForCausalLM` routes: softmax over all experts in float32, the top k, their gates renormalised
to sum 1, no drops; each expert's HF tensors are one slice of the stacked experts' weight.
"""

from __future__ import annotations

from ushard.models.config import ModelConfig
from ushard.models.family import HFMap
from ushard.models.hf_names import (
    attention_tensors,
    end_tensors,
    expert_tensors,
    gated_mlp_tensors,
    model_rope,
    norm_tensor,
    refuse,
    refuse_common,
    refuse_other_routing,
    require_whole,
    rope_json,
    sizes,
    stacked_tensors,
)
from ushard.models.llama.model import is_moe_layer, stacks

# transformers' MixtralConfig defaults where they differ from Llama's, for a config.json that omits them.
MIXTRAL_DEFAULTS = {"rms_norm_eps": 1e-5, "rope_theta": 1e6, "num_local_experts": 8, "num_experts_per_tok": 2}
# How Mixtral routes, as model.moe settings: every layer MoE, softmax scores, the top k renormalised,
# dropless, no shared experts, no group limit.
MIXTRAL_ROUTING = {"score_func": "softmax", "normalize_gates": True, "routed_scale": 1.0, "capacity_factor": 0.0,
                   "num_shared_experts": 0, "every": 1, "first_dense_layers": 0, "num_groups": 1, "top_groups": 1}


def settings(hf: dict, directory: str) -> dict:
    """ModelConfig keywords for a Llama, Mistral or Mixtral config.json; refuses what ushard's Llama
    does not compute, naming the field."""
    if hf.get("model_type") == "mixtral":
        hf = {**MIXTRAL_DEFAULTS, **hf}
    require_whole(hf, directory, ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size",
                                  "vocab_size"))
    refuse_common(hf, directory)
    if hf.get("sliding_window") is not None:
        refuse(directory, "sliding_window", hf["sliding_window"], "ushard's Llama attends to the whole context; "
               "set it to null if the model was trained without one")
    moe = {}
    if hf["model_type"] == "mixtral":
        require_whole(hf, directory, ("num_local_experts", "num_experts_per_tok"))
        if hf.get("router_jitter_noise", 0.0):
            refuse(directory, "router_jitter_noise", hf["router_jitter_noise"], "ushard's router adds no noise")
        moe = {"num_experts": hf["num_local_experts"], "top_k": hf["num_experts_per_tok"], **MIXTRAL_ROUTING}
    theta, scaling = model_rope(hf, directory)
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    return dict(sizes(hf), head_dim=head_dim, rope_theta=theta, rope_scaling=scaling,
                tie_embeddings=bool(hf.get("tie_word_embeddings", False)), moe=moe)


def config(cfg: ModelConfig, dtype: str, max_positions: int) -> dict:
    """config.json for `cfg` as a `LlamaForCausalLM` or, with experts, a `MixtralForCausalLM`, in the
    top-level RoPE spelling that transformers 4 and 5 both read."""
    if cfg.moe.num_experts:
        kind = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "intermediate_size": cfg.expert_d_ff,
                "num_local_experts": cfg.moe.num_experts, "num_experts_per_tok": cfg.moe.top_k,
                "router_jitter_noise": 0.0, "sliding_window": None}
    else:
        kind = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "intermediate_size": cfg.d_ff}
    return {**kind, **common_config(cfg, dtype, max_positions), "mlp_bias": False}


def common_config(cfg: ModelConfig, dtype: str, max_positions: int) -> dict:
    """The config.json fields the Llama-style families (llama, qwen3) write alike."""
    return {
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
        "hidden_act": "silu", "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
        "rope_scaling": rope_json(cfg.rope_scaling), "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": False, "max_position_embeddings": max_positions, "torch_dtype": dtype,
    }


def check_export(cfg: ModelConfig) -> None:
    """Refuses to export an MoE model that transformers' Mixtral would compute differently."""
    refuse_other_routing(cfg, MIXTRAL_ROUTING, "Hugging Face's Mixtral, the one MoE architecture of the llama family,")


def layer_tensors(cfg: ModelConfig, moe_tensors, qk_norm: bool = False) -> list:
    """Every layer's tensors in its stack (ushard/models/llama/model.py's `stacks`): `moe_tensors()`
    gives an MoE layer's MLP tensors."""
    def layer(i: int):
        mlp = moe_tensors() if is_moe_layer(cfg, i) else gated_mlp_tensors(cfg.fused_mlp)
        return [norm_tensor("input_layernorm", "attn_norm"), *attention_tensors(qk_norm),
                norm_tensor("post_attention_layernorm", "mlp_norm"), *mlp]

    return stacked_tensors(stacks(cfg), layer)


def tensors(cfg: ModelConfig) -> list:
    """Every HF tensor of a Llama-family checkpoint of `cfg`."""
    mixtral = lambda: expert_tensors(cfg.moe.num_experts, "block_sparse_moe", "gate", ("w1", "w2", "w3"))  # noqa: E731
    return [*end_tensors(cfg.tie_embeddings), *layer_tensors(cfg, mixtral)]


HF = HFMap(model_types=("llama", "mistral", "mixtral"), settings=settings, config=config, tensors=tensors,
           check_export=check_export)
