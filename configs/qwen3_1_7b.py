"""Qwen3-1.7B's shapes, as Qwen/Qwen3-1.7B's config.json gives them, sized to train on one GPU.

From config.json: vocab_size 151936, hidden_size 2048, intermediate_size 6144, num_hidden_layers 28,
num_attention_heads 16, num_key_value_heads 8, head_dim 128, rope_theta 1000000, rms_norm_eps 1e-6,
tie_word_embeddings true. On one H200: 4k-token sequences, 8 a step, the layer loop unrolled as
bench_1b's, remat of everything but the matmuls and attention.
"""

from ushard.config import default_config


def get_config():
    c = default_config()
    c.model.family = "qwen3"
    c.model.vocab_size = 151936
    c.model.d_model = 2048
    c.model.n_layers = 28
    c.model.n_heads = 16
    c.model.n_kv_heads = 8
    c.model.head_dim = 128
    c.model.d_ff = 6144
    c.model.rope_theta = 1e6
    c.model.norm_eps = 1e-6
    c.model.tie_embeddings = True
    c.model.compute_dtype = "bfloat16"
    c.model.remat = "dots_attention"
    c.model.scan_unroll = 28
    c.model.fused_mlp = True
    c.train.steps = 1000
    c.train.batch_size = 8
    c.train.seq_len = 4096
    c.train.lr = 3e-4
    c.train.warmup_steps = 100
    c.train.log_every = 10
    c.train.eval_every = 0
    return c
