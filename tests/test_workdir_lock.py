"""One run per workdir: a second holder is refused with one sentence; a dead holder's lock is taken over."""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys

import pytest

from ushard import workdir_lock
from ushard.errors import UserError
from ushard.workdir_lock import WorkdirLock, holder_alive, identity

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOST = socket.gethostname()


def _one_sentence(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message and message.endswith("."), message
    return message


def _holder_in_file(workdir) -> dict | None:
    text = (workdir / ".lock").read_text()
    return json.loads(text) if text else None


def test_second_holder_in_one_process_is_refused_naming_the_first(tmp_path):
    logged = []
    with WorkdirLock(str(tmp_path), log=logged.append) as lock:
        assert lock.path == str(tmp_path / ".lock")
        recorded = _holder_in_file(tmp_path)
        assert (recorded["host"], recorded["pid"]) == (HOST, os.getpid())
        with pytest.raises(UserError) as excinfo:
            WorkdirLock(str(tmp_path)).acquire()
        message = _one_sentence(excinfo)
        assert message.startswith(
            f"workdir {tmp_path} is in use by another run (pid {os.getpid()} on host {HOST}, since ")
        assert f"lock file {tmp_path / '.lock'}); wait for it to end or choose another --workdir." in message
    assert _holder_in_file(tmp_path) is None  # released: emptied, kept
    with WorkdirLock(str(tmp_path), log=logged.append):
        pass
    assert logged == []  # a clean release leaves nothing to take over


def test_released_when_an_exception_passes_through(tmp_path):
    with pytest.raises(RuntimeError, match="boom"):
        with WorkdirLock(str(tmp_path)):
            raise RuntimeError("boom")
    assert _holder_in_file(tmp_path) is None
    with WorkdirLock(str(tmp_path)) as again:
        assert _holder_in_file(tmp_path)["pid"] == os.getpid() and again._fd is not None


def test_only_the_holder_process_takes_it(tmp_path):
    workdir = tmp_path / "new"
    with WorkdirLock(str(workdir), holder=False):
        assert not workdir.exists()  # processes other than 0 touch nothing
    with WorkdirLock(str(workdir)):
        with WorkdirLock(str(workdir), holder=False) as other:
            assert other._fd is None and _holder_in_file(workdir)["pid"] == os.getpid()


HOLD = """
import sys, time
from ushard.workdir_lock import WorkdirLock
lock = WorkdirLock(sys.argv[1]).acquire()
print("held", flush=True)
sys.stdin.readline()
"""


def _holder_process(workdir):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(workdir)], env=env, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdout.readline() == "held\n"
    return proc


def test_another_process_holds_it_then_is_killed_and_its_lock_is_taken_over(tmp_path):
    proc = _holder_process(tmp_path)
    try:
        with pytest.raises(UserError) as excinfo:
            WorkdirLock(str(tmp_path)).acquire()
        assert f"in use by another run (pid {proc.pid} on host {HOST}, since " in _one_sentence(excinfo)
    finally:
        proc.send_signal(signal.SIGKILL)  # no release: the file still names it
        proc.wait()
    assert _holder_in_file(tmp_path)["pid"] == proc.pid
    logged = []
    with WorkdirLock(str(tmp_path), log=logged.append):
        assert _holder_in_file(tmp_path)["pid"] == os.getpid()
    assert len(logged) == 1
    assert logged[0].startswith(f"ushard: warning: took over the lock file {tmp_path / '.lock'} left by pid {proc.pid} "
                                f"on host {HOST}, since ")
    assert logged[0].endswith(", a run that ended without releasing it.")


FORK = """
import os, sys, time
from ushard.workdir_lock import WorkdirLock
WorkdirLock(sys.argv[1]).acquire()
child = os.fork()
if child == 0:
    time.sleep(60)  # the child keeps the inherited lock
else:
    print(os.getpid(), child, flush=True)
    os._exit(0)
"""


def test_a_lock_kept_by_a_forked_child_names_the_ended_parent(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", FORK, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": REPO})
    parent, child = map(int, proc.stdout.readline().split())
    proc.stdout.close()
    proc.wait()
    try:
        with pytest.raises(UserError) as excinfo:
            WorkdirLock(str(tmp_path)).acquire()
        assert f"(pid {parent} on host {HOST}, since " in _one_sentence(excinfo)
        assert ", which has ended, but a process it started still holds it; lock file " in str(excinfo.value)
    finally:
        os.kill(child, signal.SIGKILL)


