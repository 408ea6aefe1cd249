"""DeepSeek-V2-Lite's shapes, as deepseek-ai/DeepSeek-V2-Lite's config.json gives them: multi-head
latent attention and a mixture of experts, 15.7B parameters, 2.4B active per token (the paper's).

From config.json: vocab_size 102400, hidden_size 2048, num_hidden_layers 27, num_attention_heads 16
(num_key_value_heads 16), q_lora_rank null (queries from one projection), kv_lora_rank 512,
qk_nope_head_dim 128, qk_rope_head_dim 64 (q·k over 192 a head), v_head_dim 128, rms_norm_eps 1e-6,
rope_theta 10000, rope_scaling yarn with factor 40, original_max_position_embeddings 4096, beta_fast
32, beta_slow 1, mscale 0.707, mscale_all_dim 0.707 (max_position_embeddings 163840);
first_k_dense_replace 1 (the first layer dense, intermediate_size 10944), then every layer
(moe_layer_freq 1) MoE with n_routed_experts 64 of moe_intermediate_size 1408 and n_shared_experts 2,
num_experts_per_tok 6 by softmax scores (scoring_func softmax, topk_method greedy: no group limit,
n_group 1), norm_topk_prob false, routed_scaling_factor 1.0; aux_loss_alpha 0.001 with seq_aux true
(the balance loss per sequence); tie_word_embeddings false.

The experts over mesh.expert (8), the rest ZeRO-3 over fsdp, full remat, dropless through the ragged
dispatch; no router z-loss, as DeepSeek trains.
"""

from ushard.config import default_config


def get_config():
    c = default_config()
    c.model.family = "deepseek"
    c.model.vocab_size = 102400
    c.model.d_model = 2048
    c.model.n_layers = 27
    c.model.n_heads = 16
    c.model.n_kv_heads = 16
    c.model.d_ff = 10944  # the leading dense layer
    c.model.norm_eps = 1e-6
    c.model.rope_theta = 10000.0
    r = c.model.rope_scaling
    r.type = "yarn"
    r.factor = 40.0
    r.original_max_position_embeddings = 4096
    r.beta_fast = 32.0
    r.beta_slow = 1.0
    r.mscale = 0.707
    r.mscale_all_dim = 0.707
    a = c.model.mla
    a.q_lora_rank = 0
    a.kv_lora_rank = 512
    a.qk_nope_head_dim = 128
    a.qk_rope_head_dim = 64
    a.v_head_dim = 128
    c.model.remat = "full"
    m = c.model.moe
    m.num_experts = 64
    m.top_k = 6
    m.num_shared_experts = 2
    m.expert_d_ff = 1408
    m.first_dense_layers = 1
    m.score_func = "softmax"
    m.normalize_gates = False
    m.routed_scale = 1.0
    m.aux_loss_weight = 0.001
    m.aux_loss_per_sequence = True
    m.z_loss_weight = 0.0
    m.dispatch = "ragged"
    c.mesh.expert = 8
    c.train.steps = 10000
    c.train.batch_size = 256
    c.train.seq_len = 4096
    c.train.lr = 4.2e-4
    c.train.warmup_steps = 2000
    c.train.log_every = 10
    c.train.eval_every = 500
    return c
