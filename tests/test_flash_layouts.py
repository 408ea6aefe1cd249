"""ushard's flash attention (ushard/kernels/flash.py) where the layouts run it: the blocks of a split
sequence (ring and all-gather, with documents) and the layers inside pipeline stages, against one
device. There is no GPU here: the kernels run in Pallas's interpreter, and the platform check that
keeps users from that slow path is lifted for these tests."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import small_config
from helpers import assert_matches_reference, assert_same_training, run_config, split_on
from ushard.data import make_batches
from ushard.kernels import attention
from ushard.kernels.flash import FLASH_BLOCKS


@pytest.mark.parametrize("mode", ["ring", pytest.param("all_gather", marks=pytest.mark.slow)])
def test_flash_blocks_of_a_split_sequence_with_documents_match_plain_attention(mode):
    """The sequence split 2 ways (each device's two zig-zag chunks: one 64-token block each), grouped
    K/V heads, documents that start inside blocks and some that a block's keys never reach."""
    n, t, heads, kv_heads, hd = 2, 256, 4, 2, 64
    rng = np.random.default_rng(2)
    normal = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)  # noqa: E731
    q_shape, kv_shape = (1, t, heads, hd), (1, t, kv_heads, hd)
    q, k, v, weights = normal(*q_shape), normal(*kv_shape), normal(*kv_shape), normal(*q_shape)
    segments = jnp.asarray(1 + np.cumsum(rng.random((1, t)) < 0.02, axis=1), jnp.int32)
    assert len(np.unique(segments)) > 2
    assert_matches_reference(split_on(FLASH_BLOCKS, n, mode), q, k, v, segments, weights)


# Head size 64 (one of the kernel's), 128-token rows of documents.
FLASH_MODEL = {"model.d_model": 256, "model.n_heads": 4, "model.n_kv_heads": 2, "model.n_layers": 4,
               "train.seq_len": 128, "train.batch_size": 8, "model.document_mask": True}


