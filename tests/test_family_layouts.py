"""Every layout of a Qwen3, a Qwen3-MoE, a Gemma 3 and a DeepSeek model computes what one device computes.

As tests/test_parallel_parity.py does for the Llama: loss and gradients of step 0, then the losses
and parameters of three steps, float32 on simulated CPU devices, against the same family's model on
one device. Qwen3's head size is its own (24, against d_model / n_heads = 16); Gemma 3's windows (8
tokens of 32) alternate with global layers, so the ring's reach and the windowed blocks are part of
every sequence layout, and its windows move the loss (checked, so the comparison cannot pass on a
model that ignores them). DeepSeek's latent attention (q·k heads of 24, values of 12, q through a
bottleneck, the up-projections' `latent` axis split by ZeRO-3) with YaRN, sigmoid group-limited
routing, a shared expert, the per-sequence balance loss and a multi-token prediction module.
"""

import jax
import pytest

from conftest import DEEPSEEK, SMALL_MOE, small_config
from helpers import RTOL, assert_same_training, run_config

QWEN3 = {"model.family": "qwen3", "model.head_dim": 24}
QWEN3_MOE = {**QWEN3, **SMALL_MOE, "model.moe.num_experts": 4, "model.moe.top_k": 2,
             "model.moe.normalize_gates": False}
GEMMA3 = {"model.family": "gemma3", "model.head_dim": 24, "model.n_layers": 4, "model.sliding_window": 8,
          "model.sliding_window_pattern": 2, "model.local_rope_theta": 10000.0, "model.rope_theta": 1e6,
          "model.query_pre_attn_scalar": 32.0, "model.tie_embeddings": True}
FAMILIES = {"qwen3": ("tiny", QWEN3), "qwen3_moe": ("tiny_moe", QWEN3_MOE), "gemma3": ("tiny", GEMMA3),
            "deepseek": ("tiny_moe", DEEPSEEK)}
MOE_FAMILIES = ("qwen3_moe", "deepseek")

ONE_F_ONE_B = {"mesh.pipeline": 2, "parallel.pipeline_schedule": "1f1b", "parallel.pipeline_microbatches": 4}
LAYOUTS = {
    "fsdp": {"mesh.fsdp": 8, "parallel.zero_stage": 3},
    "tensor_sp": {"mesh.tensor": 2, "mesh.fsdp": 4, "parallel.sequence_parallel": True},
    "ring": {"mesh.sequence": 4, "mesh.fsdp": 2, "parallel.context_parallel": "ring"},
    "all_gather": {"mesh.sequence": 4, "mesh.fsdp": 2, "parallel.context_parallel": "all_gather"},
    "1f1b": {**ONE_F_ONE_B, "mesh.fsdp": 4},
}
MOE_LAYOUTS = {
    "expert": {"mesh.expert": 4, "mesh.fsdp": 2},
    "1f1b_expert": {**ONE_F_ONE_B, "mesh.expert": 2, "mesh.fsdp": 2},
    "1f1b_sequence": {**ONE_F_ONE_B, "mesh.sequence": 2, "mesh.fsdp": 2, "parallel.context_parallel": "ring"},
    # Latent attention's heads split over tensor, its latent whole on every tensor rank, around the ring.
    "tensor_ring": {"mesh.tensor": 2, "mesh.sequence": 2, "mesh.fsdp": 2, "parallel.context_parallel": "ring"},
    # An MoE pipeline's reference is one device with each batch in the pipeline's 4 microbatches: the
    # balancing terms are each microbatch's (as tests/test_pipeline.py explains).
    "single_accum4": {"train.grad_accum": 4},
}


def devices(overrides) -> list:
    n = 1
    for key, size in overrides.items():
        n *= size if key.startswith("mesh.") else 1
    return jax.devices()[:n]


class Results(dict):
    def __init__(self, batches):
        super().__init__()
        self.batches = batches

    def __missing__(self, key):
        family, layout = key
        name, settings = FAMILIES[family]
        overrides = {**LAYOUTS, **MOE_LAYOUTS}.get(layout, {})
        config = small_config(name, **settings, **overrides)
        self[key] = run_config(config, devices(overrides), self.batches)
        return self[key]


@pytest.fixture(scope="module")
def results(stdlib_batches):
    return Results(stdlib_batches)


CASES = ([(f, layout) for f in FAMILIES for layout in LAYOUTS]
         + [(f, layout) for f in MOE_FAMILIES for layout in ("expert", "1f1b_expert")]
         + [("deepseek", "1f1b_sequence"), ("deepseek", "tensor_ring")])


# In the default tier, each kind of thing a family adds to a layout, on Gemma 3: QK-norm on heads
# split over tensor (with SP), the windows on a split sequence (the ring's reach) and in 1F1B's
# stages. The rest, whose parts those and the Llama's rows cover (tests/test_parallel_parity.py;
# experts inside pipeline stages: tests/test_pipeline.py), run in the slow tier (`-m slow`), for the
# suite's time; all of them matched one device when added. The windows on a split sequence are
# tests/test_window.py's in the default tier, and latent attention's ring tests/test_context_parallel.py's
# (the latent moved and expanded, against plain attention); DeepSeek's rows, its MTP module's shifted
# tokens around the ring among them, and Gemma 3's ring run in the slow tier.
DEFAULT_TIER = {("gemma3", "tensor_sp"), ("gemma3", "1f1b")}
SLOW = {c for c in CASES if c not in DEFAULT_TIER}


@pytest.mark.parametrize("family, layout", [pytest.param(*c, marks=pytest.mark.slow) if c in SLOW else c
                                            for c in CASES])
def test_layout_matches_single_device(results, family, layout):
    reference = "single_accum4" if family in MOE_FAMILIES and "1f1b" in layout else "single"
    assert_same_training(results[family, layout], results[family, reference], RTOL, RTOL)


def test_the_families_train_and_gemma_windows_matter(results, stdlib_batches):
    for family in FAMILIES:
        losses = results[family, "single"]["losses"]
        assert losses[-1] < losses[0] - 0.05, (family, losses)
    name, settings = FAMILIES["gemma3"]
    unwindowed = run_config(small_config(name, **{**settings, "model.sliding_window": 32}), jax.devices()[:1],
                            stdlib_batches)
    assert abs(unwindowed["loss0"] - results["gemma3", "single"]["loss0"]) > 1e-4
