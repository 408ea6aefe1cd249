"""The training loop: build the layout, feed global batches, log, evaluate, checkpoint and resume.

Fault handling lives here: a run started on a workdir with checkpoints resumes from the newest
complete one; SIGTERM / SIGINT save a checkpoint before exiting; a save that failed in the background
stops the run at the next step (at the next log or save with several processes, which must agree);
a non-finite loss or gradient is handled by `train.on_nonfinite`. The host only waits for the device
at sync points (logging, eval, checkpoints, signals), so dispatch stays ahead of the device in between.
"""

from __future__ import annotations

import math
import signal
import sys
import time

import jax
import numpy as np

from ushard.build import build
from ushard.checkpoint import Checkpoints
from ushard.data import local_block, make_batches, place_batch
from ushard.errors import UserError
from ushard.metrics import MetricsWriter, peak_flops
from ushard.training.state import TrainState


class Preempted(Exception):
    """Training stopped by a signal after saving a checkpoint; the exit status is 128 + signal number."""

    def __init__(self, signum: int, step: int, saved: bool):
        self.signum, self.step, self.saved = signum, step, saved
        name = signal.Signals(signum).name
        where = "checkpoint saved; run the same command to resume" if saved else "no workdir, nothing saved"
        super().__init__(f"stopped by {name} at step {step} ({where}).")


