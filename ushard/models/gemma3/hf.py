"""Gemma 3 text checkpoints (config.json model_type `gemma3_text`, transformers' Gemma3ForCausalLM).

Both spellings of the RoPE settings are read: transformers 5's `rope_parameters` with a group per
layer type (`full_attention`, `sliding_attention`), and the published checkpoints' top-level
`rope_theta` (global layers), `rope_local_base_freq` (local layers) and `rope_scaling` (global layers
only: linear, factor 8, from Gemma 3 4B on). The layers' kinds come from `layer_types`, or from
`sliding_window_pattern` where a config.json has no list.
"""

from __future__ import annotations

from ushard.models.config import ModelConfig
from ushard.models.family import HFMap
from ushard.models.gemma3.model import is_local, stacks
from ushard.models.hf_names import (
    attention_tensors,
    end_tensors,
    gated_mlp_tensors,
    norm_tensor,
    refuse,
    refuse_common,
    require_whole,
    rope,
    rope_json,
    sizes,
    stacked_tensors,
)

# transformers' Gemma3TextConfig defaults, for a config.json that omits them.
DEFAULTS = {"rms_norm_eps": 1e-6, "rope_theta": 1e6, "rope_local_base_freq": 1e4, "sliding_window": 4096,
            "query_pre_attn_scalar": 256, "head_dim": 256, "tie_word_embeddings": True,
            "hidden_activation": "gelu_pytorch_tanh"}
GLOBAL, LOCAL = "full_attention", "sliding_attention"


def _pattern(hf: dict, directory: str) -> int:
    """model.sliding_window_pattern from `layer_types` (or the pattern's own key): every layer local is 0."""
    n = hf["num_hidden_layers"]
    pattern = hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern", 6))
    types = hf.get("layer_types")
    if types is None:
        return pattern
    if not isinstance(types, list) or len(types) != n or any(t not in (GLOBAL, LOCAL) for t in types):
        refuse(directory, "layer_types", types, f"it must list {n} layers, each {GLOBAL!r} or {LOCAL!r}")
    pattern = types.index(GLOBAL) + 1 if GLOBAL in types else 0
    expected = [GLOBAL if pattern and (i + 1) % pattern == 0 else LOCAL for i in range(n)]
    if types != expected:
        refuse(directory, "layer_types", types, f"ushard's Gemma 3 makes every {pattern}th layer global "
               "and the others local (a repeating pattern)")
    return pattern


def _ropes(hf: dict, directory: str):
    """((global theta, global scaling), local theta)."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and GLOBAL in params:
        theta, scaling = rope(params[GLOBAL], f"rope_parameters.{GLOBAL}", directory)
        local, local_scaling = rope(params.get(LOCAL, {"rope_theta": DEFAULTS["rope_local_base_freq"]}),
                                    f"rope_parameters.{LOCAL}", directory)
    else:
        theta, scaling = rope({"rope_theta": hf["rope_theta"], **(hf.get("rope_scaling") or {})}, "rope_scaling",
                              directory)
        local, local_scaling = rope({"rope_theta": hf["rope_local_base_freq"]}, "rope_local_base_freq", directory)
    if local_scaling.type != "none":
        refuse(directory, f"rope_parameters.{LOCAL}.rope_type", local_scaling.type,
               "Gemma 3's local layers use unscaled RoPE")
    return theta, scaling, local


def settings(hf: dict, directory: str) -> dict:
    hf = {**DEFAULTS, **hf}
    require_whole(hf, directory, ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size",
                                  "vocab_size", "head_dim", "sliding_window"))
    refuse_common(hf, directory, activations=("gelu_pytorch_tanh", "gelu_tanh"), activation_key="hidden_activation")
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if hf.get(key) is not None:
            refuse(directory, key, hf[key], "Gemma 3 caps no logits; this is a Gemma 2 setting")
    if hf.get("use_bidirectional_attention"):
        refuse(directory, "use_bidirectional_attention", True, "ushard's attention is causal")
    theta, scaling, local = _ropes(hf, directory)
    return dict(sizes(hf), head_dim=hf["head_dim"], sliding_window=hf["sliding_window"],
                sliding_window_pattern=_pattern(hf, directory), local_rope_theta=local,
                query_pre_attn_scalar=float(hf["query_pre_attn_scalar"]), rope_theta=theta, rope_scaling=scaling,
                tie_embeddings=bool(hf["tie_word_embeddings"]), moe={})


def config(cfg: ModelConfig, dtype: str, max_positions: int) -> dict:
    """config.json as transformers 4.50+ and 5 both read it (the top-level RoPE spelling)."""
    scalar = cfg.query_pre_attn_scalar or cfg.head_dim
    types = [LOCAL if is_local(cfg, i) else GLOBAL for i in range(cfg.n_layers)]
    return {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model, "intermediate_size": cfg.d_ff, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
        "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
        "rope_scaling": rope_json(cfg.rope_scaling), "rope_local_base_freq": cfg.local_rope_theta or cfg.rope_theta,
        "sliding_window": cfg.sliding_window or max_positions, "layer_types": types,
        # transformers 5 takes a whole number only (Gemma's are).
        "query_pre_attn_scalar": int(scalar) if float(scalar).is_integer() else scalar, "final_logit_softcapping": None,
        "attn_logit_softcapping": None, "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": False,
        "max_position_embeddings": max_positions, "torch_dtype": dtype,
    }


def _layer(fused: bool) -> list:
    return [norm_tensor("input_layernorm", "attn_norm"), *attention_tensors(qk_norm=True),
            norm_tensor("post_attention_layernorm", "post_attn_norm"),
            norm_tensor("pre_feedforward_layernorm", "mlp_norm"), *gated_mlp_tensors(fused),
            norm_tensor("post_feedforward_layernorm", "post_mlp_norm")]


def tensors(cfg: ModelConfig) -> list:
    return [*end_tensors(cfg.tie_embeddings), *stacked_tensors(stacks(cfg), lambda i: _layer(cfg.fused_mlp))]


HF = HFMap(model_types=("gemma3_text",), settings=settings, config=config, tensors=tensors,
           check_export=lambda cfg: None)
