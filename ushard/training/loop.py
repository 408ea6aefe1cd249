"""The training loop: build the layout, feed global batches, log, evaluate, checkpoint and resume.

Fault handling lives here: a run started on a workdir with checkpoints resumes from the newest
complete one; SIGTERM / SIGINT save a checkpoint before exiting; a save that failed in the background
stops the run at the next step (at the next log or save with several processes, which must agree);
a non-finite loss or gradient is handled by `train.on_nonfinite`. The host only waits for the device
at sync points (logging, eval, checkpoints, signals), so dispatch stays ahead of the device in between.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import signal
import sys
import time

import jax
import numpy as np

from ushard import planner, tracking
from ushard.build import build
from ushard.checkpoint import Checkpoints
from ushard.data import local_block, make_batches, place_batch
from ushard.errors import Preempted, UserError
from ushard.metrics import MetricsWriter, peak_flops
from ushard.models.config import LoraConfig
from ushard.models.moe import DISPATCH_OVERFLOW
from ushard.sharding import with_shardings
from ushard.training import dpo_reference, processes
from ushard.training.init_from import initial_params
from ushard.training.lora import fingerprint, same_base
from ushard.training.objectives import check_same_objective
from ushard.training.optim import check_same_optimizer, schedule_change
from ushard.training.state import TrainState


class StopSignals:
    """While active, SIGTERM and SIGINT only set `received`; the run stops at its next safe point (after
    a step, a restore or a compilation) through `check`. Never inside a compilation: XLA's compiler
    polls for signals, and an exception raised in the middle of one crashed the interpreter at exit.
    Inside `at_once(where)`, around pure-Python work that holds nothing (loading the data), the first
    signal raises Preempted right away. A second signal of either kind acts at once."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.received = None
        self._previous = {}
        self._at_once = None  # the `where` of Preempted while a signal stops the run on arrival

    def _handle(self, signum, frame):
        self.received = signum
        for sig, handler in self._previous.items():  # the next signal is not caught
            signal.signal(sig, handler)
        if self._at_once is not None:
            raise Preempted(signum, self._at_once)

    @contextlib.contextmanager
    def at_once(self, where: str):
        self.check(where)
        self._at_once = where
        collecting = gc.isenabled()
        gc.disable()  # raised inside a gc callback (JAX has one), Preempted would be printed and dropped
        try:
            yield
        finally:
            self._at_once = None
            if collecting:
                gc.enable()

    def check(self, where: str) -> None:
        """Raises Preempted if a signal came."""
        if self.received is not None:
            raise Preempted(self.received, where)

    def __enter__(self):
        try:
            self._previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}
        except ValueError:  # not the main thread: leave signals alone
            self._previous = {}
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class NonfiniteRow:
    """Counts non-finite steps in a row (train.max_nonfinite_steps). A finite step ends the row only at
    or past the last non-finite step: the steps replayed after a rollback were finite before and are no
    progress, so a rollback that meets the same trouble again counts on."""

    def __init__(self, limit: int):
        self.limit, self.count, self.last_bad, self.any_finite = limit, 0, 0, False

    def add(self, step: int, finite: bool) -> bool:
        """Records one step; True once `limit` non-finite steps came in a row."""
        if finite:
            self.any_finite = True
            if step >= self.last_bad:
                self.count = 0
            return False
        self.count += 1
        self.last_bad = step
        return self.count >= self.limit


# How many steps the host may dispatch ahead of the devices. Unbounded (until the next log or save
# step), two processes on CPU stopped for good some 260 steps ahead, each blocked in a dispatch, and
# every step in flight holds its batch on the devices: a few steps ahead keep the devices fed.
STEPS_AHEAD = 16


