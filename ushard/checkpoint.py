"""Orbax checkpoints in DIR/checkpoints/<step>/: training state, data-iterator state and the config.

Saves are sharded (each process writes its own shards) and, by default, asynchronous: the call
returns once the arrays are copied off the devices. Orbax writes into a temporary directory and
renames it when complete, so a save killed half-way leaves a `*.orbax-checkpoint-tmp*` directory that
is never mistaken for a checkpoint; ushard warns about it. Restoring takes the *current* shardings, so a
run resumes on any mesh and any number of devices. One restore path (`Checkpoints.restore_newest`)
serves training (the whole state) and `ushard sample` / `ushard.load_model` (the parameters alone);
whether a checkpoint fits is decided by comparing its parameter tree on disk with the one expected.

Faults: a checkpoint that cannot be read (any file of it missing, truncated or garbled) is damaged;
training moves it to DIR/checkpoints-damaged/ (never deletes it) and resumes from the newest good one.
When none is good, training stops and moves nothing unless checkpoint.restart is set. An error of the
operating system (permission denied, I/O) is not damage: it stops the run and moves nothing.
A save that fails (a full disk, a read-only directory) raises `SaveFailed` as soon as it is known; the
checkpoints before it stay complete.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import sys
import time
import warnings

import jax
import numpy as np
import orbax.checkpoint as ocp

from ushard.errors import UserError
from ushard.models.config import ModelConfig
from ushard.models.definition import tree_paths

DAMAGED_DIR = "checkpoints-damaged"  # beside checkpoints/, so that orbax's listing of steps never sees it


class SaveFailed(UserError):
    """A checkpoint could not be written (a full disk, a read-only directory): the run stops with one
    sentence and exit status 2; the checkpoints before it are complete, and the same command resumes.
    `waited_only`: it failed only waiting for other processes (their failure is the cause)."""

    waited_only = False


class Damaged(Exception):
    """A checkpoint whose files can be read but do not hold what a checkpoint holds."""


class _OrbaxLogFilter(logging.Filter):
    """Drops what orbax logs about the failures ushard reports itself in one line: orbax logs each failed
    save from several threads with tracebacks (2,579 lines for one full disk, and asyncio adds its own
    'Task exception was never retrieved'), and warns about every missing file of a damaged checkpoint."""

    reading = False  # set while checkpoints that may be damaged are read

    def filter(self, record: logging.LogRecord) -> bool:
        from_orbax = "/orbax/" in record.pathname or (record.name == "asyncio" and "/orbax/" in record.getMessage())
        if not from_orbax or record.levelno >= logging.CRITICAL:
            return True
        return record.levelno < (logging.WARNING if self.reading else logging.ERROR)


_orbax_log = _OrbaxLogFilter()


@contextlib.contextmanager
def _reading_checkpoints():
    """orbax's warnings are not shown while checkpoints that may be damaged are read."""
    _orbax_log.reading = True
    try:
        yield
    finally:
        _orbax_log.reading = False


def _hide_stray_tensorstore_errors(previous_hook):
    """A sys.unraisablehook: when one read or write of a checkpoint fails, orbax closes its event loop
    while TensorStore still completes the others, whose callbacks then fail with 'Event loop is closed'
    or drop a future holding their error; Python would print each as an 'Exception ignored' traceback
    (dozens for one damaged file). ushard reports the failure itself; anything else goes to `previous_hook`."""

    def hook(unraisable):
        error = unraisable.exc_value
        closed_loop = isinstance(error, RuntimeError) and str(error) == "Event loop is closed"
        stray = closed_loop or "TensorStore" in str(error)
        if not stray:
            previous_hook(unraisable)

    return hook


_quieted = False


def quiet_orbax() -> None:
    """Keeps what orbax reports about failures ushard reports itself out of the output: its log filter,
    `sys.unraisablehook` wrapped, one warnings filter. They are process-wide, so they are installed
    (once) when checkpoints are first opened, not when ushard is imported."""
    global _quieted
    if _quieted:
        return
    _quieted = True
    logging.getLogger("absl").setLevel(logging.WARNING)  # orbax logs every save at INFO
    logging.getLogger("absl").addFilter(_orbax_log)
    logging.getLogger("asyncio").addFilter(_orbax_log)
    sys.unraisablehook = _hide_stray_tensorstore_errors(sys.unraisablehook)
    warnings.filterwarnings("ignore", message=".*Couldn't find sharding info under RestoreArgs.*")


