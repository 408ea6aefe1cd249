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
    assert plan.attention.name == "xla" and plan.context_blocks.name == "XLA attention"
    described = setup.describe()
    assert "context parallelism: all_gather over 2 devices, blocks on XLA attention\n" in described
    assert "attention: XLA attention (auto on cpu)\n" in described
    # Inside a stage the layout still carries the plan (the kernels it chose) and the seams.
