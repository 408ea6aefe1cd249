"""DeepSeek-V3's mixture of experts at its size, on ushard's Llama attention (GQA instead of MLA).

61 layers of width 7168, the first 3 dense (d_ff 18432); every other layer has 256 routed experts
of d_ff 2048 plus one shared expert, each token routed to 8 of them by sigmoid scores, within its
4 best of 8 expert groups, the 8 gates renormalised and scaled by 2.5. Balanced without an auxiliary
loss: a per-expert routing bias moves by 0.001 a step against each expert's load, beside a tiny
load-balancing loss (DeepSeek-V3's is per sequence, ushard's per batch). Attention is 56 heads of
128 with 8 key/value heads where DeepSeek-V3 has multi-head latent attention, so the parameter
count differs from its 671B (37B active): 667B here, 33B active.

Needs hundreds of accelerators: the experts over mesh.expert (DeepSeek-V3 trained with 64-way
expert parallelism), the rest ZeRO-3 over fsdp, full remat. Dropless, as DeepSeek-V3, through the
ragged dispatch (receive buffers of twice an even load, `model.moe.dispatch_headroom`).
"""

from ushard.config import default_config


def get_config():
    c = default_config()
    c.model.vocab_size = 129280
    c.model.d_model = 7168
    c.model.n_layers = 61
    c.model.n_heads = 56
    c.model.n_kv_heads = 8
    c.model.d_ff = 18432  # the three dense layers
    c.model.rope_theta = 10000.0
    c.model.norm_eps = 1e-6
    c.model.remat = "full"
    m = c.model.moe
    m.num_experts = 256
    m.top_k = 8
    m.num_shared_experts = 1
    m.expert_d_ff = 2048
    m.first_dense_layers = 3
    m.score_func = "sigmoid"
    m.normalize_gates = True
    m.routed_scale = 2.5
    m.num_groups = 8
    m.top_groups = 4
    m.bias_update_rate = 0.001
    m.aux_loss_weight = 0.0001
    m.z_loss_weight = 0.0
    m.dispatch = "ragged"  # dropless over mesh.expert: buffers sized from the counts, not the worst case
    c.mesh.expert = 64
    c.train.steps = 10000
    c.train.batch_size = 1024
    c.train.seq_len = 4096
    c.train.lr = 2.2e-4
    c.train.warmup_steps = 2000
    c.train.log_every = 10
    c.train.eval_every = 500
    return c