class Checkpoints:
    """DIR/checkpoints of one workdir; `create=False` opens an existing one for reading only: then a
    damaged checkpoint is skipped but not moved (a reader holds no lock on the workdir)."""

    # What a checkpoint of another model asks the user to do (the end of that sentence).
    ANOTHER_MODEL = "use the same model settings or another --workdir"

    def __init__(self, workdir: str, keep: int = 3, async_save: bool = True, create: bool = True,
                 another_model: str = ANOTHER_MODEL, barrier_timeout_s: int = 1200):
        quiet_orbax()
        self.workdir = workdir
        self.another_model = another_model
        self.directory = os.path.abspath(os.path.join(workdir, "checkpoints"))
        self.damaged_directory = os.path.join(os.path.dirname(self.directory), DAMAGED_DIR)
        self.move_damaged = create
        if not create and not os.path.isdir(self.directory):
            raise UserError(f"{self.directory} does not exist; train a model first with "
                            f"`ushard train --workdir {workdir}`.")
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, enable_async_checkpointing=async_save, create=create,
            # Directories made by save() itself: a read-only directory fails there and then. Made in the
            # background, the failure left the array writers waiting 5 minutes for a directory that never came.
            async_options=ocp.AsyncOptions(create_directories_asynchronously=False, timeout_secs=barrier_timeout_s),
        )
        # The state as a PyTree: its metadata can be read, and it can be restored in part.
        handlers = {"state": ocp.PyTreeCheckpointHandler(), "data": ocp.JsonCheckpointHandler(),
                    "config": ocp.JsonCheckpointHandler()}
        with _reading_checkpoints():  # it reads the metadata of every step
            self.manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)
        self._in_flight = None  # the step of a save that may still be running
        self._handlers = handlers

    def save(self, step: int, state: dict, data_state: dict, config) -> None:
        """Starts saving; returns once the device arrays are safe to overwrite (donate) again. Raises
        SaveFailed if this save, or the one before it, failed."""
        self.wait()  # orbax would wait for the save before anyway, and blame its failure on this one
        items = ocp.args.Composite(state=ocp.args.PyTreeSave(state), data=ocp.args.JsonSave(data_state),
                                   config=ocp.args.JsonSave(json.loads(config.to_json())))
        try:
            self.manager.save(step, args=items, force=True)
        except Exception as e:  # a synchronous save, or the directories of an asynchronous one
            raise self._save_failed(step, e) from e
        self._in_flight = step

    def check(self) -> None:
        """Raises SaveFailed if the save in flight has failed; never waits for one still being written."""
        failure = self.failure()
        if failure is not None:
            raise failure

    def failure(self) -> SaveFailed | None:
        """SaveFailed if the save in flight has failed, else None; never waits for one still being written.
        A run of several processes shares the answer at a step they agree on (training/processes.py)."""
        if self._in_flight is None or self.manager.is_saving_in_progress():
            return None
        return self.finished()  # it has ended: this returns at once

    def finished(self) -> SaveFailed | None:
        """Waits until the save in flight is written; its SaveFailed if it failed, else None."""
        try:
            self.wait()
        except SaveFailed as e:
            return e
        return None

    def wait(self) -> None:
        """Waits until the save in flight is written; raises SaveFailed if it failed."""
        step, self._in_flight = self._in_flight, None
        try:
            self.manager.wait_until_finished()
        except Exception as e:
            raise self._save_failed(step, e) from e

    def _save_failed(self, step, error: Exception) -> SaveFailed:
        kept = [s for s in self.manager.all_steps() if s != step]
        newest = f"the newest complete checkpoint is step {max(kept)}" if kept else "no checkpoint was completed"
        failed = SaveFailed(
            f"saving the checkpoint of step {step} to {os.path.join(self.directory, str(step))} failed "
            f"({_cause(error)}); training stopped and {newest}: fix the cause, then run the same command to resume."
        )
        failed.waited_only = _waited_only(error)
        return failed

    def restore_newest(self, target, log=print, restart: bool = False):
        """(step, state, data_state, saved config) from the newest checkpoint that can be read, or None
        when there is none. `target(saved_config)` gives (abstract state, ModelConfig) to restore into:
        a dict with at least "params", leaves ShapeDtypeStructs carrying the shardings wanted. A damaged
        checkpoint is reported in one line, moved aside (when opened for training) and the one before it
        tried, so that no step that is listed on disk lies ahead of the restored one; a checkpoint of
        another model stops at once with a UserError and is left where it is, as does one the operating
        system will not let us read (permissions, I/O, a lost mount: not the files' fault). When every
        checkpoint is damaged, training stops with a UserError and moves nothing, unless `restart`
        (checkpoint.restart): then they are moved aside and None says to start over.

        Several processes: each reads its own shards, all agree on each checkpoint's verdict (damage
        or a refused read on any process counts for all), and process 0 moves."""
        for name in sorted(os.listdir(self.directory)) if os.path.isdir(self.directory) else ():
            if "orbax-checkpoint-tmp" in name:
                log(f"ushard: warning: skipping {os.path.join(self.directory, name)}, a save that never finished.")
        restored, damaged = None, []
        with _reading_checkpoints(), self._reader() as reader:
            self.manager.reload()
            for step in sorted(self.manager.all_steps(), reverse=True):
                error = None
                try:
                    attempt = (step, *self._restore(reader, step, target))
                except (UserError, MemoryError, jax.errors.JaxRuntimeError):
                    raise  # another model, or the devices (out of memory): not the files' fault
                except Exception as e:  # a file missing, truncated, garbled, or one the OS will not read
                    error = e
                denied, error = _read_together(step, error)
                if denied:
                    raise UserError(f"checkpoint {step} in {self.directory} cannot be read ({denied}); "
                                    f"nothing was moved: fix the access (permissions, the mount, the disk), "
                                    f"then run the same command again.") from None
                if error is None:
                    restored = attempt
                    break
                damaged.append((step, error))
        if damaged and restored is None and self.move_damaged and not restart:
            newest, error = damaged[0]
            raise UserError(f"none of the {len(damaged)} checkpoints in {self.directory} can be read (the newest, "
                            f"step {newest}: {_first_line(error)}); nothing was moved. Set "
                            f"--config.checkpoint.restart=true to move them to {self.damaged_directory} and start "
                            f"over from step 0.")
        for step, error in damaged:
            self._set_aside(step, error, log)
        if damaged and restored is None:
            if not self.move_damaged:
                raise UserError(f"no checkpoint in {self.directory} can be read; train again to write a new one.")
            log(f"starting over from step 0 (checkpoint.restart=true): no checkpoint in {self.directory} could be "
                f"read.")
        if damaged and self.move_damaged:
            if jax.process_count() > 1:  # nobody lists the steps again before process 0 has moved them
                from jax.experimental import multihost_utils

                multihost_utils.sync_global_devices("ushard: damaged checkpoints moved")
            self.manager.reload()  # a damaged step is no longer listed, so saving it again cannot collide
        return restored

    def _set_aside(self, step: int, error: Exception, log) -> None:
        """Reports a damaged checkpoint in one line and, when training, moves it out of checkpoints/."""
        what = f"ushard: warning: checkpoint {step} is damaged ({_first_line(error)})"
        if not self.move_damaged:
            log(f"{what}; trying an older one.")
            return
        source = os.path.join(self.directory, str(step))
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        destination = os.path.join(self.damaged_directory, f"{step}-{stamp}")
        if jax.process_index() == 0:
            try:
                os.makedirs(self.damaged_directory, exist_ok=True)
                destination = _unused(destination)
                os.rename(source, destination)
            except OSError as e:
                raise UserError(f"{what} and cannot be moved to {destination} ({e.strerror}); move {source} "
                                f"out of {self.directory} yourself, then run again.") from e
        log(f"{what}; moved it to {destination} and trying an older one.")

    @contextlib.contextmanager
    def _reader(self):
        """The manager restores read through. With several processes, one of this process's own that
        reads its shards with none of orbax's syncs between processes: a process that fails part-way
        would leave the others waiting in one (each reads only its own shards, so damage can fail one
        process alone); `_read_together` agrees on every checkpoint's verdict instead."""
        if jax.process_count() == 1:
            yield self.manager
            return
        me = jax.process_index()
        alone = ocp.options.MultiprocessingOptions(primary_host=me, active_processes={me})
        options = ocp.CheckpointManagerOptions(create=False, multiprocessing_options=alone)
        reader = ocp.CheckpointManager(self.directory, options=options, item_handlers=self._handlers)
        try:
            yield reader
        finally:
            reader.close()

    def _restore(self, reader, step: int, target):
        saved_config = reader.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"]
        if not isinstance(saved_config, dict) or not isinstance(saved_config.get("model"), dict):
            raise Damaged("its saved config holds no model settings")
        abstract, model_cfg = target(saved_config)
        metadata = reader.item_metadata(step)["state"]
        if metadata is None:
            raise Damaged("the metadata of its state cannot be read")
        check_compatible(metadata.tree["params"], abstract["params"], saved_config, model_cfg, step, self.another_model)
        if "opt_state" in abstract and "opt_state" not in metadata.tree:
            raise UserError(
                f"the checkpoint at step {step} in {self.directory} holds parameters only (as `ushard convert` "
                f"writes them), not a training run to resume; train in another workdir with "
                f"--config.checkpoint.init_from={self.workdir} to start from it."
            )
        restore_args = ocp.checkpoint_utils.construct_restore_args(abstract)
        items = ocp.args.Composite(
            state=ocp.args.PyTreeRestore(item=abstract, restore_args=restore_args, partial_restore=True),
            data=ocp.args.JsonRestore(),
        )
        restored = reader.restore(step, args=items)
        data = restored["data"]
        # The data code checks what the position means; here only that there is one.
        if not isinstance(data, dict) or not ("next_batch" in data or "position" in data):
            raise Damaged(f"its data state {json.dumps(data)[:80]} holds no position")
        return restored["state"], data, saved_config

    def close(self) -> None:
        """Waits for the save in flight (SaveFailed if it failed), then stops orbax's threads."""
        try:
            self.wait()
        finally:
            self.manager.close()


