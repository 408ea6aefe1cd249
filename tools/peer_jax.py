"""peer_jax: a minimal hand-written single-file JAX training loop.

A peer baseline for comparing ushard against. It deliberately uses none of
ushard: a Llama-style decoder LM (RMSNorm pre-norm, RoPE, SwiGLU, causal
attention via jax.nn.dot_product_attention, untied embedding / output
projection, no biases), parameters as a plain dict with the layers stacked on
a leading axis and run with jax.lax.scan, float32 master params cast to
bfloat16 inside the loss, softmax cross-entropy in float32, optax.adamw, and
one jitted train step that donates (params, opt_state). Runs on one device.

Defaults are the "bench_1b" model. Prints ONE line of JSON to stdout, e.g.
  python tools/peer_jax.py --remat dots
Tiny CPU smoke test:
  python tools/peer_jax.py --d_model 64 --n_layers 2 --n_heads 4 --n_kv_heads 4 \
      --d_ff 128 --vocab 256 --seq_len 32 --batch 2
"""
import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp
import optax

# cuDNN flash attention on GPUs; JAX's default (implementation=None) is XLA, which materialises [T, T].
ATTN_IMPL = "cudnn" if jax.default_backend() == "gpu" else "xla"


def flops_per_token(n_params_no_embed, n_layers, seq_len, d_model):
    """Training FLOPs per token: 6*N (fwd+bwd matmuls over the weights, N
    excluding the input embedding table and norm scales, including the output projection)
    plus 6*L*T*d for causal attention scores and values (12*L*T*d fwd+bwd,
    halved because of the causal mask)."""
    return 6 * n_params_no_embed + 6 * n_layers * seq_len * d_model


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in [("vocab", 32000), ("d_model", 2048), ("n_layers", 16),
                          ("n_heads", 16), ("n_kv_heads", None), ("d_ff", 5632),
                          ("seq_len", 2048), ("batch", 16), ("steps", 10),
                          ("warmup", 3), ("seed", 0)]:
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--remat", choices=["none", "dots", "full"], default="dots")
    p.add_argument("--fixed_batch", action="store_true",
                   help="reuse one random batch every step (loss should fall)")
    p.add_argument("--log_loss", action="store_true",
                   help="print every step's loss to stderr (adds a sync per step)")
    a = p.parse_args()
    a.n_kv_heads = a.n_kv_heads or a.n_heads  # default: as many kv heads as heads (16)
    return a


def init_params(key, a):
    hd = a.d_model // a.n_heads
    L, D, F = a.n_layers, a.d_model, a.d_ff
    shapes = {
        "wq": (L, D, a.n_heads * hd), "wk": (L, D, a.n_kv_heads * hd),
        "wv": (L, D, a.n_kv_heads * hd), "wo": (L, a.n_heads * hd, D),
        "w_gate": (L, D, F), "w_up": (L, D, F), "w_down": (L, F, D),
    }
    keys = jax.random.split(key, len(shapes) + 2)
    layers = {n: 0.02 * jax.random.normal(k, s, jnp.float32)
              for (n, s), k in zip(shapes.items(), keys[2:])}
    layers["attn_norm"] = jnp.ones((L, D), jnp.float32)
    layers["mlp_norm"] = jnp.ones((L, D), jnp.float32)
    return {
        "embed": 0.02 * jax.random.normal(keys[0], (a.vocab, D), jnp.float32),
        "layers": layers,
        "final_norm": jnp.ones((D,), jnp.float32),
        "out": 0.02 * jax.random.normal(keys[1], (D, a.vocab), jnp.float32),
    }


def rms_norm(x, w, eps=1e-5):
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return xf.astype(x.dtype) * w


def rope_tables(seq_len, head_dim, theta=500000.0):
    inv_freq = 1.0 / theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    ang = jnp.arange(seq_len, dtype=jnp.float32)[:, None] * inv_freq[None, :]
    return jnp.cos(ang), jnp.sin(ang)  # each (T, head_dim/2)