@pytest.mark.parametrize("make, needle", [
    (lambda d: (d / "run").write_text("x"),
     "workdir {d}/run exists and is not a directory; give a directory for --workdir."),
    (lambda d: (d / "run" / ".lock").mkdir(parents=True), "cannot create the lock file {d}/run/.lock: Is a directory"),
])
def test_unusable_workdir_is_one_sentence(tmp_path, make, needle):
    make(tmp_path)
    with pytest.raises(UserError) as excinfo:
        WorkdirLock(str(tmp_path / "run")).acquire()
    assert needle.format(d=tmp_path) in _one_sentence(excinfo)


def test_a_full_disk_is_one_sentence_and_leaves_the_lock_free(tmp_path, monkeypatch):
    def pwrite(fd, data, offset):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with monkeypatch.context() as patch:
        patch.setattr(workdir_lock.os, "pwrite", pwrite)
        with pytest.raises(UserError) as excinfo:
            WorkdirLock(str(tmp_path)).acquire()
    assert _one_sentence(excinfo) == f"cannot write the lock file {tmp_path / '.lock'}: No space left on device."
    with WorkdirLock(str(tmp_path)):  # the failed attempt holds nothing
        assert _holder_in_file(tmp_path)["pid"] == os.getpid()


def test_a_read_only_filesystem_is_one_sentence(tmp_path, monkeypatch):
    def read_only(path, flags, mode=0o777):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    with monkeypatch.context() as patch:  # root can write through chmod, not through a read-only mount
        patch.setattr(workdir_lock.os, "open", read_only)
        with pytest.raises(UserError) as excinfo:
            WorkdirLock(str(tmp_path)).acquire()
    assert _one_sentence(excinfo) == (f"cannot create the lock file {tmp_path / '.lock'}: Read-only file system; "
                                      f"give a writable directory for --workdir.")


@pytest.mark.parametrize("workdir, sentence", [
    ("file", "workdir {d}/file exists and is not a directory; give a directory for --workdir."),
    ("file/run",
     "cannot create the lock file {d}/file/run/.lock: Not a directory; give a writable directory for --workdir."),
])
def test_cli_refuses_an_unusable_workdir_before_loading_data(tmp_path, capsys, monkeypatch, workdir, sentence):
    from ushard.cli import main
    from ushard.training import loop

    (tmp_path / "file").write_text("not a directory")
    monkeypatch.setattr(loop, "make_batches", lambda *args, **kwargs: pytest.fail("the data loaded first"))
    assert main(["train", "--config", "tiny", "--workdir", str(tmp_path / workdir)]) == 2
    assert capsys.readouterr().err.splitlines() == ["ushard: error: " + sentence.format(d=tmp_path)]


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_read_only_workdir_is_one_sentence(tmp_path):
    tmp_path.chmod(0o500)
    try:
        with pytest.raises(UserError) as excinfo:
            WorkdirLock(str(tmp_path)).acquire()
        assert "Permission denied; give a writable directory for --workdir." in _one_sentence(excinfo)
    finally:
        tmp_path.chmod(0o700)


# --------------------------------------------------------------------------- filesystems without flock


@pytest.fixture
def no_flock(monkeypatch):
    def flock(fd, op):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(workdir_lock.fcntl, "flock", flock)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.mark.parametrize("change, alive", [
    ({}, True),  # this very process
    ({"host": "elsewhere-node"}, None),  # cannot be checked from here: respected
    ({"pid": "dead"}, False),
    ({"start_ticks": -1}, False),  # our pid, but started at another time: a reused pid
    ({"boot_id": "another-boot"}, False),  # this host rebooted since
])
def test_without_flock_the_recorded_holder_decides(tmp_path, no_flock, change, alive):
    holder = {**identity(), **change}
    if holder["pid"] == "dead":
        holder["pid"] = _dead_pid()
    (tmp_path / ".lock").write_text(json.dumps(holder))
    assert holder_alive(holder) is alive
    logged = []
    if alive is False:
        with WorkdirLock(str(tmp_path), log=logged.append):
            assert _holder_in_file(tmp_path)["pid"] == os.getpid()
        assert len(logged) == 1 and f"left by pid {holder['pid']} on host {holder['host']}" in logged[0]
    else:
        with pytest.raises(UserError) as excinfo:
            WorkdirLock(str(tmp_path), log=logged.append).acquire()
        assert f"(pid {holder['pid']} on host {holder['host']}, since " in _one_sentence(excinfo)
        assert logged == [] and _holder_in_file(tmp_path) == holder  # untouched

