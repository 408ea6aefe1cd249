"""A ~2M-parameter byte-level model that visibly learns Python in a few CPU minutes.

float32 compute: CPUs have no fast bfloat16 matmul. Runs on any device count (fsdp=-1).
"""

from ushard.config import default_config


def get_config():
    c = default_config()
    c.model.vocab_size = 512  # 257 byte tokens, padded to a friendly size
    c.model.d_model = 192
    c.model.n_layers = 4
    c.model.n_heads = 6
    c.model.n_kv_heads = 2
    c.model.d_ff = 512
    c.model.compute_dtype = "float32"
    c.train.steps = 300
    c.train.batch_size = 32
    c.train.seq_len = 128
    c.train.lr = 3e-3
    c.train.warmup_steps = 30
    c.train.log_every = 10
    c.train.eval_every = 100
    return c