def apply_rope(x, cos, sin):
    """x: (B, T, H, hd); rotate the two halves of the head dim (Llama style)."""
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], -1).astype(x.dtype)


def make_loss_fn(a):
    hd = a.d_model // a.n_heads

    def layer(x, p, cos, sin):
        B, T, _ = x.shape
        h = rms_norm(x, p["attn_norm"])
        q = apply_rope((h @ p["wq"]).reshape(B, T, a.n_heads, hd), cos, sin)
        k = apply_rope((h @ p["wk"]).reshape(B, T, a.n_kv_heads, hd), cos, sin)
        v = (h @ p["wv"]).reshape(B, T, a.n_kv_heads, hd)
        o = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=ATTN_IMPL)
        x = x + o.reshape(B, T, a.n_heads * hd) @ p["wo"]
        h = rms_norm(x, p["mlp_norm"])
        return x + (jax.nn.silu(h @ p["w_gate"]) * (h @ p["w_up"])) @ p["w_down"]

    if a.remat == "dots":
        layer = jax.checkpoint(layer, prevent_cse=False,
                               policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
    elif a.remat == "full":
        layer = jax.checkpoint(layer, prevent_cse=False)

    def loss_fn(params, tokens):
        p = jax.tree.map(lambda w: w.astype(jnp.bfloat16), params)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        cos, sin = rope_tables(inputs.shape[1], hd)
        x = p["embed"][inputs]
        x, _ = jax.lax.scan(lambda x, lp: (layer(x, lp, cos, sin), None), x, p["layers"])
        logits = rms_norm(x, p["final_norm"]) @ p["out"]  # bf16 matmul
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))

    return loss_fn


def main():
    a = parse_args()
    dev = jax.devices()[0]
    key_params, key_data = jax.random.split(jax.random.PRNGKey(a.seed))
    params = init_params(key_params, a)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    # Norm scales multiply no matmul: leave them out of N, as ushard/metrics.py does.
    n_norm = (2 * a.n_layers + 1) * a.d_model
    n_no_embed = n_params - params["embed"].size - n_norm

    tx = optax.adamw(a.lr, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)
    opt_state = tx.init(params)
    loss_fn = make_loss_fn(a)

    def train_step(params, opt_state, tokens):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    train_step = jax.jit(train_step, donate_argnums=(0, 1))

    n_batches = 1 if a.fixed_batch else a.warmup + a.steps
    batches = jax.random.randint(key_data, (n_batches, a.batch, a.seq_len + 1),
                                 0, a.vocab, dtype=jnp.int32)
    batches = [batches[i] for i in range(n_batches)]

    loss = None
    for i in range(a.warmup + a.steps):
        if i == a.warmup:  # start the clock once all warmup work has finished
            jax.block_until_ready((params, opt_state, loss))
            t0 = time.perf_counter()
        params, opt_state, loss = train_step(params, opt_state, batches[i % n_batches])
        if a.log_loss:
            print(f"step {i} loss {float(loss):.4f}", file=sys.stderr)
    jax.block_until_ready((params, opt_state, loss))
    elapsed = time.perf_counter() - t0

    step_time = elapsed / a.steps
    tokens_per_s = a.batch * a.seq_len / step_time
    n_devices = 1  # this peer runs on a single device
    fpt = flops_per_token(n_no_embed, a.n_layers, a.seq_len, a.d_model)
    tflops = fpt * tokens_per_s / n_devices / 1e12
    peak = 989.0 if ("H100" in dev.device_kind or "H200" in dev.device_kind) else None
    stats = dev.memory_stats() if hasattr(dev, "memory_stats") else None
    peak_mem = (stats["peak_bytes_in_use"] / 2**30
                if stats and "peak_bytes_in_use" in stats else None)
    print(json.dumps({
        "name": "peer_jax", "tokens_per_s": tokens_per_s, "step_time_s": step_time,
        "tflops_per_device": tflops, "mfu": tflops / peak if peak else None,
        "peak_mem_gib": peak_mem, "final_loss": float(loss), "n_params": int(n_params),
    }))


if __name__ == "__main__":
    main()
