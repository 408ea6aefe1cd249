"""Llama 3.1 405B's shapes, laid out as Meta trained it: tensor x context x pipeline x FSDP.

Architecture (Llama 3 paper, "The Llama 3 Herd of Models", Table 3, and Meta's published config):
d_model 16384, 128 query heads and 8 key/value heads of 128, FFN 53248, vocabulary 128256, RoPE theta
500000 with Llama 3.1's long-context scaling (rope_type "llama3": factor 8, low/high frequency
factors 1 and 4, original context 8192). Meta's model has 126 layers; this config has 128, see below.

Layout (the paper's section 3.3.2, "4D parallelism", and Table 4): tensor parallelism 8 inside a host,
context parallelism, pipeline parallelism 16, and FSDP over the rest. Meta's 16,384-GPU run at 8192
tokens was TP 8 x CP 1 x PP 16 x DP 128 (16M tokens a step); the 131,072-token stage TP 8 x CP 16 x
PP 16 x DP 4. Here: mesh.tensor=8 (with Megatron sequence parallelism), mesh.sequence=2 with
context_parallel='all_gather' (the paper's CP gathers keys and values too; ring attention is refused
inside ushard's stages), mesh.pipeline=16, mesh.fsdp=-1 (ZeRO-3); 256 devices a model replica, so
any slice of 256 * k chips (v5p:4x8x8 is one replica). For long context raise train.seq_len and
mesh.sequence together (Meta: 131072 over 16).

Why 128 layers: ushard's pipeline stages are equal (n_layers a multiple of mesh.pipeline x
parallel.pipeline_repeats), and 126 = 2 x 3^2 x 7 has no factor 16. Meta's 16 stages had 8 layer
slots each, and the paper balances the first and last stages (which also run the embedding, and the
output projection and loss) by giving them one layer fewer: 126. ushard splits the vocabulary over
the stages instead (parallel.pipeline_head 'split', the default inside one slice), so its stages are
equal, and this config keeps the two slots: 128 layers, 6.4B parameters (1.6%) more than Meta's
405.9B. For the exact model (for example to start from Meta's checkpoint with
checkpoint.init_from), set model.n_layers=126 and a stage count that divides it, e.g.
mesh.pipeline=14 (9 layers a stage; 224 devices a replica) or 18 (7 layers; 288), with
parallel.pipeline_head=whole (128256 does not split over 14 x 8 or 18 x 8 devices).

Schedule: 1F1B, 64 microbatches of 32 sequences a step (bubble (S - 1) / (M + S - 1) = 15 / 79, 19%);
a microbatch's rows split over up to 32 FSDP groups (8192 devices; at Meta's 16,384 set
parallel.pipeline_microbatches=32). Meta ran an interleaved schedule; ushard's interleaved one
(circular) keeps every tick's residuals, each tick's bf16 copy of the stage's weights among them:
compiled for v5p with 32 microbatches, GPipe needed 60 GiB of temporaries a chip and circular with 2
rounds 85 GiB where 1F1B needed 10 (one layer a stage, two for circular; docs/benchmarks.md).

Attention: XLA's (model.attention_impl='xla'). Inside pipeline stages GPUs run XLA attention anyway;
on TPUs 'auto' would be splash attention, whose all-gather context-parallel blocks do not yet trace
inside a stage (a custom VJP's gradient loses the stage axis's varying type; docs/benchmarks.md).

Training settings from the paper (section 3.4.1): peak learning rate 8e-5, 8,000 warm-up steps, cosine
decay to 8e-7 over 1,200,000 steps, 16M tokens a step at 8192 (Meta grew the batch from 4M tokens to
16M during training; ushard has no batch schedule). bf16 compute, f32 state, full remat.
Compiled for TPU without a TPU in docs/benchmarks.md ("Production layouts compiled for TPU"): all
128 layers at one sequence a chip in each microbatch peak at 67.8 GiB a v5p chip on one replica
(v5p:4x8x8), 49.8 GiB at fsdp=2 (v5p:8x8x8).
"""

from ushard.config import default_config


def get_config():
    c = default_config()
    c.model.vocab_size = 128256
    c.model.d_model = 16384
    c.model.n_layers = 128  # Meta's 126 plus the two slots of its shortened first and last stages
    c.model.n_heads = 128
    c.model.n_kv_heads = 8
    c.model.d_ff = 53248
    c.model.rope_theta = 500000.0
    c.model.rope_scaling.type = "llama3"
    c.model.rope_scaling.factor = 8.0
    c.model.rope_scaling.low_freq_factor = 1.0
    c.model.rope_scaling.high_freq_factor = 4.0
    c.model.rope_scaling.original_max_position_embeddings = 8192
    c.model.compute_dtype = "bfloat16"
    c.model.remat = "full"
    c.model.attention_impl = "xla"  # splash's context-parallel blocks fail inside stages (see above)
    c.mesh.tensor = 8
    c.mesh.sequence = 2
    c.mesh.pipeline = 16
    c.mesh.fsdp = -1
    c.parallel.zero_stage = 3
    c.parallel.sequence_parallel = True
    c.parallel.context_parallel = "all_gather"
    c.parallel.pipeline_schedule = "1f1b"
    c.parallel.pipeline_microbatches = 64
    c.train.steps = 1_200_000
    c.train.batch_size = 2048  # x 8192 tokens: 16M tokens a step
    c.train.seq_len = 8192
    c.train.lr = 8e-5
    c.train.min_lr_ratio = 0.01  # 8e-7
    c.train.warmup_steps = 8000
    c.train.log_every = 10
    c.train.eval_every = 500
    return c
