"""The GPU benchmark for latent attention (0.9B parameters): bench_1b's sizes (configs/bench_1b.py)
with DeepSeek-V2-Lite's multi-head latent attention in every layer (configs/deepseek_v2_lite.py: 16
heads, no query bottleneck, a 512-number latent, q·k over 128 + 64 a head, values of 128) and a
dense MLP, at 4,096 tokens a sequence so that attention's 192 / 128 kernels carry a share of the step.

FLOPs count latent attention's own (`model.family="deepseek"`'s `attention_shape`: q·k over 192,
values over 128) and its projections (6 x parameters), as the planner counts them.
"""

from ushard.configs.bench_1b import get_config as bench_1b_config


def get_config():
    c = bench_1b_config()
    c.model.family = "deepseek"
    a = c.model.mla
    a.q_lora_rank = 0
    a.kv_lora_rank = 512
    a.qk_nope_head_dim = 128
    a.qk_rope_head_dim = 64
    a.v_head_dim = 128
    c.train.batch_size = 8
    c.train.seq_len = 4096
    return c
