"""Checkpoints, exact resume, resharding on restore, preemption and non-finite policies."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from conftest import SMALL_MOE, small_config
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


def losses_by_step(workdir) -> dict[int, float]:
    """The last logged loss of each step (a resumed run logs the steps after its checkpoint again)."""
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records}


def wait_for_step(workdir, step, proc, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        path = workdir / "metrics.jsonl"
        if path.exists() and any(json.loads(l)["step"] >= step for l in path.read_text().splitlines() if l):
            return
        assert proc.poll() is None, "the run ended before it was interrupted"
        time.sleep(0.05)
    raise TimeoutError(step)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("uninterrupted")
    subprocess.run(train_cmd(workdir, "--config.train.steps=12"), env=env(), check=True, capture_output=True)
    return losses_by_step(workdir)


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


@pytest.mark.parametrize("layout,devices", [
    ({"mesh.data": 2, "mesh.fsdp": 4, "parallel.zero_stage": 1}, 8),
    ({"mesh.fsdp": 4}, 4),
])
def test_resume_on_another_mesh_and_device_count(tmp_path, zero3_run, stdlib_batches, layout, devices):
    resume_from_step_3_and_compare(zero3_run, ckpt_config(**layout), tmp_path, stdlib_batches, devices)


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
    ({"model.param_dtype": "bfloat16"}, r"blocks\.attn\.wk is \(2, 64, 2, 16\) float32 there but \(2, 64, 2, 16\) bfloat16 here"),
    # Same parameters, another function:
    ({"model.rope_theta": 500000.0}, r"holds another model: model\.rope_theta=10000\.0 there but 500000\.0 here"),
    ({"model.document_mask": False}, r"holds another model: model\.document_mask=True there but False here"),
])
def test_incompatible_checkpoint_names_the_difference(zero3_run, stdlib_batches, override, match):
    saved_dir, _ = zero3_run
    with pytest.raises(UserError, match=match):
        Trainer(ckpt_config(**{"mesh.fsdp": 8, **override}), str(saved_dir), batches=stdlib_batches).run(log=quiet)


def test_a_saved_config_without_newer_keys_reads_them_as_defaults():
    from ushard.checkpoint import saved_model_config
    from ushard.models.config import ModelConfig

    model = ckpt_config().model
    saved = {"model": {k: v for k, v in model.to_dict().items() if k not in ("fused_qkv", "fused_mlp")}}
    assert saved_model_config(saved) == ModelConfig.from_config(model)  # an older checkpoint of the same model


# ----------------------------------------------------------------------------- non-finite policies


class PoisonedBatches:
    """The real batches, except that batch number `bad` (counted from 0) carries an out-of-range token:
    its embedding is NaN."""

    def __init__(self, batches, bad: int):
        self._batches, self.bad = batches, bad

    def position(self, batch_number: int) -> int:
        return batch_number * small_config().train.batch_size * self._batches.window

    def train_batch(self, state, batch_size, rows=None):
        batch, next_state = self._batches.train_batch(state, batch_size, rows)
        if state["position"] == self.position(self.bad):
            batch["inputs"] = batch["inputs"].copy()
            batch["inputs"][:, 3] = 10_000
        return batch, next_state

    def __getattr__(self, name):
        return getattr(self._batches, name)


def test_nonfinite_skip_counts_and_keeps_the_state(stdlib_batches):
    trainer = Trainer(ckpt_config(**{"mesh.fsdp": 8, "train.on_nonfinite": "skip"}),
                      batches=PoisonedBatches(stdlib_batches, bad=3))
    records = trainer.run(log=quiet)
    by_step = {r["step"]: r for r in records}
    assert not np.isfinite(by_step[4]["loss"])  # step 4 trains on batch 3
    assert by_step[3]["skipped_steps"] == 0 and by_step[4]["skipped_steps"] == 1 and by_step[6]["skipped_steps"] == 1
    assert all(np.isfinite(by_step[s]["loss"]) for s in (5, 6))
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(jax.device_get(trainer.state.params)))


def test_nonfinite_rollback_restores_and_moves_past_the_batch(tmp_path, stdlib_batches):
    lines = []
    config = ckpt_config(**{"mesh.fsdp": 8, "train.on_nonfinite": "rollback", "checkpoint.every": 2})
    trainer = Trainer(config, str(tmp_path), batches=PoisonedBatches(stdlib_batches, bad=4))
    records = trainer.run(log=lines.append)
    assert any("rolled back to step 4, skipping that batch" in l for l in lines), lines
    final = {r["step"]: r for r in records}  # the last record of each step: after the rollback
    assert all(np.isfinite(final[s]["loss"]) for s in range(1, 7))
    poisoned = trainer.batches
    assert trainer.skip_positions == {poisoned.position(4)}
    # Steps 5 and 6 trained on batches 5 and 6; the checkpoint says the next batch is 7.
    saved = json.loads((tmp_path / "checkpoints" / "6" / "data" / "metadata").read_text())
    assert saved["position"] == poisoned.position(7)
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(jax.device_get(trainer.state.params)))


def test_nonfinite_stop_says_where(stdlib_batches):
    trainer = Trainer(ckpt_config(**{"mesh.fsdp": 8, "train.on_nonfinite": "stop"}),
                      batches=PoisonedBatches(stdlib_batches, bad=1))
    with pytest.raises(UserError, match=r"training stopped: step 2 \(the batch at data position 528\) gave loss nan"):
        trainer.run(log=quiet)


# ----------------------------------------------------------------------------- several processes


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    np.testing.assert_allclose([two[s] for s in sorted(two)], [uninterrupted[s] for s in sorted(uninterrupted)], rtol=1e-5)
    assert (tmp_path / "checkpoints" / "12").is_dir()


def test_incomplete_multiprocess_flags_are_refused(capsys):
    from ushard.cli import main

    assert main(["train", "--config", "tiny", "--num_processes", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["ushard: error: a multi-process run needs all of --coordinator_address HOST:PORT, "
                   "--num_processes N and --process_id I."]
