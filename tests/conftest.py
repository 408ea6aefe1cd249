"""Tests run on 8 simulated CPU devices in float32 (an explicit JAX_NUM_CPU_DEVICES is respected)."""

import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The test models are tiny, so LLVM's optimisation passes are most of XLA's CPU compile time and buy
# nothing here: without them the suite compiles in about half the time (same results).
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()

import jax  # noqa: E402
import pytest  # noqa: E402

from ushard.config import load_config  # noqa: E402
from ushard.data import make_batches  # noqa: E402


def small_config(config_name="tiny", **overrides):
    """configs/tiny.py (or another shipped config) shrunk so a layout compiles in a second or two;
    float32 for exact comparisons."""
    config = load_config(config_name)
    settings = {
        "model.d_model": 64, "model.n_layers": 2, "model.n_heads": 4, "model.n_kv_heads": 2, "model.d_ff": 128,
        "model.compute_dtype": "float32", "train.seq_len": 32, "train.batch_size": 16, "train.steps": 3,
        "train.warmup_steps": 1, "train.lr": 1e-3, "train.eval_every": 0, "train.log_every": 1,
        "mesh.fsdp": 1,
    }
    settings.update(overrides)
    from ushard.config import apply_overrides

    apply_overrides(config, [f"{k}={v}" for k, v in settings.items()])
    return config


def data_config(**values):
    """default_config().data with `values` set."""
    from ushard.config import default_config

    c = default_config().data
    for k, v in values.items():
        c[k] = v
    return c


# configs/tiny_moe.py's experts (8, top-2) at the test sizes, dropless, with the loss-free balancing
# bias moving.
SMALL_MOE = {"model.moe.expert_d_ff": 32, "model.moe.capacity_factor": 0.0, "model.moe.bias_update_rate": 0.01}

# A small DeepSeek (on tiny_moe): latent attention with YaRN, sigmoid group-limited routing, a shared
# expert, the per-sequence balance loss and one multi-token prediction module.
DEEPSEEK = {**SMALL_MOE, "model.family": "deepseek", "model.n_kv_heads": 4, "model.mla.q_lora_rank": 24,
            "model.mla.kv_lora_rank": 16, "model.mla.qk_nope_head_dim": 16, "model.mla.qk_rope_head_dim": 8,
            "model.mla.v_head_dim": 12, "model.rope_scaling.type": "yarn", "model.rope_scaling.factor": 4.0,
            "model.rope_scaling.original_max_position_embeddings": 16, "model.rope_scaling.mscale": 1.0,
            "model.rope_scaling.mscale_all_dim": 0.8, "model.moe.num_experts": 4, "model.moe.top_k": 2,
            "model.moe.num_shared_experts": 1, "model.moe.score_func": "sigmoid", "model.moe.routed_scale": 2.5,
            "model.moe.num_groups": 2, "model.moe.top_groups": 1, "model.moe.aux_loss_per_sequence": True,
            "model.mtp.depth": 1}


def free_port() -> int:
    """A TCP port nobody listens on now: a fresh coordinator address for each multi-process test."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tpu_devices(topology: str, num_slices: int = 1) -> list:
    """Compile-only devices of a TPU topology (ushard.aot.tpu_devices); skips without the tpu extra."""
    pytest.importorskip("libtpu", reason="needs libtpu: pip install -e '.[tpu]'")
    from ushard.aot import tpu_devices as devices

    return devices(topology, num_slices)


@pytest.fixture(scope="session")
def stdlib_batches():
    """The embedded default data at the small test sizes, loaded once per test session."""
    config = small_config()
    return make_batches(config.data, config.train.seq_len, config.train.seed)


# Meshes of 8 devices (and one device, the reference) that lay a batch out differently.
BATCH_MESHES = {
    "fsdp8": ["mesh.fsdp=8"],
    "data2_fsdp4": ["mesh.data=2", "mesh.fsdp=4"],
    "data8": ["mesh.data=8", "mesh.fsdp=1"],
    "tensor2_fsdp4": ["mesh.tensor=2", "mesh.fsdp=4"],
    "one_device": ["mesh.fsdp=-1"],
}


def assert_same_global_batch_on_every_mesh(config_for, batches, steps):
    """The trainer's global batch at each of `steps` is the same on every mesh of BATCH_MESHES (each
    device holding exactly its slice of it) and equals `batches.train_batch`. `config_for(mesh
    overrides)` gives the run's config."""
    import numpy as np

    from ushard.data.packing import FIELDS
    from ushard.training.loop import Trainer

    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices: run with JAX_NUM_CPU_DEVICES=8")
    batch_size, state, states = config_for([]).train.batch_size, batches.initial_state(), {}
    for s in range(max(steps) + 1):
        states[s] = state
        state = batches.advance(state, batch_size)
    for name, mesh in BATCH_MESHES.items():
        devices = jax.devices()[:1] if name == "one_device" else jax.devices()[:8]
        trainer = Trainer(config_for(mesh), None, devices=devices, batches=batches)
        assert trainer.setup.mesh.size == len(devices)
        for step in steps:
            arrays, next_state = trainer.global_batch(states[step])
            assert next_state == batches.advance(states[step], batch_size)
            expected = batches.train_batch(states[step], batch_size)[0]
            assert set(arrays) == set(expected) == set(FIELDS)
            for k, array in arrays.items():
                full = np.asarray(array)
                np.testing.assert_array_equal(full, expected[k], err_msg=f"{name} step {step} {k}")
                for shard in array.addressable_shards:  # every device holds exactly its slice
                    np.testing.assert_array_equal(np.asarray(shard.data), full[shard.index], err_msg=f"{name} {k}")


def pytest_report_header(config):
    return f"jax {jax.__version__}, {jax.device_count()} {jax.devices()[0].platform} devices"


# The files that take longest, longest first (CPU-seconds on two cores, 2026-11-27: about 450, 450,
# 390, 140, 120, 90, 85, 75). `--dist loadfile` hands whole files to the two workers in collection
# order, each to the first worker free: the long ones first leave only short files to even out the
# end, instead of one worker starting a long file while the other runs out of work.
LONGEST_FIRST = ("test_parallel_parity.py", "test_fault_tolerance.py", "test_pipeline.py", "test_context_parallel.py",
                 "test_model.py", "test_api.py", "test_tpu.py", "test_moe.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file's own order stays
