"""Llama 3 70B shapes (vocab 128256, GQA 64/8 heads, d_ff 28672, 80 layers, seq 8192).

Needs many accelerators: ZeRO-3 over fsdp with full remat; add mesh.tensor inside a host for speed.
"""

from ushard.config import default_config


def get_config():
    c = default_config()
    c.model.vocab_size = 128256
    c.model.d_model = 8192
    c.model.n_layers = 80
    c.model.n_heads = 64
    c.model.n_kv_heads = 8
    c.model.d_ff = 28672
    c.model.rope_theta = 500000.0
    c.model.remat = "full"
    # Measured on bench_1b (docs/benchmarks.md): gate and up as one GEMM, and neighbouring weights
    # merged into FSDP all-gathers / reduce-scatters of up to 128 MiB, which XLA starts earlier.
    c.model.fused_mlp = True
    c.parallel.collective_combine_mib = 128
    c.train.steps = 10000
    c.train.batch_size = 512
    c.train.seq_len = 8192
    c.train.lr = 1.5e-4
    c.train.warmup_steps = 2000
    c.train.log_every = 10
    c.train.eval_every = 500
    return c
