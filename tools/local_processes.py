"""Runs a tool as N local processes of one device each, joined by `jax.distributed`, as a cluster
launcher would (tools/bench.py and tools/p2p_overlap.py `--processes N`)."""

from __future__ import annotations

import os
import socket
import subprocess


def start(cmd: list[str], processes: int, env: dict | None = None, **popen) -> list[subprocess.Popen]:
    """`cmd` started `processes` times, process i on GPU i (one CPU device each where there is no GPU),
    each told `--processes N --coordinator HOST:PORT --process-id i` to pass to jax.distributed."""
    with socket.socket() as sock:  # a free port for the coordinator
        sock.bind(("127.0.0.1", 0))
        coordinator = f"127.0.0.1:{sock.getsockname()[1]}"
    started = []
    for i in range(processes):
        role = ["--processes", str(processes), "--coordinator", coordinator, "--process-id", str(i)]
        one_device = {"CUDA_VISIBLE_DEVICES": str(i), "JAX_NUM_CPU_DEVICES": "1"}
        started.append(subprocess.Popen(cmd + role, env={**os.environ, **(env or {}), **one_device}, **popen))
    return started
