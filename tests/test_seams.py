"""The package's seams hold: the model imports no parallel code, the plan decides once, build wires it."""

import ast
import pathlib

import jax

from conftest import small_config
from ushard import build
from ushard.parallel import SEAMS

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "ushard"


def imported_modules(path: pathlib.Path) -> set[str]:
    """Every module a source file imports, at any depth of its code (functions included)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def test_the_model_imports_nothing_from_the_parallel_package():
    files = sorted((PACKAGE / "models").glob("*.py"))
    assert len(files) > 5
    offending = {f.name: sorted(m for m in imported_modules(f) if m.startswith("ushard.parallel")) for f in files}
    assert {name: mods for name, mods in offending.items() if mods} == {}


def test_kernels_import_nothing_from_the_parallel_package_or_the_model():
    for f in sorted((PACKAGE / "kernels").glob("*.py")):
        assert not [m for m in imported_modules(f) if m.startswith(("ushard.parallel", "ushard.models"))], f.name


def test_build_makes_one_plan_and_the_layout_carries_it_and_the_seams():
    config = small_config(**{"mesh.pipeline": 2, "mesh.sequence": 2, "mesh.fsdp": 2, "model.n_layers": 4,
                             "parallel.pipeline_schedule": "1f1b", "parallel.pipeline_microbatches": 4,
                             "parallel.context_parallel": "all_gather"})
    setup = build(config, devices=jax.devices()[:8])
    plan = setup.plan
    assert setup.layout.plan is plan and setup.layout.seams is SEAMS
    assert plan.shape["pipeline"] == 2 and plan.context_mode == "all_gather" and plan.pipeline.name == "1f1b"
    assert plan.attention.name == "xla" and plan.context_blocks.name == "xla"
    described = setup.describe()
    assert "context parallelism: all_gather over 2 devices, blocks on XLA attention\n" in described
    assert "attention: XLA attention (auto on cpu)\n" in described
    # Inside a stage the layout still carries the plan (the kernels it chose) and the seams.


def test_grouped_matmul_matches_a_per_group_float32_reference():
    import jax.numpy as jnp
    import numpy as np

    from ushard.kernels.grouped_matmul import grouped_matmul

    rng = np.random.default_rng(0)
    sizes = np.array([3, 0, 5, 2], np.int32)  # an empty group, and 2 rows past the last group
    x, w = rng.normal(size=(12, 8)).astype(np.float32), rng.normal(size=(4, 8, 6)).astype(np.float32)
    groups = np.repeat(np.arange(4), sizes)
    want = np.zeros((12, 6), np.float32)
    want[: len(groups)] = np.einsum("rk,rkn->rn", x[: len(groups)], w[groups])
    got = grouped_matmul(jnp.asarray(x), jnp.asarray(w), jnp.asarray(sizes))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
