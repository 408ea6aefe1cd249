"""Qwen3's layers: Llama's pre-norm blocks (ushard/models/llama/model.py) with QK-norm, an RMSNorm
over each head of q and k before RoPE. The head size is `model.head_dim`, independent of d_model /
n_heads (Qwen3-8B: 128 of 4096 / 32; Qwen3-0.6B: 128 of 1024 / 16). The MoE models route as
`model.moe` says: softmax over the experts, top k, renormalised where `normalize_gates`
(norm_topk_prob), no shared experts."""

from __future__ import annotations

import functools

from flax import nnx

from ushard.models.config import ModelConfig
from ushard.models.decoder import Decoder
from ushard.models.llama import model as llama


def build(cfg: ModelConfig, rngs: nnx.Rngs) -> Decoder:
    return Decoder(cfg, rngs, llama.stacks(cfg, qk_norm=True), mtp_block=llama.mtp_block(cfg, qk_norm=True))


check = functools.partial(llama.check, family="qwen3")
