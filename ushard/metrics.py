"""Throughput, FLOPs, MFU and the writers of DIR/metrics.jsonl and TensorBoard events.

FLOPs per token (the convention of the Chinchilla and PaLM papers, and of MaxText and torchtitan):
    6 * N  +  6 * n_layers * seq_len * d_model
N counts every parameter that takes part in a matmul: all except the input embedding table (a
lookup) and norm scales, while the output projection counts (a tied table counts once). 6 = 2 FLOPs per multiply-add
x (forward + 2 x backward). The second term is attention's two [T x T] matmuls: 4*T*d per token and
layer forward, x3 with the backward = 12*T*d, halved because causal attention needs only the lower
triangle. Remat recomputation is not counted: MFU measures useful work.
"""

from __future__ import annotations

import json
import os

import jax

# Datasheet dense bf16 peak, FLOP/s per device, matched against `device_kind`.
PEAK_BF16_FLOPS = (
    ("H200", 989e12),
    ("H100", 989e12),
    ("H800", 989e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("TPU v6", 918e12),
    ("TPU v5p", 459e12),
    ("TPU v5 lite", 197e12),
    ("TPU v5e", 197e12),
    ("TPU v4", 275e12),
)


def peak_flops(device=None) -> float | None:
    """The datasheet bf16 dense peak of `device` (default: the first device), None where unknown (CPU)."""
    kind = (device or jax.devices()[0]).device_kind
    for name, flops in PEAK_BF16_FLOPS:
        if name.lower() in kind.lower():
            return flops
    return None


def flops_per_token(model_cfg, matmul_params: int, seq_len: int) -> float:
    """Training FLOPs per token; `matmul_params` is N above (`ModelDef.num_matmul_params()`)."""
    attention = 6 * model_cfg.n_layers * seq_len * model_cfg.d_model
    return 6 * matmul_params + attention


class MetricsWriter:
    """Appends one JSON object per logged step to DIR/metrics.jsonl, and the same scalars to TensorBoard.

    Only process 0 writes; on the others every method is a no-op.
    """

    def __init__(self, workdir: str | None):
        self.enabled = workdir is not None and jax.process_index() == 0
        self._jsonl = self._tb = None
        if self.enabled:
            os.makedirs(workdir, exist_ok=True)
            self._jsonl = open(os.path.join(workdir, "metrics.jsonl"), "a", buffering=1)
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(logdir=os.path.join(workdir, "tensorboard"))

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        self._jsonl.write(json.dumps(record) + "\n")
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                self._tb.add_scalar(key, value, record["step"])

    def close(self) -> None:
        if self.enabled:
            self._jsonl.close()
            self._tb.close()
