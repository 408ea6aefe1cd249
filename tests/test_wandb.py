"""metrics.wandb: an offline W&B run holds the rows of metrics.jsonl and the config, a resumed run logs
into the same W&B run, a W&B failure never stops training, and what is missing (the package, a login)
stops the run in one sentence before it trains. Nothing here talks to a W&B server."""

from __future__ import annotations

import json
import struct
import sys

import pytest

import ushard
from ushard import tracking
from ushard.errors import UserError
from ushard.metrics import MetricsWriter

wandb = pytest.importorskip("wandb")

# configs/tiny.py at tests/conftest.py's small sizes (on the default mesh: all the devices): quick to compile.
SMALL = {
    "model.d_model": 64, "model.n_layers": 2, "model.n_heads": 4, "model.n_kv_heads": 2, "model.d_ff": 128,
    "model.compute_dtype": "float32", "train.seq_len": 32, "train.batch_size": 16, "train.warmup_steps": 1,
    "train.lr": 1e-3, "train.eval_every": 0, "train.log_every": 1, "checkpoint.every": 2,
    "metrics.wandb": True,
}


@pytest.fixture(autouse=True)
def offline_wandb(tmp_path, monkeypatch):
    """W&B offline and quiet, its own files under tmp_path (none in $HOME), no key of the machine's."""
    home = tmp_path / "wandb_home"
    for name, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DIR": home / "dir",
                        "WANDB_CACHE_DIR": home / "cache", "WANDB_CONFIG_DIR": home / "config",
                        "WANDB_DATA_DIR": home / "data", "HOME": home}.items():
        monkeypatch.setenv(name, str(value))
    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "NETRC"):
        monkeypatch.delenv(name, raising=False)
    wandb.teardown()  # settings W&B loaded earlier in this process would outlive the environment above
    yield
    wandb.teardown()


def _config(steps: int):
    return ushard.load_config("tiny", {**SMALL, "train.steps": steps})


# --------------------------------------------------------------------------- reading an offline run

BLOCK = 32 * 1024  # a .wandb file is a LevelDB-style log: 32 KiB blocks of (crc32, length, kind) + data
FULL, LAST = 1, 4


def _records(path):
    """The Record protos of one offline `run-ID.wandb` file, in the order written."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    at, pieces = 7, []  # after the 7-byte file header, which counts towards the first block
    while at + 7 <= len(data):
        left = BLOCK - at % BLOCK
        _, length, kind = struct.unpack_from("<IHB", data, at)
        if left < 7 or (length == 0 and kind == 0):  # the padding at a block's end
            at += left
            continue
        pieces.append(data[at + 7:at + 7 + length])
        at += 7 + length
        if kind in (FULL, LAST):
            yield wandb_internal_pb2.Record.FromString(b"".join(pieces))
            pieces = []


def _offline_run(path) -> tuple[dict, dict]:
    """(config, rows) of one offline run file: the run's config as a dict, its history as {step: {key: value}}."""
    config, rows = {}, {}
    for record in _records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            config.update({u.key: json.loads(u.value_json) for u in record.run.config.update})
        elif kind == "history":
            # A key is in `key` or, as wandb 0.31 writes them, in `nested_key` (one element for a flat key).
            rows[record.history.step.num] = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                                             for i in record.history.item}
    return config, rows


def _offline_files(workdir, run_id) -> list:
    """The run file of each offline run directory that `run_id` has, oldest first (the names start
    with the time)."""
    return sorted((workdir / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))


def _jsonl(workdir) -> list[dict]:
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def _same_rows(logged: dict, expected: list[dict]) -> None:
    assert sorted(logged) == [r["step"] for r in expected]
    for row in expected:
        for key, value in row.items():
            if key != "step" and value is not None:
                assert logged[row["step"]][key] == pytest.approx(value, rel=1e-12), (row["step"], key)


# --------------------------------------------------------------------------- runs


def test_an_offline_run_holds_the_rows_and_the_config_and_a_resume_logs_into_the_same_run(tmp_path):
    workdir = tmp_path / "run"
    ushard.train(_config(4), str(workdir), log=lambda line: None)
    run_id = (workdir / tracking.RUN_ID_FILE).read_text().strip()
    (first_file,) = _offline_files(workdir, run_id)
    config, rows = _offline_run(first_file)
    first = _jsonl(workdir)
    assert [r["step"] for r in first] == [1, 2, 3, 4]
    _same_rows(rows, first)
    assert config["train"]["steps"] == 4 and config["metrics"]["wandb"] is True
    assert config["model"]["d_model"] == 64

    ushard.train(_config(6), str(workdir), log=lambda line: None)  # resumes from the checkpoint at step 4
    assert (workdir / tracking.RUN_ID_FILE).read_text().strip() == run_id
    assert len(list((workdir / "wandb").glob("offline-run-*"))) == 2
    assert _offline_files(workdir, run_id)[0] == first_file  # and the second one has the same id
    config, rows = _offline_run(_offline_files(workdir, run_id)[1])
    everything = _jsonl(workdir)
    assert [r["step"] for r in everything] == [1, 2, 3, 4, 5, 6]
    _same_rows(rows, everything[4:])
    assert config["train"]["steps"] == 6


