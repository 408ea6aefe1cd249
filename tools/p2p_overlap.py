"""Does a ring transfer hide under compute on this machine? The measurement behind the ring's floor.

    python tools/p2p_overlap.py [--rows 4 --tokens 8192 --heads 16 --head-dim 128 --hops 8 --matmul 8192]
    python tools/p2p_overlap.py --processes 4   # the same ring, one process per GPU of this host

Over all devices in one ring (one process driving every local device, or with `--processes N` that
many local processes of one device each, joined by `jax.distributed`, as a cluster launcher runs
them), times with device-side waits (`block_until_ready`), each after a warm-up:
- `ppermute`: K and V of one device ([rows, tokens, heads, head_dim] bfloat16 each; the defaults are
  one `bench_1b` ring step at 32k tokens over 4 GPUs) sent one device on, `--hops` times;
- `matmul`: `--hops` square bfloat16 matmuls of size `--matmul`, which need no transfer;
- `both`: the two in one program, each hop's transfer independent of its matmul, so XLA may run them
  at once (its schedule puts the matmul between the transfer's start and done);
- `two_way`: the same bytes, K sent one device on and V one device back (a ring that splits its
  heads between the two directions would move its blocks so);
- `all_gather`: K and V gathered from every device once.
It prints the transfer's bandwidth per device (bytes sent by one device over the time) and how much
of the shorter of the two the combined program hid: 0% means the transfers and the matmuls ran one
after the other. XLA flags apply as usual, e.g. `XLA_FLAGS=--xla_gpu_experimental_enable_nccl_symmetric_buffers=true`.
On four H200s: 160 GB/s and 4% hidden, 297 GB/s and 13% with
that flag, where PyTorch's NCCL send/recv moved 300 GB/s and hid 68% (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import local_processes  # tools/, this script's folder


def _seconds(fn, *args, repeats: int = 5) -> float:
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    for _ in range(repeats):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / repeats


def measure(rows: int, tokens: int, heads: int, head_dim: int, hops: int, matmul: int) -> dict:
    devices = jax.devices()
    n = len(devices)
    mesh = Mesh(devices, ("ring",))
    perm = [(j, (j + 1) % n) for j in range(n)]
    back = [(j, (j - 1) % n) for j in range(n)]
    by_tokens, by_rows = P(None, "ring"), P("ring")

    def shift(k, v):
        return jax.lax.ppermute(k, "ring", perm), jax.lax.ppermute(v, "ring", perm)

    def transfers(k, v):
        for _ in range(hops):
            k, v = shift(k, v)
        return k, v

    def two_way(k, v):
        for _ in range(hops):
            k, v = jax.lax.ppermute(k, "ring", perm), jax.lax.ppermute(v, "ring", back)
        return k, v

    def matmuls(a):
        for _ in range(hops):
            a = jnp.tanh(a @ a)  # tanh keeps the values bounded over the hops
        return a

    def both(k, v, a):
        for _ in range(hops):
            k, v = shift(k, v)
            a = jnp.tanh(a @ a)
        return k, v, a

    def gathered(k, v):
        return tuple(jax.lax.all_gather(x, "ring", axis=1, tiled=True).sum(1) for x in (k, v))

    def mapped(fn, in_specs, out_specs):
        return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False))

    def filled(shape, value, spec):  # built shard by shard: each process makes only its own devices' part
        sharding = NamedSharding(mesh, spec)
        return jax.make_array_from_callback(shape, sharding,
                                            lambda _: np.full(sharding.shard_shape(shape), value, jnp.bfloat16))

    kv = filled((rows, tokens * n, heads, head_dim), 1.0, by_tokens)
    a = filled((matmul * n, matmul), 0.01, by_rows)
    t_transfer = _seconds(mapped(transfers, (by_tokens, by_tokens), (by_tokens, by_tokens)), kv, kv)
    t_two_way = _seconds(mapped(two_way, (by_tokens, by_tokens), (by_tokens, by_tokens)), kv, kv)
    t_matmul = _seconds(mapped(matmuls, (by_rows,), by_rows), a)
    t_both = _seconds(mapped(both, (by_tokens, by_tokens, by_rows), (by_tokens, by_tokens, by_rows)), kv, kv, a)
    t_gather = _seconds(mapped(gathered, (by_tokens, by_tokens), (P(), P())), kv, kv)
    block_bytes = 2 * rows * tokens * heads * head_dim * 2  # K and V, bfloat16
    return {
        "devices": n,
        "ppermute_ms": 1e3 * t_transfer,
        "ppermute_gb_s": hops * block_bytes / t_transfer / 1e9,
        "two_way_gb_s": hops * block_bytes / t_two_way / 1e9,
        "matmul_ms": 1e3 * t_matmul,
        "both_ms": 1e3 * t_both,
        "hidden": (t_transfer + t_matmul - t_both) / min(t_transfer, t_matmul),
        "all_gather_gb_s": (n - 1) * block_bytes / t_gather / 1e9,
    }


def probe_parser(description: str) -> argparse.ArgumentParser:
    """The sizes of the probe, shared with its PyTorch peer (tools/p2p_overlap_torch.py)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=8192, help="tokens of one device's block")
    parser.add_argument("--heads", type=int, default=16, help="K/V heads")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--hops", type=int, default=8)
    parser.add_argument("--matmul", type=int, default=8192, help="side of each square matmul")
    return parser


def main() -> None:
    parser = probe_parser(__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, help="run as this many local processes, one device each")
    parser.add_argument("--coordinator", help=argparse.SUPPRESS)  # set by --processes for its children
    parser.add_argument("--process-id", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.processes and args.process_id is None:
        children = local_processes.start([sys.executable, __file__, *sys.argv[1:]], args.processes)
        sys.exit(next((code for code in (child.wait() for child in children) if code), 0))
    if args.processes:
        jax.distributed.initialize(args.coordinator, args.processes, args.process_id)
    if len(jax.devices()) < 2:
        raise SystemExit(f"p2p_overlap needs two or more devices to make a ring; "
                         f"this machine has {len(jax.devices())}.")
    r = measure(args.rows, args.tokens, args.heads, args.head_dim, args.hops, args.matmul)
    if jax.process_index() == 0:
        print(f"{r['devices']} devices in {jax.process_count()} process(es): ppermute {r['ppermute_gb_s']:.0f} GB/s "
              f"({r['ppermute_ms']:.1f} ms), matmuls {r['matmul_ms']:.1f} ms, both {r['both_ms']:.1f} ms: "
              f"{100 * r['hidden']:.0f}% hidden; both directions {r['two_way_gb_s']:.0f} GB/s; "
              f"all-gather {r['all_gather_gb_s']:.0f} GB/s")


if __name__ == "__main__":
    main()
