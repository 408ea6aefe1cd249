"""DeepSeek-V2's and V3's decoder layers: Llama's pre-norm blocks (ushard/models/llama/model.py) with
multi-head latent attention (ushard/models/mla.py) in every layer, and the MLP as `model.moe` lays it
out: `first_dense_layers` dense SwiGLU layers of width d_ff (first_k_dense_replace), then MoE layers
whose shared experts are one SwiGLU of num_shared_experts * expert_d_ff. How the experts are chosen
(V3: sigmoid scores, a routing bias, groups scored by their two best; V2: softmax, groups by their
best) is all `model.moe`.

Multi-token prediction (`model.mtp`, ushard/models/mtp.py): each module's block is an MoE layer like
the last ones (DeepSeek-V3's checkpoints hold it as layer num_hidden_layers).
"""

from __future__ import annotations

from flax import nnx

from ushard.errors import UserError
from ushard.models.config import ModelConfig
from ushard.models.decoder import Decoder
from ushard.models.family import AttentionShape
from ushard.models.llama import model as llama
from ushard.models.mla import LatentAttention


def stacks(cfg: ModelConfig):
    return llama.stacks(cfg, attention=LatentAttention)


def build(cfg: ModelConfig, rngs: nnx.Rngs) -> Decoder:
    return Decoder(cfg, rngs, stacks(cfg), mtp_block=llama.mtp_block(cfg, attention=LatentAttention))


def attention_shape(cfg: ModelConfig) -> AttentionShape:
    """Every layer global; q·k over the heads' nope and rope parts, values of v_head_dim; the decoding
    cache holds a token's latent and its RoPE key (ushard/models/mla.py)."""
    mla = cfg.mla
    return AttentionShape(cfg.n_heads, mla.qk_head_dim, mla.v_head_dim, (0,) * cfg.n_layers,
                          cache=(1, mla.kv_lora_rank, mla.qk_rope_head_dim))


def check(cfg: ModelConfig) -> None:
    """Refuses what DeepSeek's layers do not have, and a latent attention without its sizes."""
    llama.refuse_windows(cfg, "deepseek")
    if not cfg.mla.kv_lora_rank:
        raise UserError("model.family='deepseek' computes multi-head latent attention: set model.mla.kv_lora_rank, "
                        "qk_nope_head_dim, qk_rope_head_dim and v_head_dim (configs/deepseek_v3.py has V3's).")
    if cfg.n_kv_heads != cfg.n_heads:
        raise UserError(f"model.n_kv_heads={cfg.n_kv_heads} must equal model.n_heads={cfg.n_heads} in "
                        "model.family='deepseek': latent attention expands a key and a value for every head.")
    if cfg.query_pre_attn_scalar:
        raise UserError(f"model.query_pre_attn_scalar={cfg.query_pre_attn_scalar!r} is not used by "
                        "model.family='deepseek', whose scores are scaled by the q·k head size (and YaRN's "
                        "mscale_all_dim).")
