"""The per-device memory estimate (ushard/estimate.py) against XLA's memory analysis of the compiled
train step, on 8 simulated CPU devices: the state and batch exactly, the peak within 10% (full remat
within 15%: the estimate misses part of the recomputed layer's working set). One case of every mesh
kind runs by default; the rest of the grid (more ZeRO stages, remat policies, wider tensor splits,
MoE dispatch modes, the shipped configs) is marked slow."""

import json
import math
import os

import jax
import pytest

from conftest import small_config
from ushard.aot import build_for, compile_train_step, peak_bytes
from ushard.build import build
from ushard.config import apply_overrides, load_config
from ushard.estimate import estimate

# A model large enough that activations, not bookkeeping, fill the memory: 4 layers of width 256,
# 16 sequences of 256 tokens.
BASE = {"model.d_model": 256, "model.d_ff": 1024, "model.n_layers": 4, "train.seq_len": 256, "train.batch_size": 16}
TENSOR = {"mesh.tensor": 2, "mesh.fsdp": 4}
SEQUENCE = {"mesh.sequence": 2, "mesh.fsdp": 4}
ONE_F_ONE_B = {"mesh.pipeline": 2, "mesh.fsdp": 4, "parallel.pipeline_schedule": "1f1b",
               "parallel.pipeline_microbatches": 4}
GPIPE = {**ONE_F_ONE_B, "parallel.pipeline_schedule": "gpipe"}
MOE = ("tiny_moe", {"mesh.expert": 8})  # configs/tiny_moe.py at BASE's sizes: capacity factor 1.25
# DeepSeek's latent attention at BASE's sizes (tiny_moe's experts, 4 of them): under context
# parallelism its latents travel and each device expands them (ushard/parallel/context.py).
LATENT = ("tiny_moe", {"model.family": "deepseek", "model.n_heads": 8, "model.n_kv_heads": 8,
                       "model.mla.q_lora_rank": 64, "model.mla.kv_lora_rank": 64, "model.mla.qk_nope_head_dim": 32,
                       "model.mla.qk_rope_head_dim": 16, "model.mla.v_head_dim": 32, "model.moe.num_experts": 4,
                       "model.moe.top_k": 2, "model.moe.expert_d_ff": 128})