def test_missing_package_stops_before_training(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    with pytest.raises(UserError) as stopped:
        ushard.train(_config(2), str(tmp_path / "run"), log=lambda line: None)
    assert str(stopped.value) == ("metrics.wandb=true needs the wandb package: pip install -e '.[wandb]' in a "
                                  "clone of ushard (pip install 'ushard[wandb]' from a package index).")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_missing_login_stops_before_training(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE")  # online: a login is needed, and none is in the environment or $HOME
    with pytest.raises(UserError) as stopped:
        ushard.train(_config(2), str(tmp_path / "run"), log=lambda line: None)
    message = str(stopped.value)
    assert message.startswith("metrics.wandb=true found no W&B login") and "WANDB_MODE=offline" in message
    assert "\n" not in message and message.endswith(".")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_no_workdir_stops_before_training():
    with pytest.raises(UserError, match=r"^metrics.wandb=true needs a workdir"):
        ushard.train(_config(2), None, log=lambda line: None)


# --------------------------------------------------------------------------- W&B failing mid-run


class FlakyRun:
    """A stand-in for wandb's Run whose log fails from the `fail_at`-th call on."""

    def __init__(self, fail_at: int):
        self.id, self.starting_step, self.fail_at = "flaky", 0, fail_at
        self.logged, self.finished = [], []

    def log(self, values, step):
        if len(self.logged) + 1 >= self.fail_at:
            raise ConnectionError("the service went away\nwith a long story")
        self.logged.append((step, values))

    def finish(self, exit_code=None):
        self.finished.append(exit_code)


def test_a_wandb_failure_is_one_warning_and_the_metrics_go_on(tmp_path):
    run, warnings = FlakyRun(fail_at=3), []
    writer = MetricsWriter(str(tmp_path), resume_step=0, tracker=tracking.WandbRun(run, warnings.append))
    for step in range(1, 6):
        writer.write({"step": step, "loss": float(step), "mfu": None, "ok": True, "skipped_steps": 0})
    writer.close()
    assert run.logged == [(1, {"loss": 1.0, "skipped_steps": 0}), (2, {"loss": 2.0, "skipped_steps": 0})]
    assert warnings == ["ushard: warning: W&B could not log step 3 (ConnectionError: the service went away); "
                        "training goes on without W&B (every row is in metrics.jsonl)."]
    assert run.finished == []  # not at close either: a broken W&B could block there
    assert [r["step"] for r in _jsonl(tmp_path)] == [1, 2, 3, 4, 5]


def test_a_rollback_keeps_the_wandb_run_open(tmp_path):
    run, warnings = FlakyRun(fail_at=100), []
    writer = MetricsWriter(str(tmp_path), resume_step=0, tracker=tracking.WandbRun(run, warnings.append))
    for step in (1, 2, 3, 4):
        writer.write({"step": step, "loss": float(step)})
    writer.rewind(2)
    for step in (3, 4, 5):
        writer.write({"step": step, "loss": 100.0 + step})
    assert run.finished == []
    writer.close()
    assert [(step, values["loss"]) for step, values in run.logged] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0),
                                                                       (5, 105.0)]
    assert warnings == ["ushard: W&B keeps the rows it has up to step 4; the replayed steps 3-4 are in "
                        "metrics.jsonl only."]
    assert run.finished == [None]


def test_a_wandb_init_that_fails_is_one_warning_and_no_tracking(tmp_path, monkeypatch):
    def unreachable(**kwargs):
        raise TimeoutError("no answer from the server\nafter 90 s")

    monkeypatch.setattr(wandb, "init", unreachable)
    warnings = []
    assert tracking.start(_config(2), str(tmp_path), warnings.append) is None
    assert warnings == ["ushard: warning: W&B could not start (TimeoutError: no answer from the server); training "
                        "goes on without W&B."]
    assert (tmp_path / tracking.RUN_ID_FILE).read_text().strip()  # kept for the next run
