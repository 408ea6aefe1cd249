"""What the processes of a multi-process run decide together, and how they notice one that is gone.

- `agree`: at a step that every process treats as a sync point (a log or save step, and at least every
  `AGREE_EVERY_STEPS` steps whatever the log and save intervals), every process
  says whether a signal reached it and whether something failed on it (a background save, the
  metrics file); all then act on the union. A preemption notice that reaches one host, or the hosts
  seconds apart, thus stops every process at the same step, after the same save; a process that stopped
  alone would leave the others waiting in the next collective.
- `Watchdog`: each process publishes a heartbeat in JAX's coordination service and watches the
  others'. One silent for `train.process_timeout_s` (killed, its host lost, wedged) ends this process
  with one sentence naming it, before JAX's own heartbeat check aborts it with a native stack.

A single-process run uses neither.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import zlib

import jax
import numpy as np

from ushard.errors import UserError

# The most steps between two agreements: what bounds a signal's delay when train.log_every and
# checkpoint.every are long.
AGREE_EVERY_STEPS = 50
FAILURE_KEY = "ushard/failure/{process}/{step}"  # a process's own sentence for a failure it agreed on
LEFT = "left"  # a process's heartbeat once its run has ended


def check_same_run(config, gather=None) -> None:
    """UserError, on every process, where the processes were started with different ushard code or
    different configs (a process given other overrides would train with its own learning-rate
    schedule until the runs hang on a mismatched collective): the keys whose values differ. `gather`:
    `process_allgather` (a test's stand-in)."""
    if jax.process_count() == 1 and gather is None:
        return
    if gather is None:
        from jax.experimental import multihost_utils

        gather = multihost_utils.process_allgather
    settings = _flat(config.to_dict())
    code = gather(np.array([_digest(_code_fingerprint()), len(settings)], np.int64))
    if (code != code[0]).any():
        other = int(np.argmax((code != code[0]).any(axis=1)))
        raise UserError(f"process {other} runs other ushard code than process 0 (another version or checkout); "
                        f"start every process from the same installation.")
    keys = sorted(settings)
    values = gather(np.array([_digest(f"{k}={settings[k]}") for k in keys], np.int64))
    differ = [k for k, column in zip(keys, values.T) if (column != column[0]).any()]
    if differ:
        shown = ", ".join(differ[:5]) + (f" and {len(differ) - 5} more" if len(differ) > 5 else "")
        raise UserError(f"the processes were started with different configs ({shown} "
                        f"{'differs' if len(differ) == 1 else 'differ'}); start every process with the same "
                        f"--config and overrides.")


def _flat(tree: dict, prefix: str = "") -> dict:
    """{"a.b": the value as JSON} of a config's nested dict."""
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[prefix + key] = json.dumps(value, sort_keys=True, default=str)
    return flat


def _digest(text: str) -> int:
    return zlib.crc32(text.encode())


def _code_fingerprint() -> str:
    """The ushard package's source, as one digest of its files' names and bytes."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    digest = 0
    for folder, dirs, files in sorted(os.walk(root)):
        dirs.sort()
        for name in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(folder, name)
            with open(path, "rb") as f:
                digest = zlib.crc32(os.path.relpath(path, root).encode() + f.read(), digest)
    return str(digest)


def _client():
    from jax._src import distributed

    return distributed.global_state.client


def agree(step: int, signum: int | None, failure: UserError | None, timeout_s: float,
          settled: bool = False) -> int | None:
    """Every process's verdict at `step`, which every process must call at the same step. Raises what
    failed: this process's `failure`, or another's, named, with its own sentence, where this one only
    waited for it (a checkpoint barrier that timed out, `failure.waited_only`); else returns the first
    signal number any process received (None: none). `settled`: every process has waited for its save
    to end, so a failure that only waited is final (else `NotYet` may ask to hold it)."""
    if jax.process_count() == 1:
        if failure is not None:
            raise failure
        return signum
    from jax.experimental import multihost_utils

    if failure is not None:  # published before the gather, so that it is there when the others read it
        _client().key_value_set(FAILURE_KEY.format(process=jax.process_index(), step=step), str(failure), True)
    waited = failure is not None and getattr(failure, "waited_only", False)
    verdicts = multihost_utils.process_allgather(
        np.array([signum or 0, failure is not None and not waited, failure is not None], np.int32))
    signals = verdicts[:, 0][verdicts[:, 0] > 0]
    first_signal = int(signals[0]) if signals.size else None
    if not settled and not verdicts[:, 1].any() and 0 < verdicts[:, 2].sum() < len(verdicts):
        # Only waits have failed so far: the process that caused them has not heard of its own failure
        # yet (its barrier times out a moment later). Ask again at the next agreement.
        if failure is not None:
            raise NotYet(failure, first_signal)
        return first_signal
    causes = np.flatnonzero(verdicts[:, 1]) if verdicts[:, 1].any() else np.flatnonzero(verdicts[:, 2])
    if failure is not None and (not waited or jax.process_index() == causes[0]):
        raise failure
    if causes.size:
        first = int(causes[0])
        try:
            theirs = _client().blocking_key_value_get(FAILURE_KEY.format(process=first, step=step),
                                                      int(timeout_s * 1000))
        except Exception:  # noqa: BLE001 (gone before it said why: the gather says that much)
            theirs = "it did not say why"
        raise UserError(f"process {first} of {jax.process_count()} stopped the run at step {step}: {theirs}")
    return first_signal


class NotYet(Exception):
    """`agree` when this process's failure only waited for others that have not failed yet: hold
    `failure` and offer it at the next agreement; `signum` is what the processes agreed on meanwhile."""

    def __init__(self, failure: UserError, signum: int | None):
        super().__init__(str(failure))
        self.failure, self.signum = failure, signum


class Watchdog:
    """A heartbeat of this process in the coordination service, and a watch on the others' (module
    docstring). `lost(process, why)` ends the process; by default with one sentence and exit status 2."""

    PERIOD_S = 1.0

    def __init__(self, timeout_s: float, lost=None):
        self.timeout_s = timeout_s
        self.me, self.count = jax.process_index(), jax.process_count()
        self.lost = lost or _exit_lost
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="ushard-watchdog", daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=5 * self.PERIOD_S)
        try:  # a process that ends its run, however, is not lost: the others stop watching it
            _client().key_value_set(f"ushard/alive/{self.me}", LEFT, True)
        except Exception:  # noqa: BLE001 (the coordination service is gone already)
            pass

    def wait_for_verdict(self) -> None:
        """Waits as long as it takes the watch to notice a lost process (it ends this one then). For an
        error of a collective, which a lost peer causes at once: then the sentence names the process."""
        self._thread.join(timeout=self.timeout_s + 5 * self.PERIOD_S)

    def _watch(self) -> None:
        client = _client()
        beats = 0
        start = time.monotonic()
        seen = {p: (None, start) for p in range(self.count) if p != self.me}  # last heartbeat, when it changed
        unreachable_since = None
        while not self._stop.wait(self.PERIOD_S):
            now = time.monotonic()
            beats += 1
            try:
                client.key_value_set(f"ushard/alive/{self.me}", str(beats), True)
                for process, (last, since) in seen.items():
                    try:
                        value = client.key_value_try_get(f"ushard/alive/{process}")
                    except Exception:  # noqa: BLE001 (no heartbeat yet: still starting)
                        value = None
                    if value == LEFT:
                        continue  # it ended its run (with its own message); a barrier it left times out
                    if value != last:
                        seen[process] = (value, now)
                    elif now - since > self.timeout_s:
                        return self.lost(process, f"no heartbeat for {self.timeout_s:g} s")
                unreachable_since = None
            except Exception:  # noqa: BLE001 (the coordination service, which process 0 runs, is gone)
                unreachable_since = unreachable_since or now
                if now - unreachable_since > self.timeout_s:
                    return self.lost(0, f"its coordination service unreachable for {self.timeout_s:g} s")


def _exit_lost(process: int, why: str) -> None:
    """Ends this process at once: a lost peer leaves collectives and checkpoint barriers that can never
    complete, so there is nothing to clean up that would not wait for it."""
    print(f"ushard: error: process {process} of {jax.process_count()} was lost ({why}); process "
          f"{jax.process_index()} stopped too. The checkpoints written before stand: restart every process "
          f"with the same command to resume.", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(2)