slow = pytest.mark.slow
GRID = {
    "fsdp8_zero0": ("tiny", {"mesh.fsdp": 8, "parallel.zero_stage": 0}),
    "fsdp8_zero1": ("tiny", {"mesh.fsdp": 8, "parallel.zero_stage": 1}),
    "fsdp8_zero2": ("tiny", {"mesh.fsdp": 8, "parallel.zero_stage": 2}),
    "fsdp8_zero3": ("tiny", {"mesh.fsdp": 8}),
    "data8": ("tiny", {"mesh.data": 8}),
    "data2_fsdp4": ("tiny", {"mesh.data": 2, "mesh.fsdp": 4}),
    "data2_fsdp4_accum2": ("tiny", {"mesh.data": 2, "mesh.fsdp": 4, "train.grad_accum": 2}),
    "fsdp8_remat_dots": ("tiny", {"mesh.fsdp": 8, "model.remat": "dots"}),
    "fsdp8_remat_dots_attention_norms": ("tiny", {"mesh.fsdp": 8, "model.remat": "dots_attention_norms"}),
    "fsdp8_remat_full": ("tiny", {"mesh.fsdp": 8, "model.remat": "full"}),
    "tensor2_fsdp4": ("tiny", TENSOR),
    "tensor2_fsdp4_sp": ("tiny", {**TENSOR, "parallel.sequence_parallel": True}),
    "sequence2_fsdp4_ring": ("tiny", SEQUENCE),
    "sequence2_fsdp4_all_gather": ("tiny", {**SEQUENCE, "parallel.context_parallel": "all_gather"}),
    "pipeline2_fsdp4_1f1b": ("tiny", ONE_F_ONE_B),
    "pipeline2_fsdp4_gpipe": ("tiny", GPIPE),
    "expert8_padded": MOE,
    "expert8_ragged": (MOE[0], {**MOE[1], "model.moe.dispatch": "ragged"}),
    "expert4_fsdp2_width": (MOE[0], {"mesh.expert": 4, "mesh.fsdp": 2, "parallel.expert_split": "width"}),
    # the slow tier
    "tensor4_fsdp2_kv_repeated": ("tiny", {"mesh.tensor": 4, "mesh.fsdp": 2}),
    "tensor4_fsdp2_sp": ("tiny", {"mesh.tensor": 4, "mesh.fsdp": 2, "parallel.sequence_parallel": True}),
    "tensor2_fsdp4_sp_zero1_dots": ("tiny", {**TENSOR, "parallel.sequence_parallel": True,
                                             "parallel.zero_stage": 1, "model.remat": "dots"}),
    "sequence2_fsdp4_ring_keep_kv": ("tiny", {**SEQUENCE, "parallel.context_keep_kv": True}),
    "sequence2_tensor2_fsdp2_ring": ("tiny", {"mesh.sequence": 2, "mesh.tensor": 2, "mesh.fsdp": 2}),
    # Read 0.91 and 1.00 of XLA:CPU's peak (before the latent travelled: 0.92 and 1.01).
    "sequence2_fsdp4_ring_latent": (LATENT[0], {**LATENT[1], **SEQUENCE}),
    "sequence2_fsdp4_all_gather_latent": (LATENT[0], {**LATENT[1], **SEQUENCE,
                                                      "parallel.context_parallel": "all_gather"}),
    "pipeline2_fsdp4_1f1b_2_microbatches": ("tiny", {**ONE_F_ONE_B, "parallel.pipeline_microbatches": 2}),
    "pipeline2_fsdp4_1f1b_remat_full": ("tiny", {**ONE_F_ONE_B, "model.remat": "full"}),
    "pipeline2_tensor2_fsdp2_1f1b": ("tiny", {**ONE_F_ONE_B, "mesh.tensor": 2, "mesh.fsdp": 2}),
    "pipeline2_fsdp4_gpipe_remat_full": ("tiny", {**GPIPE, "model.remat": "full"}),
    "pipeline4_fsdp2_gpipe": ("tiny", {**GPIPE, "mesh.pipeline": 4, "mesh.fsdp": 2}),
    "pipeline2_tensor2_fsdp2_gpipe": ("tiny", {**GPIPE, "mesh.tensor": 2, "mesh.fsdp": 2}),
    "pipeline2_fsdp4_circular": ("tiny", {**GPIPE, "parallel.pipeline_schedule": "circular",
                                          "parallel.pipeline_repeats": 2}),
    "pipeline2_fsdp4_circular_remat_dots": ("tiny", {**GPIPE, "parallel.pipeline_schedule": "circular",
                                                     "parallel.pipeline_repeats": 2, "model.remat": "dots",
                                                     "parallel.pipeline_microbatches": 2}),
    "expert4_fsdp2_dropless": (MOE[0], {"mesh.expert": 4, "mesh.fsdp": 2, "model.moe.capacity_factor": 0.0}),
    "expert1_fsdp8_zero3": (MOE[0], {"mesh.expert": 1, "mesh.fsdp": 8}),
    "expert8_padded_remat_dots": (MOE[0], {**MOE[1], "model.remat": "dots"}),
    "expert8_width": (MOE[0], {**MOE[1], "parallel.expert_split": "width"}),
}
DEFAULT_TIER = list(GRID)[:list(GRID).index("tensor4_fsdp2_kv_repeated")]

