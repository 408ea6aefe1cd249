"""Ahead-of-time compilation of the real train step for a named TPU topology, on any machine.

libtpu (the `tpu` extra) describes a TPU slice or several by name, e.g. "v5p:4x4x4", without the
hardware; `compile_for` lays a config out on those devices exactly as training on them would and
compiles its train step. The executable cannot run here, but it tells what the step costs on each
chip: `memory_analysis()` per device, and the collectives XLA inserted (`collectives_per_step`).

    import ushard
    compiled = ushard.compile_for(ushard.load_config("llama3_8b"), topology="v5p:4x4x4")
    print(ushard.aot.summary(compiled))

Keep JAX_PLATFORMS=cpu on a machine without TPUs (libtpu is otherwise tried as the default backend).
"""

from __future__ import annotations

import os

import jax

from ushard.errors import UserError

# libtpu looks for a TPU VM's metadata when it starts; on other machines these keep it quiet.
_NOT_ON_A_TPU_VM = {"TPU_ACCELERATOR_TYPE": "v5p-8", "TPU_WORKER_HOSTNAMES": "localhost", "TPU_WORKER_ID": "0"}
# Generations whose chips have two TensorCores that a TPU VM presents as one device ("megacore"); the
# topology description presents them as two unless asked. (v5p presents one device a chip by default.)
_MEGACORE = ("v4",)
TOPOLOGY_FORM = "GENERATION:SHAPE, e.g. v5p:4x4x4, v5e:4x4, v6e:4x4 or v4:2x2x2"


def tpu_devices(topology: str, num_slices: int = 1) -> list:
    """The devices of `num_slices` slices of the TPU `topology`, as a TPU VM's JAX would list them
    (compile-only: they can lay out and compile programs, not run them)."""
    if not isinstance(num_slices, int) or isinstance(num_slices, bool) or num_slices < 1:
        raise UserError(f"num_slices={num_slices!r} must be a whole number of slices >= 1.")
    if not isinstance(topology, str) or ":" not in topology:
        raise UserError(f"topology={topology!r} is not a TPU topology name; write it as {TOPOLOGY_FORM}.")
    try:
        import libtpu  # noqa: F401
    except ImportError:
        raise UserError("compiling for a TPU topology needs libtpu; install it with pip install 'ushard[tpu]'.") from None
    from jax.experimental import topologies

    if jax.default_backend() != "tpu":
        for name, value in _NOT_ON_A_TPU_VM.items():
            os.environ.setdefault(name, value)
    options = {"chip_config_name": "megacore"} if topology.split(":")[0] in _MEGACORE else {}
    if num_slices > 1:
        options["num_slices"] = num_slices
    try:
        return list(topologies.get_topology_desc(topology, "tpu", **options).devices)
    except Exception as e:  # libtpu's own refusal (JaxRuntimeError INVALID_ARGUMENT: ...)
        reason = " ".join(str(e).split()).removeprefix("INVALID_ARGUMENT: ").rstrip(".")
        raise UserError(f"libtpu does not know the TPU topology {topology!r} ({reason}); write it as {TOPOLOGY_FORM}.") from None
