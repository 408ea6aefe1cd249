"""DeepSeek-V2 and DeepSeek-V3 checkpoints (config.json model_type `deepseek_v2`, `deepseek_v3`).

What is read. The sizes; latent attention's (q_lora_rank, null for V2-Lite; kv_lora_rank,
qk_nope_head_dim, qk_rope_head_dim, v_head_dim: `model.mla`); RoPE, plain or YaRN; the MoE layout
(first_k_dense_replace dense layers, then MoE layers of n_routed_experts experts of
moe_intermediate_size and n_shared_experts shared ones) and its routing:
- V3: sigmoid scores, e_score_correction_bias added to choose (ushard's routing bias, read from the
  checkpoint), groups scored by their two best, top-k, renormalised where norm_topk_prob, times
  routed_scaling_factor;
- V2: softmax scores, topk_method `greedy` (no groups) or `group_limited_greedy` (groups scored by
  their best), never renormalised (transformers' DeepseekV2 ignores norm_topk_prob), times
  routed_scaling_factor.
DeepSeek's own training settings where a config.json has them: aux_loss_alpha (the balance loss's
weight) and seq_aux (per sequence); DeepSeek trains without a router z-loss.

The layouts. DeepSeek's checkpoints rotate interleaved pairs of the RoPE dimensions (V3's
rope_interleave, V2's complex rotation); import reorders q's and the shared key's rotary columns to
rotate-half's layout (hf_names.rope_pairs_to_halves), export back, so the same function runs on
ushard's `rotary` and the round trip is exact. V3's experts are saved per expert by transformers 5
(`mlp.experts.{e}.gate_proj`, ...), as this map names them.

Refused, naming the field: quantized checkpoints (V3's FP8: dequantize first), biases, another
activation, a topk_method or scoring_func ushard does not compute, moe_layer_freq other than 1, fewer
KV heads than heads, V3 with rope_interleave false, V2 with norm_topk_prob true.

Multi-token prediction (`model.mtp`, V3's num_nextn_predict_layers): module k is layer
num_hidden_layers + k - 1 of the checkpoint, read and written as DeepSeek-V3 stores it
(`_mtp_tensors`); transformers ignores those layers, and saves none: a checkpoint without them
imports without the modules (ushard/hf.py, `stored_mtp`).
"""

from __future__ import annotations

import dataclasses

from ushard.models.config import ModelConfig
from ushard.models.deepseek.model import stacks
from ushard.models.family import HFMap
from ushard.models.hf_names import (
    LAYER,
    Tensor,
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
    rope_pairs_to_halves,
    sizes,
    stacked_tensors,
)
from ushard.models.llama.model import is_moe_layer

V2, V3 = "deepseek_v2", "deepseek_v3"
# transformers' config defaults, for a config.json that omits a field.
DEFAULTS = {
    V3: {"rms_norm_eps": 1e-6, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
         "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 256, "n_shared_experts": 1,
         "num_experts_per_tok": 8, "moe_intermediate_size": 2048, "first_k_dense_replace": 3, "n_group": 8,
         "topk_group": 4, "norm_topk_prob": True, "routed_scaling_factor": 2.5, "rope_interleave": True},
    V2: {"rms_norm_eps": 1e-6, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
         "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 64, "n_shared_experts": 2,
         "moe_intermediate_size": 1407, "first_k_dense_replace": 0, "topk_method": "greedy",
         "norm_topk_prob": False, "routed_scaling_factor": 1.0},
}
TOPK_METHODS = {V3: ("noaux_tc",), V2: ("greedy", "group_limited_greedy")}
SCORING = {V3: "sigmoid", V2: "softmax"}
ARCHITECTURES = {V3: "DeepseekV3ForCausalLM", V2: "DeepseekV2ForCausalLM"}