# The shipped configs at their own widths, vocabularies, dtypes and remat, shrunk in layers, sequence and
# batch so that a compile takes seconds; there the weights and the vocabulary's buffers outweigh the
# activations. The first one runs by default, the rest are marked slow.
SHIPPED = {
    "bench_1b_fsdp8": ("bench_1b", {"mesh.fsdp": 8}),
    "llama3_8b_fsdp8": ("llama3_8b", {"mesh.fsdp": 8}),
    "tiny_moe_expert8": ("tiny_moe", {}),
    "tiny_fsdp8": ("tiny", {"mesh.fsdp": 8}),
    "bench_1b_fsdp8_reshard": ("bench_1b", {"mesh.fsdp": 8, "parallel.reshard_after_forward": True,
                                            "model.scan_unroll": 1}),
    "bench_1b_fsdp8_zero1": ("bench_1b", {"mesh.fsdp": 8, "parallel.zero_stage": 1}),
    "bench_1b_tensor2_fsdp4_sp": ("bench_1b", {"mesh.tensor": 2, "mesh.fsdp": 4, "parallel.sequence_parallel": True}),
    "bench_1b_fsdp8_remat_full": ("bench_1b", {"mesh.fsdp": 8, "model.remat": "full"}),
    "llama3_8b_fsdp8_keep_gathered": ("llama3_8b", {"mesh.fsdp": 8, "parallel.reshard_after_forward": False}),
    "llama3_8b_fsdp8_zero1": ("llama3_8b", {"mesh.fsdp": 8, "parallel.zero_stage": 1}),
    "llama3_8b_fsdp8_remat_dots": ("llama3_8b", {"mesh.fsdp": 8, "model.remat": "dots"}),
    "llama3_8b_tensor2_fsdp4": ("llama3_8b", {"mesh.tensor": 2, "mesh.fsdp": 4}),
    "llama3_8b_tensor2_fsdp4_sp": ("llama3_8b", {"mesh.tensor": 2, "mesh.fsdp": 4, "parallel.sequence_parallel": True}),
    "llama3_8b_pipeline2_fsdp4_1f1b": ("llama3_8b", {**ONE_F_ONE_B, "model.n_layers": 4, "train.batch_size": 16}),
    # In float32: XLA:CPU aborts compiling GPipe over bfloat16 compute ("Invalid binary instruction
    # opcode copy", JAX 0.10.2; docs/dev-notes.md).
    "bench_1b_pipeline2_fsdp4_gpipe": ("bench_1b", {**GPIPE, "model.n_layers": 4, "train.batch_size": 16,
                                                    "model.compute_dtype": "float32"}),
    # ZeRO-2: XLA:CPU keeps the gradients no scan carries whole (estimate.gradient_bytes), all of them
    # in bench_1b's unrolled stack, the vocabulary's in llama3_8b's scanned one.
    "bench_1b_fsdp8_zero2": ("bench_1b", {"mesh.fsdp": 8, "parallel.zero_stage": 2}),
    "llama3_8b_fsdp8_zero2": ("llama3_8b", {"mesh.fsdp": 8, "parallel.zero_stage": 2}),
}
# Not yet within 10% on the shipped configs, so not here: data-only meshes (bench_1b's reads 0.87 of
# XLA:CPU's peak), sequence over a large vocabulary, the MoE configs (bench_moe, mixtral_8x7b);
# deepseek_v3_like needs more than two layers. Nor in the grid: dropless experts on the grouped matmul,
# `lax.ragged_dot` as XLA:CPU compiles it (tiny_moe at BASE's sizes reads 0.74 of XLA:CPU's peak with
# the experts whole over fsdp=8, 0.52 with their width split over expert=4; bench_moe's one-GPU row,
# on the GPU kernels, is within 15%: tests/data/estimate/gpu_rows.json).
SHIPPED_DEFAULT_TIER = list(SHIPPED)[:1]  # one in the default tier, for the suite's time
SHRUNK = {"model.n_layers": 2, "train.seq_len": 256, "train.batch_size": 8, "train.grad_accum": 1, "mesh.fsdp": 1,
          "mesh.tensor": 1, "mesh.sequence": 1, "mesh.pipeline": 1, "mesh.data": 1}


