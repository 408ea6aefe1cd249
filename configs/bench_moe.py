"""The GPU MoE benchmark model: bench_1b's attention with 8 experts, top-2, in every layer.

Each expert is half as wide as bench_1b's MLP, so a token's two experts cost what bench_1b's MLP
costs: 0.95B active parameters per token (MFU counts these), 2.6B in all. Dropless (capacity factor
0, exact, no token dropped): on Hopper GPUs the experts run JAX's Mosaic-GPU grouped matmul, measured
on one H200 at 469 TFLOP/s, 84% of dense bench_1b's 559 and above the padded dispatch's 454
(`--config.model.moe.capacity_factor=1.25`) in the same call (docs/benchmarks.md). It peaks at
71 GiB on one GPU (86 GiB padded): on an 80 GB H100 it fits at `--config.train.batch_size=8`, or
with `--config.model.remat=full`. remat "dots_attention" rather than bench_1b's "none": 2.6B
parameters' training state is 42 GB before activations.
"""

from ushard.configs.bench_1b import get_config as bench_1b_config


def get_config():
    c = bench_1b_config()
    c.model.moe.num_experts = 8
    c.model.moe.top_k = 2
    c.model.moe.expert_d_ff = 2816  # bench_1b's d_ff / top_k
    c.model.moe.capacity_factor = 0.0
    c.model.remat = "dots_attention"
    return c
