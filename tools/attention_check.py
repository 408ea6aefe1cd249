"""Our flash kernels against float32 attention, on the device they run on: the forward's out and lse,
and the backward's dq, dk and dv with a random cotangent for both outputs, over the cases the
kernels must take: causal or not, no documents, equal and ragged documents, grouped K/V heads, head
dims 64, 128 and 256, latent attention's 192 / 128 (q·k, values), short and long rows, sliding windows.

    python3 tools/attention_check.py [--tolerance 0.01] [--only window,hd256] [--cudnn]

`--only`: the cases whose names contain one of the comma-separated words. `--cudnn`: also cuDNN
through `kernels.attention.whole_sequence` (out and gradients; it gives no lse) on the windowed cases
and Gemma's.

On Hopper this checks the Mosaic GPU kernels (ushard/kernels/flash_hopper*.py), elsewhere the Triton
ones (on a CPU, in Pallas's interpreter: slow, and only the tests' small cases are meant for it).
Each output's error is its norm relative to the reference's, after bf16 inputs are upcast for the
reference (xla_block, float32); one line per case, and a non-zero exit if any exceeds `--tolerance`
(bf16 rounding gives about 2.5e-3).
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

from ushard.kernels import flash
from ushard.kernels.attention import xla_block

# name: (batch, length, heads, kv heads, head dim (or (q·k's, values') for two), causal, documents: None,
# a count of equal ones, or "ragged" for five boundaries at random places[, sliding window: 0 for none])
CASES = {
    "hd128": (2, 2048, 16, 16, 128, True, None),
    "hd128 4 documents": (2, 2048, 16, 16, 128, True, 4),
    "hd128 ragged documents": (2, 2048, 16, 16, 128, True, "ragged"),
    "grouped 2:1": (2, 2048, 16, 8, 128, True, None),
    "grouped 4:1 ragged": (2, 1024, 8, 2, 128, True, "ragged"),
    "hd64": (2, 2048, 32, 32, 64, True, None),
    "not causal": (2, 1024, 8, 8, 128, False, None),
    "not causal ragged": (2, 1024, 8, 8, 128, False, "ragged"),
    "short rows": (2, 256, 4, 4, 128, True, None),
    "window 1024 at 8k": (1, 8192, 16, 16, 128, True, None, 1024),
    "window 300 grouped ragged": (2, 2048, 16, 8, 128, True, "ragged", 300),
    "window 64 (inside a block)": (2, 1024, 8, 8, 128, True, None, 64),
    "window 200 hd64 4 documents": (2, 2048, 32, 32, 64, True, 4, 200),
    "hd256": (2, 2048, 8, 8, 256, True, None),
    "hd256 grouped ragged window 512": (2, 2048, 8, 4, 256, True, "ragged", 512),
    # Gemma 3 1B's attention (one of its 4 rows): its local layers' window, and its global layers.
    "gemma3_1b 4 documents window 512": (1, 8192, 4, 1, 256, True, 4, 512),
    "gemma3_1b 4 documents": (1, 8192, 4, 1, 256, True, 4, 0),
    # DeepSeek-V2/V3's latent attention: q·k over 192 a head, values of 128.
    "mla 192/128": (2, 2048, 16, 16, (192, 128), True, None),
    "mla 192/128 grouped 2:1 ragged": (2, 2048, 16, 8, (192, 128), True, "ragged"),
    "mla 192/128 not causal 4 documents": (2, 1024, 8, 8, (192, 128), False, 4),
    "mla 192/128 window 300": (2, 2048, 8, 8, (192, 128), True, None, 300),
    "mla 192/128 short rows": (2, 256, 4, 4, (192, 128), True, None),
}


def segment_ids(batch: int, length: int, documents, seed: int = 0):
    if documents is None:
        return None
    if documents == "ragged":
        rng = np.random.default_rng(seed)
        cuts = [np.sort(rng.choice(np.arange(1, length), 5, replace=False)) for _ in range(batch)]
        return jnp.asarray(np.stack([np.searchsorted(c, np.arange(length), side="right") for c in cuts]), jnp.int32)
    return jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32) // (length // documents), (batch, length))


def ours_and_reference(q, k, v, d_out, d_lse, ids, causal: bool, window: int = 0,
                       ours=None) -> tuple[tuple, tuple]:
    """(ours, float32 reference): out, lse, dq, dk, dv of our kernels (`flash.attention`) on q, k, v
    and of float32 attention (`xla_block`) on them upcast, each pulled back along (d_out, d_lse).
    `ours`: another kernel (q, k, v) -> (out, lse) to check instead."""
    positions = jnp.arange(q.shape[1])[None]

    def reference(q, k, v):
        return xla_block(q, k, v, positions, positions if causal else jnp.zeros_like(positions), ids, ids, window)

    if ours is None:
        def ours(q, k, v):
            return flash.attention(q, k, v, ids, causal, **({"window": window} if window else {}))

    def outputs_and_grads(fn, *inputs):
        outputs, pullback = jax.vjp(fn, *inputs)
        return (*outputs, *pullback((d_out.astype(outputs[0].dtype), d_lse)))

    got = jax.jit(lambda *a: outputs_and_grads(ours, *a))(q, k, v)
    want = jax.jit(lambda *a: outputs_and_grads(reference, *a))(*(x.astype(jnp.float32) for x in (q, k, v)))
    return got, want


def cudnn(ids, window):
    """cuDNN through the seam (`whole_sequence`), as (out, lse) with a stand-in lse of zeros: it gives none."""
    from ushard.kernels.attention import whole_sequence

    def attend(q, k, v):
        out = whole_sequence(q, k, v, ids, "cudnn", window=window)
        return out, jnp.zeros(out.shape[:3], jnp.float32)

    return attend


def errors(case, seed: int = 1, impl: str = "ours") -> dict:
    """Relative error of out, lse, dq, dk, dv against float32 attention for one case (`impl` "cudnn":
    cuDNN's, without lse)."""
    b, t, heads, kv_heads, hd, causal, documents, window = (*case, 0)[:8]
    hd, vd = hd if isinstance(hd, tuple) else (hd, hd)
    keys = jax.random.split(jax.random.key(seed), 5)
    q = jax.random.normal(keys[0], (b, t, heads, hd), jnp.bfloat16)
    k = jax.random.normal(keys[1], (b, t, kv_heads, hd), jnp.bfloat16)
    v = jax.random.normal(keys[2], (b, t, kv_heads, vd), jnp.bfloat16)
    d_out = jax.random.normal(keys[3], (b, t, heads, vd), jnp.bfloat16)
    d_lse = jax.random.normal(keys[4], q.shape[:3], jnp.float32)
    ids = segment_ids(b, t, documents)
    if impl == "cudnn":
        d_lse = jnp.zeros_like(d_lse)  # cuDNN's outputs have no lse to pull back
    got, want = ours_and_reference(q, k, v, d_out, d_lse, ids, causal, window,
                                   ours=cudnn(ids, window) if impl == "cudnn" else None)
    result = {}
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        if impl == "cudnn" and name == "lse":
            continue
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        seen = np.isfinite(w)  # lse: -inf where a query sees no key (not in these cases, but exact there)
        result[name] = float(np.linalg.norm(np.where(seen, g - w, 0)) / np.linalg.norm(np.where(seen, w, 0)))
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--tolerance", type=float, default=0.01, help="largest relative error allowed")
    parser.add_argument("--only", default="", help="comma-separated words: the cases whose names hold one")
    parser.add_argument("--cudnn", action="store_true", help="also cuDNN (whole_sequence) on the windowed cases")
    args = parser.parse_args(argv)
    print(f"device: {jax.devices()[0].device_kind}, JAX {jax.__version__}")
    words = [w for w in args.only.split(",") if w]
    cases = {name: case for name, case in CASES.items() if not words or any(w in name for w in words)}
    runs = [(name, case, "ours") for name, case in cases.items()]
    if args.cudnn:
        runs += [(name, case, "cudnn") for name, case in cases.items()
                 if (len(case) > 7 and case[7]) or name.startswith("gemma")]
    failed = []
    for name, case, impl in runs:
        label = name if impl == "ours" else f"cudnn: {name}"
        try:
            result = errors(case, impl=impl)
        except Exception as e:  # noqa: BLE001 (a kernel that refuses a case fails it; the others still run)
            print(f"{label:36s} FAILED: {str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__}",
                  flush=True)
            failed.append(label)
            continue
        worst = max(result.values())
        verdict = "ok" if worst <= args.tolerance else "OFF"
        print(f"{label:36s} " + " ".join(f"{k} {e:.1e}" for k, e in result.items()) + f" -> {verdict}", flush=True)
        if not worst <= args.tolerance:  # NaN fails too
            failed.append(label)
    if failed:
        print(f"{len(failed)} of {len(runs)} cases beyond {args.tolerance}: {', '.join(failed)}")
        return 1
    print(f"all {len(runs)} cases within {args.tolerance}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
