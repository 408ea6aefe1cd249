"""Faults in two-process runs (2 processes x 2 CPU devices, `tiny`), as a cluster meets them: a
preemption notice reaching one host or both seconds apart, a process killed, a save that fails on
one process, a full disk under the metrics. Every process must exit within a bound, with one sentence,
and the same command must resume bitwise (ushard/training/processes.py).

Each run goes through `ushard train` in its own processes; a hang fails its test (every wait has a
timeout, after which every process is killed).
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import free_port

TIMEOUT_S = 10  # train.process_timeout_s in these runs
STEPS = 100
# A small run that logs every 5 steps (the steps where the processes agree), checkpoints every 50,
# and waits 40 ms a step, so that a signal sent seconds after another still finds it running.
RUN = [
    "--config.model.n_layers=1", "--config.train.seq_len=32", "--config.train.batch_size=8",
    "--config.train.log_every=5", "--config.train.eval_every=0", "--config.checkpoint.every=50",
    f"--config.train.steps={STEPS}", f"--config.train.process_timeout_s={TIMEOUT_S}",
]
SLOW_STEPS = """
import os, sys, time
import ushard.training.loop as loop
from ushard.cli import main

batch = loop.Trainer.global_batch

def slow_batch(self, data_state):
    time.sleep(0.04)
    return batch(self, data_state)

loop.Trainer.global_batch = slow_batch
if os.environ.get("FILE_SIZE_LIMIT"):  # what `prlimit --fsize` does: a larger write fails (EFBIG)
    import resource
    limit = int(os.environ["FILE_SIZE_LIMIT"])
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
full_at = int(os.environ.get("METRICS_DISK_FULL_AT_STEP", "0"))
if full_at:  # metrics.jsonl on a disk that fills at that step
    import errno, json
    import ushard.metrics as metrics

    class FullDisk:
        def __init__(self, file):
            self.file = file
        def write(self, text):
            if json.loads(text)["step"] >= full_at:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return self.file.write(text)
        def close(self):
            self.file.close()

    open_files = metrics.MetricsWriter._open
    def open_on_a_full_disk(self, resume_step):
        open_files(self, resume_step)
        self._jsonl = FullDisk(self._jsonl)
    metrics.MetricsWriter._open = open_on_a_full_disk
if os.environ.get("CHECKPOINTS_UNREADABLE"):  # the file system refuses to open them, as TensorStore says it
    import orbax.checkpoint as ocp

    def denied(self, step, *args, **kwargs):
        raise ValueError(f"PERMISSION_DENIED: Error opening file: Permission denied [os_error_code='13']")
    ocp.CheckpointManager.restore = denied
