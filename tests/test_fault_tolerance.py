"""Checkpoints, exact resume, resharding on restore, preemption and non-finite policies."""

import contextlib
import errno
import io
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest

import ushard
from conftest import SMALL_MOE, free_port, small_config
from helpers import MetricsOnAFullDisk
from ushard.errors import UserError
from ushard.training.loop import Trainer

# A small run that logs every step and checkpoints every 3 steps.
RUN = [
    "--config.model.n_layers=1", "--config.train.seq_len=32", "--config.train.batch_size=8",
    "--config.train.log_every=1", "--config.train.eval_every=0", "--config.checkpoint.every=3",
]


def train_cmd(workdir, *extra):
    return [sys.executable, "-m", "ushard", "train", "--config", "tiny", "--workdir", str(workdir), *RUN, *extra]


def env(devices=8):
    return {**os.environ, "JAX_NUM_CPU_DEVICES": str(devices)}


def cached_env(cache_dir):
    """env() with JAX's persistent compilation cache in `cache_dir`: the first run compiles, the runs
    after it load the executables (seconds instead of a compilation)."""
    return {**env(), "JAX_COMPILATION_CACHE_DIR": str(cache_dir), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}


def losses_by_step(workdir) -> dict[int, float]:
    """The last logged loss of each step (a resumed run logs the steps after its checkpoint again)."""
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records}


