"""The public Python API: the README's example runs as written, `ushard.train` is the CLI's run bit for
bit, `load_model` gives the same logits on one device and laid out over eight, and `load_config` raises
the CLI's sentences as UserError."""

import json
import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

import ushard

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def readme_example() -> str:
    readme = open(os.path.join(REPO, "README.md")).read()
    section = readme.split("## Python", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.fixture(scope="module")
def api_run(tmp_path_factory):
    """The README's example, run as written in a fresh directory; returns that directory and its names."""
    where = tmp_path_factory.mktemp("api")
    cwd = os.getcwd()
    os.chdir(where)
    try:
        names = {}
        exec(compile(readme_example(), "README.md", "exec"), names)
    finally:
        os.chdir(cwd)
    return where, names


def losses(workdir) -> list[float]:
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line)["loss"] for line in f]


def test_readme_example_trains_and_loads(api_run):
    where, names = api_run
    rows, logits = names["rows"], names["logits"]
    assert [r["step"] for r in rows] == list(range(1, 11))
    assert rows[-1]["loss"] < rows[0]["loss"] - 1.0
    assert logits.shape == (1, 11, names["config"].model.vocab_size) and logits.dtype == np.float32
    assert (where / "runs" / "api-demo" / "checkpoints" / "10").is_dir()
    assert names["setup"].layout.axes("act_batch") == ("data", "fsdp", "expert")


@pytest.mark.slow  # the suite's time; the README example runs the API in the default tier
def test_api_train_writes_the_cli_losses_bitwise(api_run, tmp_path):
    where, _ = api_run
    env = dict(os.environ, JAX_NUM_CPU_DEVICES=str(jax.device_count()), JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p))
    cmd = [sys.executable, "-m", "ushard", "train", "--config", "tiny", "--config.train.steps=10",
           "--config.train.log_every=1", "--workdir", str(tmp_path / "cli")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    api, cli = losses(where / "runs" / "api-demo"), losses(tmp_path / "cli")
    assert len(api) == len(cli) == 10 and api == cli  # equal floats, not close ones


def test_load_model_laid_out_over_all_devices_matches_one_device(api_run):
    where, names = api_run
    one = names["model"]
    spread = ushard.load_model(str(where / "runs" / "api-demo"), devices=jax.devices(), log=lambda *_: None)
    assert spread.step == one.step == 10
    w = jax.tree.leaves(spread.params)[0]
    assert len(w.sharding.device_set) == jax.device_count()
    tokens = np.random.default_rng(0).integers(0, 256, (jax.device_count(), 24)).astype(np.int32)
    np.testing.assert_allclose(np.asarray(spread(tokens)), np.asarray(one(tokens)), rtol=1e-4, atol=1e-4)
    with pytest.raises(ushard.UserError, match=r"a batch of 3 rows does not split over 8 devices"):
        spread(tokens[:3])


@pytest.mark.parametrize("overrides, match", [
    ({"train.step": 5}, r"did you mean 'steps'"),
    ({"model.remat": "everything"}, r"model\.remat='everything' is not valid; choose one of: none, full"),
    (["--config.train.steps=0"], r"train\.steps=0 must be a number >= 1"),
])
def test_load_config_raises_the_cli_sentence(overrides, match):
    with pytest.raises(ushard.UserError, match=match):
        ushard.load_config("tiny", overrides)


def test_load_config_takes_a_dict_or_strings():
    assert ushard.load_config("tiny", {"train.steps": 7}).train.steps == 7
    assert ushard.load_config("tiny", ["--config.train.steps=8", "model.remat=full"]).model.remat == "full"


def test_load_model_without_checkpoints_is_one_sentence(tmp_path):
    with pytest.raises(ushard.UserError, match=r"does not exist; train a model first"):
        ushard.load_model(str(tmp_path))