def assert_estimate_matches_compiler(setup):
    estimated = estimate(setup)
    memory = compile_train_step(setup).memory_analysis()
    if setup.plan.platform == "tpu":  # TPU arrays are stored in tiles (8 x 128 for 32 bits): small ones padded
        assert estimated.state + estimated.batch == pytest.approx(memory.argument_size_in_bytes, rel=0.05)
    else:
        assert estimated.state + estimated.batch == memory.argument_size_in_bytes
    tolerance = 0.15 if setup.model_config.remat == "full" else 0.10
    assert estimated.peak == pytest.approx(peak_bytes(memory), rel=tolerance)


@pytest.mark.parametrize("name", [n if n in DEFAULT_TIER else pytest.param(n, marks=slow) for n in GRID])
def test_the_estimate_matches_the_compilers_memory_analysis(name):
    config_name, overrides = GRID[name]
    assert_estimate_matches_compiler(build(small_config(config_name, **{**BASE, **overrides})))


@pytest.mark.parametrize("name", [n if n in SHIPPED_DEFAULT_TIER else pytest.param(n, marks=slow) for n in SHIPPED])
def test_the_estimate_matches_the_compiler_on_the_shipped_configs(name):
    config_name, overrides = SHIPPED[name]
    config = load_config(config_name)
    apply_overrides(config, [f"{k}={v}" for k, v in {**SHRUNK, **overrides}.items()])
    assert_estimate_matches_compiler(build(config))


# On TPU devices (compiled ahead of time through libtpu, ushard/aot.py): splash attention, bfloat16 compute,
# a vocabulary large enough that the logits and their gradient are the peak's largest buffers. The whole
# llama3_8b at 4 sequences of 8192 a chip on v5p:4x4x4 (fsdp=64, 90 s to compile) reads 31.67 GiB
# estimated against 31.56 GiB compiled (75.1 GiB before splash attention's residuals and the logits'
# gradient were modelled).
SPLASH_CP = {"model.d_model": 256, "model.n_heads": 4, "model.n_kv_heads": 2, "model.d_ff": 1024, "model.n_layers": 4,
             "train.seq_len": 4096, "train.batch_size": 8, "mesh.fsdp": 4, "mesh.sequence": 2,
             "model.compute_dtype": "bfloat16", "model.vocab_size": 32768}
