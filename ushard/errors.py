"""The exceptions that end a command without a traceback.

Anything raised as `UserError` reaches the user as a single sentence and a non-zero exit (see cli.py);
`Preempted` ends a run stopped by a signal, its state saved; every other exception is a bug in ushard
and keeps its traceback. This module imports nothing, so that the CLI's `--help` starts no JAX.
"""

import signal


class UserError(Exception):
    """Bad input from the user: a config value, a mesh that doesn't fit, a missing file."""


class Preempted(Exception):
    """Training stopped by a signal; the exit status is 128 + signal number. `where` ends the sentence:
    when it stopped and what was saved."""

    def __init__(self, signum: int, where: str):
        self.signum = signum
        super().__init__(f"stopped by {signal.Signals(signum).name} {where}.")


def install_hint(extra: str) -> str:
    """How to install an optional extra, from a clone (the README's set-up) and from a package index."""
    return f"pip install -e '.[{extra}]' in a clone of ushard (pip install 'ushard[{extra}]' from a package index)"
