"""Llama 3 8B shapes (vocab 128256, GQA 32/8 heads, d_ff 14336, RoPE theta 500000, seq 8192).

With the byte tokenizer only 257 of the 128256 embedding rows are used; the shapes, memory and speed
are those of the real model. ZeRO-3 over all devices by default. Full remat fits the most sequences
per device; where memory allows (four H100s at one sequence each), `model.remat=dots_attention
model.scan_unroll=32` measured 427 TFLOP/s per GPU against 361 (docs/benchmarks.md).
"""

from ushard.config import default_config


def get_config():
    c = default_config()
    c.model.vocab_size = 128256
    c.model.d_model = 4096
    c.model.n_layers = 32
    c.model.n_heads = 32
    c.model.n_kv_heads = 8
    c.model.d_ff = 14336
    c.model.rope_theta = 500000.0
    c.model.remat = "full"
    # Measured on bench_1b (docs/benchmarks.md): gate and up as one GEMM, and neighbouring weights
    # merged into FSDP all-gathers / reduce-scatters of up to 128 MiB, which XLA starts earlier.
    c.model.fused_mlp = True
    c.parallel.collective_combine_mib = 128
    c.train.steps = 10000
    c.train.batch_size = 256
    c.train.seq_len = 8192
    c.train.lr = 3e-4
    c.train.warmup_steps = 2000
    c.train.log_every = 10
    c.train.eval_every = 500
    return c
