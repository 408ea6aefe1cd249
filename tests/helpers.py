"""Functions the test modules share (a test module imports from here, never from another test module).

conftest.py sets up JAX's devices and holds the fixtures and configs; this holds code that runs and
checks: whole-training parity runs, layouts, reference attention and its comparison.
"""

import contextlib
import dataclasses
import errno
import json
import os
import re
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from conftest import small_config
from ushard.aot import callees, computations
from ushard.config import MESH_AXES
from ushard.data.sources import component_documents
from ushard.kernels.attention import xla_block
from ushard.mesh import build_mesh
from ushard.models.config import ModelConfig
from ushard.parallel import context
from ushard.plan import ParallelPlan
from ushard.sharding import Layout, use_layout
from ushard.training.loop import Trainer

RTOL = 1e-5  # float32 throughout: a parallel computation against its one-device reference


# --------------------------------------------------------------------------- data


def source_documents(data_cfg) -> list:
    """(name, bytes or str) of each document the configured source yields, in order."""
    return [(name, content) for _, name, content in component_documents(data_cfg)]


# --------------------------------------------------------------------------- training runs


@contextlib.contextmanager
def compiler_log():
    """Collects what XLA's C++ code writes to file descriptor 2 (its warnings) while the block runs."""
    lines = []
    with tempfile.TemporaryFile(mode="w+") as log:
        saved = os.dup(2)
        os.dup2(log.fileno(), 2)
        try:
            yield lines
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            log.seek(0)
            lines.extend(log.read().splitlines())


def run_config(config, devices, batches, before_running=None):
    """Step-0 loss and gradients, the compiled train step (memory, HLO, compiler log) and the losses
    of train.steps steps. `before_running(hlo text)` checks the compiled step before any step runs
    (a step that would hang in a rendezvous is refused before it runs)."""
    trainer = Trainer(config, devices=devices, batches=batches)
    state = trainer.steps.init(config.train.seed)
    batches = trainer.global_batches(config.train.steps)
    first = batches[0]
    with compiler_log() as log:
        loss0, grads0 = trainer.steps.loss_and_grads(state.params, first, *trainer.steps.extra_inputs(state))
        compiled = trainer.steps.train_step.lower(state, first).compile()
    if before_running is not None:
        before_running(compiled.as_text())
    result = {
        "trainer": trainer,
        "loss0": float(loss0),
        "grads0": jax.device_get(grads0),
        "grad_shardings": jax.tree.map(lambda g: g.sharding, grads0),
        "init_shardings": jax.tree.map(lambda x: x.sharding, state),
        "memory": compiled.memory_analysis(),
        "all_gathers": len(re.findall(r"= \S+ all-gather(?:-start)?\(", compiled.as_text())),
        "hlo": compiled.as_text(),
        "compiler_log": log,
        "losses": [],
        "aux": [],
    }
    for batch in batches:
        state, metrics = compiled(state, batch)
        result["losses"].append(float(metrics["loss"]))
        result["aux"].append({k: float(v) for k, v in metrics["aux"].items()})
    result["params"] = jax.device_get(state.params)
    return result


def collectives_in_branches(hlo_text: str, kind: str) -> int:
    """How many `kind` collectives (e.g. "collective-permute") a compiled program runs inside the
    branches of its conditionals, at any depth."""
    by_name, _ = computations(hlo_text)
    todo = [c for instructions in by_name.values() for i in instructions if i.opcode == "conditional"
            for c in callees(i.rest)]
    seen = set()
    while todo:
        name = todo.pop()
        if name not in seen and name in by_name:
            seen.add(name)
            todo.extend(c for i in by_name[name] for c in callees(i.rest))
    return sum(i.opcode in (kind, f"{kind}-start") for name in seen for i in by_name[name])


def tree_relative_difference(a, b) -> float:
    diffs = jax.tree.map(lambda x, y: np.linalg.norm(np.asarray(x) - y) / max(np.linalg.norm(y), 1e-30), a, b)
    return max(jax.tree.leaves(diffs))


