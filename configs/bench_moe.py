"""The GPU MoE benchmark model: bench_1b's attention with 8 experts, top-2, in every layer.

Each expert is half as wide as bench_1b's MLP, so a token's two experts cost what bench_1b's MLP
costs: 0.95B active parameters per token (MFU counts these), 2.6B in all. Dropless by default: on
one GPU the experts run as grouped matmuls (`jax.lax.ragged_dot`) with nothing padded. With expert
parallelism (`--config.mesh.expert=4 --config.mesh.fsdp=1` on four GPUs) dispatch is a
fixed-capacity all-to-all, whose dropless capacity is every local token (buffers 4x the
assignments): set `--config.model.moe.capacity_factor=1.25` for the usual padded dispatch.
Not yet measured: the memory (2.6B parameters' training state is 42 GB before activations, so
remat "dots_attention" rather than bench_1b's "none") and the speed (docs/benchmarks.md).
"""

from ushard.configs.bench_1b import get_config as bench_1b_config


def get_config():
    c = bench_1b_config()
    c.model.moe.num_experts = 8
    c.model.moe.top_k = 2
    c.model.moe.expert_d_ff = 2816  # bench_1b's d_ff / top_k
    c.model.remat = "dots_attention"
    return c