def _read_together(step: int, error: Exception | None) -> tuple[str | None, Exception | None]:
    """(the OS error that stops the run, or None; the damage, or None) for checkpoint `step`, as every
    process sees it after each read its own shards (`error`: what this one met, None if it read all):
    denied if any process was refused access, damaged if any found damage."""
    # orbax raises its own "Encountered error while reading array" from TensorStore's error: the OS
    # error number is in the chain, not on the outermost exception.
    refused = error is not None and any(_os_errno(e) in ACCESS_ERRNOS for e in _chain(error))
    denied = _cause(error, with_path=True) if refused else None
    if jax.process_count() == 1:
        return denied, error
    from jax.experimental import multihost_utils

    verdicts = multihost_utils.process_allgather(np.int32(2 if denied else 1 if error is not None else 0))
    if denied is None and (verdicts == 2).any():
        denied = f"process {int(np.argmax(verdicts == 2))} was refused access"
    if error is None and verdicts.any():
        error = Damaged(f"process {int(np.argmax(verdicts > 0))} could not read its part")
    return denied, error


# Errors of the operating system that say nothing about a checkpoint's content.
ACCESS_ERRNOS = frozenset({errno.EACCES, errno.EPERM, errno.EIO, errno.ENODEV, errno.ENXIO, errno.ENOTCONN,
                           errno.ESTALE, errno.EHOSTDOWN, errno.ETIMEDOUT})


