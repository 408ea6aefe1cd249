"""The model on its own: document masking, scanned depth, remat policies, tied embeddings, FLOPs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import small_config
from ushard.models.attention import causal_attention
from ushard.models.config import ModelConfig
from ushard.models.definition import ModelDef
from ushard.models.layers import embed_lookup, gated_silu_pair
from ushard.training.loss import cross_entropy_sums


def model_and_params(**overrides):
    model = ModelDef(ModelConfig.from_config(small_config(**{f"model.{k}": v for k, v in overrides.items()}).model))
    return model, jax.jit(lambda: model.init(0))()


def tokens_and_positions(batch=2, length=16, seed=0):
    tokens = jax.random.randint(jax.random.key(seed), (batch, length), 0, 257)
    return tokens, jnp.broadcast_to(jnp.arange(length), (batch, length))


def summed_loss(model, params, tokens, positions):
    """The model's summed next-token loss over every position (targets = the tokens themselves)."""
    return cross_entropy_sums(model.apply(params, tokens, positions)[0], tokens, jnp.ones_like(tokens))[0]


def reference_attention(q, k, v, segment_ids):
    """Plain softmax attention with an explicit causal-and-same-document mask, GQA by repetition."""
    groups = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    t = q.shape[1]
    allowed = jnp.tril(jnp.ones((t, t), bool))[None, None]
    allowed &= (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]
    weights = jax.nn.softmax(jnp.where(allowed, scores, -1e30), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", weights, v)


def test_attention_matches_reference_with_documents_and_gqa():
    kq, kk, kv = jax.random.split(jax.random.key(1), 3)
    q = jax.random.normal(kq, (2, 12, 4, 8))
    k = jax.random.normal(kk, (2, 12, 2, 8))
    v = jax.random.normal(kv, (2, 12, 2, 8))
    segments = jnp.array([[1] * 5 + [2] * 7, [1] * 12])
    got = causal_attention(q, k, v, segments, "xla")
    np.testing.assert_allclose(got, reference_attention(q, k, v, segments), rtol=1e-5, atol=1e-5)


def test_document_mask_isolates_packed_documents():
    model, params = model_and_params()
    tokens, _ = tokens_and_positions(batch=1, length=16)
    # Two documents: positions restart at 8 and segment ids change there.
    positions = jnp.concatenate([jnp.arange(8), jnp.arange(8)])[None]
    segments = jnp.array([[1] * 8 + [2] * 8])
    other_first_doc = tokens.at[0, :8].set((tokens[0, :8] + 1) % 257)
    a = model.apply(params, tokens, positions, segments)[0]
    b = model.apply(params, other_first_doc, positions, segments)[0]
    np.testing.assert_allclose(a[0, 8:], b[0, 8:], rtol=1e-5, atol=1e-5)  # second document untouched
    assert not np.allclose(a[0, :8], b[0, :8])
    # ...and the second document alone, from position 0, gives the same logits.
    alone = model.apply(params, tokens[:, 8:], positions[:, 8:], jnp.ones((1, 8), jnp.int32))[0]
    np.testing.assert_allclose(a[0, 8:], alone[0], rtol=1e-4, atol=1e-5)


def test_causality():
    model, params = model_and_params()
    tokens, positions = tokens_and_positions()
    changed = tokens.at[:, 10].set((tokens[:, 10] + 1) % 257)
    a = model.apply(params, tokens, positions)[0]
    b = model.apply(params, changed, positions)[0]
    np.testing.assert_allclose(a[:, :10], b[:, :10], rtol=1e-5, atol=1e-6)
    assert not np.allclose(a[:, 10:], b[:, 10:])


@pytest.mark.parametrize("policy, fused", [
    ("full", False), ("dots", False), ("dots_no_batch", False),
    pytest.param("dots_attention", False, marks=pytest.mark.slow),  # the suite's time: the fused row has it
    ("dots_attention_norms", False), ("full", True), ("dots_attention_norms", True)])
def test_remat_policies_keep_gradients(policy, fused):
    tokens, positions = tokens_and_positions()

    def grads(remat):
        model, params = model_and_params(remat=remat, fused_mlp=fused)
        return jax.grad(summed_loss, argnums=1)(model, params, tokens, positions)

    reference, got = grads("none"), grads(policy)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(reference)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gated_silu_pair_matches_the_plain_expression_and_its_autodiff(dtype):
    keys = jax.random.split(jax.random.key(7), 2)
    gate_up = (3 * jax.random.normal(keys[0], (2, 5, 2, 24), jnp.float32)).astype(dtype)
    d_hidden = jax.random.normal(keys[1], (2, 5, 24), jnp.float32).astype(dtype)

    def plain(gu):
        gu = gu.astype(jnp.float32)
        return jax.nn.silu(gu[..., 0, :]) * gu[..., 1, :]

    got, got_vjp = jax.vjp(gated_silu_pair, gate_up)
    want, want_vjp = jax.vjp(plain, gate_up.astype(jnp.float32))
    (got_grad,), (want_grad,) = got_vjp(d_hidden), want_vjp(d_hidden.astype(jnp.float32))
    tol = 1e-6 if dtype == jnp.float32 else 2e-2
    assert got.dtype == got_grad.dtype == dtype
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=tol, atol=tol)
    np.testing.assert_allclose(np.asarray(got_grad, np.float32), want_grad, rtol=tol, atol=tol)