def settings(hf: dict, directory: str) -> dict:
    kind = hf["model_type"]
    hf = {**DEFAULTS[kind], **hf}
    if hf.get("quantization_config"):  # before refuse_common: say what to do about DeepSeek-V3's FP8 weights
        refuse(directory, "quantization_config", hf["quantization_config"].get("quant_method", "?"),
               "ushard imports unquantized weights; dequantize the checkpoint to bfloat16 first (DeepSeek-V3's "
               "repository has inference/fp8_cast_bf16.py for its FP8 weights)")
    require_whole(hf, directory, ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size",
                                  "vocab_size", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
    refuse_common(hf, directory)
    heads = hf["num_attention_heads"]
    if (hf.get("num_key_value_heads") or heads) != heads:
        refuse(directory, "num_key_value_heads", hf["num_key_value_heads"], "latent attention expands a key and a "
               f"value for each of the num_attention_heads={heads} heads")
    if kind == V3 and hf.get("rope_interleave") is not True:
        refuse(directory, "rope_interleave", hf.get("rope_interleave"), "ushard reads the rotary columns in "
               "DeepSeek's interleaved pairs, as DeepSeek-V3's checkpoints store them")
    theta, scaling = model_rope(hf, directory, types=("default", "yarn"))
    mla = {"q_lora_rank": hf.get("q_lora_rank") or 0, **{k: hf[k] for k in ("kv_lora_rank", "qk_nope_head_dim",
                                                                           "qk_rope_head_dim", "v_head_dim")}}
    return dict(sizes(hf), rope_theta=theta, rope_scaling=scaling, tie_embeddings=bool(hf.get("tie_word_embeddings")),
                mla=mla, moe=_moe(hf, directory, kind), mtp={"depth": _mtp_depth(hf, directory)})


def _mtp_depth(hf: dict, directory: str) -> int:
    """Multi-token prediction's modules: num_nextn_predict_layers (DeepSeek-V3's config.json: 1)."""
    depth = hf.get("num_nextn_predict_layers") or 0
    if not isinstance(depth, int) or isinstance(depth, bool) or depth < 0:
        refuse(directory, "num_nextn_predict_layers", depth, "it must be a whole number")
    return depth


def _moe(hf: dict, directory: str, kind: str) -> dict:
    """model.moe's settings; {} for a model whose layers are all dense."""
    dense = hf.get("first_k_dense_replace") or 0
    if not hf.get("n_routed_experts") or dense >= hf["num_hidden_layers"]:
        return {}
    require_whole(hf, directory, ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
                                  "n_shared_experts", "first_k_dense_replace"))
    if hf.get("moe_layer_freq", 1) != 1:
        refuse(directory, "moe_layer_freq", hf["moe_layer_freq"], "transformers' DeepSeek makes every layer after "
               "the first_k_dense_replace dense ones an MoE layer, as ushard does (moe_layer_freq 1)")
    method = hf.get("topk_method", TOPK_METHODS[kind][0])
    if method not in TOPK_METHODS[kind]:
        refuse(directory, "topk_method", method, f"ushard routes {kind} by {' or '.join(TOPK_METHODS[kind])}")
    scoring = hf.get("scoring_func", SCORING[kind])
    if scoring != SCORING[kind]:
        refuse(directory, "scoring_func", scoring, f"{kind}'s router scores by {SCORING[kind]}")
    moe = {"num_experts": hf["n_routed_experts"], "top_k": hf["num_experts_per_tok"],
           "expert_d_ff": hf["moe_intermediate_size"], "num_shared_experts": hf["n_shared_experts"],
           "first_dense_layers": dense, "every": 1, "capacity_factor": 0.0, "score_func": scoring,
           "routed_scale": float(hf["routed_scaling_factor"]), "z_loss_weight": 0.0}
    groups = kind == V3 or method == "group_limited_greedy"
    if groups:
        require_whole(hf, directory, ("n_group", "topk_group"))
        moe.update(num_groups=hf["n_group"], top_groups=hf["topk_group"],
                   group_score="top2_sum" if kind == V3 else "max")
    if kind == V3:
        moe["normalize_gates"] = bool(hf["norm_topk_prob"])
    else:
        if hf.get("norm_topk_prob"):
            refuse(directory, "norm_topk_prob", True, "transformers' DeepseekV2 never renormalises the top-k "
                   "gates, while DeepSeek's own code would; ushard follows transformers")
        moe["normalize_gates"] = False
    if isinstance(hf.get("aux_loss_alpha"), (int, float)):  # DeepSeek's training settings, where stated
        moe["aux_loss_weight"] = float(hf["aux_loss_alpha"])
    if isinstance(hf.get("seq_aux"), bool):
        moe["aux_loss_per_sequence"] = hf["seq_aux"]
    return moe


def _kind(cfg: ModelConfig) -> str:
    """The architecture `cfg` is exported as: V2 where the router scores by softmax, else V3."""
    return V2 if cfg.moe.num_experts and cfg.moe.score_func == "softmax" else V3


def config(cfg: ModelConfig, dtype: str, max_positions: int) -> dict:
    kind, moe, mla = _kind(cfg), cfg.moe, cfg.mla
    experts = moe.num_experts
    values = {
        "architectures": [ARCHITECTURES[kind]], "model_type": kind, "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model, "intermediate_size": cfg.d_ff, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_heads, "hidden_act": "silu",
        "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta, "rope_scaling": rope_json(cfg.rope_scaling),
        "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": False, "max_position_embeddings": max_positions,
        "torch_dtype": dtype, "q_lora_rank": mla.q_lora_rank or None, "kv_lora_rank": mla.kv_lora_rank,
        "qk_nope_head_dim": mla.qk_nope_head_dim, "qk_rope_head_dim": mla.qk_rope_head_dim,
        "v_head_dim": mla.v_head_dim,
        # A dense model: every layer one of the leading dense ones.
        "first_k_dense_replace": moe.first_dense_layers if experts else cfg.n_layers,
        "n_routed_experts": experts or 1, "num_experts_per_tok": moe.top_k if experts else 1,
        "moe_intermediate_size": cfg.expert_d_ff, "n_shared_experts": moe.num_shared_experts,
        "routed_scaling_factor": moe.routed_scale, "n_group": moe.num_groups, "topk_group": moe.top_groups,
    }
    if kind == V3:
        return {**values, "norm_topk_prob": moe.normalize_gates, "rope_interleave": True,
                "num_nextn_predict_layers": cfg.mtp.depth}
    method = "group_limited_greedy" if moe.num_groups > 1 else "greedy"
    return {**values, "topk_method": method, "norm_topk_prob": False}


