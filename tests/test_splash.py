"""Splash attention (ushard/kernels/splash.py), the TPU kernel, against plain causal attention.

There is no TPU here: the Pallas kernel runs in Pallas's interpreter on the CPU (`interpret=True`),
which executes the same kernel program (its blocks, masks and backward kernels) with jnp. It runs
under a layout that splits the batch over data x fsdp and the heads over tensor, as in training.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import assert_matches_reference, reference_attention, split_on
from ushard.errors import UserError
from ushard.kernels.attention import check as check_impl
from ushard.kernels.attention import resolve as resolve_impl
from ushard.kernels.splash import splash_attention
from ushard.mesh import build_mesh
from ushard.sharding import Layout, use_layout


def test_splash_matches_plain_attention_in_value_and_gradient():
    shape = {"pipeline": 1, "data": 2, "fsdp": 2, "expert": 1, "sequence": 1, "tensor": 2}
    layout = Layout.create(build_mesh(shape))
    rng = np.random.default_rng(0)
    b, t, heads, kv_heads, hd = 4, 128, 4, 2, 16  # 128: one block of the kernel's 128 lanes
    normal = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)  # noqa: E731
    q_shape, kv_shape = (b, t, heads, hd), (b, t, kv_heads, hd)
    q, k, v, weights = normal(*q_shape), normal(*kv_shape), normal(*kv_shape), normal(*q_shape)
    segments = jnp.asarray(1 + np.cumsum(rng.random((b, t)) < 0.03, axis=1), jnp.int32)  # a few documents a row
    assert len(np.unique(segments[0])) > 1

    def splash(q, k, v):
        with use_layout(layout):
            return splash_attention(q, k, v, segments, interpret=True)

    def loss(attention):
        return jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(attention(q, k, v) * weights), argnums=(0, 1, 2)))

    got, got_grads = loss(splash)(q, k, v)
    want, want_grads = loss(lambda *a: reference_attention(*a, segments))(q, k, v)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for g, w in zip(got_grads, want_grads):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(w))))


def test_splash_inside_a_pipeline_stage_matches_plain_attention():
    """Each of two stages (a shard_map manual over `pipeline`, as the schedules run them) attends its
    own rows by splash over data x fsdp; value and gradients as plain attention's, documents masked."""
    from jax.sharding import PartitionSpec as P

    shape = {"pipeline": 2, "data": 2, "fsdp": 2, "expert": 1, "sequence": 1, "tensor": 1}
    layout = Layout.create(build_mesh(shape))
    rng = np.random.default_rng(2)
    stages, b, t, heads, hd = 2, 4, 128, 2, 16
    normal = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)  # noqa: E731
    q, k, v, weights = (normal(stages, b, t, heads, hd) for _ in range(4))
    segments = jnp.asarray(1 + np.cumsum(rng.random((stages, b, t)) < 0.03, axis=2), jnp.int32)

    def staged(q, k, v):
        def stage(q, k, v, weights, segments):
            with use_layout(layout.inside_stage()):
                return jnp.sum(splash_attention(q[0], k[0], v[0], segments[0], interpret=True) * weights[0])[None]

        per_stage = jax.shard_map(stage, mesh=layout.mesh, in_specs=(P("pipeline"),) * 5, out_specs=P("pipeline"),
                                  axis_names={"pipeline"})
        return per_stage(q, k, v, weights, segments).sum()

    def plain(q, k, v):
        return sum(jnp.sum(reference_attention(q[s], k[s], v[s], segments[s]) * weights[s]) for s in range(stages))

    with use_layout(layout):
        got, got_grads = jax.jit(jax.value_and_grad(staged, argnums=(0, 1, 2)))(q, k, v)
    want, want_grads = jax.jit(jax.value_and_grad(plain, argnums=(0, 1, 2)))(q, k, v)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for g, w in zip(got_grads, want_grads):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(w))))


@pytest.mark.parametrize("impl, platform, seq_len, stages, match", [
    ("splash", "gpu", 2048, 1,
     r"^model.attention_impl='splash' is Pallas splash attention, which runs on TPUs only, and these devices are gpu"),
    ("splash", "cpu", 2048, 1, r"runs on TPUs only, and these devices are cpu; use 'auto'"),
    ("cudnn", "tpu", 2048, 1,
     r"^model.attention_impl='cudnn' is cuDNN flash attention, which runs on GPUs only, and these devices are tpu"),
    ("splash", "tpu", 1000, 1, r"needs train.seq_len to be a multiple of 128 .*; it is 1000\.$"),
    ("cudnn", "cpu", 2048, 2, r"model\.attention_impl='cudnn' cannot run inside pipeline stages \(mesh\.pipeline=2\)"),
])
def test_a_kernel_the_platform_lacks_is_one_sentence(impl, platform, seq_len, stages, match):
    with pytest.raises(UserError, match=match):
        check_impl(impl, platform, seq_len, stages)


