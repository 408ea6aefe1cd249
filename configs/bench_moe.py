"""The GPU MoE benchmark model: bench_1b's attention with 8 experts, top-2, in every layer.

Each expert is half as wide as bench_1b's MLP, so a token's two experts cost what bench_1b's MLP
costs: 0.95B active parameters per token (MFU counts these), 2.6B in all. Capacity factor 1.25, the
usual padded dispatch, measured fastest on four H200s (docs/benchmarks.md): one GPU 403 TFLOP/s
(71% of dense bench_1b's), `--config.mesh.expert=4 --config.mesh.fsdp=1 --config.train.batch_size=64`
on four GPUs 357 per GPU. Dropless (`--config.model.moe.capacity_factor=0`, exact) runs the Mosaic-GPU
grouped matmul on Hopper: 375-388 TFLOP/s on one H200 against padded's 399 in the same call, so padded
stays the default here. One GPU peaks at 77.5 GiB (an H200's 141 GiB hold it; on an
80 GB H100 use `--config.model.remat=full` or split the experts). remat "dots_attention" rather than
bench_1b's "none": 2.6B parameters' training state is 42 GB before activations.
"""

from ushard.configs.bench_1b import get_config as bench_1b_config


def get_config():
    c = bench_1b_config()
    c.model.moe.num_experts = 8
    c.model.moe.top_k = 2
    c.model.moe.expert_d_ff = 2816  # bench_1b's d_ff / top_k
    c.model.moe.capacity_factor = 1.25
    c.model.remat = "dots_attention"
    return c