sys.exit(main(sys.argv[1:]))
"""


def start(workdir, *extra, environ=(None, None)) -> list[subprocess.Popen]:
    """Both processes of a run in `workdir`; `environ[i]`: more environment for process i."""
    port = free_port()
    procs = []
    for i in range(2):
        cmd = [sys.executable, "-c", SLOW_STEPS, "train", "--config", "tiny", "--workdir", str(workdir), *RUN, *extra,
               "--coordinator_address", f"127.0.0.1:{port}", "--num_processes", "2", "--process_id", str(i)]
        env = {**os.environ, "JAX_NUM_CPU_DEVICES": "2", "PYTHONUNBUFFERED": "1", **(environ[i] or {})}
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    return procs


def finish(procs, bound_s: float) -> list[tuple[int, str, str]]:
    """(exit status, stdout, stderr) of each process; fails, after killing them all, unless every one
    exits within `bound_s` seconds from now."""
    deadline = time.monotonic() + bound_s
    results = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            outputs = [q.communicate() for q in procs]
            pytest.fail(f"a process did not exit within {bound_s} s; stderr tails: "
                        + " /// ".join(e[-1500:] for _, e in outputs))
        results.append((p.returncode, out, err))
    return results


def losses(workdir) -> dict[int, float]:
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines() if line]
    return {r["step"]: r["loss"] for r in records}


def wait_for_step(workdir, step: int, procs, timeout=120) -> None:
    deadline = time.monotonic() + timeout
    path = workdir / "metrics.jsonl"
    while time.monotonic() < deadline:
        if path.exists() and any(json.loads(line)["step"] >= step for line in path.read_text().splitlines() if line):
            return
        assert all(p.poll() is None for p in procs), "the run ended before the fault"
        time.sleep(0.05)
    raise TimeoutError(step)


def last_line(stderr: str) -> str:
    return stderr.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """The workdir of an uninterrupted two-process run of STEPS steps (checkpoints 50 and 100)."""
    workdir = tmp_path_factory.mktemp("two_processes")
    results = finish(start(workdir), bound_s=300)
    assert [r[0] for r in results] == [0, 0], results[0][2][-2000:] + results[1][2][-2000:]
    return workdir


@pytest.fixture(scope="module")
def uninterrupted(finished_run):
    return losses(finished_run)


def resume_matches(workdir, uninterrupted, checkpointed: bool = True) -> None:
    """The same command resumes (from a checkpoint, if one was `checkpointed`), and the run's losses
    are those of the uninterrupted run."""
    results = finish(start(workdir), bound_s=300)
    assert [r[0] for r in results] == [0, 0], results[0][2][-2000:]
    assert ("resumed from the checkpoint at step" in results[0][1]) == checkpointed
    assert losses(workdir) == uninterrupted


# Both cases in the slow tier (`-m slow`), as the rest of this file, for the default suite's time
# (two processes trained twice: over a minute and a half on two cores). tests/test_fault_tolerance.py
# has the one-process signals, tests/test_placement.py two processes training.
@pytest.mark.slow
@pytest.mark.parametrize("apart_s", [None, 3.0], ids=["one_process", "both_3s_apart"])
def test_sigterm_stops_both_processes_at_one_step_with_a_checkpoint(tmp_path, uninterrupted, apart_s):
    procs = start(tmp_path)
    wait_for_step(tmp_path, 3, procs)
    procs[1].send_signal(signal.SIGTERM)  # a preemption notice that reaches one host
    if apart_s:
        time.sleep(apart_s)
        procs[0].send_signal(signal.SIGTERM)
    results = finish(procs, bound_s=60)
    assert [r[0] for r in results] == [128 + signal.SIGTERM] * 2, results[0][2][-2000:] + results[1][2][-2000:]
    steps = {int(last_line(err).split("stopped by SIGTERM at step ")[1].split()[0]) for _, _, err in results}
    assert len(steps) == 1, steps  # the same step on both
    step = steps.pop()
    assert step < STEPS and (tmp_path / "checkpoints" / str(step)).is_dir()
    resume_matches(tmp_path, uninterrupted)


@pytest.mark.slow  # the suite's time
def test_a_killed_process_stops_the_other_with_a_sentence_naming_it(tmp_path, uninterrupted):
    procs = start(tmp_path)
    wait_for_step(tmp_path, 55, procs)  # past the checkpoint at step 50
    procs[1].kill()
    results = finish(procs, bound_s=TIMEOUT_S + 30)
    status, _, err = results[0]
    assert status == 2, err[-2000:]
    assert last_line(err).startswith("ushard: error: process 1 of 2 was lost (no heartbeat for 10 s); process 0 "
                                     "stopped too."), err[-2000:]
    assert "Traceback" not in err
    resume_matches(tmp_path, uninterrupted)


@pytest.mark.slow  # the suite's time
def test_a_save_that_fails_on_one_process_stops_both_with_its_cause(tmp_path, uninterrupted):
    procs = start(tmp_path, environ=(None, {"FILE_SIZE_LIMIT": "2000"}))  # process 1's files: 2 kB at most
    results = finish(procs, bound_s=120 + TIMEOUT_S + 30)
    errors = [last_line(err) for _, _, err in results]
    assert [r[0] for r in results] == [2, 2], results[0][2][-2000:] + results[1][2][-2000:]
    saving = f"saving the checkpoint of step 50 to {tmp_path / 'checkpoints' / '50'} failed ([Errno 27] File too large)"
    assert errors[1].startswith(f"ushard: error: {saving}"), errors[1]
    assert errors[0].startswith("ushard: error: process 1 of 2 stopped the run at step "), errors[0]
    assert saving in errors[0], errors[0]
    assert not (tmp_path / "checkpoints" / "50").is_dir()
    resume_matches(tmp_path, uninterrupted, checkpointed=False)


@pytest.mark.slow  # the suite's time; tests/test_fault_tolerance.py has the one-process case
def test_a_full_disk_under_the_metrics_stops_both_processes(tmp_path, uninterrupted):
    procs = start(tmp_path, environ=({"METRICS_DISK_FULL_AT_STEP": "60"}, None))
    results = finish(procs, bound_s=120)
    assert [r[0] for r in results] == [2, 2], results[0][2][-2000:] + results[1][2][-2000:]
    said = f"could not write the metrics of step 60 to {tmp_path / 'metrics.jsonl'} (No space left on device)"
    assert last_line(results[0][2]) .startswith(f"ushard: error: {said}")
    assert last_line(results[1][2]).startswith("ushard: error: process 0 of 2 stopped the run at step 60: " + said)
    assert max(losses(tmp_path)) == 55  # the last step logged before it
    resume_matches(tmp_path, uninterrupted)


@pytest.mark.slow  # the suite's time; tests/test_fault_tolerance.py has the one-process cases
@pytest.mark.parametrize("fault", ["damaged", "unreadable"])
def test_checkpoints_that_cannot_be_restored_stop_both_processes_and_move_nothing(tmp_path, finished_run, fault):
    from test_fault_tolerance import _array_file, _garble

    shutil.copytree(finished_run, tmp_path, dirs_exist_ok=True)
    history = (tmp_path / "metrics.jsonl").read_text()
    unreadable = {"CHECKPOINTS_UNREADABLE": "1"}
    if fault == "damaged":
        for step in ("50", "100"):
            _garble(_array_file(tmp_path / "checkpoints" / step))
    results = finish(start(tmp_path, environ=(None, None) if fault == "damaged" else (unreadable, unreadable)), 120)
    assert [r[0] for r in results] == [2, 2], results[0][2][-2000:] + results[1][2][-2000:]
    said = {"damaged": f"ushard: error: none of the 2 checkpoints in {tmp_path / 'checkpoints'} can be read",
            "unreadable": f"ushard: error: checkpoint 100 in {tmp_path / 'checkpoints'} cannot be read ([Errno 13] "
                          "Permission denied); nothing was moved"}[fault]
    assert all(last_line(err).startswith(said) for _, _, err in results), [last_line(e) for _, _, e in results]
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["100", "50"]
    assert not (tmp_path / "checkpoints-damaged").exists()
    assert (tmp_path / "metrics.jsonl").read_text() == history


class _Client:
    """The coordination service's key-value store, as `processes.agree` uses it."""

    def __init__(self, values=None):
        self.values = dict(values or {})

    def key_value_set(self, key, value, allow_overwrite=False):
        self.values[key] = value

    def blocking_key_value_get(self, key, timeout_in_ms):
        return self.values[key]


