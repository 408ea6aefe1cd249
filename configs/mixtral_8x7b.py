"""Mixtral 8x7B shapes: Mistral 7B's attention (GQA 32/8 heads, RoPE theta 1e6) with 8 experts of
d_ff 14336 in every layer, each token routed to 2 (softmax, the two gates renormalised). 46.7B
parameters, 12.9B active per token (Mistral AI's published counts).

Needs many accelerators: the experts split over mesh.expert (8, one per device in a host), the rest
ZeRO-3 over fsdp, full remat. Dropless, through the ragged dispatch (receive buffers of twice an even
load, `model.moe.dispatch_headroom`); `model.moe.capacity_factor` sets a capacity instead.
"""

from ushard.config import default_config


def get_config():
    c = default_config()
    c.model.vocab_size = 32000
    c.model.d_model = 4096
    c.model.n_layers = 32
    c.model.n_heads = 32
    c.model.n_kv_heads = 8
    c.model.d_ff = 14336
    c.model.rope_theta = 1e6
    c.model.remat = "full"
    c.model.moe.num_experts = 8
    c.model.moe.top_k = 2
    c.model.moe.score_func = "softmax"
    c.model.moe.normalize_gates = True
    c.model.moe.aux_loss_weight = 0.02
    c.model.moe.dispatch = "ragged"  # dropless over mesh.expert: buffers sized from the counts, not the worst case
    c.mesh.expert = 8
    c.train.steps = 10000
    c.train.batch_size = 256
    c.train.seq_len = 4096
    c.train.lr = 3e-4
    c.train.warmup_steps = 2000
    c.train.log_every = 10
    c.train.eval_every = 500
    return c