TPU = {
    "tiny_v5p8_vocab32k": ("tiny", {"model.d_model": 256, "model.n_heads": 4, "model.n_kv_heads": 2, "model.d_ff": 1024,
                                    "model.n_layers": 4, "train.seq_len": 1024, "train.batch_size": 16,
                                    "mesh.fsdp": 8, "model.compute_dtype": "bfloat16", "model.vocab_size": 32768}),
    "llama3_8b_v5p8": ("llama3_8b", {"model.n_layers": 2, "train.seq_len": 2048, "train.batch_size": 8,
                                     "mesh.fsdp": 8}),
    # ZeRO-1: the TPU compiler reduce-scatters the gradients the optimizer reads in shards
    # (estimate.gradient_bytes). The bench_1b shape is the shipped grid's shrunk one.
    "bench_1b_v5p8_zero1": ("bench_1b", {**SHRUNK, "mesh.fsdp": 8, "parallel.zero_stage": 1}),
    "llama3_8b_v5p8_zero1": ("llama3_8b", {**SHRUNK, "mesh.fsdp": 8, "parallel.zero_stage": 1}),
    # ZeRO-0: no copies of the moments kept for a skipped step (estimate.kept_state), and in
    # bench_1b's unrolled stack no layer gradient yet at the loss (MemoryEstimate.gradients_at_loss).
    "bench_1b_v5p8_zero0": ("bench_1b", {**SHRUNK, "mesh.fsdp": 8, "parallel.zero_stage": 0}),
    "llama3_8b_v5p8_zero0": ("llama3_8b", {**SHRUNK, "mesh.fsdp": 8, "parallel.zero_stage": 0}),
    # Context parallelism on splash blocks (each device's half-chunks 1,024 tokens): the ring and
    # all-gather modes as custom VJPs that keep flash attention's residuals, never [T, T] scores.
    "tiny_v5p8_sequence2_ring": ("tiny", {**SPLASH_CP, "model.document_mask": True}),
    "tiny_v5p8_sequence2_all_gather": ("tiny", {**SPLASH_CP, "parallel.context_parallel": "all_gather"}),
    "tiny_v5p8_sequence2_ring_keep_kv": ("tiny", {**SPLASH_CP, "parallel.context_keep_kv": True}),
    # An unrolled stack under dots_attention (the one-GPU config's settings): no logits' gradient is
    # written (estimate.logits_gradient; 1.31 of the compiled peak when one was charged, now 1.00).
    "qwen3_1_7b_v5p8_unrolled": ("qwen3_1_7b", {"model.n_layers": 4, "model.scan_unroll": 4, "mesh.fsdp": 8,
                                                "train.batch_size": 16}),
    # deepseek_v3_layout's kind of step, small: circular over experts (ragged, grouped matmul), ZeRO-1, an MTP
    # module after the stages (estimate.tick_loop_buffers, grouped_matmul_backward; 0.93 of the compiled peak).
    "tiny_moe_v5p8_circular_expert2_mtp": ("tiny_moe", {
        "model.d_model": 256, "model.n_heads": 4, "model.n_kv_heads": 2, "model.d_ff": 1024, "model.n_layers": 4,
        "model.moe.expert_d_ff": 256, "model.moe.capacity_factor": 0.0, "model.moe.dispatch": "ragged",
        "model.vocab_size": 32768, "train.seq_len": 1024, "train.batch_size": 16, "mesh.pipeline": 2, "mesh.expert": 2,
        "mesh.fsdp": 2, "parallel.pipeline_schedule": "circular", "parallel.pipeline_repeats": 2,
        "parallel.pipeline_microbatches": 2, "model.remat": "full", "model.compute_dtype": "bfloat16",
        "parallel.zero_stage": 1, "model.mtp.depth": 1}),
}


@slow
@pytest.mark.parametrize("name", list(TPU))
def test_the_estimate_matches_the_tpu_compiler(name):
    pytest.importorskip("libtpu")
    config_name, overrides = TPU[name]
    config = load_config(config_name)
    apply_overrides(config, [f"{k}={v}" for k, v in overrides.items()])
    assert_estimate_matches_compiler(build_for(config, "v5p:2x2x2"))


def tpu_setup(config_name="qwen3_1_7b", **overrides):
    """A shipped config laid out on v5p:2x2x1's four chips (libtpu's devices; nothing is compiled), its
    two layers rolled unless `overrides` say otherwise."""
    pytest.importorskip("libtpu")
    config = load_config(config_name)
    settings = {"model.n_layers": 2, "model.scan_unroll": 1, "train.seq_len": 256, "train.batch_size": 8,
                "mesh.fsdp": 4, **overrides}
    apply_overrides(config, [f"{k}={v}" for k, v in settings.items()])
    return build_for(config, "v5p:2x2x1")


def test_on_tpus_only_a_rolled_stack_writes_the_logits_gradient():
    """An unrolled stack's head fuses the loss's backward into both of its matmuls, leaving the logits
    live through the backward pass instead (estimate.logits_gradient): no phase of its own."""
    from ushard import estimate as e

    setup = tpu_setup()
    rolled, work, cfg = estimate(setup), e.device_work(setup), setup.model_config
    assert rolled.logits_gradient == work.rows * work.length * cfg.vocab_size * 2  # bfloat16
    assert rolled.phases()["the loss"]["logits_gradient"] == rolled.logits_gradient
    unrolled = estimate(tpu_setup(**{"model.scan_unroll": 2}))
    assert unrolled.logits_gradient == 0
    # The loss stays a phase: the saved activations and the vocabulary's buffers peak together there.
    assert unrolled.phases()["the loss"] == {"saved_activations": unrolled.saved_activations, "logits_gradient": 0,
                                             "vocabulary_buffers": unrolled.vocabulary_buffers, "gradients": 0}
    assert unrolled.saved_activations == rolled.saved_activations  # the logits among them either way


