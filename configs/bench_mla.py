"""The GPU benchmark for latent attention (0.9B parameters): bench_1b's sizes (configs/bench_1b.py)
with DeepSeek-V2-Lite's multi-head latent attention in every layer (configs/deepseek_v2_lite.py: 16
heads, no query bottleneck, a 512-number latent, q·k over 128 + 64 a head, values of 128) and a
dense MLP, at 4,096 tokens a sequence so that attention's 192 / 128 kernels carry a share of the step.

FLOPs count latent attention's own (`model.family="deepseek"`'s `attention_shape`: q·k over 192,
values over 128) and its projections (6 x parameters), as the planner counts them.
"""

from ushard.configs.bench_1b import get_config as bench_1b_config
from ushard.configs.deepseek_v2_lite import get_config as deepseek_v2_lite_config


def get_config():
    c = bench_1b_config()
    c.model.family = "deepseek"
    for key, value in deepseek_v2_lite_config().model.mla.items():  # its latent attention, not its YaRN or MoE
        c.model.mla[key] = value
    c.train.batch_size = 8
    c.train.seq_len = 4096
    return c