@pytest.mark.parametrize("me, verdicts, settled, expected", [
    # Process 0's save only waited at a barrier, process 1 has not heard of its own failure yet: hold it.
    (0, [[0, 0, 1], [0, 0, 0]], False, "not yet"),
    (1, [[0, 0, 1], [0, 0, 0]], False, None),
    # Every save has ended (settled): a wait is final, and the one that waited reports it.
    (0, [[0, 0, 1], [0, 0, 0]], True, "own"),
    (1, [[0, 0, 1], [0, 0, 0]], True, "process 0 of 2 stopped the run at step 7: theirs"),
    # Process 1 failed for a cause of its own: both report it.
    (0, [[0, 0, 1], [0, 1, 1]], False, "process 1 of 2 stopped the run at step 7: theirs"),
    (1, [[0, 0, 1], [0, 1, 1]], False, "own"),
    # A signal that reached process 1 only stops both.
    (0, [[0, 0, 0], [15, 0, 0]], False, 15),
])
def test_the_processes_report_the_failure_that_caused_the_others(monkeypatch, me, verdicts, settled, expected):
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    from ushard.errors import UserError
    from ushard.training import processes

    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(jax, "process_index", lambda: me)
    monkeypatch.setattr(multihost_utils, "process_allgather", lambda x: np.array(verdicts, np.int32))
    other = 1 - me
    monkeypatch.setattr(processes, "_client", lambda: _Client({f"ushard/failure/{other}/7": "theirs"}))
    own_row = verdicts[me]
    failure = None
    if own_row[2]:
        failure = UserError("own")
        failure.waited_only = not own_row[1]
    if expected == "not yet":
        with pytest.raises(processes.NotYet) as held:
            processes.agree(7, None, failure, 1.0, settled)
        assert held.value.failure is failure
    elif isinstance(expected, str):
        with pytest.raises(UserError, match=f"^{expected}$"):
            processes.agree(7, None, failure, 1.0, settled)
    else:
        assert processes.agree(7, None, failure, 1.0, settled) == expected