def test_on_tpus_a_rolled_zero3_stack_keeps_its_weight_shards_cast_to_the_compute_dtype():
    """The cast of the stacked layer shards (float32 -> bfloat16) is hoisted out of the layer loops and
    kept across both (estimate.hoisted_cast): half the stack's float32 shards, counted beside every phase."""
    from ushard.estimate import shard_bytes

    setup = tpu_setup()
    model = setup.model
    stack = jax.tree.leaves(model.split_stack(setup.steps.abstract_state().params)[0])
    names = jax.tree.leaves(model.split_stack(model.logical)[0], is_leaf=lambda x: isinstance(x, tuple))
    matmul_weights = [w for w, n in zip(stack, names) if "norm" not in n]  # norm scales are used as stored
    m = estimate(setup)
    assert m.kept_weights == shard_bytes(matmul_weights) // 2 > 0
    assert m.temporaries == m.kept_weights + max(sum(t.values()) for t in m.phases().values())
    for other in ({"model.scan_unroll": 2}, {"parallel.zero_stage": 1}, {"model.param_dtype": "bfloat16"}):
        assert estimate(tpu_setup(**other)).kept_weights == 0, other


def test_layouts_it_does_not_model_are_refused():
    setup = build(small_config("tiny_moe", **{"mesh.pipeline": 2, "mesh.fsdp": 4, "parallel.pipeline_microbatches": 4,
                                              "model.n_layers": 4, "model.moe.first_dense_layers": 2}))
    with pytest.raises(NotImplementedError, match="two layer stacks"):
        estimate(setup)


# GPU rules (module docstring). They were checked against measured GPU peaks, not a compile; here, on a
# GPU plan laid out on the simulated devices (as `ushard plan` does), that each rule touches exactly the
# residuals it names. Width and sequence are both 256, as bench_1b's are both 2048: only the scaled
# trace tells the residual stream [tokens, width] from a weight [width, ...] or [tokens, tokens].
GPU_SMALL = {"model.d_model": 256, "model.n_heads": 4, "model.n_kv_heads": 4, "model.d_ff": 512, "model.n_layers": 2,
             "model.vocab_size": 512, "train.seq_len": 256, "train.batch_size": 8, "train.grad_accum": 1,
             "parallel.zero_stage": 0, "model.remat": "none"}


def gpu_setup(**overrides):
    from ushard.planner import GPU_KINDS

    config = load_config("bench_1b")
    apply_overrides(config, [f"{k}={v}" for k, v in {**GPU_SMALL, **overrides}.items()])
    return build(config, jax.devices()[:4], "gpu", GPU_KINDS["h200"])


@pytest.mark.parametrize("layout", [{"mesh.fsdp": 4},
                                    {"mesh.fsdp": 2, "mesh.tensor": 2, "parallel.sequence_parallel": True}])
def test_on_gpus_rmsnorms_float32_pair_is_one_16_bit_input_and_sp_holds_norm_outputs_whole(layout):
    import math

    from ushard import estimate as e

    setup = gpu_setup(**layout)
    cfg, work = setup.model_config, e.device_work(setup)
    as_traced = sum(math.ceil(e.device_elements(shape, grown, work)) * size for (shape, size), (grown, _) in zip(
        e.residual_shapes(setup, work, "none", cfg.n_layers, scaled=False),
        e.residual_shapes(setup, work, "none", cfg.n_layers, scaled=True)))
    norms = 2 * cfg.n_layers + 1  # two a layer, and the final one
    stream = work.rows * work.length * cfg.d_model // work.residual_ways  # one device's [tokens, width]
    # Each norm's float32 x and x * rsqrt (8 bytes an element) are held as one bfloat16 x (2 bytes), and
    # its bfloat16 output is held whole along the sequence (as gathered for the column-parallel matmuls).
    expected = as_traced - norms * stream * (8 - 2) + norms * stream * 2 * (work.residual_ways - 1)
    assert e.device_residual_bytes(setup, work, "none", cfg.n_layers) == expected


