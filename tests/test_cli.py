"""`ushard train` end to end: a short real run writes the metrics contract and TensorBoard events;
`ushard convert`'s output directories."""

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from ushard import cli
from ushard.errors import UserError

REQUIRED_KEYS = {"step", "loss", "grad_norm", "lr", "tokens_per_s", "step_time_s", "tflops_per_device", "mfu"}


def test_train_writes_metrics_and_tensorboard(tmp_path):
    workdir = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "ushard", "train", "--config", "tiny", "--workdir", str(workdir),
        "--config.train.steps=4", "--config.train.log_every=2", "--config.train.eval_every=4",
        "--config.train.eval_batches=1", "--config.model.n_layers=1", "--config.train.seq_len=32",
        "--config.train.batch_size=8", "--config.parallel.collective_combine_mib=64",  # XLA must accept the flag
    ]
    env = {**os.environ, "JAX_NUM_CPU_DEVICES": "8"}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "fsdp=8" in proc.stdout and "ZeRO-3" in proc.stdout  # the layout is reported
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 4]
    for r in records:
        assert REQUIRED_KEYS <= set(r)
        assert r["mfu"] is None  # no known peak on a CPU
        assert r["tokens_per_s"] > 0 and r["tflops_per_device"] > 0 and r["grad_norm"] > 0
    assert 3.0 < records[0]["loss"] < 7.0  # near ln(257) = 5.55 at the start
    assert "eval_loss" in records[-1] and "eval_loss" not in records[0]
    events = list((workdir / "tensorboard").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0


def test_xla_flags_from_the_config_yield_to_the_users(monkeypatch):
    from ushard import xla_flags
    from ushard.config import load_config

    config = load_config("tiny", ["parallel.collective_combine_mib=64"])
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_all_gather_combine_threshold_bytes=1")
    xla_flags.apply(config)
    assert os.environ["XLA_FLAGS"].split() == [
        "--xla_gpu_all_gather_combine_threshold_bytes=67108864",
        "--xla_gpu_reduce_scatter_combine_threshold_bytes=67108864",
        "--xla_gpu_all_gather_combine_threshold_bytes=1",  # later: XLA takes the user's value
    ]
    monkeypatch.delenv("XLA_FLAGS")
    xla_flags.apply(load_config("tiny"))  # 0: XLA's defaults, nothing set
    assert "XLA_FLAGS" not in os.environ



def test_convert_into_a_directory_it_cannot_create_says_so_before_any_work(tmp_path):
    """Every direction of `ushard convert` creates its output first: a path under a file is one
    sentence, before a checkpoint is read (the input directories here hold none)."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    nothing = dict(from_hf=None, to=None, from_workdir=None, to_hf=None, to_peft=None, dtype=None)
    for flag, given in (("--to", dict(from_hf=str(tmp_path), to=str(blocker / "w"))),
                        ("--to-hf", dict(from_workdir=str(tmp_path), to_hf=str(blocker / "hf"))),
                        ("--to-peft", dict(from_workdir=str(tmp_path), to_peft=str(blocker / "peft")))):
        with pytest.raises(UserError, match=f"^cannot create {flag} {blocker}/.*: Not a directory; give a writable "
                                            "directory.$"):
            cli.convert(SimpleNamespace(**{**nothing, **given}))


def test_jax_platforms_is_cpu_only_where_no_accelerator_shows_and_the_user_set_none(tmp_path, monkeypatch):
    from ushard import xla_flags

    device = tmp_path / "sys/bus/pci/devices/0000:00:04.0"
    device.mkdir(parents=True)
    (device / "vendor").write_text("0x1af4\n")  # a virtio disk
    assert not xla_flags.accelerators_present(str(tmp_path))
    for vendor in xla_flags.ACCELERATOR_VENDORS:
        (device / "vendor").write_text(vendor + "\n")
        assert xla_flags.accelerators_present(str(tmp_path))
    (device / "vendor").write_text("0x1af4\n")
    (tmp_path / "dev").mkdir()
    (tmp_path / "dev/nvidia0").write_text("")
    assert xla_flags.accelerators_present(str(tmp_path))

    for present, given, expected in ((False, None, "cpu"), (True, None, None), (False, "tpu", "tpu")):
        monkeypatch.setattr(xla_flags, "accelerators_present", lambda present=present: present)
        if given is None:
            monkeypatch.delenv("JAX_PLATFORMS", raising=False)
        else:
            monkeypatch.setenv("JAX_PLATFORMS", given)
        xla_flags.skip_an_absent_tpu()
        assert os.environ.get("JAX_PLATFORMS") == expected


def test_train_help_names_the_overrides(capsys):
    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    assert "--config.a.b=value" in capsys.readouterr().out


@pytest.mark.parametrize("address", ["notaport", "127.0.0.1:abc", "127.0.0.1:99999", ":1234", "127.0.0.1:0"])
def test_a_coordinator_address_that_is_not_host_and_port_is_one_sentence(address):
    args = SimpleNamespace(coordinator_address=address, num_processes=2, process_id=0)
    with pytest.raises(UserError, match=f"^--coordinator_address={address!r} is not HOST:PORT"):
        cli.start_processes(args)
