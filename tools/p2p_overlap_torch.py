"""The ring-transfer probe of tools/p2p_overlap.py in PyTorch: what the same GPUs and NCCL do outside XLA.

    python tools/p2p_overlap_torch.py [--rows 4 --tokens 8192 --heads 16 --head-dim 128 --hops 8 --matmul 8192]
    python tools/p2p_overlap_torch.py --cpu 2 --rows 1 --tokens 16 --heads 2 --head-dim 8 --matmul 16   # gloo, a check

One process per GPU (torch.multiprocessing), NCCL. Each process sends the bytes of one device's K
and V (as p2p_overlap.py does) to the next device and receives the previous one's, `--hops` times
(`batch_isend_irecv`, on NCCL's own stream), then runs `--hops` independent matmuls on the default
stream, then both at once; it prints the transfer's bandwidth and how much of the shorter of the two
the combined run hid, in p2p_overlap.py's words. With two or more GPUs it then copies the same bytes
from GPU 0 to GPU 1 on a side stream (the copy engines, no NCCL) beside the same matmuls. `--cpu N`
runs the ring as N CPU processes with gloo instead: no timing worth reading, but the check that each
device receives its neighbour's block runs the same way.
"""

from __future__ import annotations

import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from p2p_overlap import probe_parser  # tools/, this script's folder


def _seconds(fn, synchronize, repeats: int = 5) -> float:
    """Mean wall time of `fn` after one warm-up; `fn` returns the requests to wait for."""
    for request in fn():
        request.wait()
    synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        for request in fn():
            request.wait()
    synchronize()
    return (time.perf_counter() - start) / repeats


def _line(what: str, gb_s: float, t_transfer: float, t_matmul: float, t_both: float) -> str:
    hidden = (t_transfer + t_matmul - t_both) / min(t_transfer, t_matmul)
    return (f"{what}: {gb_s:.0f} GB/s ({1e3 * t_transfer:.1f} ms), matmuls {1e3 * t_matmul:.1f} ms, "
            f"both {1e3 * t_both:.1f} ms: {100 * hidden:.0f}% hidden")


def _block_elements(args) -> int:
    """Elements of one device's K and V, as p2p_overlap.py sizes them."""
    return 2 * args.rows * args.tokens * args.heads * args.head_dim


def _matmuls(a, hops: int):
    def run():
        x = a
        for _ in range(hops):
            x = torch.tanh(x @ x)  # tanh keeps the values bounded over the hops
        return []
    return run


def _ring(rank: int, n: int, port: int, args, cpu: bool) -> None:
    """One process of the ring: device `rank` sends to rank + 1 and receives from rank - 1."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cpu") if cpu else torch.device("cuda", rank)
    if cpu:
        dist.init_process_group("gloo", rank=rank, world_size=n)
        synchronize = lambda: None  # noqa: E731
    else:
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", rank=rank, world_size=n, device_id=device)
        synchronize = torch.cuda.synchronize
    dtype = torch.float32 if cpu else torch.bfloat16
    block = torch.full((_block_elements(args),), rank + 1.0, device=device, dtype=dtype)
    received = torch.empty_like(block)
    a = torch.full((args.matmul, args.matmul), 0.01, device=device, dtype=dtype)

    def sends():
        requests = []
        for _ in range(args.hops):
            ops = [dist.P2POp(dist.isend, block, (rank + 1) % n), dist.P2POp(dist.irecv, received, (rank - 1) % n)]
            requests += dist.batch_isend_irecv(ops)
        return requests

    matmuls = _matmuls(a, args.hops)
    t_transfer = _seconds(sends, synchronize)
    if not bool((received == (rank - 1) % n + 1).all()):
        raise SystemExit(f"device {rank} did not receive device {(rank - 1) % n}'s block")
    t_matmul = _seconds(matmuls, synchronize)
    t_both = _seconds(lambda: sends() + matmuls(), synchronize)
    if rank == 0:
        gb_s = args.hops * block.numel() * block.element_size() / t_transfer / 1e9
        backend = "gloo" if cpu else "NCCL"
        what = f"{n} devices, {backend} send/recv ring, one process each"
        print(_line(what, gb_s, t_transfer, t_matmul, t_both), flush=True)
    dist.destroy_process_group()


def _copy_engine(args) -> str:
    """GPU 0's block copied to GPU 1 on a side stream, beside GPU 0's matmuls, in this process."""
    source = torch.ones(_block_elements(args), device="cuda:0", dtype=torch.bfloat16)
    target = torch.empty_like(source, device="cuda:1")
    side = torch.cuda.Stream(device=0)
    a = torch.full((args.matmul, args.matmul), 0.01, device="cuda:0", dtype=torch.bfloat16)

    def copies():
        with torch.cuda.stream(side):
            for _ in range(args.hops):
                target.copy_(source, non_blocking=True)
        return []

    def synchronize():
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)

    matmuls = _matmuls(a, args.hops)
    t_copy, t_matmul = _seconds(copies, synchronize), _seconds(matmuls, synchronize)
    t_both = _seconds(lambda: copies() + matmuls(), synchronize)
    gb_s = args.hops * source.numel() * source.element_size() / t_copy / 1e9
    peer = "with" if torch.cuda.can_device_access_peer(0, 1) else "without"
    return _line(f"GPU 0 to GPU 1 on the copy engines ({peer} peer access)", gb_s, t_copy, t_matmul, t_both)


def main() -> None:
    parser = probe_parser(__doc__.splitlines()[0])
    parser.add_argument("--cpu", type=int, metavar="N", help="N CPU processes with gloo instead of the GPUs")
    args = parser.parse_args()
    n = args.cpu or (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    if n < 2:
        raise SystemExit(f"p2p_overlap_torch needs two or more GPUs (or --cpu 2 or more) to make a ring; "
                         f"this machine has {n} GPU(s).")
    with socket.socket() as sock:  # a free port for the process group
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(_ring, args=(n, port, args, bool(args.cpu)), nprocs=n)
    if not args.cpu:
        print(_copy_engine(args), flush=True)


if __name__ == "__main__":
    main()
