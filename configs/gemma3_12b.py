"""Gemma 3 12B's text model, as google/gemma-3-12b-pt's config.json (its text_config) gives it.

From config.json: vocab_size 262208, hidden_size 3840, intermediate_size 15360, num_hidden_layers 48,
num_attention_heads 16, num_key_value_heads 8, head_dim 256, query_pre_attn_scalar 256,
sliding_window 1024 with sliding_window_pattern 6 (five local layers, then a global one),
rope_local_base_freq 10000 for the local layers, rope_theta 1000000 with rope_scaling linear factor 8
for the global ones, rms_norm_eps 1e-6, tie_word_embeddings true, hidden_activation
gelu_pytorch_tanh. ZeRO-3 over all devices, full remat, 8k-token sequences.
"""

from ushard.config import default_config


def get_config():
    c = default_config()
    c.model.family = "gemma3"
    c.model.vocab_size = 262208
    c.model.d_model = 3840
    c.model.n_layers = 48
    c.model.n_heads = 16
    c.model.n_kv_heads = 8
    c.model.head_dim = 256
    c.model.d_ff = 15360
    c.model.sliding_window = 1024
    c.model.sliding_window_pattern = 6
    c.model.local_rope_theta = 10000.0
    c.model.rope_theta = 1e6
    c.model.rope_scaling.type = "linear"
    c.model.rope_scaling.factor = 8.0
    c.model.query_pre_attn_scalar = 256.0
    c.model.norm_eps = 1e-6
    c.model.tie_embeddings = True
    c.model.remat = "full"
    c.parallel.collective_combine_mib = 128
    c.train.steps = 10000
    c.train.batch_size = 256
    c.train.seq_len = 8192
    c.train.lr = 3e-4
    c.train.warmup_steps = 2000
    c.train.log_every = 10
    c.train.eval_every = 500
    return c
