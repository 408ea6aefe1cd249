"""Throughput, FLOPs, MFU and the writers of DIR/metrics.jsonl and TensorBoard events.

FLOPs per token (the convention of the Chinchilla and PaLM papers, and of MaxText and torchtitan),
`ModelDef.flops_per_token`:
    6 * N  +  attention's, 6 * n_layers * seq_len * d_model for a Llama
N counts every parameter that takes part in a token's matmuls: all except the input embedding table
(a lookup), norm scales and MoE routing biases, while the output projection counts (a tied table
counts once); of an MoE layer's routed experts only the top_k of num_experts a token is sent to
count (active parameters). 6 = 2 FLOPs per multiply-add
x (forward + 2 x backward). The second term is attention's two [T x T] matmuls: 4*T*d per token and
layer forward, x3 with the backward = 12*T*d, halved because causal attention needs only the lower
triangle; a layer with a sliding window counts the keys its queries see (ushard/models/family.py,
`AttentionShape`). Remat recomputation is not counted: MFU measures useful work.
"""

from __future__ import annotations

import json
import os
import time

import jax

from ushard.errors import UserError

# Datasheet dense bf16 peak, FLOP/s per device. GPUs: matched by a name inside `device_kind` (e.g.
# "NVIDIA H100 80GB HBM3"). TPUs: by `device_kind` exactly as JAX reports it (checked with libtpu's
# topology descriptions, tests/test_tpu.py): v5p reports "TPU v5", v5e "TPU v5 lite", v6e "TPU v6
# lite". A TPU device is a chip from v4 on (v4 and v5p present their two TensorCores as one
# "megacore" device) and one TensorCore on v2 and v3, whose peaks are therefore half a chip's.
GPU_PEAK_BF16_FLOPS = (
    ("H200", 989e12),
    ("H100", 989e12),
    ("H800", 989e12),
    ("A100", 312e12),
    ("L40S", 362e12),
)
TPU_PEAK_BF16_FLOPS = {
    "TPU v2": 45e12 / 2,
    "TPU v3": 123e12 / 2,
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,  # v5e
    "TPU v5": 459e12,  # v5p
    "TPU v6 lite": 918e12,  # v6e (Trillium)
}


def peak_flops(device=None) -> float | None:
    """The datasheet bf16 dense peak of `device` (default: the first device), None where unknown (CPU)."""
    kind = (device or jax.devices()[0]).device_kind
    if kind in TPU_PEAK_BF16_FLOPS:
        return TPU_PEAK_BF16_FLOPS[kind]
    for name, flops in GPU_PEAK_BF16_FLOPS:
        if name.lower() in kind.lower():
            return flops
    return None


class MetricsWriter:
    """Appends one JSON object per logged step to DIR/metrics.jsonl, and the same scalars to TensorBoard.

    `resume_step=S` (the restored checkpoint's step, 0 for a fresh start) makes the files hold one
    history: records with step > S, logged by an earlier run after its last checkpoint, are dropped
    from metrics.jsonl, and TensorBoard is told to hide its events with step > S. Without it the
    writer appends as it finds the file. Only process 0 writes; on the others every method is a no-op.
    `tracker` (ushard/tracking.py, W&B) gets every record too, stays open across `rewind` and is
    closed by `close`; it never raises.
    """

    def __init__(self, workdir: str | None, resume_step: int | None = None, tracker=None):
        self.enabled = workdir is not None and jax.process_index() == 0
        self._jsonl = self._tb = None
        self._tracker = tracker
        if self.enabled:
            os.makedirs(workdir, exist_ok=True)
            self.path = os.path.join(workdir, "metrics.jsonl")
            self._tb_dir = os.path.join(workdir, "tensorboard")
            self._open(resume_step)

    def _open(self, resume_step: int | None) -> None:
        if resume_step is not None:
            drop_after(self.path, resume_step)
        self._jsonl = open(self.path, "a", buffering=1)
        from tensorboardX import SummaryWriter
        from tensorboardX.proto.event_pb2 import Event, SessionLog

        # The nanosecond suffix keeps two writers opened in one second from overwriting one file (the
        # name has whole seconds) and keeps the files in the order they were written (TensorBoard reads
        # them sorted by name).
        suffix = f".{time.time_ns()}"
        if resume_step is None:
            self._tb = SummaryWriter(logdir=self._tb_dir, filename_suffix=suffix)
            return
        # A START event at step S+1 makes TensorBoard hide the events with step >= S+1 written before
        # it (TensorBoard's own server also drops them when a step repeats). TensorBoard's Python
        # loader ignores the first START it sees in a directory, so a second one follows for
        # directories whose earlier files (older ushard) hold none; a repeated START changes nothing.
        self._tb = SummaryWriter(logdir=self._tb_dir, purge_step=resume_step + 1, filename_suffix=suffix)
        self._tb.file_writer.add_event(Event(step=resume_step + 1, session_log=SessionLog(status=SessionLog.START)))

    def rewind(self, step: int) -> None:
        """Forgets what was written after `step`: for a run rolled back to the checkpoint at `step`."""
        if self.enabled:
            self._close_files()
            self._open(step)
            if self._tracker:
                self._tracker.rewind(step)

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        try:
            self._jsonl.write(json.dumps(record) + "\n")
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._tb.add_scalar(key, value, record["step"])
            if self._tracker:
                self._tracker.log(record)
        except OSError as e:
            self.enabled = False  # nothing more is written, and close() only lets go of the files
            self._let_go()
            raise UserError(f"could not write the metrics of step {record['step']} to {self.path} "
                            f"({e.strerror or e}); the run stopped there. Make room (or fix the directory) and "
                            f"run the same command to resume from the last checkpoint.") from None

    def close(self) -> None:
        try:
            if self.enabled:
                self.enabled = False
                self._close_files()
        finally:  # the tracker too after a failed write: it still has a run to finish
            tracker, self._tracker = self._tracker, None
            if tracker:
                tracker.close()

    def _close_files(self) -> None:
        try:
            self._jsonl.close()
            self._tb.close()
        except OSError as e:
            self.enabled = False
            self._let_go()
            raise UserError(f"could not finish writing the metrics to {self.path} ({e.strerror or e}).") from None

    def _let_go(self) -> None:
        """Closes both files after a failed write, ignoring what they cannot flush (the disk is full)."""
        for closable in (self._jsonl, self._tb):
            try:
                closable.close()
            except (OSError, ValueError):
                pass


def drop_after(path: str, step: int) -> int:
    """Removes the records with `"step"` > `step` from the JSONL file at `path` (atomically, by writing
    a new file and renaming it over the old); returns how many were removed.

    A last line cut off by a crash is dropped too, so that the next record starts on a line of its own;
    other lines without a step are kept.
    """
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except FileNotFoundError:
        return 0
    kept = []
    for line in lines:
        try:
            later = json.loads(line)["step"] > step
        except (ValueError, TypeError, KeyError):  # not one of our records
            if line.endswith("\n"):
                kept.append(line)
            continue
        if not later:
            kept.append(line if line.endswith("\n") else line + "\n")
    if kept == lines:
        return 0
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(kept)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return len(lines) - len(kept)