def test_auto_picks_each_platforms_kernel():
    assert resolve_impl("auto", "tpu", jnp.bfloat16, 8192) == "splash"
    assert resolve_impl("auto", "tpu", jnp.float32, 8192) == "splash"
    assert resolve_impl("auto", "tpu", jnp.bfloat16, 1000) == "xla"  # not whole blocks
    assert resolve_impl("auto", "tpu", jnp.bfloat16, 8192, in_stage=True) == "splash"
    assert resolve_impl("auto", "gpu", jnp.bfloat16, 8192) == "cudnn"
    assert resolve_impl("auto", "gpu", jnp.float32, 8192) == "xla"
    # Inside pipeline stages, where cuDNN cannot run: ushard's flash kernel where it has blocks for the
    # shape, else XLA's.
    assert resolve_impl("auto", "gpu", jnp.bfloat16, 8192, in_stage=True) == "flash"
    assert resolve_impl("auto", "gpu", jnp.bfloat16, 8192, in_stage=True, head_dim=96) == "xla"
    assert resolve_impl("auto", "gpu", jnp.bfloat16, 8192, in_stage=True, split=True) == "flash"  # blocks in stages
    # Documents: ours, whose blocks take the mask on a split sequence (cuDNN's do not) and skip other
    # documents' blocks on whole ones (cuDNN computes every block of its dense mask); cuDNN's dense
    # mask only where ours has no blocks for the shape.
    assert resolve_impl("auto", "gpu", jnp.bfloat16, 8192, split=True, documents=True) == "flash"
    assert resolve_impl("auto", "gpu", jnp.bfloat16, 8192, split=True, documents=True, head_dim=96) == "xla"
    assert resolve_impl("auto", "gpu", jnp.bfloat16, 8192, split=True) == "cudnn"
    assert resolve_impl("auto", "gpu", jnp.bfloat16, 8192, documents=True) == "flash"
    assert resolve_impl("auto", "gpu", jnp.bfloat16, 8192, documents=True, head_dim=96) == "cudnn"
    assert resolve_impl("auto", "gpu", jnp.bfloat16, 8192, documents=True, in_stage=True) == "flash"
    assert resolve_impl("auto", "gpu", jnp.bfloat16, 1000, in_stage=True) == "xla"
    assert resolve_impl("auto", "gpu", jnp.float32, 8192, in_stage=True) == "xla"
    assert resolve_impl("auto", "cpu", jnp.bfloat16, 8192) == "xla"
    # Latent attention's q·k heads of 192: ours runs them (flash_fits), slower than cuDNN's two-width
    # kernels, so auto keeps cuDNN where it runs, and ours where it cannot (pipeline stages).
    from ushard.kernels.attention import flash_fits

    assert flash_fits(8192, 192)
    assert resolve_impl("auto", "gpu", jnp.bfloat16, 8192, head_dim=192) == "cudnn"
    assert resolve_impl("auto", "gpu", jnp.bfloat16, 8192, documents=True, head_dim=192) == "cudnn"
    assert resolve_impl("auto", "gpu", jnp.bfloat16, 8192, in_stage=True, head_dim=192) == "flash"
    assert resolve_impl("flash", "gpu", jnp.bfloat16, 8192, head_dim=192) == "flash"


@pytest.mark.parametrize("mode,documents", [("ring", False), ("ring", True), ("all_gather", True)])
def test_splash_blocks_of_a_split_sequence_match_plain_attention(mode, documents):
    """Splash as context parallelism's block kernel (interpreted), sequence split 2 ways, grouped K/V
    heads, with and without documents (some of them wholly outside a block's keys)."""
    from ushard.kernels.splash import splash_blocks

    n, t, heads, kv_heads, hd = 2, 512, 4, 2, 16  # each device's halves: one 128-lane block
    rng = np.random.default_rng(1)
    normal = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)  # noqa: E731
    q_shape, kv_shape = (1, t, heads, hd), (1, t, kv_heads, hd)
    q, k, v, weights = normal(*q_shape), normal(*kv_shape), normal(*kv_shape), normal(*q_shape)
    segments = jnp.asarray(1 + np.cumsum(rng.random((1, t)) < 0.01, axis=1), jnp.int32) if documents else None
    assert_matches_reference(split_on(splash_blocks(interpret=True), n, mode), q, k, v, segments, weights)