def _os_errno(error: BaseException) -> int | None:
    """The OS error number of `error`, or of the one TensorStore wraps in it (os_error_code='N')."""
    if isinstance(error, OSError) and error.errno:
        return error.errno
    code = re.search(r"os_error_code='?(\d+)", str(error))
    return int(code.group(1)) if code else None


def _first_line(error: BaseException, limit: int = 200) -> str:
    """`Type: first line of the message`, cut to `limit` characters: TensorStore's messages run to 465 KB."""
    lines = str(error).strip().splitlines()
    first = lines[0] if lines else ""
    text = first if isinstance(error, Damaged) else f"{type(error).__name__}: {first}"
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _chain(error: BaseException) -> list[BaseException]:
    """`error` and the exceptions it was raised from or while handling, outermost first."""
    chain = []
    while error is not None and error not in chain:
        chain.append(error)
        error = error.__cause__ or error.__context__
    return chain


def _waited_only(error: BaseException) -> bool:
    """Whether a save failed only by waiting for other processes at one of orbax's barriers, with no
    error of its own: with several processes, then another one's failure is the cause."""
    chain = _chain(error)  # never empty: `error` itself
    return (not any(_os_errno(e) for e in chain)
            and all(isinstance(e, TimeoutError) or "Barrier timed out" in str(e) for e in chain))