def assert_same_training(got, ref, step0_rtol=RTOL, trained_rtol=RTOL):
    """Step-0 loss and gradients, then the losses and parameters of the steps after, as `ref`'s."""
    np.testing.assert_allclose(got["loss0"], ref["loss0"], rtol=RTOL)
    assert tree_relative_difference(got["grads0"], ref["grads0"]) <= step0_rtol
    np.testing.assert_allclose(got["losses"], ref["losses"], rtol=trained_rtol)
    assert tree_relative_difference(got["params"], ref["params"]) <= trained_rtol
    # Only the ragged dispatch over devices reports its overflows and its busiest device.
    ragged_only = {"moe_dispatch_overflow", "moe_busiest_device_over_mean"}
    for got_aux, ref_aux in zip(got["aux"], ref["aux"]):  # MoE: losses, expert loads, drops
        assert got_aux.keys() - ragged_only == ref_aux.keys()
        np.testing.assert_allclose([got_aux[k] for k in ref_aux], list(ref_aux.values()), rtol=trained_rtol)
        assert got_aux.get("moe_dispatch_overflow", 0) == 0


def per_device_bytes(memory) -> int:
    # Donated state aliases the outputs, so arguments + temporaries is what a device holds at peak.
    return memory.argument_size_in_bytes + memory.temp_size_in_bytes


# --------------------------------------------------------------------------- layouts


def layout_for(zero_stage=3, expert_width=False, **sizes) -> Layout:
    shape = {axis: sizes.get(axis, 1) for axis in MESH_AXES}
    n = int(np.prod(list(shape.values())))
    return Layout.create(build_mesh(shape, devices=jax.devices()[:n]), zero_stage, expert_width=expert_width)


def sequence_layout(n: int, mode: str = "ring", keep_kv: bool = False, zigzag: bool = False,
                    impl: str = "xla", tensor: int = 1) -> Layout:
    """The sequence split n ways in `mode` (and the heads `tensor` ways), its tokens in zig-zag order
    (as the train step reorders them, `context.reordered`) or in their own, attention on `impl` as
    the run's plan decides it."""
    shape = {"pipeline": 1, "data": 1, "fsdp": 1, "expert": 1, "sequence": n, "tensor": tensor}
    config = small_config(**{"mesh.sequence": n, "mesh.tensor": tensor, "parallel.context_parallel": mode,
                             "parallel.context_keep_kv": keep_kv, "model.attention_impl": impl})
    plan = ParallelPlan.create(config, shape, jax.devices()[0].platform, ModelConfig.from_config(config.model))
    layout = Layout.from_plan(build_mesh(shape, devices=jax.devices()[:n * tensor]), plan)
    return dataclasses.replace(layout, zigzag=zigzag)


# --------------------------------------------------------------------------- attention against a reference


def reference_attention(q, k, v, segment_ids):
    """Softmax attention with an explicit causal and same-document mask, on one device."""
    b, t, h, hd = q.shape
    k, v = (jnp.repeat(x, h // x.shape[2], axis=2) for x in (k, v))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(hd)
    visible = jnp.tril(jnp.ones((t, t), bool))[None, None]
    if segment_ids is not None:
        visible = visible & (segment_ids[:, None, :, None] == segment_ids[:, None, None, :])
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(jnp.where(visible, scores, -jnp.inf), axis=-1), v)


def loss_and_grads(attention, q, k, v, segments, weights):
    """A scalar of the output with random weights (so every output element has its own gradient)."""
    loss = lambda q, k, v: jnp.sum(attention(q, k, v, segments) * weights)  # noqa: E731
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)


def assert_matches_reference(attention, q, k, v, segments, weights):
    """`attention`'s loss and gradients equal the one-device reference's, to RTOL."""
    want_loss, want_grads = loss_and_grads(reference_attention, q, k, v, segments, weights)
    got_loss, got_grads = loss_and_grads(attention, q, k, v, segments, weights)
    np.testing.assert_allclose(got_loss, want_loss, rtol=RTOL)
    for name, got, want in zip("qkv", got_grads, want_grads):
        assert np.linalg.norm(got - want) <= RTOL * np.linalg.norm(want), name


def split_on(blocks, n, mode="ring", keep_kv=False):
    """Attention with the sequence split n ways in `mode`, the blocks on the fused kernel `blocks`
    (None: XLA blocks), in the train step's zig-zag order and back."""
    layout = sequence_layout(n, mode, keep_kv, zigzag=True)

    def split_attention(q, k, v, segments):
        with use_layout(layout):
            q, k, v, segments = context.reordered((q, k, v, segments), layout)
            out = context.attention(q, (k, v), segments, xla_block, blocks)
        return context.zigzag(out, n, inverse=True)

    return split_attention


class MetricsOnAFullDisk:
    """metrics.jsonl (the open file `file`) on a disk that fills: writing the record of `step` or a later
    one fails with ENOSPC."""

    def __init__(self, file, step: int):
        self.file, self.step = file, step

    def write(self, text):
        if json.loads(text)["step"] >= self.step:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return self.file.write(text)

    def close(self):
        self.file.close()
