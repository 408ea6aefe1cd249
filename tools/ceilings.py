"""The ceilings of a config's training step on this device, measured, and the floor they put on a step.

    python tools/ceilings.py --config configs/bench_1b.py [--config.a.b=v ...] [--repeats 20]

On one device, for the config's model at its global batch (`train.batch_size`; override it with the
sequences one device holds for a config meant for many) and sequence length:
- memory bandwidth: an elementwise pass over 1 GiB of bf16 (bytes read plus bytes written);
- every matmul of a step, at its own shape, in its three forms (forward; the backward's input gradient;
  the weight gradient), bf16 operands and output, as XLA compiles a lone dot;
- the fused causal attention kernel (cuDNN on GPUs), forward and forward + backward, for one layer.

The floor of a step is then: all matmuls at their measured times + attention at its measured time +
the fewest bytes the step's other work must move, over the measured bandwidth (`elementwise_bytes`).
No implementation of this computation with these kernels runs much faster; measured step time over
the floor is what fusion, scheduling and overhead cost. TFLOP/s use ushard/metrics.py's count.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ushard.config import load_config  # noqa: E402
from ushard.metrics import peak_flops  # noqa: E402
from ushard.models.config import ModelConfig  # noqa: E402
from ushard.models.definition import ModelDef  # noqa: E402

BF16 = jnp.bfloat16


def time_ms(fn, *args, repeats: int) -> float:
    """Median over 3 rounds of the mean time of `repeats` back-to-back calls of jitted `fn` (ms)."""
    fn = jax.jit(fn)
    jax.block_until_ready(fn(*args))
    rounds = []
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(repeats):
            out = fn(*args)
        jax.block_until_ready(out)
        rounds.append((time.perf_counter() - start) / repeats * 1e3)
    return statistics.median(rounds)


def random(key: int, shape, dtype=BF16):
    return jax.random.normal(jax.random.key(key), shape, jnp.float32).astype(dtype)


def layer_matmuls(m) -> list[tuple[str, int, int]]:
    """(name, in features, out features) of each weight matmul of one block."""
    hd = m.d_model // m.n_heads
    q, kv = m.n_heads * hd, m.n_kv_heads * hd
    attention = [("q", m.d_model, q), ("k", m.d_model, kv), ("v", m.d_model, kv)]
    mlp = [("gate_up", m.d_model, 2 * m.d_ff)] if m.fused_mlp else [
        ("gate", m.d_model, m.d_ff), ("up", m.d_model, m.d_ff)]
    return attention + [("o", q, m.d_model)] + mlp + [("down", m.d_ff, m.d_model)]


def matmul_forms(tokens: int, k: int, n: int) -> dict[str, tuple]:
    """The three matmuls a weight [k, n] costs per step: (operand shapes, contracting dims)."""
    return {
        "forward": (((tokens, k), (k, n)), ((1,), (0,))),  # x @ w
        "input grad": (((tokens, n), (k, n)), ((1,), (1,))),  # dy @ w.T
        "weight grad": (((tokens, k), (tokens, n)), ((0,), (0,))),  # x.T @ dy
    }


def elementwise_bytes(m, tokens: int, n_params: int) -> dict[str, float]:
    """The fewest bytes a step's work outside matmuls and attention reads plus writes, in the 16-bit
    compute dtype (2 bytes) with float32 master weights and AdamW moments; a [tokens, d_model] tensor
    is one "row" below, a [tokens, d_ff] one an "mlp row".

    Per layer, forward: residual add fused with each RMSNorm (read x and the branch output, write the
    sum and the normed: 4 rows, twice); rotary on q and k (read and write each); silu(gate) * up (read
    2 mlp rows, write 1). Backward: each norm (read x, its output gradient and the residual gradient,
    write the input gradient; read x and the output gradient again for the scale's gradient: 6 rows);
    rotary (4 rows of q/k); the SwiGLU gradient (read 3 mlp rows, write 2). The loss (its matmul's
    write of the logits is in the matmul's time): the logits read once for the softmax statistics and
    once for their gradient, the gradient written (3 passes of [tokens, vocab]). AdamW: read weight,
    gradient and two moments, write weight and moments (7 float32 numbers per parameter).
    """
    row, mlp_row = 2 * tokens * m.d_model, 2 * tokens * m.d_ff
    qk_rows = 2 * tokens * (m.n_heads + m.n_kv_heads) * m.head_dim
    per_layer = (2 * 4 * row + 2 * qk_rows + 3 * mlp_row) + (2 * 6 * row + 2 * qk_rows + 5 * mlp_row)
    return {
        "blocks": m.n_layers * per_layer,
        "loss": 3 * 2 * tokens * m.vocab_size,
        "optimizer": 7 * 4 * n_params,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="bench_1b")
    parser.add_argument("--repeats", type=int, default=20)
    args, overrides = parser.parse_known_args()
    config = load_config(args.config, [o[len("--config."):] for o in overrides])
    m, t = config.model, config.train
    tokens = t.batch_size * t.seq_len
    reps = args.repeats

    elements = 2**29  # 1 GiB of bf16
    bandwidth = 2 * 2 * elements / (time_ms(lambda x: x * 1.5 + 1.0, random(0, (elements,)), repeats=reps) / 1e3)
    print(f"device: {jax.devices()[0].device_kind}; memory bandwidth (read + write): {bandwidth / 1e12:.2f} TB/s")

    weights = [(name, k, n, m.n_layers) for name, k, n in layer_matmuls(m)] + [("lm_head", m.d_model, m.vocab_size, 1)]
    matmul_ms, matmul_flops = 0.0, 0
    print(f"\n{'matmul':<10} {'form':<12} {'shape':<24} {'ms':>7} {'TFLOP/s':>8}")
    for name, k, n, count in weights:
        for form, (shapes, (lhs_c, rhs_c)) in matmul_forms(tokens, k, n).items():
            a, b = random(1, shapes[0]), random(2, shapes[1])
            dot = lambda a, b, lc=lhs_c, rc=rhs_c: jax.lax.dot_general(a, b, ((lc, rc), ((), ())))  # noqa: E731
            ms = time_ms(dot, a, b, repeats=reps)
            flops = 2 * tokens * k * n
            matmul_ms += count * ms
            matmul_flops += count * flops
            operands = f"{shapes[0]}x{shapes[1]}"
            print(f"{name:<10} {form:<12} {operands:<24} {ms:7.3f} {flops / ms / 1e9:8.0f}")
    rate = matmul_flops / matmul_ms / 1e9
    print(f"all matmuls of a step: {matmul_ms:.1f} ms, {matmul_flops / 1e12:.1f} TFLOP at {rate:.0f} TFLOP/s")

    hd = m.d_model // m.n_heads
    impl = "cudnn" if jax.default_backend() == "gpu" else "xla"
    q_shape, kv_shape = (t.batch_size, t.seq_len, m.n_heads, hd), (t.batch_size, t.seq_len, m.n_kv_heads, hd)
    q, d_out = random(3, q_shape), random(4, q_shape)
    k, v = random(5, kv_shape), random(6, kv_shape)
    attend = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)  # noqa: E731
    forward_ms = time_ms(attend, q, k, v, repeats=reps)
    train_ms = time_ms(lambda q, k, v, d: jax.vjp(attend, q, k, v)[1](d), q, k, v, d_out, repeats=reps)
    attention_flops = 3 * 4 * t.batch_size * t.seq_len**2 * m.d_model // 2  # causal: half the score matrix
    print(f"\nattention ({impl}), one layer: forward {forward_ms:.2f} ms, forward + backward {train_ms:.2f} ms "
          f"({attention_flops / train_ms / 1e9:.0f} TFLOP/s)")

    model = ModelDef(ModelConfig.from_config(m))  # shapes only
    moved = elementwise_bytes(model.cfg, tokens, model.num_params())
    moved_ms = {part: b / bandwidth * 1e3 for part, b in moved.items()}
    floor_ms = matmul_ms + m.n_layers * train_ms + sum(moved_ms.values())
    step_flops = model.flops_per_token(t.seq_len) * tokens
    peak = peak_flops()
    print("\nfloor of one step: matmuls {:.1f} + attention {:.1f} + other work {:.1f} ms ({}) = {:.1f} ms".format(
        matmul_ms, m.n_layers * train_ms, sum(moved_ms.values()),
        ", ".join(f"{part} {ms:.1f}" for part, ms in moved_ms.items()), floor_ms))
    rate = step_flops / floor_ms / 1e9
    print(f"at most {rate:.0f} TFLOP/s per device" + (f" ({100 * rate * 1e12 / peak:.1f}% MFU)" if peak else ""))


if __name__ == "__main__":
    main()
