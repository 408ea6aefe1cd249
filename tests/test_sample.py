"""Inference: KV-cache decoding equals the full forward; `ushard sample` end to end."""

import io
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import small_config
from ushard.errors import UserError
from ushard.sample import sample
from ushard.training.loop import Trainer
from ushard.models.config import ModelConfig
from ushard.models.definition import ModelDef


def test_kv_cache_decoding_matches_full_forward():
    config = small_config()
    assert config.model.n_kv_heads < config.model.n_heads  # grouped-query attention
    model = ModelDef(ModelConfig.from_config(config.model))
    params = jax.jit(lambda: model.init(0))()
    batch, length, prefill = 2, 12, 5
    tokens = jax.random.randint(jax.random.key(3), (batch, length), 0, 257)
    positions = jnp.broadcast_to(jnp.arange(length), (batch, length))
    full = model.apply(params, tokens, positions)[0]

    decode = jax.jit(model.decode)
    cache = model.init_cache(batch, length + 4)  # empty slots past the end must stay masked
    logits, cache = decode(params, tokens[:, :prefill], positions[:, :prefill], cache)
    got = [logits]
    for t in range(prefill, length - 3):  # one token at a time...
        logits, cache = decode(params, tokens[:, t:t + 1], positions[:, t:t + 1], cache)
        got.append(logits)
    logits, cache = decode(params, tokens[:, -3:], positions[:, -3:], cache)  # ...and a chunk of three
    got.append(logits)
    assert int(cache["length"]) == length
    np.testing.assert_allclose(jnp.concatenate(got, axis=1), full, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def trained_workdir(tmp_path_factory, stdlib_batches):
    workdir = tmp_path_factory.mktemp("sample_run")
    config = small_config(**{
        "model.n_layers": 1, "train.seq_len": 32, "train.batch_size": 8, "train.steps": 2, "train.eval_every": 0,
        "checkpoint.every": 2, "mesh.fsdp": -1,  # trained over all 8 devices, sampled on one
    })
    Trainer(config, workdir=str(workdir), batches=stdlib_batches).run(log=lambda *_: None)
    assert (workdir / "checkpoints" / "2").is_dir()
    return workdir


def run_cli(*args):
    env = {**os.environ, "JAX_NUM_CPU_DEVICES": "8", "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-m", "ushard", "sample", *args], env=env, capture_output=True, text=True)


def test_sample_command_continues_the_prompt(trained_workdir):
    result = run_cli("--workdir", str(trained_workdir), "--prompt", "def ", "--max_new_tokens", "8")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("def ")
    assert "checkpoint at step 2" in result.stderr


def test_sampling_is_seeded_and_greedy_is_the_argmax(trained_workdir):
    def text(**kwargs):
        return sample(str(trained_workdir), "import ", max_new_tokens=6, out=io.StringIO(), log=lambda *_: None, **kwargs)

    assert text(temperature=1.0, top_k=5, seed=7) == text(temperature=1.0, top_k=5, seed=7)
    greedy = text(temperature=0.0)
    assert greedy == text(temperature=0.5, top_k=1, seed=1)  # top-1 sampling is greedy


def test_sample_without_checkpoints_is_one_error_line(tmp_path):
    result = run_cli("--workdir", str(tmp_path), "--prompt", "def ")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ushard: error:"), result.stderr
    assert "checkpoints" in lines[0]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"prompt": ""}, "--prompt is empty"),
        ({"max_new_tokens": 0}, "--max_new_tokens=0"),
        ({"temperature": -1.0}, "--temperature=-1.0"),
        ({"top_k": -2}, "--top_k=-2"),
    ],
)
def test_bad_arguments_are_user_errors(tmp_path, kwargs, message):
    arguments = {"prompt": "def ", **kwargs}
    with pytest.raises(UserError, match=message):
        sample(str(tmp_path), **arguments)
