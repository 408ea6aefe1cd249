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
from ushard.models.config import ModelConfig
from ushard.models.definition import ModelDef
from ushard.sample import sample
from ushard.training.loop import Trainer


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
        return sample(str(trained_workdir), "import ", max_new_tokens=6, out=io.StringIO(), log=lambda *_: None,
                      **kwargs)

    assert text(temperature=1.0, top_k=5, seed=7) == text(temperature=1.0, top_k=5, seed=7)
    greedy = text(temperature=0.0)
    assert greedy == text(temperature=0.5, top_k=1, seed=1)  # top-1 sampling is greedy


def test_sample_without_checkpoints_is_one_error_line(tmp_path):
    result = run_cli("--workdir", str(tmp_path), "--prompt", "def ")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ushard: error:"), result.stderr
    assert "checkpoints" in lines[0]


def test_a_generation_too_big_for_memory_is_one_error_line(trained_workdir):
    result = run_cli("--workdir", str(trained_workdir), "--prompt", "def ", "--max_new_tokens", "1000000000")
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("ushard: error: --max_new_tokens=1000000000 would need about ")
    assert "GB of host memory; the largest --max_new_tokens that fits is " in lines[-1]
    assert "Traceback" not in result.stderr and not result.stdout  # refused before generating anything


class FakeDevice:
    def __init__(self, limit, in_use):
        self.stats = {"bytes_limit": limit, "bytes_in_use": in_use}

    def memory_stats(self):
        return self.stats

    def __str__(self):
        return "cuda:0"


def test_memory_check_names_the_largest_generation_that_fits():
    from ushard.sample import check_memory, generation_bytes

    cfg = ModelConfig(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, compute_dtype="bfloat16")
    per_position = 3 * 2 * 2 * 2 * 16 * 2 + 2 * 5 * 4 * 4  # the cache three times, the prefill's scores
    assert generation_bytes(cfg, 5, 1) == per_position
    device = FakeDevice(limit=2_000_000_000 + 100_000, in_use=2_000_000_000)  # 100 kB free
    largest = 100_000 // per_position - 5
    check_memory(cfg, 5, largest, device)
    with pytest.raises(UserError) as excinfo:
        check_memory(cfg, 5, largest + 1, device)
    assert str(excinfo.value) == (
        f"--max_new_tokens={largest + 1} would need about 0.1 MB for the KV cache of {largest + 6} positions, more "
        f"than the 0.1 MB free on cuda:0; the largest --max_new_tokens that fits is {largest}."
    )
    with pytest.raises(UserError, match="even one new token does not fit after this prompt; shorten it"):
        check_memory(cfg, 200, 1, device)


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
