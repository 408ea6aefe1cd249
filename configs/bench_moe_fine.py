"""A fine-grained MoE benchmark model shaped like DeepSeek-V2-Lite: 64 routed experts, top-6, 2 shared.

DeepSeek-V2-Lite (DeepSeek-AI, "DeepSeek-V2", 2024, its Lite variant) routes each token to 6 of 64
narrow experts plus 2 shared ones in every layer but the first. This preset keeps that routing and
the experts' shape relative to the model (an expert about two thirds of d_model wide) at a size one
GPU holds: d_model 1536, 8 MoE layers, experts 1024 wide, grouped-query attention in place of MLA
(which ushard does not have). 2.7B parameters in all, 0.43B of them in a token's matmuls (MFU counts
these).
Dropless (capacity factor 0), as DeepSeek trains: on GPUs the experts run JAX's Mosaic-GPU grouped
matmul (`model.moe.grouped_matmul_impl=auto`). Numbers in docs/benchmarks.md.
"""

from ushard.configs.bench_1b import get_config as bench_1b_config


def get_config():
    c = bench_1b_config()
    c.model.d_model = 1536
    c.model.n_layers = 8
    c.model.n_heads = 12  # head_dim 128
    c.model.n_kv_heads = 12
    c.model.scan_unroll = 8
    c.model.moe.num_experts = 64
    c.model.moe.top_k = 6
    c.model.moe.num_shared_experts = 2
    c.model.moe.expert_d_ff = 1024
    c.model.moe.capacity_factor = 0.0
    c.model.remat = "dots_attention"
    return c