def test_unrolled_layer_loop_computes_the_same():
    tokens, positions = tokens_and_positions()
    model, params = model_and_params()
    unrolled = ModelDef(ModelConfig.from_config(small_config(**{"model.scan_unroll": 2}).model))
    np.testing.assert_allclose(unrolled.apply(params, tokens, positions)[0], model.apply(params, tokens, positions)[0],
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("remat, unroll", [("none", 2), ("full", 2), ("full", 1)])
def test_recomputation_is_fenced_off_from_the_forward_pass_only_when_unrolled(remat, unroll):
    """Unrolled, nothing but an optimization barrier stops XLA from merging the remat recomputation with
    the forward pass (which silently keeps every activation: docs/dev-notes.md); a rolled scan keeps
    them apart itself, where a barrier would only cost speed."""
    tokens, positions = tokens_and_positions()
    model = ModelDef(ModelConfig.from_config(small_config(**{"model.remat": remat, "model.scan_unroll": unroll}).model))
    grad_fn = jax.jit(jax.grad(lambda p: summed_loss(model, p, tokens, positions)))
    barriers = grad_fn.lower(model.shapes).as_text().count("optimization_barrier")
    assert (barriers > 0) == (remat != "none" and unroll > 1), barriers


def test_program_size_does_not_grow_with_depth():
    tokens, positions = tokens_and_positions()

    def hlo_size(n_layers):
        model = ModelDef(ModelConfig.from_config(small_config(**{"model.n_layers": n_layers}).model))
        fn = jax.jit(lambda p: model.apply(p, tokens, positions)[0])
        return len(fn.lower(model.shapes).as_text())

    assert hlo_size(8) < 1.05 * hlo_size(2)


def test_tied_embeddings_share_the_table():
    model, params = model_and_params(tie_embeddings=True)
    assert "lm_head" not in params
    untied, _ = model_and_params()
    assert untied.num_params() - model.num_params() == 64 * 512
    assert untied.num_matmul_params() == model.num_matmul_params()  # the table counts once, as the head


def test_flops_per_token_counts_matmuls_and_causal_attention():
    config = small_config()
    m, t = config.model, config.train
    model = ModelDef(ModelConfig.from_config(m))
    d, f, h, kv, hd = m.d_model, m.d_ff, m.n_heads, m.n_kv_heads, m.d_model // m.n_heads
    per_layer = d * h * hd * 2 + d * kv * hd * 2 + 3 * d * f  # q, o, k, v, gate/up/down
    matmul_params = m.n_layers * per_layer + d * m.vocab_size  # + LM head; the input table is a lookup
    expected = 6 * matmul_params + 6 * m.n_layers * t.seq_len * d
    assert model.num_matmul_params() == matmul_params
    assert model.flops_per_token(t.seq_len) == expected


def test_cross_entropy_matches_reference():
    logits = jax.random.normal(jax.random.key(0), (2, 5, 7))
    targets = jnp.array([[1, 2, 3, 4, 5], [6, 0, 1, 2, 3]])
    mask = jnp.array([[1, 1, 0, 1, 1], [1, 1, 1, 1, 0]])
    total, count = cross_entropy_sums(logits, targets, mask)
    log_probs = jax.nn.log_softmax(logits)
    expected = -sum(float(log_probs[b, t, targets[b, t]]) for b in range(2) for t in range(5) if mask[b, t])
    np.testing.assert_allclose(total, expected, rtol=1e-6)
    assert count == 8


def test_embedding_gradient_sums_repeated_tokens_in_float32():
    table = jax.random.normal(jax.random.key(0), (11, 4))
    tokens = jnp.array([[3, 3, 3, 7], [3, 0, 7, 3]])  # repeats: their gradients must add up
    cotangent = jax.random.normal(jax.random.key(1), (2, 4, 4))
    reference = jnp.zeros((11, 4)).at[tokens].add(cotangent)  # float32 throughout

    def grad_of(dtype):
        f = lambda t: jnp.sum(embed_lookup(t.astype(dtype), tokens).astype(jnp.float32) * cotangent)  # noqa: E731
        return jax.grad(f)(table)

    np.testing.assert_allclose(grad_of(jnp.float32), reference, rtol=1e-6)
    # bf16 compute: the cotangents arrive in bf16; their float32 sum is rounded once, not at every add.
    bf16_cotangent = cotangent.astype(jnp.bfloat16).astype(jnp.float32)
    summed_once = jnp.zeros((11, 4)).at[tokens].add(bf16_cotangent).astype(jnp.bfloat16).astype(jnp.float32)
    np.testing.assert_array_equal(grad_of(jnp.bfloat16), summed_once)
    np.testing.assert_array_equal(embed_lookup(table, tokens), table[tokens])


def test_fused_mlp_computes_the_same_function():
    plain, params = model_and_params()
    fused, fused_init = model_and_params(fused_mlp=True)
    mlp = params["blocks"]["mlp"]
    repacked = dict(params)
    repacked["blocks"] = dict(params["blocks"])
    repacked["blocks"]["mlp"] = {"w_gate_up": jnp.stack([mlp["w_gate"], mlp["w_up"]], axis=2), "w_down": mlp["w_down"]}
    assert jax.tree.map(jnp.shape, repacked) == jax.tree.map(jnp.shape, fused_init)
    tokens, positions = tokens_and_positions()
    np.testing.assert_allclose(
        fused.apply(repacked, tokens, positions)[0], plain.apply(params, tokens, positions)[0], rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_cross_entropy_gradient_matches_autodiff(dtype):
    logits = (3 * jax.random.normal(jax.random.key(0), (2, 6, 50))).astype(dtype)
    targets = jax.random.randint(jax.random.key(1), (2, 6), 0, 50)
    mask = jnp.array([[1, 1, 0, 1, 1, 1], [1, 0, 1, 1, 1, 1]])

    def autodiff_reference(x):
        x = x.astype(jnp.float32)
        picked = jnp.take_along_axis(x, targets[..., None], axis=-1)[..., 0]
        return jnp.sum((jax.nn.logsumexp(x, axis=-1) - picked) * mask)

    got = jax.grad(lambda x: 0.5 * cross_entropy_sums(x, targets, mask)[0])(logits)
    expected = jax.grad(lambda x: 0.5 * autodiff_reference(x))(logits)
    assert got.dtype == dtype
    np.testing.assert_allclose(got.astype(jnp.float32), expected.astype(jnp.float32), rtol=1e-6, atol=1e-7)
    assert np.all(np.asarray(got[0, 2]) == 0)  # a masked token contributes no gradient


def test_fp8_model_tracks_the_bf16_model():
    """model.fp8 quantises every block matmul (ushard/models/fp8.py tests each one): the loss and its
    gradient stay within FP8's error of the unquantised model's (the gradient of wq passes through
    four quantised backward matmuls, each with e5m2's 2 mantissa bits), and differ from it."""
    plain, params = model_and_params()
    fp8, _ = model_and_params(fp8=True)
    tokens, positions = tokens_and_positions()

    def loss_and_grad(model):
        return jax.value_and_grad(summed_loss, argnums=1)(model, params, tokens, positions)

    (loss, grads), (loss8, grads8) = loss_and_grad(plain), loss_and_grad(fp8)
    assert 0 < abs(loss8 - loss) / loss < 0.02
    wq, wq8 = grads["blocks"]["attn"]["wq"], grads8["blocks"]["attn"]["wq"]
    assert 1e-4 < np.linalg.norm(wq8 - wq) / np.linalg.norm(wq) < 0.3
    cosine = np.sum(wq8 * wq) / (np.linalg.norm(wq8) * np.linalg.norm(wq))
    assert cosine > 0.95
