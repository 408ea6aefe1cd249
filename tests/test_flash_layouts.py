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


def _np_scores(q, k, causal, q_segments, k_segments):
    """Scaled scores [B, heads, Tq, Tk] in float64 numpy, -inf where a query does not see a key."""
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    k = np.repeat(k, q.shape[2] // k.shape[2], axis=2)
    scores = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    t = q.shape[1]
    visible = np.tril(np.ones((t, t), bool)) if causal else np.ones((t, t), bool)
    visible = np.broadcast_to(visible, (q.shape[0], 1, t, t))
    if q_segments is not None:
        visible = visible & (np.asarray(q_segments)[:, None, :, None] == np.asarray(k_segments)[:, None, None, :])
    return np.where(visible, scores, -np.inf)


def _np_probabilities(scores, lse):
    """exp(scores - lse) for lse [B, heads, Tq], 0 for a query that sees nothing (lse -inf)."""
    finite = np.isfinite(lse)[..., None]
    return np.where(finite, np.exp(scores - np.where(finite, lse[..., None], 0.0)), 0.0)


def _callback_forward(q, k, v, causal, q_segments, k_segments):
    """`BlockKernel.forward` as a host callback: out, and the lse of the block's visible scores (-inf
    for a query that sees none of them, whose out is 0)."""
    def run(q, k, v, q_segments, k_segments):
        scores = _np_scores(q, k, causal, q_segments, k_segments)
        peak = scores.max(-1, keepdims=True)
        peak = np.where(np.isfinite(peak), peak, 0.0)
        total = np.exp(scores - peak).sum(-1)
        with np.errstate(divide="ignore"):
            lse = np.where(total > 0, np.log(total) + peak[..., 0], -np.inf)
        v_rep = np.repeat(np.asarray(v, np.float64), q.shape[2] // v.shape[2], axis=2)
        out = np.einsum("bhqk,bkhd->bqhd", _np_probabilities(scores, lse), v_rep)
        return out.astype(q.dtype), lse.transpose(0, 2, 1).astype(np.float32)

    shapes = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(q.shape[:3], jnp.float32))
    return jax.pure_callback(run, shapes, q, k, v, q_segments, k_segments)


def _callback_backward(q, k, v, out, lse, d_out, causal, q_segments, k_segments):
    """`BlockKernel.backward` as a host callback: the block's share of the gradients, from the queries'
    final out and lse (over every block)."""
    def run(q, k, v, out, lse, d_out, q_segments, k_segments):
        scores = _np_scores(q, k, causal, q_segments, k_segments)
        p = _np_probabilities(scores, np.asarray(lse, np.float64).transpose(0, 2, 1))
        group = q.shape[2] // k.shape[2]
        v_rep = np.repeat(np.asarray(v, np.float64), group, axis=2)
        k_rep = np.repeat(np.asarray(k, np.float64), group, axis=2)
        d_out = np.asarray(d_out, np.float64)
        d_v = np.einsum("bhqk,bqhd->bkhd", p, d_out)
        d_p = np.einsum("bqhd,bkhd->bhqk", d_out, v_rep)
        final = np.einsum("bqhd,bqhd->bhq", d_out, np.asarray(out, np.float64))
        d_s = p * (d_p - final[..., None]) / np.sqrt(q.shape[-1])
        d_q = np.einsum("bhqk,bkhd->bqhd", d_s, k_rep)
        d_k = np.einsum("bhqk,bqhd->bkhd", d_s, np.asarray(q, np.float64))
        fold = lambda g: g.reshape(*k.shape[:2], k.shape[2], group, k.shape[3]).sum(3)  # noqa: E731
        return tuple(g.astype(q.dtype) for g in (d_q, fold(d_k), fold(d_v)))

    shapes = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (q, k, v))
    return jax.pure_callback(run, shapes, q, k, v, out, lse, d_out, q_segments, k_segments)


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


@pytest.mark.slow  # the suite's time: flash inside stages and flash blocks of a ring are each in the default tier
@pytest.mark.parametrize("mode", ["ring", "all_gather"])
def test_flash_blocks_of_a_split_sequence_inside_pipeline_stages_match_one_device(flash_on_cpu, mode):
    """pipeline=2 x sequence=2 with attention_impl="flash" and documents: our blocks (opaque halves, as
    a kernel's) run the split sequence inside the stages, their map's types checked so that the
    custom VJP's gradients carry the stage's axes (unchecked, they could not: this test found it),
    and training matches one device."""
    model = {**FLASH_MODEL, "train.seq_len": 512, "train.batch_size": 4}
    config = small_config(**model, **{"model.attention_impl": "xla"})
    batches = make_batches(config.data, config.train.seq_len, config.train.seed)
    reference = run_config(config, jax.devices()[:1], batches)
    settings = {**model, "model.attention_impl": "flash", "mesh.pipeline": 2, "mesh.sequence": 2,
                "parallel.context_parallel": mode, "parallel.pipeline_schedule": "1f1b",
                "parallel.pipeline_microbatches": 4}
    got = run_config(small_config(**settings), jax.devices()[:4], batches)
    assert got["trainer"].setup.plan.context_blocks.name == "flash"
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
    assert (split_in_stages.stage_attention.name, split_in_stages.context_blocks.name) == ("flash", "flash")
    split = {"mesh.sequence": 2, "mesh.fsdp": 4}
    assert plan(**split).context_blocks.name == "cudnn"
    with_documents = plan(**split, **{"model.document_mask": True})
    assert (with_documents.attention.name, with_documents.context_blocks.name) == ("flash", "flash")
    assert "take no document mask" in with_documents.attention.why
    whole = plan(**{"mesh.fsdp": 8, "model.document_mask": True})
    assert whole.attention.name == "flash" and "computes every block" in whole.attention.why


@pytest.mark.parametrize("keep_kv", [False, True])
def test_remat_dots_attention_keeps_the_rings_output_instead_of_running_the_ring_again(keep_kv):
    """Under `model.remat=dots_attention` the ring of fused blocks names its merged out and lse (and
    the blocks it kept, with `context_keep_kv`) for the policy: compiled, the backward pass then sends
    no block around a second time and runs our forward kernel no more often than without remat. The
    same policy without the name ran the whole ring again."""
    from ushard.models.stack import REMAT_POLICIES

    n, t, heads, hd = 2, 256, 2, 64
    x = jnp.ones((1, t, heads, hd), jnp.float32)
    weight = jnp.ones((hd, hd), jnp.float32)
    split = split_on(FLASH_BLOCKS, n, "ring", keep_kv=keep_kv)

    def layer(q, k, v):
        return jnp.tanh(split(q, k, v, None) @ weight)

    def compiled(policy) -> str:
        fn = layer if policy is None else jax.checkpoint(layer, policy=policy)
        return jax.jit(jax.grad(lambda *a: fn(*a).sum(), argnums=(0, 1, 2))).lower(x, x, x).compile().as_text()

    def counts(text):
        return text.count("collective-permute-start") or text.count("collective-permute("), \
            text.count("ushard_flash_forward")

    plain, kept = counts(compiled(None)), counts(compiled(REMAT_POLICIES["dots_attention"]))
    assert plain[0] > 0 and kept[0] <= plain[0] and kept[1] < 1.5 * plain[1], (plain, kept)
    unnamed = jax.checkpoint_policies.save_from_both_policies(REMAT_POLICIES["dots_no_batch"],
                                                              lambda prim, *_, **__: "attention" in prim.name)
    again = counts(compiled(unnamed))
    assert again[0] > plain[0] or again[1] > 1.5 * plain[1], (plain, again)