def test_processes_started_with_other_configs_or_code_are_refused_naming_what_differs(monkeypatch):
    """`check_same_run` as two processes would see it: a stand-in for process_allgather puts what the
    other process gathers (recorded from its own config and code) beside this one's."""
    import numpy as np

    from ushard.config import load_config
    from ushard.errors import UserError
    from ushard.training import processes

    def gathered_by(config) -> list:
        calls = []
        processes.check_same_run(config, gather=lambda local: calls.append(local) or np.stack([local, local]))
        return calls

    def beside(other: list):
        return lambda local: np.stack([local, other.pop(0)])

    mine = load_config("tiny", ["train.steps=20"])
    processes.check_same_run(mine, gather=beside(gathered_by(load_config("tiny", ["train.steps=20"]))))
    with pytest.raises(UserError, match=r"^the processes were started with different configs \(train\.lr, "
                                        r"train\.steps differ\); start every process with the same --config"):
        processes.check_same_run(mine, gather=beside(gathered_by(load_config("tiny", ["train.steps=24",
                                                                                     "train.lr=1e-3"]))))
    with monkeypatch.context() as patch:
        patch.setattr(processes, "_code_fingerprint", lambda: "another checkout")
        other_code = gathered_by(mine)
    with pytest.raises(UserError, match=r"^process 1 runs other ushard code than process 0"):
        processes.check_same_run(mine, gather=beside(other_code))


# Long intervals: nothing logged or saved for 300 steps (issue 47's hang: the host loops ran some 260
# steps ahead of the devices and stopped for good). Both in the slow tier: 600 steps twice.
LONG = ["--config.train.log_every=300", "--config.checkpoint.every=300", "--config.train.steps=600"]


@pytest.mark.slow
def test_long_log_and_save_intervals_finish_with_the_losses_of_short_ones(tmp_path):
    """600 steps logged and saved every 300 finish, with the losses of the same two processes logging
    every 100 (bitwise: the intervals change no number), and of one process of the same four devices
    to 1e-2: float32's other summation order (Gloo's reductions) compounds over 300 steps (measured:
    1e-7 relative over the first 50 steps, 2.6e-4 at step 300)."""
    results = finish(start(tmp_path / "long", *LONG), bound_s=400)
    assert [r[0] for r in results] == [0, 0], results[0][2][-2000:] + results[1][2][-2000:]
    results = finish(start(tmp_path / "short", *LONG, "--config.train.log_every=100"), bound_s=400)
    assert [r[0] for r in results] == [0, 0], results[0][2][-2000:] + results[1][2][-2000:]
    one = tmp_path / "one"
    cmd = [sys.executable, "-m", "ushard", "train", "--config", "tiny", "--workdir", str(one), *RUN, *LONG]
    done = subprocess.run(cmd, env={**os.environ, "JAX_NUM_CPU_DEVICES": "4"}, capture_output=True, text=True,
                          timeout=400)
    assert done.returncode == 0, done.stderr[-2000:]
    long, short, single = losses(tmp_path / "long"), losses(tmp_path / "short"), losses(one)
    assert sorted(long) == sorted(single) == [300, 600]
    for step in long:
        assert long[step] == short[step]
        assert long[step] == pytest.approx(single[step], rel=1e-2)


@pytest.mark.slow
def test_a_sigterm_between_long_intervals_stops_both_within_the_agreement_bound(tmp_path):
    from ushard.training.processes import AGREE_EVERY_STEPS

    procs = start(tmp_path, *LONG)
    time.sleep(15)  # compiled, and some way into the 300 steps before the first log
    procs[1].send_signal(signal.SIGTERM)
    results = finish(procs, bound_s=60)
    assert [r[0] for r in results] == [128 + signal.SIGTERM] * 2, results[0][2][-2000:] + results[1][2][-2000:]
    steps = {int(last_line(err).split("stopped by SIGTERM at step ")[1].split()[0]) for _, _, err in results}
    assert len(steps) == 1 and steps.pop() % AGREE_EVERY_STEPS == 0  # an agreement step, not the log step
    assert any((tmp_path / "checkpoints").iterdir())
