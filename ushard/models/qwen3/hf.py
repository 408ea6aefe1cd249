"""Qwen3 and Qwen3-MoE checkpoints (config.json model_type `qwen3`, `qwen3_moe`).

transformers' Qwen3 is Llama's computation with QK-norm (q_norm, k_norm over the head dimension,
before RoPE) and `head_dim` a setting of its own. Qwen3-MoE's sparse block routes by a softmax over
all experts in float32, takes the top `num_experts_per_tok`, renormalises them when
`norm_topk_prob`, and has no shared experts; layer i is an MoE layer unless it is in
`mlp_only_layers` or (i + 1) is not a multiple of `decoder_sparse_step`. ushard's MoE layout holds
leading dense layers, then periods with the MoE layer first: the HF patterns it takes are
`mlp_only_layers` = the first m layers with `decoder_sparse_step` 1 (every layer after them MoE).
"""

from __future__ import annotations

from ushard.models.config import ModelConfig
from ushard.models.family import HFMap
from ushard.models.hf_names import (
    end_tensors,
    expert_tensors,
    model_rope,
    refuse,
    refuse_common,
    refuse_other_routing,
    require_whole,
    sizes,
)
from ushard.models.llama import hf as llama_hf

# How Qwen3-MoE routes, as model.moe settings (`normalize_gates` comes from norm_topk_prob).
ROUTING = {"score_func": "softmax", "routed_scale": 1.0, "capacity_factor": 0.0, "num_shared_experts": 0,
           "every": 1, "num_groups": 1, "top_groups": 1}


def _experts(hf: dict) -> int:
    """The routed experts' count: `num_experts` in published config.json files, `num_local_experts`
    in transformers 5's."""
    return hf.get("num_experts", hf.get("num_local_experts", 0)) or 0


def settings(hf: dict, directory: str) -> dict:
    require_whole(hf, directory, ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size",
                                  "vocab_size"))
    refuse_common(hf, directory)
    if hf.get("use_sliding_window") and hf.get("sliding_window") is not None:
        refuse(directory, "use_sliding_window", True, "ushard's Qwen3 attends to the whole context")
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    theta, scaling = model_rope(hf, directory)
    values = dict(sizes(hf), head_dim=head_dim, rope_theta=theta, rope_scaling=scaling,
                  tie_embeddings=bool(hf.get("tie_word_embeddings", False)), moe={})
    if hf["model_type"] == "qwen3_moe" and _experts(hf):
        values["moe"] = _moe(hf, directory)
    return values


def _moe(hf: dict, directory: str) -> dict:
    require_whole(hf, directory, ("num_experts_per_tok", "moe_intermediate_size"))
    step, dense = hf.get("decoder_sparse_step", 1), sorted(hf.get("mlp_only_layers") or [])
    if step != 1:
        refuse(directory, "decoder_sparse_step", step, "ushard's Qwen3-MoE makes every layer after the "
               "mlp_only_layers an MoE layer (decoder_sparse_step 1)")
    if dense != list(range(len(dense))) or len(dense) >= hf["num_hidden_layers"]:
        refuse(directory, "mlp_only_layers", dense, "ushard's dense layers are the first ones, before every MoE layer")
    return {"num_experts": _experts(hf), "top_k": hf["num_experts_per_tok"], "expert_d_ff": hf["moe_intermediate_size"],
            "normalize_gates": bool(hf.get("norm_topk_prob", False)), "first_dense_layers": len(dense), **ROUTING}


def config(cfg: ModelConfig, dtype: str, max_positions: int) -> dict:
    common = llama_hf.common_config(cfg, dtype, max_positions)
    if not cfg.moe.num_experts:
        return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "intermediate_size": cfg.d_ff,
                **common, "use_sliding_window": False, "sliding_window": None}
    moe = cfg.moe
    return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "intermediate_size": cfg.d_ff,
            "moe_intermediate_size": cfg.expert_d_ff, "num_experts": moe.num_experts,
            "num_experts_per_tok": moe.top_k, "norm_topk_prob": moe.normalize_gates, "decoder_sparse_step": 1,
            "mlp_only_layers": list(range(moe.first_dense_layers)), **common, "use_sliding_window": False,
            "sliding_window": None}


def check_export(cfg: ModelConfig) -> None:
    """Refuses an MoE model that transformers' Qwen3-MoE would route differently."""
    refuse_other_routing(cfg, ROUTING, "Hugging Face's Qwen3-MoE")


def tensors(cfg: ModelConfig) -> list:
    experts = lambda: expert_tensors(cfg.moe.num_experts, "mlp", "gate", ("gate_proj", "down_proj", "up_proj"))  # noqa: E731
    return [*end_tensors(cfg.tie_embeddings), *llama_hf.layer_tensors(cfg, experts, qk_norm=True)]


HF = HFMap(model_types=("qwen3", "qwen3_moe"), settings=settings, config=config, tensors=tensors,
           check_export=check_export)
