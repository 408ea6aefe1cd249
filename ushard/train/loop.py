"""The training loop: build the layout, feed global batches, log metrics and eval loss."""

from __future__ import annotations

import math
import sys
import time

import jax
import numpy as np

from ushard.config import validate
from ushard.data import make_batches
from ushard.mesh import build_mesh
from ushard.metrics import MetricsWriter, flops_per_token, peak_flops
from ushard.sharding import ZeroRules, format_rules
from ushard.train.optim import make_optimizer
from ushard.train.state import ModelDef
from ushard.train.step import Steps


def local_rows(sharding, global_shape) -> range:
    """The rows of a batch-sharded global array that live on this process's devices."""
    slices = [idx[0] for idx in sharding.addressable_devices_indices_map(global_shape).values()]
    starts = [s.start or 0 for s in slices]
    stops = [global_shape[0] if s.stop is None else s.stop for s in slices]
    return range(min(starts), max(stops))


class Trainer:
    """One training run: a validated config laid out on a mesh, with its data and compiled steps."""

    def __init__(self, config, workdir: str | None = None, devices=None, batches=None):
        self.config = config
        self.workdir = workdir
        devices = jax.devices() if devices is None else devices
        self.mesh_shape = validate(config, len(devices))
        self.mesh = build_mesh(self.mesh_shape, dict(config.mesh.dcn), devices)
        self.model = ModelDef(config.model)
        self.tx, self.schedule = make_optimizer(config.train, self.model.logical)
        self.zero = ZeroRules.for_stage(config.parallel.zero_stage)
        self.steps = Steps(self.model, self.tx, self.schedule, self.zero, self.mesh, config.train.grad_accum)
        self.batches = batches or make_batches(config.data, config.train.seq_len, config.train.seed)
        t = config.train
        self.batch_shape = (t.batch_size, t.seq_len)
        self.rows = local_rows(self.steps.shardings.batch, self.batch_shape)
        self.flops_per_token = flops_per_token(config.model, self.model.num_matmul_params(), t.seq_len)
        self.peak = peak_flops(devices[0])

    # ------------------------------------------------------------------ batches

    def _to_device(self, host_batch):
        sharding = self.steps.shardings.batch
        return {k: jax.make_array_from_process_local_data(sharding, v, self.batch_shape) for k, v in host_batch.items()}

    def global_batch(self, step: int):
        return self._to_device(self.batches.train_batch(step, self.config.train.batch_size, self.rows))

    def eval_loss(self, params) -> float:
        t = self.config.train
        sums = [self.steps.eval_step(params, self._to_device(self.batches.eval_batch(i, t.batch_size, self.rows)))
                for i in range(t.eval_batches)]
        loss, count = np.sum(jax.device_get(sums), axis=0)
        return float(loss / max(count, 1.0))

    # ------------------------------------------------------------------ the run

    def describe(self) -> str:
        shape = " x ".join(f"{a}={s}" for a, s in self.mesh_shape.items() if s > 1) or "one device"
        return (
            f"ushard: {self.model.num_params() / 1e6:.1f}M params on {self.mesh.size} {jax.devices()[0].platform} "
            f"device(s), mesh {shape}, ZeRO-{self.config.parallel.zero_stage}\n"
            f"parameter layout (logical axis -> mesh axes):\n{format_rules(self.zero.params)}"
        )

    def run(self, log=print) -> list[dict]:
        """Trains for train.steps steps; returns the logged records (also written to DIR/metrics.jsonl)."""
        t = self.config.train
        log(self.describe())
        state = self.steps.init(t.seed)
        start = time.perf_counter()
        step_fn = self.steps.train_step.lower(state, self.global_batch(0)).compile()
        log(f"compiled the train step in {time.perf_counter() - start:.1f}s")

        writer = MetricsWriter(self.workdir)
        bar = _progress_bar(t.steps)
        records, pending = [], []
        tokens_per_step = t.batch_size * t.seq_len
        last_time, last_step = time.perf_counter(), 0
        for step in range(t.steps):
            state, metrics = step_fn(state, self.global_batch(step))
            pending.append(metrics)
            done = step + 1
            if bar:
                bar.update(1)
            if done % t.log_every and done != t.steps:
                continue
            fetched = jax.device_get(pending)  # waits for the device: the only sync point
            pending = []
            now = time.perf_counter()
            step_time = (now - last_time) / (done - last_step)
            record = self._record(done, fetched[-1], step_time, tokens_per_step)
            if t.eval_every and (done % t.eval_every == 0 or done == t.steps):
                record["eval_loss"] = self.eval_loss(state["params"])
            records.append(record)
            writer.write(record)
            line = _format(record)
            bar.write(line) if bar else log(line)
            if not math.isfinite(record["loss"]):
                log(f"ushard: loss is {record['loss']} at step {done}; stopping.")
                break
            last_time, last_step = time.perf_counter(), done
        if bar:
            bar.close()
        writer.close()
        self.state = state
        return records

    def _record(self, step, metrics, step_time, tokens_per_step) -> dict:
        tokens_per_s = tokens_per_step / step_time
        tflops = self.flops_per_token * tokens_per_s / self.mesh.size / 1e12
        return {
            "step": step,
            "loss": float(metrics["loss"]),
            "grad_norm": float(metrics["grad_norm"]),
            "lr": float(metrics["lr"]),
            "tokens_per_s": tokens_per_s,
            "step_time_s": step_time,
            "tflops_per_device": tflops,
            "mfu": tflops * 1e12 / self.peak if self.peak else None,
        }


def _format(record: dict) -> str:
    parts = [f"step {record['step']}", f"loss {record['loss']:.4f}"]
    if "eval_loss" in record:
        parts.append(f"eval {record['eval_loss']:.4f}")
    parts += [f"gnorm {record['grad_norm']:.3f}", f"lr {record['lr']:.2e}", f"{record['tokens_per_s']:,.0f} tok/s",
              f"{record['tflops_per_device']:.1f} TFLOP/s/dev"]
    if record["mfu"] is not None:
        parts.append(f"MFU {100 * record['mfu']:.1f}%")
    return " | ".join(parts)


def _progress_bar(total: int):
    """A tqdm bar on an interactive terminal (process 0), None otherwise (logs, CI, pipes)."""
    if jax.process_index() != 0 or not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="step", dynamic_ncols=True, leave=True)