def check_export(cfg: ModelConfig) -> None:
    """Refuses routing that transformers' DeepSeek-V3 (sigmoid) or -V2 (softmax) computes otherwise."""
    kind, moe = _kind(cfg), cfg.moe
    routing = {"every": 1} if kind == V3 else {"every": 1, "normalize_gates": False}
    if moe.num_groups > 1:
        routing["group_score"] = "top2_sum" if kind == V3 else "max"
    refuse_other_routing(cfg, routing, f"Hugging Face's {ARCHITECTURES[kind]}")


def _layer_tensors(cfg: ModelConfig, layer: int) -> list[Tensor]:
    mla, kind = cfg.mla, _kind(cfg)
    attn = LAYER + "self_attn."
    q_order = rope_pairs_to_halves(mla.qk_head_dim, mla.qk_rope_head_dim)
    if mla.q_lora_rank:
        queries = [Tensor(attn + "q_a_proj.weight", "attn.wq_a"), norm_tensor("self_attn.q_a_layernorm", "attn.q_norm"),
                   Tensor(attn + "q_b_proj.weight", "attn.wq_b", order=q_order)]
    else:
        queries = [Tensor(attn + "q_proj.weight", "attn.wq", order=q_order)]
    kv_order = rope_pairs_to_halves(mla.kv_lora_rank + mla.qk_rope_head_dim, mla.qk_rope_head_dim)
    attention = [*queries, Tensor(attn + "kv_a_proj_with_mqa.weight", "attn.wkv_a", order=kv_order),
                 norm_tensor("self_attn.kv_a_layernorm", "attn.kv_norm"),
                 Tensor(attn + "kv_b_proj.weight", "attn.wkv_b"), Tensor(attn + "o_proj.weight", "attn.wo", rows=2)]
    if is_moe_layer(cfg, layer):
        mlp = expert_tensors(cfg.moe.num_experts, "mlp", "gate", ("gate_proj", "down_proj", "up_proj"))
        if kind == V3:
            mlp.append(Tensor(LAYER + "mlp.gate.e_score_correction_bias", "mlp.bias", transposed=False))
        if cfg.moe.num_shared_experts:
            mlp += gated_mlp_tensors(cfg.fused_mlp, prefix="mlp.shared", block="mlp.shared_experts")
    else:
        mlp = gated_mlp_tensors(cfg.fused_mlp)
    return [norm_tensor("input_layernorm", "attn_norm"), *attention,
            norm_tensor("post_attention_layernorm", "mlp_norm"), *mlp]


def tensors(cfg: ModelConfig) -> list[Tensor]:
    return [*end_tensors(cfg.tie_embeddings), *stacked_tensors(stacks(cfg), lambda i: _layer_tensors(cfg, i)),
            *[t for k in range(1, cfg.mtp.depth + 1) for t in _mtp_tensors(cfg, k)]]


def _mtp_tensors(cfg: ModelConfig, k: int) -> list[Tensor]:
    """Multi-token prediction module k (ushard/models/mtp.py, `mtp<k>`) as DeepSeek-V3's checkpoints
    store it: layer num_hidden_layers + k - 1, with its norms (enorm for the embedding, hnorm for the
    hidden state, shared_head.norm before the head), eh_proj over [embedding; hidden state], its
    block's tensors, and copies of the embedding and the head, which the module shares with the model
    (written on export; on import the model's own are read)."""
    layer, module = cfg.n_layers + k - 1, f"mtp{k}"
    prefix = f"model.layers.{layer}."
    head = Tensor(prefix + "shared_head.head.weight", "embedding" if cfg.tie_embeddings else "lm_head",
                  transposed=not cfg.tie_embeddings)
    own = [Tensor(prefix + "enorm.weight", f"{module}.embed_norm.scale"),
           Tensor(prefix + "hnorm.weight", f"{module}.hidden_norm.scale"),
           Tensor(prefix + "eh_proj.weight", f"{module}.proj", rows=2),
           Tensor(prefix + "shared_head.norm.weight", f"{module}.final_norm.scale"),
           Tensor(prefix + "embed_tokens.weight", "embedding", transposed=False), head]
    block = [dataclasses.replace(t, name=t.name.format(layer=layer), param=f"{module}.block.{t.param}")
             for t in _layer_tensors(cfg, layer)]
    return own + block


def ignored(cfg: ModelConfig, name: str) -> bool:
    """Multi-token prediction's layers past `model.mtp.depth` (DeepSeek-V3's `model.layers.61.*` with
    depth 0): left out, as transformers leaves them."""
    parts = name.split(".")
    first = cfg.n_layers + cfg.mtp.depth
    return name.startswith("model.layers.") and parts[2].isdigit() and int(parts[2]) >= first


HF = HFMap(model_types=(V3, V2), settings=settings, config=config, tensors=tensors, check_export=check_export,
           ignored=ignored)
