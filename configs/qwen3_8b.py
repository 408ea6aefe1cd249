"""Qwen3-8B's shapes, as Qwen/Qwen3-8B's config.json gives them.

From config.json: vocab_size 151936, hidden_size 4096, intermediate_size 12288, num_hidden_layers 36,
num_attention_heads 32, num_key_value_heads 8, head_dim 128, rope_theta 1000000, rms_norm_eps 1e-6,
tie_word_embeddings false, no sliding window (use_sliding_window false). Qwen3's layers are Llama's
with QK-norm (model.family="qwen3"). To fine-tune the released weights, import them
(docs/finetuning.md, `ushard convert --from-hf`), whose settings these match. ZeRO-3 over all devices,
full remat, 8k-token sequences.
"""

from ushard.config import default_config


def get_config():
    c = default_config()
    c.model.family = "qwen3"
    c.model.vocab_size = 151936
    c.model.d_model = 4096
    c.model.n_layers = 36
    c.model.n_heads = 32
    c.model.n_kv_heads = 8
    c.model.head_dim = 128
    c.model.d_ff = 12288
    c.model.rope_theta = 1e6
    c.model.norm_eps = 1e-6
    c.model.remat = "full"
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
