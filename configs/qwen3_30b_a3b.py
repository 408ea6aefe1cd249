"""Qwen3-30B-A3B's shapes, as Qwen/Qwen3-30B-A3B's config.json gives them: 30.5B parameters, 3.3B
active per token.

From config.json: vocab_size 151936, hidden_size 2048, num_hidden_layers 48, num_attention_heads 32,
num_key_value_heads 4, head_dim 128 (independent of 2048 / 32 = 64), rope_theta 1000000, rms_norm_eps
1e-6, tie_word_embeddings false; every layer MoE (decoder_sparse_step 1, mlp_only_layers []) with
num_experts 128 of moe_intermediate_size 768, num_experts_per_tok 8, norm_topk_prob true (the 8
gates renormalised), no shared experts; router_aux_loss_coef 0.001. intermediate_size 6144 is the
width of a dense layer, of which this model has none. Needs many accelerators: the experts over
mesh.expert (8), the rest ZeRO-3 over fsdp, full remat, dropless through the ragged dispatch.
"""

from ushard.config import default_config


def get_config():
    c = default_config()
    c.model.family = "qwen3"
    c.model.vocab_size = 151936
    c.model.d_model = 2048
    c.model.n_layers = 48
    c.model.n_heads = 32
    c.model.n_kv_heads = 4
    c.model.head_dim = 128
    c.model.d_ff = 6144
    c.model.rope_theta = 1e6
    c.model.norm_eps = 1e-6
    c.model.remat = "full"
    c.model.moe.num_experts = 128
    c.model.moe.top_k = 8
    c.model.moe.expert_d_ff = 768
    c.model.moe.score_func = "softmax"
    c.model.moe.normalize_gates = True
    c.model.moe.aux_loss_weight = 0.001
    c.model.moe.dispatch = "ragged"
    c.mesh.expert = 8
    c.train.steps = 10000
    c.train.batch_size = 256
    c.train.seq_len = 4096
    c.train.lr = 3e-4
    c.train.warmup_steps = 2000
    c.train.log_every = 10
    c.train.eval_every = 500
    return c