def test_on_gpus_without_remat_the_backward_pass_trades_activations_for_gradients():
    from ushard import estimate as e

    setup = gpu_setup(**{"mesh.fsdp": 4})
    m = estimate(setup)
    assert m.gradients_apart and m.gradients > 0
    assert m.layer_activations == e.stream_gradients(setup, e.device_work(setup))
    assert m.backward_phase == m.saved_activations + m.layer_activations  # no gradient at its start
    assert m.phases()["the backward pass's end"]["gradients"] == m.gradients
    assert "gradients_apart" not in m.breakdown  # bytes only
    # Under remat, and on CPU, gradients and activations are counted together as before.
    assert not estimate(gpu_setup(**{"mesh.fsdp": 4, "model.remat": "dots_attention"})).gradients_apart
    config = load_config("bench_1b")
    apply_overrides(config, [f"{k}={v}" for k, v in {**GPU_SMALL, "mesh.fsdp": 4}.items()])
    assert not estimate(build(config, jax.devices()[:4])).gradients_apart


def test_on_gpus_a_policy_keeping_fused_attention_keeps_cudnns_output_and_statistics():
    """cuDNN's forward under dots_attention keeps its output and softmax statistics (the policy keeps
    its primitive's outputs). The trace's stand-in keeps the same by name: dots_attention's residuals
    are dots_no_batch's (the policy it extends) plus every layer's output and statistics, nothing else."""
    import math

    from ushard import estimate as e

    def traced_bytes(remat):
        setup = gpu_setup(**{"mesh.fsdp": 4, "model.remat": remat})
        cfg, work = setup.model_config, e.device_work(setup)
        shapes = e.residual_shapes(setup, work, remat, cfg.n_layers, scaled=False)
        return sum(math.prod(shape) * itemsize for shape, itemsize in shapes), cfg, work

    kept, cfg, work = traced_bytes("dots_attention")
    output = work.rows * work.length * cfg.n_heads * cfg.head_dim * 2  # bfloat16
    statistics = work.rows * cfg.n_heads * work.length * 4  # float32
    assert kept - traced_bytes("dots_no_batch")[0] == cfg.n_layers * (output + statistics)


GPU_ROWS = json.load(open(os.path.join(os.path.dirname(__file__), "data", "estimate", "gpu_rows.json")))["rows"]


@pytest.mark.slow
@pytest.mark.parametrize("row", [r for r in GPU_ROWS if not r.get("not_matched")], ids=lambda r: r["id"])
def test_the_gpu_estimate_is_within_15_percent_of_the_measured_peaks(row):
    """The estimate of each measured GPU row (laid out on simulated devices as `ushard plan` does)
    against its measured peak. In-sample: the GPU rules were fitted to these rows; the test keeps a
    later change from undoing them."""
    from ushard.config import load_config
    from ushard.planner import GPU_KINDS

    config = load_config(row["config"], row["overrides"])
    setup = build(config, jax.devices()[:row["gpus"]], "gpu", GPU_KINDS[row["hardware"]])
    assert estimate(setup).peak / 2**30 == pytest.approx(row["peak_gib"], rel=0.15)


