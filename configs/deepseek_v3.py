"""DeepSeek-V3's shapes, as deepseek-ai/DeepSeek-V3's config.json gives them: multi-head latent
attention and 256 routed experts, 671B parameters, 37B active per token (the report's, without its
multi-token prediction module: 14B more, one MoE layer with its projection and norms).

From config.json: vocab_size 129280, hidden_size 7168, num_hidden_layers 61, num_attention_heads 128
(num_key_value_heads 128), q_lora_rank 1536, kv_lora_rank 512, qk_nope_head_dim 128,
qk_rope_head_dim 64 (q·k over 192 a head), v_head_dim 128, rms_norm_eps 1e-6, rope_theta 10000,
rope_scaling yarn with factor 40, original_max_position_embeddings 4096, beta_fast 32, beta_slow 1,
mscale 1.0, mscale_all_dim 1.0 (so the attention factor is 1 and the softmax scale gains
(0.1 ln 40 + 1)^2); first_k_dense_replace 3 (dense layers of intermediate_size 18432), then every
layer (moe_layer_freq 1) MoE with n_routed_experts 256 of moe_intermediate_size 2048 and
n_shared_experts 1, num_experts_per_tok 8 by sigmoid scores plus the e_score_correction_bias
(scoring_func sigmoid, topk_method noaux_tc) within the topk_group 4 best of n_group 8 groups,
norm_topk_prob true, routed_scaling_factor 2.5; tie_word_embeddings false; num_nextn_predict_layers
1 (one multi-token prediction module, `model.mtp`, stored as layer 61). Its published weights are
FP8 (quantization_config): ushard imports them dequantized to bfloat16.

Training as the report's section 4.2 says where ushard has it: auxiliary-loss-free balancing (the
routing bias moves 0.001 a step against each expert's load) and a sequence-wise balance loss of
weight 0.0001, no z-loss; the MTP loss weighted 0.3 (the report's for its first 10T tokens, 0.1
after). The experts over mesh.expert (64, the report's expert parallelism), the rest
ZeRO-3 over fsdp, full remat, dropless through the ragged dispatch. The layout DeepSeek trained with
(pipeline x expert x ZeRO-1) is configs/deepseek_v3_layout.py's.
"""

from ushard.config import default_config


def get_config():
    c = default_config()
    c.model.family = "deepseek"
    c.model.vocab_size = 129280
    c.model.d_model = 7168
    c.model.n_layers = 61
    c.model.n_heads = 128
    c.model.n_kv_heads = 128
    c.model.d_ff = 18432  # the three dense layers
    c.model.norm_eps = 1e-6
    c.model.rope_theta = 10000.0
    r = c.model.rope_scaling
    r.type = "yarn"
    r.factor = 40.0
    r.original_max_position_embeddings = 4096
    r.beta_fast = 32.0
    r.beta_slow = 1.0
    r.mscale = 1.0
    r.mscale_all_dim = 1.0
    a = c.model.mla
    a.q_lora_rank = 1536
    a.kv_lora_rank = 512
    a.qk_nope_head_dim = 128
    a.qk_rope_head_dim = 64
    a.v_head_dim = 128
    c.model.remat = "full"
    c.model.mtp.depth = 1
    c.model.mtp.loss_weight = 0.3
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
    m.group_score = "top2_sum"
    m.bias_update_rate = 0.001
    m.aux_loss_weight = 0.0001
    m.aux_loss_per_sequence = True
    m.z_loss_weight = 0.0
    m.dispatch = "ragged"
    c.mesh.expert = 64
    c.train.steps = 10000
    c.train.batch_size = 1024
    c.train.seq_len = 4096
    c.train.lr = 2.2e-4
    c.train.warmup_steps = 2000
    c.train.log_every = 10
    c.train.eval_every = 500
    return c
