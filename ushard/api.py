"""The public Python API (re-exported by `ushard/__init__.py`): what the CLI does, callable from Python.

    import ushard
    config = ushard.load_config("tiny", {"train.steps": 50})
    rows = ushard.train(config, "runs/tiny")          # the same run as `ushard train`
    model = ushard.load_model("runs/tiny")            # int32 [batch, length] -> float32 logits
"""

from __future__ import annotations

import contextlib

from ushard import config as _config
from ushard import xla_flags
from ushard.workdir_lock import hold_workdir


def load_config(name_or_path: str, overrides=None):
    """The config `ushard train --config NAME_OR_PATH` would use, with `overrides` applied: a dict
    `{"train.steps": 50}` or a list of `"a.b=value"` strings (a leading `--config.` is allowed).
    Every setting that needs no devices is checked; a mistake raises `ushard.UserError`, whose
    message is the CLI's one sentence."""
    config = _config.load_config(name_or_path, overrides)
    _config.check_settings(config)
    return config


def train(config, workdir: str | None = None, log=print) -> list[dict]:
    """Trains `config` as `ushard train` does: DIR/metrics.jsonl, checkpoints and resume in `workdir`
    (None: nothing is written). Returns the logged metrics rows. XLA flags the config implies take
    effect only if JAX's backend has not started yet in this process. SIGTERM / SIGINT (from the main
    thread) stop it with `Preempted` at the next safe point, after saving where there is something new."""
    import jax

    from ushard.training.loop import StopSignals, Trainer
    from ushard.training.processes import Watchdog

    xla_flags.apply(config)
    with StopSignals() as signals:
        jax.devices()  # the backend starts outside `at_once`: its C++ is no place for an exception
        watch = Watchdog(config.train.process_timeout_s) if jax.process_count() > 1 else contextlib.nullcontext()
        with hold_workdir(workdir, log) if workdir else contextlib.nullcontext(), watch:  # one run per workdir
            # Python work that holds nothing yet (above all loading the data) may stop on the spot.
            with signals.at_once("while setting up the model and data, before training started (nothing to save)"):
                trainer = Trainer(config, workdir)
            try:
                return trainer.run(log, signals)
            except jax.errors.JaxRuntimeError:
                if isinstance(watch, Watchdog):  # a collective that failed because a process is gone:
                    watch.wait_for_verdict()  # the watch names it and ends this process
                raise
