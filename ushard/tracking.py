"""Weights & Biases tracking (metrics.wandb): the rows of DIR/metrics.jsonl and the config, from process 0.

One workdir is one W&B run. Its id is kept in DIR/wandb_run_id, written by the first run there, so
every later run in that workdir (a resume after a crash or a preemption) logs into the same W&B run.
W&B's files go to DIR/wandb; with WANDB_MODE=offline nothing leaves the machine (`wandb sync
DIR/wandb/offline-run-*` uploads them later). Delete DIR/wandb_run_id to start a new W&B run.

W&B steps only go forward: a row for a step the W&B run already holds is not sent. A resumed run
recomputes the steps between its checkpoint and the crash bitwise equal, so nothing is lost there.
After a rollback (train.on_nonfinite="rollback") the replayed steps differ, and W&B keeps the rows
it had for them until the run passes the last step it logged; metrics.jsonl holds the replayed ones.

W&B is a side channel, never a reason to lose training: what can be checked before training (the
package, a login) stops the run with a UserError at setup; a W&B failure once training has started
prints one warning line and ends the logging to W&B while the run carries on.
"""

from __future__ import annotations

import inspect
import numbers
import os
import secrets

import jax

from ushard.errors import UserError, install_hint

RUN_ID_FILE = "wandb_run_id"
OFFLINE_MODES = ("offline", "dryrun", "disabled")  # WANDB_MODE values that never talk to a server


def check(config, workdir: str | None) -> None:
    """Raises UserError, before anything is built, when metrics.wandb cannot work in this environment."""
    if not config.metrics.wandb:
        return
    if not workdir:  # on every process: the config says so, and all must stop alike
        raise UserError("metrics.wandb=true needs a workdir: the W&B run id is kept there, so that a resumed "
                        "run logs into the same W&B run.")
    if jax.process_index() != 0:
        return  # only process 0 talks to W&B
    wandb = _import_wandb()
    if os.environ.get("WANDB_MODE", "").strip().lower() not in OFFLINE_MODES and not _has_login(wandb):
        raise UserError("metrics.wandb=true found no W&B login (no WANDB_API_KEY, none saved by `wandb login`); "
                        "run `wandb login`, or set WANDB_MODE=offline to keep the run on this machine.")


def start(config, workdir: str | None, warn=print) -> WandbRun | None:
    """The W&B run of `workdir` where metrics.wandb is on (process 0), else None. A W&B failure here
    is one `warn` line and None: the training goes on without W&B."""
    if not (config.metrics.wandb and workdir and jax.process_index() == 0):
        return None
    name = config.metrics.wandb_name or os.path.basename(os.path.normpath(os.path.abspath(workdir)))
    try:
        run_id = _run_id(workdir)
        wandb = _import_wandb()
        run = wandb.init(id=run_id, resume="allow", dir=workdir, project=config.metrics.wandb_project,
                         name=name, config=config.to_dict())
    except Exception as e:  # whatever W&B (or a full disk) raises, the training must go on
        warn(f"ushard: warning: W&B could not start ({_describe(e)}); training goes on without W&B.")
        return None
    if run.id != run_id:
        # wandb.init hands back a run this process already has open (the caller's own, in a notebook or
        # script); logging into it, or finishing it, is not ours to do.
        warn(f"ushard: warning: another W&B run ({run.id}) is active in this process; training goes on "
             f"without W&B (finish that run to log this one as {run_id}).")
        return None
    return WandbRun(run, warn)


class WandbRun:
    """One open W&B run that forwards metrics rows; after the first W&B failure it does nothing."""

    def __init__(self, run, warn):
        self.run, self.warn = run, warn
        # A resumed online run knows the steps it holds; an offline one starts at 0.
        self.last_step = (getattr(run, "starting_step", 0) or 0) - 1

    def log(self, record: dict) -> None:
        step = record["step"]
        if self.run is None or step <= self.last_step:
            return
        values = {key: value for key, value in record.items()
                  if key != "step" and isinstance(value, numbers.Real) and not isinstance(value, bool)}
        try:
            self.run.log(values, step=step)
        except Exception as e:  # a W&B failure ends the logging, never the run
            self._give_up(f"could not log step {step} ({_describe(e)})")
            return
        self.last_step = step

    def rewind(self, step: int) -> None:
        """The run rolled back to `step`: say once that W&B keeps its rows for the steps replayed."""
        if self.run is not None and step < self.last_step:
            self.warn(f"ushard: W&B keeps the rows it has up to step {self.last_step}; the replayed steps "
                      f"{step + 1}-{self.last_step} are in metrics.jsonl only.")

    def close(self) -> None:
        if self.run is None:
            return
        run, self.run = self.run, None
        try:
            run.finish()
        except Exception as e:  # the training is saved; only W&B's copy is in doubt
            self.warn(f"ushard: warning: W&B could not finish the run {run.id} ({_describe(e)}); its last rows "
                      f"may be missing there (metrics.jsonl has them all).")

    def _give_up(self, what: str) -> None:
        # No finish(): a W&B whose service is gone can block in it; wandb's exit hook tries it at the end.
        self.run = None
        self.warn(f"ushard: warning: W&B {what}; training goes on without W&B (every row is in metrics.jsonl).")


def _import_wandb():
    try:
        import wandb
    except ImportError:
        raise UserError(f"metrics.wandb=true needs the wandb package: {install_hint('wandb')}.") from None
    return wandb


def _has_login(wandb) -> bool:
    """Whether W&B has credentials (an API key in the environment, in netrc or in its settings), found
    without asking the server or prompting."""
    if "prompt" in inspect.signature(wandb.login).parameters:
        return bool(wandb.login(prompt=False, verify=False))
    return bool(wandb.api.api_key)  # wandb releases whose login() always prompts when nothing is found


def _run_id(workdir: str) -> str:
    """The W&B run id of `workdir`: read from DIR/wandb_run_id, or made and written there the first time."""
    path = os.path.join(workdir, RUN_ID_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            run_id = f.read().strip()
        if run_id:
            return run_id
    except FileNotFoundError:
        pass
    run_id = secrets.token_hex(6)
    os.makedirs(workdir, exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:  # written whole, then renamed: never half an id
        f.write(run_id + "\n")
    os.replace(tmp, path)
    return run_id


def _describe(error: Exception) -> str:
    return f"{type(error).__name__}: {error}".splitlines()[0]