class Trainer:
    """One training run: `build(config)` (mesh, layout, model, steps) with data, checkpoints and the loop."""

    def __init__(self, config, workdir: str | None = None, devices=None, batches=None):
        tracking.check(config, workdir)  # a missing W&B package or login stops the run before it builds
        processes.check_same_run(config)  # several processes: one code and one config, or one sentence
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
        # With several processes a save's barriers wait no longer than train.process_timeout_s for the others.
        self.checkpoints = Checkpoints(workdir, ck.keep, ck.async_save,
                                       barrier_timeout_s=t.process_timeout_s) if workdir else None
        self.skip_positions: set[int] = set()  # data positions whose batch made the loss non-finite (rollback)
        self._held_failure = None  # a failed save waiting for the other processes' verdict (processes.NotYet)

    # ------------------------------------------------------------------ batches

    def _to_device(self, host_rows):
        return place_batch(host_rows, self.setup.layout.batch, self.batch_shape, self.columns)

    def global_batch(self, data_state: dict) -> tuple[dict, dict]:
        """The global training batch at `data_state`, on the devices, and the data state after it."""
        host_rows, next_state = self.batches.train_batch(data_state, self.config.train.batch_size, self.rows)
        return self._to_device(host_rows), next_state

    def global_batches(self, count: int) -> list[dict]:
        """The first `count` training batches of a fresh run (benchmarks and tests)."""
        batches, data_state = [], self.batches.initial_state()
        for _ in range(count):
            batch, data_state = self.global_batch(data_state)
            batches.append(batch)
        return batches

    def eval_loss(self, state: TrainState) -> float:
        """The held-out loss of a state's parameters (with LoRA its adapters on the frozen base)."""
        t = self.config.train
        batches = (self._to_device(self.batches.eval_batch(i, t.batch_size, self.rows)) for i in range(t.eval_batches))
        sums = [self.steps.eval_step(state.params, batch, *self.steps.extra_inputs(state)) for batch in batches]
        loss, count = np.sum(jax.device_get(sums), axis=0)
        return float(loss / max(count, 1.0))

    # ------------------------------------------------------------------ state

    def initial_state(self, log=print) -> tuple[TrainState, dict]:
        """(state, data_state): restored from the newest complete checkpoint, else freshly initialised."""
        if self.checkpoints:
            self.checkpoints.wait()  # a save still being written (rollback) must land first
            abstract = self.steps.abstract_state().as_dict()

            def target(saved_config):
                check_same_optimizer(saved_config, self.config, self.checkpoints.directory)
                check_same_objective(saved_config, self.config, self.checkpoints.directory)
                return abstract, self.setup.model_config

            restored = self.checkpoints.restore_newest(target, log, restart=self.config.checkpoint.restart)
            if restored:
                step, state, saved_data_state, saved_config = restored
                data_state = self.batches.check_resume(saved_data_state, self.config.data.restart)
                log(f"resumed from the checkpoint at step {step}")
                note = schedule_change(saved_config, self.config.train, step)
                if note:
                    log(note)
                state = TrainState.from_dict(state)
                if self.setup.adapters:
                    state = self._with_base(state, log)
                return state, data_state
        if self.config.checkpoint.init_from:
            return self._start_from(self.config.checkpoint.init_from, log), self.batches.initial_state()
        return self.steps.init(self.config.train.seed), self.batches.initial_state()

    def _start_from(self, path: str, log) -> TrainState:
        """A fresh run's state around the parameters in `path` (checkpoint.init_from): step 0, a fresh optimizer."""
        params = self._model_params_in(path, log)
        log(f"starting from the parameters in {path} (step 0, a fresh optimizer"
            + (", LoRA adapters on the frozen weights)" if self.setup.adapters else ")"))
        return self.steps.fresh_state(params)

    def _model_params_in(self, path: str, log):
        """The model's parameters in `path`, laid out as the run's (LoRA's adapters are no part of them)."""
        target = with_shardings(self.setup.model.shapes, self.steps.shardings.model_params)
        model_cfg = dataclasses.replace(self.setup.model_config, lora=LoraConfig())
        return initial_params(path, model_cfg, target, log)

    def _with_base(self, state: TrainState, log) -> TrainState:
        """A restored LoRA state with its frozen base rebuilt (checkpoint.init_from's, else the seed's),
        refused in a sentence if it is not the base the checkpoint's adapters were trained on."""
        path = self.config.checkpoint.init_from
        if path:
            params = self._model_params_in(path, log)
        else:
            params = self.steps.init_model(self.config.train.seed)
        frozen = self.steps.frozen_base(params)
        if not same_base(jax.device_get(state.base_check), jax.device_get(fingerprint(frozen))):
            where = f"checkpoint.init_from={path}" if path else f"the seed {self.config.train.seed}'s random weights"
            raise UserError(f"the checkpoints in {self.checkpoints.directory} hold LoRA adapters trained on another "
                            f"base than {where}; start from the base they were trained on (the saved config "
                            "names it), or use another --workdir.")
        return state.replace(frozen=frozen)

    def _save(self, state: TrainState, data_state, step: int) -> None:
        if self.checkpoints:
            self.checkpoints.save(step, state.as_dict(), data_state, self.config)

    # ------------------------------------------------------------------ the run

    def run(self, log=print, signals: StopSignals | None = None) -> list[dict]:
        """Trains up to train.steps; returns the logged records (also written to DIR/metrics.jsonl).
        SIGTERM / SIGINT at any moment end it with Preempted at the next safe point (`signals`, if
        given, is the caller's, already catching them)."""
        if signals is None:
            with StopSignals() as signals:
                return self.run(log, signals)
        t = self.config.train
        log(self.setup.describe())
        planner.check_state_fits(self.setup)
        summary = self.batches.summary()
        if summary:
            log(summary)
        state, data_state = self.initial_state(log)
        step = int(jax.device_get(state.step))
        if self.config.train.objective == "dpo" and self.config.train.dpo.reference == "precomputed":
            self.batches.with_reference(dpo_reference.table(self, state, step, log))
        signals.check(self._nothing_new(step))
        writer = MetricsWriter(self.workdir, resume_step=step,  # drops what an earlier run logged after it
                               tracker=tracking.start(self.config, self.workdir, log))
        records, failed = [], True
        try:
            if step < t.steps:
                records = self._train(state, data_state, step, writer, log, signals)
            else:
                log(f"already trained to step {step} (train.steps={t.steps}); nothing to do.")
            failed = False
        finally:
            # Each closed whatever the other does: a save still in flight is finished even when the
            # metrics cannot be written. Where the run already failed, that failure is the one reported.
            with contextlib.suppress(UserError) if failed else contextlib.nullcontext():
                try:
                    writer.close()
                finally:
                    if self.checkpoints:
                        self.checkpoints.close()
        saved = "checkpoint saved" if self.checkpoints else "no workdir"
        signals.check(f"as the run ended at step {t.steps} ({saved})")
        return records

    def _nothing_new(self, step: int) -> str:
        """Preempted's `where` before the first step of a run: nothing trained, nothing to save."""
        if not self.checkpoints:
            return f"before step {step + 1} (no workdir, nothing saved)"
        if step:
            return (f"before step {step + 1} (nothing new to save: the state was just restored from the "
                    f"checkpoint at step {step}; run the same command to resume)")
        return "before step 1 (nothing to save: the state was freshly initialised; run the same command to start)"

    def _train(self, state, data_state, step, writer, log, signals) -> list[dict]:
        t, every = self.config.train, self.config.checkpoint.every
        log("compiling the train step")
        start = time.perf_counter()
        step_fn = self.steps.train_step.lower(state, self.global_batch(data_state)[0]).compile()
        log(f"compiled the train step in {time.perf_counter() - start:.1f}s")
        stop = self._agree(step, signals.received)  # a signal that came while compiling, to any process
        if stop:
            raise Preempted(stop, self._nothing_new(step))
        bar = _progress_bar(t.steps, step)
        nonfinite = NonfiniteRow(t.max_nonfinite_steps)
        records, pending = [], []  # pending: (step, data position, device metrics) since the last sync
        together = jax.process_count() > 1
        last_time, last_step = time.perf_counter(), step
        while step < t.steps:
            while data_state["position"] in self.skip_positions:
                data_state = self.batches.advance(data_state, t.batch_size)
            position = data_state["position"]
            batch, data_state = self.global_batch(data_state)
            state, metrics = step_fn(state, batch)
            step += 1
            pending.append((step, position, metrics))
            if len(pending) > STEPS_AHEAD:  # the host no further than STEPS_AHEAD steps ahead of the devices
                jax.block_until_ready(pending[-STEPS_AHEAD - 1][2]["loss"])
            if bar:
                bar.update(1)
            # Several processes act on a signal at the next log or save step, where they all agree
            # (ushard/training/processes.py); one process acts on it at once.
            stop = None if together else signals.received  # read once: a signal may land at any moment
            log_now = step % t.log_every == 0 or step == t.steps
            save_now = (every and step % every == 0) or step == t.steps
            agree_now = together and step % processes.AGREE_EVERY_STEPS == 0
            if not together and self.checkpoints:
                self.checkpoints.check()  # a failed background save stops the run now, not at the next save
            if not (log_now or save_now or stop or agree_now):
                continue
            values = jax.device_get([m for _, _, m in pending])  # one transfer; waits for the device
            fetched = [(s, i, m) for (s, i, _), m in zip(pending, values)]
            pending = []
            _check_dispatch(fetched, self.config.model.moe)
            self._count_nonfinite(fetched, nonfinite, last=step == t.steps)
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
            failure = None
            if log_now:
                now = time.perf_counter()
                record = self._record(step, fetched[-1][2], (now - last_time) / (step - last_step))
                if t.eval_every and (step % t.eval_every == 0 or step == t.steps):
                    record["eval_loss"] = self.eval_loss(state)
                records.append(record)
                try:
                    writer.write(record)
                except UserError as e:  # a full disk: the other processes must hear of it (below)
                    failure = e
                line = _format(record)
                bar.write(line) if bar else log(line)
            stop = self._agree(step, signals.received, failure)
            save_now = save_now or stop
            if save_now:
                self._saved_together(step)  # the save before this one
                self._save(state, data_state, step)
            if stop:
                self._saved_together(step)
                where = ("checkpoint saved; run the same command to resume" if self.checkpoints
                         else "no workdir, nothing saved")
                raise Preempted(stop, f"at step {step} ({where})")
            last_time, last_step = time.perf_counter(), step
        if bar:
            bar.close()
        self._saved_together(step)
        return records

    def _saved_together(self, step: int) -> None:
        """Waits for the save in flight; raises what failed in it on any process (`_agree`), so that
        every process reports the one whose failure is the cause, where the others only waited for it."""
        if self.checkpoints:
            self._agree(step, None, self._held_failure or self.checkpoints.finished(), settled=True)

    def _agree(self, step: int, signum: int | None, failure: UserError | None = None,
               settled: bool = False) -> int | None:
        """The signal every process acts on at `step` (None: none), after raising what failed on any
        process: this one's metrics `failure`, a background save that failed (processes.agree)."""
        if failure is None and self.checkpoints:
            failure = self._held_failure or self.checkpoints.failure()
        self._held_failure = None
        try:
            return processes.agree(step, signum, failure, self.config.train.process_timeout_s, settled)
        except processes.NotYet as e:
            self._held_failure = e.failure
            return e.signum

    def _count_nonfinite(self, fetched, row: NonfiniteRow, last: bool) -> None:
        """Stops the run (UserError) once train.max_nonfinite_steps non-finite steps came in a row under
        `skip` or `rollback`, or when the last step is reached and not one step of this run was finite
        (a run that skipped everything must not end as if it had trained)."""
        policy, limit = self.config.train.on_nonfinite, self.config.train.max_nonfinite_steps
        if policy == "stop":
            return  # the first one stops (_handle_nonfinite)
        for step, position, metrics in fetched:
            if row.add(step, bool(metrics["finite"])):
                raise UserError(
                    f"training stopped: {row.count} steps in a row gave a non-finite loss or gradient norm (the "
                    f"last, step {step} on the batch at data position {position:,}: {_nonfinite_values(metrics)}), "
                    f"the limit train.max_nonfinite_steps={limit} for train.on_nonfinite={policy!r}; lower train.lr "
                    f"or check the data (checkpoints hold only finite states)."
                )
            if not metrics["finite"] and policy == "rollback":
                return  # the steps after it are rolled back: they never happened
        if last and not row.any_finite:
            step, position, metrics = fetched[-1]
            raise UserError(
                f"training stopped: every step of this run up to step {step} gave a non-finite loss or gradient "
                f"norm (the last, on the batch at data position {position:,}: {_nonfinite_values(metrics)}), so it "
                f"trained nothing; lower train.lr or check the data."
            )

    def _handle_nonfinite(self, bad, log):
        """The rollback and stop policies, once a step's loss or gradient norm was not finite."""
        step, position, metrics = bad
        what = _nonfinite_values(metrics)
        where = f"step {step} (the batch at data position {position:,})"
        if self.config.train.on_nonfinite == "stop":
            raise UserError(
                f"training stopped: {where} gave {what}; train.on_nonfinite='stop' "
                f"(choose 'skip' or 'rollback' to carry on)."
            )
        self.skip_positions.add(position)
        state, data_state = self.initial_state(log)
        back_to = int(jax.device_get(state.step))
        log(f"ushard: {where} gave {what}; rolled back to step {back_to}, skipping that batch.")
        return state, data_state, back_to

    def _record(self, step, metrics, step_time) -> dict:
        t = self.config.train
        pairs = t.objective == "dpo"  # a row each for a pair's chosen and rejected sequence
        tokens_per_s = (2 if pairs else 1) * t.batch_size * t.seq_len / step_time
        tflops = self.setup.flops_per_token * tokens_per_s / self.setup.mesh.size / 1e12
        return {
            "step": step,
            "loss": float(metrics["loss"]),
            # The model's terms as aux/<name>; an objective's own figures carry their group (dpo/<name>).
            **{name if "/" in name else f"aux/{name}": float(value) for name, value in metrics["aux"].items()},
            "grad_norm": float(metrics["grad_norm"]),
            "lr": float(metrics["lr"]),
            "tokens_per_s": tokens_per_s,
            "step_time_s": step_time,
            "tflops_per_device": tflops,
            "mfu": tflops * 1e12 / self.peak if self.peak else None,
            "skipped_steps": int(metrics["skipped"]),
            # the targets the loss counted (all but masked ones); DPO: the pairs it averaged over
            "loss_pairs" if pairs else "loss_tokens": int(metrics["loss_tokens"]),
        }


def _check_dispatch(fetched, moe) -> None:
    """Stops the run (UserError) at the first step whose ragged expert dispatch had more rows for a
    device than its receive buffer holds: that step's outputs are NaN (ushard/parallel/expert.py)
    and it is not saved; the checkpoints before it stand."""
    for step, position, metrics in fetched:
        share = float(metrics["aux"].get(DISPATCH_OVERFLOW, 0.0))
        if share > 0:
            raise UserError(
                f"training stopped: at step {step} (the batch at data position {position:,}) the experts' load was "
                f"too uneven for the ragged dispatch's receive buffers ({share:.0%} of the MoE layers: a device "
                f"had more rows than model.moe.dispatch_headroom={moe.dispatch_headroom} times an even load); "
                f"raise model.moe.dispatch_headroom and run the same command to resume from the last checkpoint."
            )


def _nonfinite_values(metrics) -> str:
    return f"loss {float(metrics['loss'])}, gradient norm {float(metrics['grad_norm'])}"


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