def _np_attention(q, k, v, causal, q_segments, k_segments):
    """(probabilities [B, heads, Tq, Tk], out, lse [B, Tq, heads]) in float64 numpy, K/V heads repeated."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    group = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    scores = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    t = q.shape[1]
    visible = np.tril(np.ones((t, t), bool)) if causal else np.ones((t, t), bool)
    visible = np.broadcast_to(visible, (q.shape[0], 1, t, t))
    if q_segments is not None:
        visible = visible & (np.asarray(q_segments)[:, None, :, None] == np.asarray(k_segments)[:, None, None, :])
    scores = np.where(visible, scores, -np.inf)
    lse = np.log(np.sum(np.exp(scores - scores.max(-1, keepdims=True)), -1)) + scores.max(-1)
    probabilities = np.exp(scores - lse[..., None])
    return probabilities, np.einsum("bhqk,bkhd->bqhd", probabilities, v), lse.transpose(0, 2, 1), (k, v)


def _callback_forward(q, k, v, causal, q_segments, k_segments):
    def run(q, k, v, q_segments, k_segments):
        _, out, lse, _ = _np_attention(q, k, v, causal, q_segments, k_segments)
        return out.astype(q.dtype), lse.astype(np.float32)

    shapes = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(q.shape[:3], jnp.float32))
    return jax.pure_callback(run, shapes, q, k, v, q_segments, k_segments)


def _callback_backward(q, k, v, out, lse, d_out, causal, q_segments, k_segments):
    def run(q, k, v, d_out, q_segments, k_segments):
        p, out, _, (k_rep, v_rep) = _np_attention(q, k, v, causal, q_segments, k_segments)
        d_out = np.asarray(d_out, np.float64)
        d_v = np.einsum("bhqk,bqhd->bkhd", p, d_out)
        d_p = np.einsum("bqhd,bkhd->bhqk", d_out, v_rep)
        d_s = p * (d_p - np.einsum("bqhd,bqhd->bhq", d_out, out)[..., None]) / np.sqrt(q.shape[-1])
        d_q = np.einsum("bhqk,bkhd->bqhd", d_s, k_rep)
        d_k = np.einsum("bhqk,bqhd->bkhd", d_s, np.asarray(q, np.float64))
        group = q.shape[2] // k.shape[2]
        fold = lambda g: g.reshape(*k.shape[:2], k.shape[2], group, k.shape[3]).sum(3)  # noqa: E731
        return tuple(g.astype(q.dtype) for g in (d_q, fold(d_k), fold(d_v)))

    shapes = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (q, k, v))
    return jax.pure_callback(run, shapes, q, k, v, d_out, q_segments, k_segments)


@pytest.fixture
def flash_on_cpu(monkeypatch):
    """"flash" allowed on CPUs, its halves replaced by opaque host callbacks (numpy, float64): inside a
    pipeline stage's shard_map, Pallas's interpreter (not the GPU lowering) trips over the stage's
    varying-axes types (JAX 0.10.2, its grid loop), so there the seam is tested (opaque halves, as a
    kernel's, joined by a custom VJP and typed as varying over the stage axis) and the kernel itself
    by test_flash.py and the ring above."""
    from ushard.kernels import flash

    monkeypatch.setitem(attention.PLATFORMS, "flash", ("cpu", attention.NAMES["flash"]))
    monkeypatch.setattr(flash, "FLASH_BLOCKS", attention.BlockKernel(_callback_forward, _callback_backward,
                                                                     segments=True, typed=False))


@pytest.mark.parametrize("schedule", ["1f1b", pytest.param("gpipe", marks=pytest.mark.slow)])
def test_flash_attention_inside_pipeline_stages_matches_one_device(flash_on_cpu, schedule):
    """Two stages, four microbatches, documents: training with the flash seam in the stages (where cuDNN
    crashes XLA's GPU compiler) matches one device with XLA attention."""
    config = small_config(**FLASH_MODEL, **{"model.attention_impl": "xla"})
    batches = make_batches(config.data, config.train.seq_len, config.train.seed)
    reference = run_config(config, jax.devices()[:1], batches)
    settings = {**FLASH_MODEL, "model.attention_impl": "flash", "mesh.pipeline": 2,
                "parallel.pipeline_schedule": schedule, "parallel.pipeline_microbatches": 4}
    got = run_config(small_config(**settings), jax.devices()[:2], batches)
    assert got["trainer"].setup.plan.attention_for(in_stage=True) == "flash"
    assert_same_training(got, reference)


def test_flash_asked_for_a_split_sequence_inside_pipeline_stages_runs_xla_blocks_there(flash_on_cpu):
    """pipeline=2 x sequence=2 with attention_impl="flash": the ring's custom VJP on our blocks cannot
    type its gradients as the stage's map wants (found with this test), so the blocks inside the stages
    run on XLA's, the plan says why, and training matches one device. Rows of 512: each device's two
    chunks would be whole blocks of 128, so the chunks' size is not the reason."""
    model = {**FLASH_MODEL, "train.seq_len": 512, "train.batch_size": 4}
    config = small_config(**model, **{"model.attention_impl": "xla"})
    batches = make_batches(config.data, config.train.seq_len, config.train.seed)
    reference = run_config(config, jax.devices()[:1], batches)
    settings = {**model, "model.attention_impl": "flash", "mesh.pipeline": 2, "mesh.sequence": 2,
                "parallel.context_parallel": "ring", "parallel.pipeline_schedule": "1f1b",
                "parallel.pipeline_microbatches": 4}
    got = run_config(small_config(**settings), jax.devices()[:4], batches)
    plan = got["trainer"].setup.plan
    assert plan.context_blocks.name == "xla" and "inside pipeline stages" in plan.context_blocks.why
    assert_same_training(got, reference)


def test_flash_is_refused_off_a_gpu_with_a_sentence():
    from ushard.errors import UserError

    with pytest.raises(UserError, match="runs on GPUs only"):
        attention.check("flash", "cpu", 128)
    with pytest.raises(UserError, match="multiple of 128"):
        attention.check("flash", "gpu", 200)


def test_a_gpu_plan_runs_flash_where_cudnn_cannot():
    """On GPUs "auto" means cuDNN, and ushard's flash kernel where cuDNN cannot run or runs worse:
    inside pipeline stages, as the blocks of a sequence split with documents (cuDNN's take no mask),
    and with documents on whole sequences (cuDNN computes every block of its dense mask); the start-up
    report says why."""
    from ushard.config import validate
    from ushard.models.config import ModelConfig
    from ushard.plan import ParallelPlan

    def plan(**settings):
        config = small_config(**{**FLASH_MODEL, "model.document_mask": False, "model.compute_dtype": "bfloat16",
                                 "train.seq_len": 512, **settings})  # head dim 64
        shape = validate(config, 8)
        return ParallelPlan.create(config, shape, "gpu", ModelConfig.from_config(config.model), "NVIDIA H200")

    staged = plan(**{"mesh.pipeline": 2, "mesh.fsdp": 4, "parallel.pipeline_microbatches": 2})
    assert (staged.attention.name, staged.stage_attention.name) == ("cudnn", "flash")
    assert "cannot run inside pipeline stages" in staged.stage_attention.why
    split_in_stages = plan(**{"mesh.pipeline": 2, "mesh.sequence": 2, "mesh.fsdp": 2,
                              "parallel.pipeline_microbatches": 2})
    assert (split_in_stages.stage_attention.name, split_in_stages.context_blocks.name) == ("xla", "xla")
    split = {"mesh.sequence": 2, "mesh.fsdp": 4}
    assert plan(**split).context_blocks.name == "cudnn"
    with_documents = plan(**split, **{"model.document_mask": True})
    assert (with_documents.attention.name, with_documents.context_blocks.name) == ("flash", "flash")
    assert "take no document mask" in with_documents.attention.why
    whole = plan(**{"mesh.fsdp": 8, "model.document_mask": True})
    assert whole.attention.name == "flash" and "computes every block" in whole.attention.why