class StopSignals:
    """While active, SIGTERM and SIGINT only set `received`; a second one of either acts at once."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.received = None
        self._previous = {}

    def _handle(self, signum, frame):
        self.received = signum
        for sig, handler in self._previous.items():  # the next signal is not caught
            signal.signal(sig, handler)

    def __enter__(self):
        try:
            self._previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}
        except ValueError:  # not the main thread: leave signals alone
            self._previous = {}
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class Trainer:
    """One training run: `build(config)` (mesh, layout, model, steps) with data, checkpoints and the loop."""

    def __init__(self, config, workdir: str | None = None, devices=None, batches=None):
        self.config = config
        self.workdir = workdir
        self.setup = build(config, devices)
        self.steps = self.setup.steps
        t = config.train
        self.batches = batches or make_batches(config.data, t.seq_len, t.seed)
        self.batch_shape = (t.batch_size, t.seq_len)
        self.rows, self.columns = local_block(self.setup.layout.batch, self.batch_shape)
        self.peak = peak_flops(self.setup.mesh.devices.flat[0])
        ck = config.checkpoint
        self.checkpoints = Checkpoints(workdir, ck.keep, ck.async_save) if workdir else None
        self.skip_batches: set[int] = set()  # batches that made the loss non-finite (rollback policy)

    # ------------------------------------------------------------------ batches

    def _to_device(self, host_rows):
        return place_batch(host_rows, self.setup.layout.batch, self.batch_shape, self.columns)

    def global_batch(self, index: int):
        """The global training batch number `index` (equal to the step unless batches were skipped)."""
        return self._to_device(self.batches.train_batch(index, self.config.train.batch_size, self.rows))

    def eval_loss(self, params) -> float:
        t = self.config.train
        sums = [self.steps.eval_step(params, self._to_device(self.batches.eval_batch(i, t.batch_size, self.rows)))
                for i in range(t.eval_batches)]
        loss, count = np.sum(jax.device_get(sums), axis=0)
        return float(loss / max(count, 1.0))

    # ------------------------------------------------------------------ state

    def initial_state(self, log=print) -> tuple[TrainState, dict]:
        """(state, data_state): restored from the newest complete checkpoint, else freshly initialised."""
        if self.checkpoints:
            self.checkpoints.wait()  # a save still being written (rollback) must land first
            abstract = self.steps.abstract_state().as_dict()
            restored = self.checkpoints.restore_newest(lambda _: (abstract, self.setup.model_config), log)
            if restored:
                step, state, data_state, _ = restored
                log(f"resumed from the checkpoint at step {step}")
                return TrainState.from_dict(state), data_state
        return self.steps.init(self.config.train.seed), {"next_batch": 0}

    def _save(self, state: TrainState, data_state, step: int) -> None:
        if self.checkpoints:
            self.checkpoints.save(step, state.as_dict(), data_state, self.config)

    # ------------------------------------------------------------------ the run

    def run(self, log=print) -> list[dict]:
        """Trains up to train.steps; returns the logged records (also written to DIR/metrics.jsonl)."""
        t = self.config.train
        log(self.setup.describe())
        state, data_state = self.initial_state(log)
        step = int(jax.device_get(state.step))
        writer = MetricsWriter(self.workdir, resume_step=step)  # drops what an earlier run logged after it
        records = []
        try:
            if step < t.steps:
                records = self._train(state, data_state, step, writer, log)
            else:
                log(f"already trained to step {step} (train.steps={t.steps}); nothing to do.")
        finally:
            writer.close()
            if self.checkpoints:
                self.checkpoints.close()
        return records

    def _train(self, state, data_state, step, writer, log) -> list[dict]:
        t, every = self.config.train, self.config.checkpoint.every
        start = time.perf_counter()
        step_fn = self.steps.train_step.lower(state, self.global_batch(data_state["next_batch"])).compile()
        log(f"compiled the train step in {time.perf_counter() - start:.1f}s")
        bar = _progress_bar(t.steps, step)
        records, pending = [], []  # pending: (step, batch index, device metrics) since the last sync
        last_time, last_step = time.perf_counter(), step
        with StopSignals() as signals:
            while step < t.steps:
                index = data_state["next_batch"]
                while index in self.skip_batches:
                    index += 1
                state, metrics = step_fn(state, self.global_batch(index))
                data_state = {"next_batch": index + 1}
                step += 1
                pending.append((step, index, metrics))
                if bar:
                    bar.update(1)
                stop = signals.received  # read once: a signal may land at any moment
                log_now = step % t.log_every == 0 or step == t.steps
                save_now = (every and step % every == 0) or step == t.steps or stop
                if self.checkpoints and (log_now or save_now or jax.process_count() == 1):
                    self.checkpoints.check()  # a failed background save stops the run now, not at the next save
                if not (log_now or save_now):
                    continue
                values = jax.device_get([m for _, _, m in pending])  # one transfer; waits for the device
                fetched = [(s, i, m) for (s, i, _), m in zip(pending, values)]
                pending = []
                bad = next(((s, i, m) for s, i, m in fetched if not m["finite"]), None)
                if bad and t.on_nonfinite != "skip":
                    state, data_state, step = self._handle_nonfinite(bad, log)
                    writer.rewind(step)
                    records = [r for r in records if r["step"] <= step]
                    last_time, last_step = time.perf_counter(), step
                    if bar:
                        bar.reset(total=t.steps)
                        bar.update(step)
                    continue
                if log_now:
                    now = time.perf_counter()
                    record = self._record(step, fetched[-1][2], (now - last_time) / (step - last_step))
                    if t.eval_every and (step % t.eval_every == 0 or step == t.steps):
                        record["eval_loss"] = self.eval_loss(state.params)
                    records.append(record)
                    writer.write(record)
                    line = _format(record)
                    bar.write(line) if bar else log(line)
                if save_now:
                    self._save(state, data_state, step)
                if stop:
                    if self.checkpoints:
                        self.checkpoints.wait()
                    raise Preempted(stop, step, saved=self.checkpoints is not None)
                last_time, last_step = time.perf_counter(), step
        if bar:
            bar.close()
        self.state = state
        return records

    def _handle_nonfinite(self, bad, log):
        """The rollback and stop policies, once a step's loss or gradient norm was not finite."""
        step, index, metrics = bad
        what = f"loss {float(metrics['loss'])}, gradient norm {float(metrics['grad_norm'])}"
        if self.config.train.on_nonfinite == "stop":
            raise UserError(
                f"training stopped: step {step} (batch {index}) gave {what}; train.on_nonfinite='stop' "
                f"(choose 'skip' or 'rollback' to carry on)."
            )
        self.skip_batches.add(index)
        state, data_state = self.initial_state(log)
        back_to = int(jax.device_get(state.step))
        log(f"ushard: step {step} (batch {index}) gave {what}; rolled back to step {back_to}, skipping that batch.")
        return state, data_state, back_to

    def _record(self, step, metrics, step_time) -> dict:
        t = self.config.train
        tokens_per_s = t.batch_size * t.seq_len / step_time
        tflops = self.setup.flops_per_token * tokens_per_s / self.setup.mesh.size / 1e12
        return {
            "step": step,
            "loss": float(metrics["loss"]),
            **{f"aux/{name}": float(value) for name, value in metrics["aux"].items()},
            "grad_norm": float(metrics["grad_norm"]),
            "lr": float(metrics["lr"]),
            "tokens_per_s": tokens_per_s,
            "step_time_s": step_time,
            "tflops_per_device": tflops,
            "mfu": tflops * 1e12 / self.peak if self.peak else None,
            "skipped_steps": int(metrics["skipped"]),
        }


def _format(record: dict) -> str:
    parts = [f"step {record['step']}", f"loss {record['loss']:.4f}"]
    if "eval_loss" in record:
        parts.append(f"eval {record['eval_loss']:.4f}")
    parts += [f"gnorm {record['grad_norm']:.3f}", f"lr {record['lr']:.2e}", f"{record['tokens_per_s']:,.0f} tok/s",
              f"{record['tflops_per_device']:.3g} TFLOP/s/dev"]
    if record["mfu"] is not None:
        parts.append(f"MFU {100 * record['mfu']:.1f}%")
    if record["skipped_steps"]:
        parts.append(f"skipped {record['skipped_steps']}")
    if not math.isfinite(record["loss"]):
        parts.append("NON-FINITE")
    return " | ".join(parts)


def _progress_bar(total: int, initial: int):
    """A tqdm bar on an interactive terminal (process 0), None otherwise (logs, CI, pipes)."""
    if jax.process_index() != 0 or not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, leave=True)