def _cause(error: BaseException, with_path: bool = False) -> str:
    """Why a read or write failed, in a few words: an OS error's number and text (TensorStore wraps it
    in a ValueError as os_error_code='N'), found anywhere in the exception's chain (with several
    processes orbax raises a barrier's timeout from it), with the file it names if `with_path`, else
    the exception's first line."""
    for link in _chain(error):
        number = _os_errno(link)
        if number:
            path = _os_path(link) if with_path else None
            return f"[Errno {number}] {os.strerror(number)}" + (f": {path}" if path else "")
    return _first_line(error)


def _os_path(error: BaseException) -> str | None:
    """The file an OS error is about: an OSError's filename, or the quoted path just before TensorStore's
    os_error_code (`Failed to open: "PATH": Permission denied [os_error_code='13']`)."""
    if isinstance(error, OSError) and error.filename:
        return str(error.filename)
    path = re.search(r'"([^"]+)": [^"]*\[os_error_code', str(error))
    return path.group(1) if path else None


def _unused(path: str) -> str:
    """`path`, or `path-2`, `path-3`, ... if it exists (a step damaged twice within one second)."""
    candidate, n = path, 1
    while os.path.exists(candidate):
        n += 1
        candidate = f"{path}-{n}"
    return candidate


def saved_model_config(saved_config: dict) -> ModelConfig:
    """The model settings of a checkpoint's saved config (JSON): defaults fill keys the checkpoint
    predates; keys this version does not know are ignored."""
    return ModelConfig.from_config(saved_config.get("model", {}), ignore_unknown=True)


def check_compatible(on_disk, expected, saved_config: dict, model_cfg: ModelConfig, step: int,
                     remedy: str = Checkpoints.ANOTHER_MODEL) -> None:
    """Raises UserError naming what differs when the checkpoint holds another model: other parameters
    on disk than the expected tree, or another setting that defines the model's function (e.g.
    rope_theta). Settings of how it is computed (remat, dtypes of compute, kernels) may change."""
    there, here = (
        {path: f"{tuple(x.shape)} {jax.numpy.dtype(x.dtype).name}" for path, x in tree_paths(tree).items()}
        for tree in (on_disk, expected)
    )
    diffs = [f"{p} is missing there" for p in here if p not in there]
    diffs += [f"{p} is not expected here" for p in there if p not in here]
    diffs += [f"{p} is {there[p]} there but {here[p]} here" for p in here if p in there and there[p] != here[p]]
    saved = saved_model_config(saved_config)
    function = saved.differences(model_cfg, function_only=True)
    if not diffs and not function:
        return
    if diffs:
        shown = "; ".join(diffs[:3]) + (f"; and {len(diffs) - 3} more" if len(diffs) > 3 else "")
        settings = saved.differences(model_cfg)
        because = f" (its settings differ: {'; '.join(settings)})" if settings else ""
        what = f"holds another model's parameters ({shown}){because}"
    else:
        what = f"holds another model: {'; '.join(function)}"
    raise UserError(f"the checkpoint at step {step} {what}; {remedy}.")

