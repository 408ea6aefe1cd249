"""Gemma 3 1B, as google/gemma-3-1b-pt's config.json gives it, sized to train on one GPU at 8k tokens.

From config.json: vocab_size 262144, hidden_size 1152, intermediate_size 6912, num_hidden_layers 26,
num_attention_heads 4, num_key_value_heads 1, head_dim 256, query_pre_attn_scalar 256, sliding_window
512 with sliding_window_pattern 6 (26 layers: four cycles of five local layers and a global one, then
two local layers), rope_local_base_freq 10000, rope_theta 1000000 without scaling, rms_norm_eps 1e-6,
tie_word_embeddings true, hidden_activation gelu_pytorch_tanh. On one H200: 8k-token sequences, 4 a
step; FLOPs and MFU count the local layers' attention over their windows (ushard/models/family.py).
"""

from ushard.config import default_config


def get_config():
    c = default_config()
    c.model.family = "gemma3"
    c.model.vocab_size = 262144
    c.model.d_model = 1152
    c.model.n_layers = 26
    c.model.n_heads = 4
    c.model.n_kv_heads = 1
    c.model.head_dim = 256
    c.model.d_ff = 6912
    c.model.sliding_window = 512
    c.model.sliding_window_pattern = 6
    c.model.local_rope_theta = 10000.0
    c.model.rope_theta = 1e6
    c.model.query_pre_attn_scalar = 256.0
    c.model.norm_eps = 1e-6
    c.model.tie_embeddings = True
    c.model.compute_dtype = "bfloat16"
    c.model.remat = "dots_attention"
    c.model.fused_mlp = True
    c.train.steps = 1000
    c.train.batch_size = 4  # the logits of 262144 tokens take 4 GiB a sequence in bfloat16
    c.train.seq_len = 8192
    c.train.lr = 3e-4
    c.train.warmup_steps = 100
    c.train.log_every = 10
    c.train.eval_every = 0
    return c