def test_on_tpus_gpipe_and_circular_hold_the_tick_loops_weight_gradient_and_the_cast_stage():
    """The backward tick loop's float32 gradient of the stage's weights (carried, and the zeros it
    starts from) and the stage cast to bfloat16 (estimate.tick_loop_buffers); under remat no tick keeps
    its chunk of weights (models.stack.tick_policy), so the saved activations hold none."""
    from ushard import estimate as e

    pipeline = {"mesh.pipeline": 2, "mesh.fsdp": 2, "model.n_layers": 4, "parallel.pipeline_schedule": "circular",
                "parallel.pipeline_repeats": 2, "parallel.pipeline_microbatches": 2, "model.remat": "full",
                "model.compute_dtype": "bfloat16", "parallel.zero_stage": 1}
    setup = tpu_setup("tiny", **pipeline)
    stack = jax.tree.leaves(setup.model.split_stack(setup.model.shapes)[0])
    names = jax.tree.leaves(setup.model.split_stack(setup.model.logical)[0], is_leaf=lambda x: isinstance(x, tuple))
    whole = sum(math.prod(setup.layout.sharding(n).shard_shape(s.shape)) for s, n in zip(stack, names))
    m = estimate(setup)
    assert m.pipeline_buffers == whole * (2 * 4 + 2) > 0
    work = e.device_work(setup)
    chunk = e.stack_and_outer(setup, work, "full", work.layers)
    assert m.saved_activations == e.ticks(setup.layout.pipeline, work.stages) * chunk[0] + 2 * chunk[1]
    unkept = estimate(tpu_setup("tiny", **{**pipeline, "model.remat": "none"}))
    assert unkept.saved_activations > m.saved_activations  # without remat the ticks keep their weights too


def test_on_tpus_a_ragged_moe_layers_backward_holds_six_more_receive_buffers():
    """The grouped matmul's backward writes its masked operands and row gradients
    (estimate.grouped_matmul_backward): six arrays of the ragged receive buffer's rows by the width."""
    from ushard import estimate as e
    from ushard.parallel.expert import receive_rows

    ragged = {"mesh.expert": 2, "mesh.fsdp": 2, "model.moe.dispatch": "ragged", "model.moe.capacity_factor": 0.0}
    setup = tpu_setup("tiny_moe", **ragged)
    cfg, work = setup.model_config, e.device_work(setup)
    rows = receive_rows(work.rows * work.length * cfg.moe.top_k, 2, cfg.moe.num_experts // 2, cfg.moe.top_k,
                        cfg.moe.dispatch_headroom)
    itemsize = jax.numpy.dtype(cfg.compute_dtype).itemsize
    assert e.grouped_matmul_backward(setup, work) == 6 * rows * cfg.d_model * itemsize > 0
    padded = tpu_setup("tiny_moe", **{**ragged, "model.moe.dispatch": "padded", "model.moe.capacity_factor": 1.25})
    assert e.grouped_matmul_backward(padded, e.device_work(padded)) == 0


def test_the_mtp_modules_are_traced_where_they_keep_residuals():
    """Without a pipeline the MTP modules' residuals are counted with the rest; after GPipe's or circular's
    stages they run microbatch by microbatch under remat and keep only their inputs."""
    mtp = {"model.mtp.depth": 1, "model.remat": "full"}
    plain = {"mesh.fsdp": 4}
    assert estimate(tpu_setup("tiny", **plain, **mtp)).saved_activations > estimate(
        tpu_setup("tiny", **plain, **{"model.remat": "full"})).saved_activations
    gpipe = {"mesh.pipeline": 2, "mesh.fsdp": 2, "parallel.pipeline_schedule": "gpipe",
             "parallel.pipeline_microbatches": 2}
    assert estimate(tpu_setup("tiny", **gpipe, **mtp)).saved_activations == estimate(
        tpu_setup("tiny", **gpipe, **{"model.remat": "full"})).saved_activations


def test_an_moe_models_leading_dense_layers_are_outside_its_layer_trace():
    """deepseek_v2_lite's and deepseek_v3's first dense layers: the one-layer trace is an MoE layer's
    after them (`stack_and_outer`; a trace of one layer in all was no valid model)."""
    from ushard import estimate as e

    moe = {"mesh.expert": 2, "mesh.fsdp": 2, "model.n_layers": 3}
    dense, plain = tpu_setup("tiny_moe", **moe, **{"model.moe.first_dense_layers": 1}), tpu_setup("tiny_moe", **moe)
    layer = [e.stack_and_outer(s, e.device_work(s), "none", 1)[0] for s in (dense, plain)]
    assert layer[0] == layer[1] > 0
    assert estimate(dense).peak > 0