def wait_for_step(workdir, step, proc, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        path = workdir / "metrics.jsonl"
        if path.exists() and any(json.loads(line)["step"] >= step for line in path.read_text().splitlines() if line):
            return
        assert proc.poll() is None, "the run ended before it was interrupted"
        time.sleep(0.05)
    raise TimeoutError(step)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """The workdir of an uninterrupted 12-step run: checkpoints 6, 9 and 12 (keep=3)."""
    workdir = tmp_path_factory.mktemp("uninterrupted")
    subprocess.run(train_cmd(workdir, "--config.train.steps=12"), env=env(), check=True, capture_output=True)
    return workdir


@pytest.fixture(scope="module")
def uninterrupted(finished_run):
    return losses_by_step(finished_run)


def test_sigkill_then_same_command_resumes_bitwise(tmp_path, uninterrupted):
    cmd = train_cmd(tmp_path, "--config.train.steps=12")
    proc = subprocess.Popen(cmd, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for_step(tmp_path, 7, proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    resumed = subprocess.run(cmd, env=env(), capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed from the checkpoint at step" in resumed.stdout
    assert losses_by_step(tmp_path) == uninterrupted  # bitwise, every step


@pytest.mark.slow  # the suite's time; a SIGKILL between steps is in the default tier
def test_sigkill_during_a_save_resumes_bitwise(tmp_path, uninterrupted):
    cmd = train_cmd(tmp_path, "--config.train.steps=12")
    proc = subprocess.Popen(cmd, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ckpts = tmp_path / "checkpoints"
    deadline = time.time() + 120
    # Kill the moment a save of step 6 or later is under way (its temporary directory exists).
    while not (ckpts.is_dir() and any("orbax-checkpoint-tmp" in p.name and int(p.name.split(".")[0]) >= 6
                                      for p in ckpts.iterdir())):
        assert time.time() < deadline and proc.poll() is None, "no save was seen in progress"
        time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    resumed = subprocess.run(cmd, env=env(), capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed from the checkpoint at step" in resumed.stdout
    assert losses_by_step(tmp_path) == uninterrupted


@pytest.mark.slow  # the suite's time; failed saves are in the default tier
def test_partial_save_is_skipped_with_a_warning(tmp_path, uninterrupted):
    cmd = train_cmd(tmp_path, "--config.train.steps=12")
    subprocess.run(cmd, env=env(), check=True, capture_output=True)
    ckpts = tmp_path / "checkpoints"
    # What a kill during the save of step 12 leaves behind: orbax's temporary directory, half written.
    shutil.move(ckpts / "12", ckpts / "12.orbax-checkpoint-tmp-1764150000")
    for path in sorted((ckpts / "12.orbax-checkpoint-tmp-1764150000").rglob("*"))[::2]:
        if path.is_file():
            path.unlink()
    (tmp_path / "metrics.jsonl").unlink()
    resumed = subprocess.run(cmd, env=env(), capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "warning: skipping" in resumed.stdout and "never finished" in resumed.stdout
    assert "resumed from the checkpoint at step 9" in resumed.stdout
    assert losses_by_step(tmp_path) == {s: uninterrupted[s] for s in (10, 11, 12)}


def test_sigterm_saves_a_restorable_checkpoint(tmp_path, uninterrupted):
    proc = subprocess.Popen(train_cmd(tmp_path, "--config.train.steps=12", "--config.checkpoint.every=0"),
                            env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_step(tmp_path, 2, proc)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-2000:]
    assert "stopped by SIGTERM at step" in stderr
    stopped_at = int(stderr.split("stopped by SIGTERM at step ")[1].split()[0])
    assert stopped_at < 12
    assert (tmp_path / "checkpoints" / str(stopped_at)).is_dir()
    resumed = subprocess.run(train_cmd(tmp_path, "--config.train.steps=12"), env=env(), capture_output=True, text=True)
    assert f"resumed from the checkpoint at step {stopped_at}" in resumed.stdout
    assert losses_by_step(tmp_path) == uninterrupted


# ----------------------------------------------------------------------------- signals at any moment

# `ushard train` whose data loading announces itself, then takes two minutes.
SLOW_DATA = """
import sys, time
import ushard.training.loop as loop
from ushard.cli import main

load = loop.make_batches

def slow_load(*args, **kwargs):
    print("loading the data", flush=True)
    time.sleep(120)
    return load(*args, **kwargs)

loop.make_batches = slow_load
sys.exit(main(sys.argv[1:]))
"""


def signal_after_line(cmd, line: str, signum: int, environ=None) -> tuple[int, str]:
    """Runs `cmd`, sends `signum` as soon as it prints `line`; returns (exit status, stderr)."""
    proc = subprocess.Popen(cmd, env={**(environ or env()), "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert any(line in out for out in proc.stdout), f"the run never printed {line!r}"
    proc.send_signal(signum)
    _, stderr = proc.communicate(timeout=120)
    return proc.returncode, stderr


def test_sigterm_while_loading_the_data_stops_at_once(tmp_path):
    from ushard.workdir_lock import WorkdirLock

    cmd = [sys.executable, "-c", SLOW_DATA, *train_cmd(tmp_path)[3:]]  # the arguments after `-m ushard`
    status, stderr = signal_after_line(cmd, "loading the data", signal.SIGTERM)
    assert status == 128 + signal.SIGTERM, stderr[-2000:]
    assert stderr.splitlines() == ["ushard: stopped by SIGTERM while setting up the model and data, before "
                                   "training started (nothing to save)."]
    assert not (tmp_path / "checkpoints").exists()
    WorkdirLock(str(tmp_path)).acquire().release()  # free again


@pytest.mark.slow  # the suite's time
def test_sigint_while_compiling_waits_for_the_compiler_then_stops(tmp_path, finished_run, uninterrupted):
    saved_dir, reference = finished_run, uninterrupted
    shutil.copytree(saved_dir / "checkpoints" / "6", tmp_path / "checkpoints" / "6")
    cmd, environ = train_cmd(tmp_path, "--config.train.steps=12"), cached_env(tmp_path / "jax-cache")
    status, stderr = signal_after_line(cmd, "compiling the train step", signal.SIGINT, environ)  # a cold cache
    # Interrupting XLA's compiler used to print "interrupted" and then crash (a segmentation fault).
    assert status == 128 + signal.SIGINT, stderr[-2000:]
    assert stderr.splitlines() == ["ushard: stopped by SIGINT before step 7 (nothing new to save: the state was just "
                                   "restored from the checkpoint at step 6; run the same command to resume)."]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["6"]
    resumed = subprocess.run(cmd, env=environ, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed from the checkpoint at step 6" in resumed.stdout
    assert losses_by_step(tmp_path) == {s: reference[s] for s in range(7, 13)}


# ----------------------------------------------------------------------------- repeated SIGKILLs


class Watched:
    """A run whose stdout is read line by line in the background, so that it can be killed at a moment."""

    def __init__(self, cmd, environ):
        self.proc = subprocess.Popen(cmd, env=environ, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self.lines = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line)

    def last_step(self) -> int:
        steps = [int(line.split()[1]) for line in list(self.lines) if line.startswith("step ")]
        return max(steps, default=0)


def saving(checkpoints, step: int) -> bool:
    """Whether the save of `step` is under way: orbax writes it into a temporary directory first."""
    temporary = f"{step}.orbax-checkpoint-tmp"
    return checkpoints.is_dir() and any(p.name.startswith(temporary) for p in checkpoints.iterdir())


@pytest.mark.slow  # seven runs: about 100 s on two busy cores
def test_repeated_random_sigkills_lose_nothing(tmp_path):
    environ = {**cached_env(tmp_path / "jax-cache"), "PYTHONUNBUFFERED": "1"}  # the reference run compiles
    settings = ("--config.train.steps=40", "--config.checkpoint.every=5")
    subprocess.run(train_cmd(tmp_path / "reference", *settings), env=environ, check=True, capture_output=True)
    reference = losses_by_step(tmp_path / "reference")
    workdir, rng = tmp_path / "killed", random.Random(9)
    cmd, checkpoints = train_cmd(workdir, *settings), workdir / "checkpoints"
    during_saves = set(rng.sample(range(5), 3))
    kills_in_saves = 0
    for i in range(5):
        # Kill i lands in steps 5i+1 .. 5i+5: during the save of step 5i+5, or after a random step.
        # Each kill is past the checkpoint the run resumed from, so every rerun makes progress.
        save_step, at_step = 5 * i + 5, 5 * i + rng.randint(1, 5)
        run = Watched(cmd, environ)
        deadline = time.time() + 120
        while True:
            assert run.proc.poll() is None and time.time() < deadline, f"run {i} ended before it was killed"
            if i in during_saves and saving(checkpoints, save_step):
                kills_in_saves += 1
                break
            if run.last_step() >= (save_step + 1 if i in during_saves else at_step):  # a save missed goes on
                break
            time.sleep(0.002)
        run.proc.send_signal(signal.SIGKILL)
        run.proc.wait()
    assert kills_in_saves >= 1
    finished = subprocess.run(cmd, env=environ, capture_output=True, text=True)
    assert finished.returncode == 0, finished.stderr[-2000:]
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 41))  # each step exactly once
    assert {r["step"]: r["loss"] for r in records} == reference  # bitwise
# ----------------------------------------------------------------------------- damaged checkpoints, failed saves


@contextlib.contextmanager
def time_limit(seconds: int):
    """Fails a test that hangs instead of blocking the suite (the waits that hung were Python waits)."""
    def expire(signum, frame):
        raise TimeoutError(f"still running after {seconds} s: a hang")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def join_once_started(thread: threading.Thread, timeout: float) -> None:
    """Joins `thread`; one that was enumerated between its start() and its first instruction (a pool
    worker the failed save's background work was still starting) cannot be joined yet, so wait."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
            return
        except RuntimeError:  # "cannot join thread before it is started"
            if time.monotonic() > deadline:
                return
            time.sleep(0.01)


def run_in_process(workdir, *extra) -> tuple[int, str, str]:
    """`ushard train` with the 12-step command of `finished_run`, in this process (so a fault can be
    injected and no interpreter start or import is paid): (exit status, stdout, stderr). Also asserts
    that no thread the run started is left running: one would block the interpreter's exit."""
    from ushard.cli import main

    before = set(threading.enumerate())
    out, err = io.StringIO(), io.StringIO()
    with time_limit(180), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(train_cmd(workdir, "--config.train.steps=12", *extra)[3:])
    for thread in set(threading.enumerate()) - before:
        if not thread.daemon:
            join_once_started(thread, timeout=10)
            assert not thread.is_alive(), f"thread {thread.name} still runs: exiting would wait for it"
    return status, out.getvalue(), err.getvalue()


def warnings_in(text: str) -> list[str]:
    return [line for line in text.splitlines() if "warning" in line or "Traceback" in line or "Error" in line]


def _array_file(step_dir):
    return max((p for p in (step_dir / "state").rglob("*") if p.is_file() and p.parent.name == "d"),
               key=lambda p: p.stat().st_size)


def _garble(path):
    path.write_bytes(random.Random(0).randbytes(path.stat().st_size))


# name: (damage done to checkpoints/<step>, which orbax still lists; how the one-line warning's reason starts)
DAMAGE = {
    "array file garbled": (lambda d: _garble(_array_file(d)), "Exception: Encountered error while reading array"),
    "state/_METADATA deleted": (lambda d: (d / "state" / "_METADATA").unlink(),
                                "the metadata of its state cannot be read"),
    "manifest.ocdbt emptied": (lambda d: (d / "state" / "manifest.ocdbt").write_bytes(b""), "ValueError: DATA_LOSS"),
    "data/metadata emptied": (lambda d: (d / "data" / "metadata").write_bytes(b""), "JSONDecodeError"),
    "data/metadata is {}": (lambda d: (d / "data" / "metadata").write_text("{}"),
                            "its data state {} holds no position"),
    "config/metadata emptied": (lambda d: (d / "config" / "metadata").write_bytes(b""), "JSONDecodeError"),
    "an empty directory": (lambda d: (shutil.rmtree(d), d.mkdir()), "KeyError"),
}


# Three kinds of damage by default (an array, the state's metadata, the whole directory), the rest in the
# slow tier for the suite's time: each reads the same path through the restore's failure.
SLOW_DAMAGE = ("manifest.ocdbt emptied", "data/metadata emptied", "data/metadata is {}", "config/metadata emptied")


@pytest.mark.parametrize("damage", [pytest.param(d, marks=pytest.mark.slow) if d in SLOW_DAMAGE else d
                                    for d in DAMAGE])
def test_a_damaged_checkpoint_is_moved_aside_and_the_rerun_finishes_bitwise(tmp_path, finished_run, uninterrupted,
                                                                             damage):
    shutil.copytree(finished_run, tmp_path, dirs_exist_ok=True)
    damage_fn, reason = DAMAGE[damage]
    damage_fn(tmp_path / "checkpoints" / "12")
    status, out, err = run_in_process(tmp_path)  # the same command again: resumes at 9, saves step 12 anew
    assert status == 0, err[-2000:]
    [warning] = warnings_in(out + err)  # one line, however long orbax's message
    moved = list((tmp_path / "checkpoints-damaged").iterdir())
    assert [p.name.split("-")[0] for p in moved] == ["12"]
    assert warning.startswith(f"ushard: warning: checkpoint 12 is damaged ({reason}")
    assert warning.endswith(f"; moved it to {moved[0]} and trying an older one.") and len(warning) < 400
    assert "resumed from the checkpoint at step 9" in out
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["12", "6", "9"]
    assert losses_by_step(tmp_path) == uninterrupted  # bitwise, every step


def test_when_no_checkpoint_can_be_read_the_run_stops_unless_told_to_start_over(tmp_path, finished_run):
    """Every checkpoint damaged: nothing is moved and no history is dropped until checkpoint.restart=true."""
    shutil.copytree(finished_run, tmp_path, dirs_exist_ok=True)
    for step in ("6", "9", "12"):
        _garble(_array_file(tmp_path / "checkpoints" / step))
    history = (tmp_path / "metrics.jsonl").read_text()
    status, out, err = run_in_process(tmp_path)
    assert status == 2
    [line] = err.strip().splitlines()
    assert line.startswith(f"ushard: error: none of the 3 checkpoints in {tmp_path / 'checkpoints'} can be read (the "
                           f"newest, step 12: Exception: Encountered error while reading array")
    assert line.endswith(f"nothing was moved. Set --config.checkpoint.restart=true to move them to "
                         f"{tmp_path / 'checkpoints-damaged'} and start over from step 0.")
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["12", "6", "9"]
    assert not (tmp_path / "checkpoints-damaged").exists()
    assert (tmp_path / "metrics.jsonl").read_text() == history
    status, out, err = run_in_process(tmp_path, "--config.checkpoint.restart=true")
    assert status == 0, err[-2000:]
    assert f"starting over from step 0 (checkpoint.restart=true): no checkpoint in {tmp_path / 'checkpoints'}" in out
    assert sorted(p.name.split("-")[0] for p in (tmp_path / "checkpoints-damaged").iterdir()) == ["12", "6", "9"]


def test_a_checkpoint_the_system_will_not_let_us_read_is_not_called_damaged(tmp_path, finished_run, monkeypatch):
    """Permission denied (as TensorStore reports it): one sentence with the OS error, nothing moved."""
    import orbax.checkpoint as ocp

    shutil.copytree(finished_run, tmp_path, dirs_exist_ok=True)

    def denied(self, step, *args, **kwargs):
        # As orbax raises it reading an array of a shard file the OS refuses (seen with a directory of
        # mode 000): its own exception, from TensorStore's, which carries the OS error.
        try:
            raise ValueError(f'PERMISSION_DENIED: Error reading "params.embedding/0.0": Failed to open: '
                             f'"{tmp_path}/checkpoints/{step}/state/ocdbt.process_0/d/33ff": Permission denied '
                             f"[os_error_code='13']")
        except ValueError as e:
            raise Exception("Encountered error while reading array index: (slice(0, 512, 1),). See full "
                            "TensorStore details: <bound method ...>.") from e

    with monkeypatch.context() as patch:
        patch.setattr(ocp.CheckpointManager, "restore", denied)
        status, out, err = run_in_process(tmp_path)
    assert status == 2
    assert err.strip() == (f"ushard: error: checkpoint 12 in {tmp_path / 'checkpoints'} cannot be read ([Errno 13] "
                           f"Permission denied: {tmp_path}/checkpoints/12/state/ocdbt.process_0/d/33ff); nothing "
                           f"was moved: fix the access (permissions, the mount, the disk), then run the same command "
                           f"again.")
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["12", "6", "9"]
    assert not (tmp_path / "checkpoints-damaged").exists()


def test_every_damaged_step_after_the_restored_one_is_moved(tmp_path, finished_run):
    shutil.copytree(finished_run, tmp_path, dirs_exist_ok=True)
    (tmp_path / "checkpoints" / "12" / "data" / "metadata").write_text("[]")
    shutil.rmtree(tmp_path / "checkpoints" / "9")
    (tmp_path / "checkpoints" / "9").mkdir()
    config = ushard.load_config("tiny", [*RUN, "--config.train.steps=12"])
    trainer, lines = Trainer(config, str(tmp_path)), []
    _, data_state = trainer.initial_state(log=lines.append)  # restoring is all it takes: no compilation
    trainer.checkpoints.close()
    assert [line.split(" is damaged")[0] for line in lines[:2]] == [
        "ushard: warning: checkpoint 12", "ushard: warning: checkpoint 9"]
    assert lines[2:] == ["resumed from the checkpoint at step 6"]
    assert data_state["position"] == 6 * 8 * 33  # 6 steps of 8 rows of 33 tokens
    assert sorted(p.name.split("-")[0] for p in (tmp_path / "checkpoints-damaged").iterdir()) == ["12", "9"]
    # Neither is listed any more, so saving steps 9 and 12 again cannot collide with them.
    assert trainer.checkpoints.manager.all_steps() == [6] and os.listdir(tmp_path / "checkpoints") == ["6"]


def test_load_model_skips_a_damaged_checkpoint_without_moving_it(tmp_path, finished_run):
    shutil.copytree(finished_run / "checkpoints", tmp_path / "checkpoints")
    (tmp_path / "checkpoints" / "12" / "state" / "manifest.ocdbt").write_bytes(b"")
    lines = []
    model = ushard.load_model(str(tmp_path), log=lines.append)
    assert model.step == 9
    [line] = lines
    assert line.startswith("ushard: warning: checkpoint 12 is damaged (ValueError: DATA_LOSS")
    assert line.endswith("; trying an older one.") and len(line) < 300
    # A reader holds no lock on the workdir: a training run may own it, so nothing is moved.
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["12", "6", "9"]
    assert not (tmp_path / "checkpoints-damaged").exists()


class _FullDisk:
    """A write of a checkpoint's arrays failing as TensorStore's fails on a full disk."""

    def __init__(self, path):
        self.path = path

    def result(self, timeout=None):
        raise ValueError(f'RESOURCE_EXHAUSTED: Error writing "params.embedding/0.0" in OCDBT database at local file '
                         f'"{self.path}": Failed to write 674767 bytes to file 9: No space left on device '
                         f"[os_error_code='28']")

    def cancel(self):
        pass


def _step_of(path, checkpoints) -> int | None:
    """The step a path under DIR/checkpoints belongs to (`9.orbax-checkpoint-tmp/state` -> 9)."""
    relative = os.path.relpath(path, checkpoints)
    head = relative.split(os.sep)[0].split(".")[0]
    return int(head) if not relative.startswith("..") and head.isdigit() else None


def full_disk_from(monkeypatch, checkpoints, step):
    """The array writes of every save from `step` on fail in the background, as on a full disk."""
    import orbax.checkpoint as ocp

    write = ocp.PyTreeCheckpointHandler.async_save

    async def async_save(self, directory, *args, **kwargs):
        commits = await write(self, directory, *args, **kwargs)
        if (_step_of(directory, checkpoints) or 0) >= step:
            return [_FullDisk(directory), *(commits or [])]
        return commits

    monkeypatch.setattr(ocp.PyTreeCheckpointHandler, "async_save", async_save)


def read_only_from(monkeypatch, checkpoints, step):
    """Creating the directory of any save from `step` on fails, as in a read-only directory (root ignores
    permission bits, so chmod cannot make one)."""
    mkdir = os.mkdir

    def read_only_mkdir(path, *args, **kwargs):
        if (_step_of(os.fspath(path), checkpoints) or 0) >= step:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fspath(path))
        return mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", read_only_mkdir)


def stop_by_fault(workdir, monkeypatch, fault, *extra) -> str:
    """Runs the 12-step command with `fault` from step 6 on; checks that it stopped before step 9 with
    one sentence and exit status 2, leaving checkpoint 3 complete; returns the sentence."""
    checkpoints = workdir / "checkpoints"
    with monkeypatch.context() as patch:
        fault(patch, str(checkpoints), step=6)
        status, out, err = run_in_process(workdir, *extra)
    assert status == 2
    assert warnings_in(out) == [] and len(err.splitlines()) == 1, err[-3000:]
    logged = max(losses_by_step(workdir))
    assert 6 <= logged < 9, logged  # stopped before the next save, which is where it used to be noticed
    assert sorted(p.name for p in checkpoints.iterdir() if p.name.isdigit()) == ["3"]
    return err.strip()


def sentence(workdir, cause) -> str:
    return (f"ushard: error: saving the checkpoint of step 6 to {workdir / 'checkpoints' / '6'} failed ({cause}); "
            f"training stopped and the newest complete checkpoint is step 3: fix the cause, then run the same "
            f"command to resume.")


@pytest.mark.parametrize("fault, cause", [
    (full_disk_from, "[Errno 28] No space left on device"),  # found in the background, after the save returned
    (read_only_from, "[Errno 30] Read-only file system"),  # found by the save itself
])
def test_a_failed_save_stops_the_run_and_the_rerun_resumes_bitwise(tmp_path, monkeypatch, uninterrupted, fault, cause):
    assert stop_by_fault(tmp_path, monkeypatch, fault) == sentence(tmp_path, cause)
    status, out, err = run_in_process(tmp_path)  # the cause fixed
    assert status == 0, err[-2000:]
    assert "resumed from the checkpoint at step 3" in out
    assert losses_by_step(tmp_path) == uninterrupted
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["12", "6", "9"]


def test_a_failed_synchronous_save_stops_the_run_the_same_way(tmp_path, monkeypatch):
    stopped = stop_by_fault(tmp_path, monkeypatch, full_disk_from, "--config.checkpoint.async_save=false")
    assert stopped == sentence(tmp_path, "[Errno 28] No space left on device")


def test_a_disk_that_fills_while_metrics_are_written_stops_with_a_sentence(tmp_path, monkeypatch, uninterrupted):
    """metrics.jsonl cannot take step 4's record (ENOSPC) while the save of step 3 may still be in flight:
    one sentence, exit status 2, the checkpoint of step 3 finished and closed; the rerun resumes bitwise."""
    from ushard.metrics import MetricsWriter

    opened = MetricsWriter._open

    def open_on_a_full_disk(self, resume_step):
        opened(self, resume_step)
        self._jsonl = MetricsOnAFullDisk(self._jsonl, step=4)

    with monkeypatch.context() as patch:
        patch.setattr(MetricsWriter, "_open", open_on_a_full_disk)
        status, out, err = run_in_process(tmp_path)
    assert status == 2
    assert warnings_in(out) == [] and err.strip() == (
        f"ushard: error: could not write the metrics of step 4 to {tmp_path / 'metrics.jsonl'} (No space left on "
        f"device); the run stopped there. Make room (or fix the directory) and run the same command to resume from "
        f"the last checkpoint.")
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()) == ["3"]
    status, out, err = run_in_process(tmp_path)  # room made
    assert status == 0, err[-2000:]
    assert "resumed from the checkpoint at step 3" in out
    assert losses_by_step(tmp_path) == uninterrupted


# ----------------------------------------------------------------------------- resharding, in process


def quiet(*_):
    pass


def ckpt_config(config_name="tiny", **overrides):
    settings = {"train.steps": 6, "checkpoint.every": 3, "train.log_every": 1, "parallel.zero_stage": 3}
    settings.update(overrides)
    return small_config(config_name, **settings)


@pytest.fixture(scope="module")
def zero3_run(tmp_path_factory, stdlib_batches):
    """A ZeRO-3 run over fsdp=8 with checkpoints at steps 3 and 6."""
    workdir = tmp_path_factory.mktemp("zero3")
    records = Trainer(ckpt_config(**{"mesh.fsdp": 8}), str(workdir), batches=stdlib_batches).run(log=quiet)
    return workdir, {r["step"]: r["loss"] for r in records}


# The layers in two stages of the 1F1B pipeline, each stage's layer ZeRO-3 sharded over fsdp=4.
PIPELINED = {"mesh.pipeline": 2, "mesh.fsdp": 4, "parallel.pipeline_schedule": "1f1b",
             "parallel.pipeline_microbatches": 4}


@pytest.fixture(scope="module")
def pipelined_run(tmp_path_factory, stdlib_batches):
    """zero3_run's training, pipelined, with checkpoints at steps 3 and 6."""
    workdir = tmp_path_factory.mktemp("pipelined")
    records = Trainer(ckpt_config(**PIPELINED), str(workdir), batches=stdlib_batches).run(log=quiet)
    return workdir, {r["step"]: r["loss"] for r in records}


# Stages with the sequence split inside them (ring attention) and tensor parallelism beside it.
PIPELINED_SEQUENCE = {"mesh.pipeline": 2, "mesh.sequence": 2, "mesh.tensor": 2, "mesh.fsdp": 1,
                      "parallel.pipeline_schedule": "1f1b", "parallel.pipeline_microbatches": 4}


@pytest.mark.parametrize("layout,devices", [
    ({"mesh.data": 2, "mesh.fsdp": 4, "parallel.zero_stage": 1}, 8),
    ({"mesh.fsdp": 4}, 4),
    pytest.param(PIPELINED, 8, marks=pytest.mark.slow),  # the suite's time: the next row pipelines too
    (PIPELINED_SEQUENCE, 8),
])
def test_resume_on_another_mesh_and_device_count(tmp_path, zero3_run, stdlib_batches, layout, devices):
    resume_from_step_3_and_compare(zero3_run, ckpt_config(**layout), tmp_path, stdlib_batches, devices)


def test_a_pipelined_run_resumes_without_a_pipeline(tmp_path, pipelined_run, zero3_run, stdlib_batches):
    _, pipelined = pipelined_run
    _, reference = zero3_run
    np.testing.assert_allclose([pipelined[s] for s in range(1, 7)], [reference[s] for s in range(1, 7)], rtol=1e-5)
    resume_from_step_3_and_compare(pipelined_run, ckpt_config(**{"mesh.fsdp": 8}), tmp_path, stdlib_batches)


def resume_from_step_3_and_compare(saved_run, config, tmp_path, batches, devices=8):
    """Resumes `config` from the saved run's checkpoint at step 3: steps 4-6 log what the saved run logged."""
    saved_dir, reference = saved_run
    shutil.copytree(saved_dir / "checkpoints" / "3", tmp_path / "checkpoints" / "3")
    lines = []
    trainer = Trainer(config, str(tmp_path), devices=jax.devices()[:devices], batches=batches)
    records = trainer.run(log=lines.append)
    assert "resumed from the checkpoint at step 3" in lines
    resumed = {r["step"]: r for r in records}
    assert sorted(resumed) == [4, 5, 6]
    for step in (4, 5, 6):
        want = reference[step] if isinstance(reference[step], dict) else {"loss": reference[step]}
        np.testing.assert_allclose([resumed[step][k] for k in want], list(want.values()), rtol=1e-5)


@pytest.fixture(scope="module")
def expert8_run(tmp_path_factory, stdlib_batches):
    """An MoE run with the experts split over 8 devices (loss-free balancing on), checkpoints at 3 and 6."""
    workdir = tmp_path_factory.mktemp("expert8")
    config = ckpt_config("tiny_moe", **SMALL_MOE, **{"mesh.expert": 8, "mesh.fsdp": 1})
    records = Trainer(config, str(workdir), batches=stdlib_batches).run(log=quiet)
    return workdir, {r["step"]: {k: v for k, v in r.items() if k == "loss" or k.startswith("aux/")} for r in records}


def test_moe_resumes_across_expert_layouts(tmp_path, expert8_run, stdlib_batches):
    """Saved with the experts over 8 devices, resumed with them over 2 (and fsdp=4): the same losses,
    auxiliary terms and expert loads (so the routing biases were restored too)."""
    config = ckpt_config("tiny_moe", **SMALL_MOE, **{"mesh.expert": 2, "mesh.fsdp": 4})
    resume_from_step_3_and_compare(expert8_run, config, tmp_path, stdlib_batches)


def test_moe_resumes_with_the_experts_widths_split_instead(tmp_path, expert8_run, stdlib_batches):
    """Saved with whole experts over 8 devices, resumed with every expert's width split over 4
    (parallel.expert_split="width"): the same losses, auxiliary terms and expert loads."""
    config = ckpt_config("tiny_moe", **SMALL_MOE, **{"mesh.expert": 4, "mesh.fsdp": 2,
                                                     "parallel.expert_split": "width"})
    resume_from_step_3_and_compare(expert8_run, config, tmp_path, stdlib_batches)


# Composed MoE layouts under 1F1B: the experts split inside the pipeline's stages.
MOE_STAGES = {"mesh.pipeline": 2, "mesh.expert": 2, "parallel.pipeline_schedule": "1f1b",
              "parallel.pipeline_microbatches": 4}


@pytest.mark.slow  # the suite's time; test_moe_resumes_across_expert_layouts is in the default tier
def test_moe_resumes_from_one_composed_layout_in_another(tmp_path_factory, stdlib_batches):
    """Saved by pipeline x expert x fsdp, resumed by pipeline x expert x tensor: the same losses,
    auxiliary terms and expert loads at steps 4-6."""
    workdir = tmp_path_factory.mktemp("moe_stages")
    saved = ckpt_config("tiny_moe", **SMALL_MOE, **MOE_STAGES, **{"mesh.fsdp": 2})
    records = Trainer(saved, str(workdir), batches=stdlib_batches).run(log=quiet)
    run = workdir, {r["step"]: {k: v for k, v in r.items() if k == "loss" or k.startswith("aux/")} for r in records}
    resumed = ckpt_config("tiny_moe", **SMALL_MOE, **MOE_STAGES, **{"mesh.tensor": 2, "mesh.fsdp": 1})
    resume_from_step_3_and_compare(run, resumed, tmp_path_factory.mktemp("moe_stages_resumed"), stdlib_batches)


def test_resume_with_another_batch_size_goes_on_at_the_next_token(tmp_path, zero3_run, stdlib_batches):
    saved_dir, _ = zero3_run
    shutil.copytree(saved_dir / "checkpoints", tmp_path / "checkpoints")
    shutil.rmtree(tmp_path / "checkpoints" / "6")
    # Half the batch size, and another remat policy (how the model is computed may change on a resume).
    config = ckpt_config(**{"mesh.fsdp": 8, "train.batch_size": 8, "train.steps": 5, "model.remat": "full"})
    Trainer(config, str(tmp_path), batches=stdlib_batches).run(log=quiet)
    window = config.train.seq_len + 1
    saved = json.loads((tmp_path / "checkpoints" / "5" / "data" / "metadata").read_text())
    assert saved["position"] == 3 * 16 * window + 2 * 8 * window  # three steps of 16 rows, two of 8


def test_resume_with_another_seed_is_refused_unless_restart(tmp_path, zero3_run):
    saved_dir, _ = zero3_run
    shutil.copytree(saved_dir / "checkpoints", tmp_path / "checkpoints")
    config = ckpt_config(**{"mesh.fsdp": 8, "train.seed": 1, "train.steps": 7})
    with pytest.raises(UserError, match=r"made with train\.seed=0 but this run has train\.seed=1.*data\.restart=true"):
        Trainer(config, str(tmp_path)).run(log=quiet)
    config = ckpt_config(**{"mesh.fsdp": 8, "train.seed": 1, "train.steps": 7, "data.restart": True})
    Trainer(config, str(tmp_path)).run(log=quiet)
    saved = json.loads((tmp_path / "checkpoints" / "7" / "data" / "metadata").read_text())
    assert saved["position"] == 16 * (config.train.seq_len + 1) and saved["order"]["seed"] == 1  # a fresh order


@pytest.mark.parametrize("override, match", [
    ({"model.d_model": 128}, r"blocks\.attn\.wk is \(2, 64, 2, 16\) float32 there but \(2, 128, 2, 32\) float32 here.*"
                             r"and 9 more.*model\.d_model=64 there but 128 here"),
    ({"model.fused_mlp": True}, r"blocks\.mlp\.w_gate_up is missing there.*"  # another parameter tree
                                r"model\.fused_mlp=False there but True here"),
    ({"model.param_dtype": "bfloat16"},
     r"blocks\.attn\.wk is \(2, 64, 2, 16\) float32 there but \(2, 64, 2, 16\) bfloat16 here"),
    # Same parameters, another function:
    ({"model.rope_theta": 500000.0}, r"holds another model: model\.rope_theta=10000\.0 there but 500000\.0 here"),
    ({"model.document_mask": False}, r"holds another model: model\.document_mask=True there but False here"),
    ({"model.rope_scaling.type": "llama3"},
     r"holds another model: model\.rope_scaling\.type='none' there but 'llama3' here"),
])
def test_incompatible_checkpoint_names_the_difference(zero3_run, stdlib_batches, override, match):
    saved_dir, _ = zero3_run
    with pytest.raises(UserError, match=match):
        Trainer(ckpt_config(**{"mesh.fsdp": 8, **override}), str(saved_dir), batches=stdlib_batches).run(log=quiet)
    # Not damaged: left where it is, for the run of the right model.
    assert sorted(os.listdir(saved_dir / "checkpoints")) == ["3", "6"]
    assert not (saved_dir / "checkpoints-damaged").exists()


def test_a_saved_config_without_newer_keys_reads_them_as_defaults():
    from ushard.checkpoint import saved_model_config
    from ushard.models.config import ModelConfig

    model = ckpt_config().model
    saved = {"model": {k: v for k, v in model.to_dict().items() if k != "fused_mlp"}}
    assert saved_model_config(saved) == ModelConfig.from_config(model)  # an older checkpoint of the same model


# ----------------------------------------------------------------------------- non-finite policies


class PoisonedBatches:
    """The real batches, except that the batches numbered in `bad` (from 0, at the run's fixed batch size)
    carry an out-of-range token: its embedding is NaN."""

    def __init__(self, batches, bad):
        self._batches, self.bad, self.batch_size = batches, bad, None

    def position(self, batch_number: int) -> int:
        return batch_number * self.batch_size * self._batches.window

    def train_batch(self, state, batch_size, rows=None):
        batch, next_state = self._batches.train_batch(state, batch_size, rows)
        self.batch_size = batch_size
        if state["position"] // self.position(1) in self.bad:
            batch["inputs"] = batch["inputs"].copy()
            batch["inputs"][:, 3] = 10_000
        return batch, next_state

    def __getattr__(self, name):
        return getattr(self._batches, name)


def saved_params_are_finite(workdir, step: int) -> bool:
    """Whether the newest checkpoint in `workdir` is the one of `step` and holds only finite parameters."""
    model = ushard.load_model(str(workdir), log=quiet)
    assert model.step == step
    return all(np.isfinite(x).all() for x in jax.tree.leaves(jax.device_get(model.params)))


def test_nonfinite_skip_counts_and_keeps_the_state(tmp_path, stdlib_batches):
    trainer = Trainer(ckpt_config(**{"mesh.fsdp": 8, "train.on_nonfinite": "skip"}), str(tmp_path),
                      batches=PoisonedBatches(stdlib_batches, bad={3}))
    records = trainer.run(log=quiet)
    by_step = {r["step"]: r for r in records}
    assert not np.isfinite(by_step[4]["loss"])  # step 4 trains on batch 3
    assert by_step[3]["skipped_steps"] == 0 and by_step[4]["skipped_steps"] == 1 and by_step[6]["skipped_steps"] == 1
    assert all(np.isfinite(by_step[s]["loss"]) for s in (5, 6))
    assert saved_params_are_finite(tmp_path, step=6)


def test_nonfinite_rollback_restores_and_moves_past_the_batch(tmp_path, stdlib_batches):
    lines = []
    config = ckpt_config(**{"mesh.fsdp": 8, "train.on_nonfinite": "rollback", "checkpoint.every": 2})
    trainer = Trainer(config, str(tmp_path), batches=PoisonedBatches(stdlib_batches, bad={4}))
    records = trainer.run(log=lines.append)
    assert any("rolled back to step 4, skipping that batch" in line for line in lines), lines
    final = {r["step"]: r for r in records}  # the last record of each step: after the rollback
    assert all(np.isfinite(final[s]["loss"]) for s in range(1, 7))
    poisoned = trainer.batches
    assert trainer.skip_positions == {poisoned.position(4)}
    # Steps 5 and 6 trained on batches 5 and 6; the checkpoint says the next batch is 7.
    saved = json.loads((tmp_path / "checkpoints" / "6" / "data" / "metadata").read_text())
    assert saved["position"] == poisoned.position(7)
    assert saved_params_are_finite(tmp_path, step=6)


def test_nonfinite_stop_says_where(stdlib_batches):
    trainer = Trainer(ckpt_config(**{"mesh.fsdp": 8, "train.on_nonfinite": "stop"}),
                      batches=PoisonedBatches(stdlib_batches, bad={1}))
    with pytest.raises(UserError, match=r"training stopped: step 2 \(the batch at data position 528\) gave loss nan"):
        trainer.run(log=quiet)


FOREVER = range(2, 10**9)  # every batch from batch 2 on: a NaN that does not go away


def single_device_config(**overrides):
    """One device and one layer: the non-finite policies do not depend on the layout."""
    return ckpt_config(**{"mesh.fsdp": 1, "model.n_layers": 1, "train.batch_size": 8, **overrides})


def test_nonfinite_rollback_gives_up_when_the_trouble_stays(tmp_path, stdlib_batches):
    lines = []
    config = single_device_config(**{"train.on_nonfinite": "rollback", "checkpoint.every": 2,
                                     "train.max_nonfinite_steps": 3})
    trainer = Trainer(config, str(tmp_path), devices=jax.devices()[:1],
                      batches=PoisonedBatches(stdlib_batches, FOREVER))
    with pytest.raises(UserError) as excinfo:
        trainer.run(log=lines.append)
    assert str(excinfo.value) == (
        "training stopped: 3 steps in a row gave a non-finite loss or gradient norm (the last, step 3 on the batch "
        "at data position 1,056: loss nan, gradient norm nan), the limit train.max_nonfinite_steps=3 for "
        "train.on_nonfinite='rollback'; lower train.lr or check the data (checkpoints hold only finite states)."
    )
    # Step 3 failed on batches 2 and 3 (each time rolled back to step 2), then on batch 4: the limit.
    assert [line for line in lines if "rolled back" in line] == [
        f"ushard: step 3 (the batch at data position {p}) gave loss nan, gradient norm nan; rolled back to step 2, "
        f"skipping that batch." for p in ("528", "792")  # batches 2 and 3 of 8 rows of 33 tokens
    ]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["2"]


@pytest.fixture(scope="module")
def skipping_trainer(stdlib_batches):
    """A 3-step run with train.on_nonfinite='skip', no workdir, compiled once; tests set its batches and
    limit, and `saved` lists the steps it would have saved."""
    config = single_device_config(**{"train.steps": 3, "train.on_nonfinite": "skip", "checkpoint.every": 0})
    trainer = Trainer(config, devices=jax.devices()[:1], batches=stdlib_batches)
    trainer.saved = []
    trainer._save = lambda state, data_state, step: trainer.saved.append(step)
    return trainer


def run_skipping(trainer, stdlib_batches, bad, limit):
    trainer.batches, trainer.saved[:] = PoisonedBatches(stdlib_batches, bad), []
    trainer.config.train.max_nonfinite_steps = limit
    return trainer.run(log=quiet)


@pytest.mark.parametrize("limit, expected", [
    (5, "training stopped: every step of this run up to step 3 gave a non-finite loss or gradient norm (the last, "
        "on the batch at data position 528: loss nan, gradient norm nan), so it trained nothing; lower train.lr "
        "or check the data."),
    (2, "training stopped: 2 steps in a row gave a non-finite loss or gradient norm (the last, step 2 on the batch "
        "at data position 264: loss nan, gradient norm nan), the limit train.max_nonfinite_steps=2 for "
        "train.on_nonfinite='skip'; lower train.lr or check the data (checkpoints hold only finite states)."),
])
def test_nonfinite_skip_of_every_step_stops_without_saving(skipping_trainer, stdlib_batches, limit, expected):
    with pytest.raises(UserError) as excinfo:
        run_skipping(skipping_trainer, stdlib_batches, bad=range(10**9), limit=limit)
    assert str(excinfo.value) == expected
    assert skipping_trainer.saved == []


def test_nonfinite_within_the_limit_trains_through(skipping_trainer, stdlib_batches):
    records = run_skipping(skipping_trainer, stdlib_batches, bad={0, 1}, limit=3)
    assert [np.isfinite(r["loss"]) for r in records] == [False, False, True]
    assert [r["skipped_steps"] for r in records] == [1, 2, 2]
    assert skipping_trainer.saved == [3]


def test_nonfinite_row_needs_progress_past_the_trouble_to_end():
    from ushard.training.loop import NonfiniteRow

    row = NonfiniteRow(limit=3)
    assert [row.add(s, f) for s, f in [(1, True), (2, False), (1, True), (2, False), (2, True), (3, False)]] == [
        False, False, False, False, False, False]
    assert row.count == 1  # step 2 became finite on another batch: progress, the row started again at 3
    assert [row.add(s, f) for s, f in [(2, True), (3, False), (3, False)]] == [False, False, True]


# ----------------------------------------------------------------------------- several processes


@pytest.mark.slow  # the suite's time; tests/test_placement.py runs two processes
def test_two_processes_of_four_devices_match_one_of_eight(tmp_path, uninterrupted):
    port = free_port()
    procs = [
        subprocess.Popen(
            train_cmd(tmp_path, "--config.train.steps=12", "--coordinator_address", f"127.0.0.1:{port}",
                      "--num_processes", "2", "--process_id", str(i)),
            env=env(devices=4), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for i in range(2)
    ]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs[0][-2000:] + outputs[1][-2000:]
    assert "on 8 cpu device(s), mesh fsdp=8" in outputs[0]
    two = losses_by_step(tmp_path)  # written by process 0 only
    np.testing.assert_allclose([two[s] for s in sorted(two)], [uninterrupted[s] for s in sorted(uninterrupted)],
                               rtol=1e-5)
    assert (tmp_path / "checkpoints" / "12").is_dir()


def test_incomplete_multiprocess_flags_are_refused(capsys):
    from ushard.cli import main

    assert main(["train", "--config", "tiny", "--num_processes", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["ushard: error: a multi-process run needs all of --coordinator_address HOST:PORT, "
                   "--num_processes N and --process_id I."]
