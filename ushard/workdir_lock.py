"""One run per workdir: a lock file, DIR/.lock, held for the whole run by process 0.

The lock is an OS lock (`fcntl.flock`) on the open file, so it ends with its process however that process
ends (SIGKILL, a crash, a node reboot): a lock left by a dead run is never mistaken for a live one. The
file also names its holder (host, pid, process start time) so that a second run is told who holds it.
A file that still names a holder when the OS lock is free was left by a run that did not release it;
it is taken over with a one-line warning.

Where the filesystem has no flock (Lustre without `-o flock`, some network filesystems), the holder
named in the file decides instead: on this host, the pid must be alive and started at the recorded
time (a reused pid is not the holder); a holder on another host cannot be checked and is respected.

The file is emptied on release but never deleted: deleting it would let a run that opened the old file
and a run that creates a new one both hold "the" lock.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import time

from ushard.errors import UserError

LOCK_NAME = ".lock"
# flock errors that mean "this filesystem does not do locks", not "someone holds it".
_NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


def _start_ticks(pid: int) -> int | None:
    """The start time of process `pid` in clock ticks since boot (Linux); None where unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # Field 22; the command name (field 2) may hold spaces and parentheses, so count from its end.
    return int(stat[stat.rindex(b")") + 2:].split()[19])


def _boot_id() -> str | None:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return None


def identity(pid: int | None = None) -> dict:
    """What the lock file records about its holder (this process by default)."""
    pid = os.getpid() if pid is None else pid
    return {"host": socket.gethostname(), "pid": pid, "start_ticks": _start_ticks(pid), "boot_id": _boot_id(),
            "since": time.strftime("%Y-%m-%d %H:%M:%S")}


def holder_alive(holder: dict) -> bool | None:
    """Whether the process named by `holder` still runs: None where that cannot be told (another host)."""
    if holder.get("host") != socket.gethostname() or not isinstance(holder.get("pid"), int):
        return None
    if holder.get("boot_id") and holder["boot_id"] != _boot_id():
        return False  # this host rebooted since
    try:
        os.kill(holder["pid"], 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, another user's
    start = _start_ticks(holder["pid"])
    # The same pid started at another time is a new process that reuses the number.
    return holder.get("start_ticks") is None or start is None or start == holder["start_ticks"]


def _describe(holder: dict | None) -> str:
    if not holder:
        return "an unknown process"
    since = f", since {holder['since']}" if holder.get("since") else ""
    return f"pid {holder.get('pid')} on host {holder.get('host')}{since}"


class WorkdirLock:
    """`with WorkdirLock(workdir, holder=jax.process_index() == 0, log=print):` around everything that
    writes to `workdir`. Raises `UserError` (one sentence) if another run holds it; only the process with
    `holder=True` takes the lock, on the others this is a no-op."""

    def __init__(self, workdir: str, holder: bool = True, log=print):
        self.workdir, self.holder, self.log = workdir, holder, log
        self.path = os.path.join(workdir, LOCK_NAME)
        self._fd = None

    def acquire(self) -> "WorkdirLock":
        if not self.holder or self._fd is not None:
            return self
        try:
            os.makedirs(self.workdir, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except FileExistsError:
            raise UserError(f"workdir {self.workdir} exists and is not a directory; "
                            "give a directory for --workdir.") from None
        except OSError as e:
            raise UserError(f"cannot create the lock file {self.path}: {e.strerror}; "
                            "give a writable directory for --workdir.") from None
        try:
            previous = self._take(fd)
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(identity()) + "\n").encode(), 0)
            os.fsync(fd)
        except OSError as e:  # a full disk, an I/O error
            os.close(fd)
            raise UserError(f"cannot write the lock file {self.path}: {e.strerror}.") from None
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        if previous is not None:
            self.log(f"ushard: warning: took over the lock file {self.path} left by {_describe(previous)}, "
                     f"a run that ended without releasing it.")
        return self

    def _take(self, fd: int) -> dict | None:
        """Locks `fd`; returns the previous holder the file still names (a stale one), or raises."""
        previous = _read(fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return _read(fd)  # read again under the lock: the holder may have released it meanwhile
        except BlockingIOError:
            raise self._busy(previous) from None
        except OSError as e:
            if e.errno not in _NO_FLOCK:
                raise UserError(f"cannot lock {self.path}: {e.strerror}.") from None
        # No flock on this filesystem: the recorded holder decides.
        if previous is not None and holder_alive(previous) is not False:
            raise self._busy(previous)
        return previous

    def _busy(self, holder: dict | None) -> UserError:
        # A forked child shares its parent's flock, so the lock can outlive the process it names.
        ended = holder and holder_alive(holder) is False
        gone = ", which has ended, but a process it started still holds it" if ended else ""
        return UserError(
            f"workdir {self.workdir} is in use by another run ({_describe(holder)}{gone}; lock file {self.path}); "
            f"wait for it to end or choose another --workdir."
        )

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            os.ftruncate(fd, 0)  # an empty file: nobody holds it
        except OSError:
            pass  # the OS lock still goes with the close below
        finally:
            os.close(fd)  # closing the last descriptor releases the flock

    def __enter__(self) -> "WorkdirLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _read(fd: int) -> dict | None:
    """The holder recorded in the lock file: None if empty; {} (unknown) if unreadable."""
    try:
        text = os.pread(fd, 4096, 0).decode("utf-8", errors="replace").strip()
    except OSError:
        return {}
    if not text:
        return None
    try:
        holder = json.loads(text)
    except json.JSONDecodeError:
        return {}
    return holder if isinstance(holder, dict) else {}


@contextlib.contextmanager
def hold_workdir(workdir: str, log=print):
    """The lock for one run, taken by process 0; in a multi-process run every process learns whether it
    was refused, so none is left waiting in the first collective for a process 0 that stopped."""
    import jax

    lock, refused = WorkdirLock(workdir, holder=jax.process_index() == 0, log=log), None
    try:
        lock.acquire()
    except UserError as e:
        refused = e
    if jax.process_count() > 1:
        import numpy as np
        from jax.experimental import multihost_utils

        if multihost_utils.broadcast_one_to_all(np.int32(refused is not None)) and refused is None:
            refused = UserError(f"process 0 could not lock workdir {workdir}; its message says why.")
    if refused is not None:
        raise refused
    try:
        yield lock
    finally:
        lock.release()
