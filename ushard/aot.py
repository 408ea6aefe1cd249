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

import collections
import os
import re
from typing import NamedTuple

import jax

from ushard.errors import UserError, install_hint

# libtpu looks for a TPU VM's metadata when it starts, and lets one process at a time hold the chips
# (/tmp/libtpu_lockfile); off a TPU VM there are no chips, and these keep it quiet and unlocked.
_NOT_ON_A_TPU_VM = {"TPU_ACCELERATOR_TYPE": "v5p-8", "TPU_WORKER_HOSTNAMES": "localhost", "TPU_WORKER_ID": "0",
                    "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
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
        raise UserError(f"compiling for a TPU topology needs libtpu; {install_hint('tpu')}.") from None
    from jax.experimental import topologies

    _quiet_libtpu()
    options = {"chip_config_name": "megacore"} if topology.split(":")[0] in _MEGACORE else {}
    if num_slices > 1:
        options["num_slices"] = num_slices
    try:
        return list(topologies.get_topology_desc(topology, "tpu", **options).devices)
    except jax.errors.JaxRuntimeError as e:
        if "INVALID_ARGUMENT" not in str(e):  # not the name: libtpu itself failed
            raise
        reason = " ".join(str(e).split()).removeprefix("INVALID_ARGUMENT: ").rstrip(".")
        raise UserError(f"libtpu does not know the TPU topology {topology!r} ({reason}); "
                        f"write it as {TOPOLOGY_FORM}.") from None


def _quiet_libtpu() -> None:
    """Off a TPU VM, libtpu's environment defaults (a user's own values stay)."""
    if jax.default_backend() != "tpu":
        for name, value in _NOT_ON_A_TPU_VM.items():
            os.environ.setdefault(name, value)


def build_for(config, topology: str = "v5p:4x4x4", num_slices: int = 1):
    """`ushard.build(config)` on `num_slices` slices of the TPU `topology` (compile-only devices)."""
    from ushard.build import build

    return build(config, tpu_devices(topology, num_slices))


def lower_train_step(setup):
    """The train step of `setup` (ushard.build's), lowered for abstract inputs of its shardings."""
    t = setup.config.train
    token_ids = jax.ShapeDtypeStruct((t.batch_size, t.seq_len), "int32", sharding=setup.layout.batch)
    batch = dict.fromkeys(setup.steps.batch_shardings, token_ids)
    return setup.steps.train_step.lower(setup.steps.abstract_state(), batch)


def compile_train_step(setup) -> jax.stages.Compiled:
    """The compiled train step of `setup`; a step the chips' memory cannot hold is the user's sentence."""
    try:
        return lower_train_step(setup).compile()
    except jax.errors.JaxRuntimeError as e:
        if not str(e).startswith("RESOURCE_EXHAUSTED"):
            raise
        raise UserError(_out_of_memory(str(e), setup.mesh.devices.flat[0].device_kind)) from None


def _out_of_memory(message: str, kind: str) -> str:
    """One sentence for the compiler's RESOURCE_EXHAUSTED `message` on `kind` chips."""
    scoped = re.search(r"Scoped allocation with size [\d.]+\w+ and limit [\d.]+\w+ exceeded scoped vmem limit by "
                       r"[\d.]+\w+", message)
    if "ScopedVmemOom" in message and scoped:
        return (f"the train step does not compile for {kind} chips: a fusion needs more than the compiler's "
                f"scoped vector memory ({scoped.group(0)}); with model.attention_impl='xla' that is attention's "
                f"[T, T] scores, which splash attention ('auto' on TPUs) never materialises.")
    reason = " ".join(message.removeprefix("RESOURCE_EXHAUSTED: ").split()).split(". ")[0].rstrip(".")
    return (f"the train step does not fit on {kind} chips ({reason}); split the state over more chips "
            f"(mesh.fsdp), lower train.batch_size or set model.remat.")


def compile_for(config, topology: str = "v5p:4x4x4", num_slices: int = 1) -> jax.stages.Compiled:
    """The compiled train step of `config` on `num_slices` slices of the TPU `topology`, laid out as
    training there would lay it out (`config.mesh.dcn.*` puts axes across the slices). Raises
    UserError for a topology libtpu does not know, a config that does not fit its devices, or a step
    that does not fit in the chips' memory."""
    return compile_train_step(build_for(config, topology, num_slices))


# --------------------------------------------------------------------------- reading the executable

COLLECTIVE_KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
# Across TPU slices XLA lowers a collective to host-transfer `send`/`recv` pairs that the megascale
# runtime carries over the data-center network (DCN); each `send` names the collective it stands for.
_DCN_TRANSFER = re.compile(r'_xla_megascale_transfer_type="(\w+)"')
_DCN_KINDS = {"ALL_REDUCE": "all-reduce", "ALL_GATHER": "all-gather", "REDUCE_SCATTER": "reduce-scatter",
              "ALL_TO_ALL": "all-to-all", "ONE_TO_ONE": "collective-permute"}
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.*?) ([a-z][\w\-]*)\((.*)$")
_ARRAY = re.compile(r"\b(pred|[a-z]+\d+)\[([\d,]*)\]")
# The computations an instruction runs: fusions, loop bodies, branches (not reducers' `to_apply`).
_CALLED = re.compile(r"\b(?:calls|body|branch_computations|true_computation|false_computation)"
                     r"=\{?(%?[\w.\-]+(?:, %?[\w.\-]+)*)")
_CONDITION = re.compile(r"\bcondition=%?([\w.\-]+)")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2,
          "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}


def _array_bytes(dtype: str, dims: str) -> int:
    count = 1
    for d in filter(None, dims.split(",")):
        count *= int(d)
    return count * _BYTES.get(dtype, 4)


def _result_bytes(shape_text: str) -> int:
    return sum(_array_bytes(dtype, dims) for dtype, dims in _ARRAY.findall(shape_text))


class Instruction(NamedTuple):
    name: str
    opcode: str
    shape: str  # the result's shape, as text
    rest: str  # operands and attributes, as text


def computations(hlo_text: str) -> tuple[dict[str, list[Instruction]], str]:
    """{computation name: its instructions in order} and the ENTRY computation's name."""
    found, current, entry = {}, None, None
    for line in hlo_text.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            head = line.split()
            current = (head[1] if head[0] == "ENTRY" else head[0]).lstrip("%")
            found[current] = []
            entry = current if head[0] == "ENTRY" else entry
        elif current is not None:
            m = _INSTRUCTION.match(line)
            if m:
                found[current].append(Instruction(m.group(1), m.group(3), m.group(2), m.group(4)))
    return found, entry


def callees(rest: str) -> list[str]:
    """The computations an instruction runs (fusions, loop bodies, branches), from its `rest`."""
    return [callee.lstrip("%") for called in _CALLED.findall(rest) for callee in called.split(", ")]


def _trip_count(rest: str, by_name: dict) -> int:
    """Iterations of a `while` loop: XLA's known trip count (GPU, CPU) or, as TPU executables have it,
    the bound N of the condition `counter < N` with the counter starting at 0 (1 when neither is seen)."""
    known = _TRIP_COUNT.search(rest)
    if known:
        return int(known.group(1))
    condition = _CONDITION.search(rest)
    lines = by_name.get(condition.group(1), ()) if condition else ()
    bounds = [int(r.split(")")[0]) for _, opcode, _, r in lines if opcode == "constant" and r.split(")")[0].isdigit()]
    less_than = any(opcode == "compare" and "direction=LT" in r for _, opcode, _, r in lines)
    return bounds[0] if less_than and len(bounds) == 1 else 1


def _dcn_kind(opcode: str, rest: str) -> str | None:
    """'dcn all-reduce' etc. for the `send` half of a collective that crosses TPU slices, else None."""
    transfer = _DCN_TRANSFER.search(rest) if opcode == "send" else None
    return transfer and "dcn " + _DCN_KINDS.get(transfer.group(1), transfer.group(1).lower())


def collectives_per_step(hlo_text: str) -> dict[str, tuple[int, int]]:
    """{kind: (how many run per step, bytes of their results per device)} from an executable's HLO
    (`compiled.as_text()`). Collectives inside a loop count once per iteration (e.g. the layer scan);
    an asynchronous pair (`-start` / `-done`) counts once. What crosses TPU slices counts apart, as
    'dcn <kind>' with the bytes each device sends."""
    by_name, entry = computations(hlo_text)
    found = collections.defaultdict(lambda: [0, 0])

    def visit(name: str, times: int) -> None:
        for _, opcode, shape, rest in by_name.get(name, ()):
            kind = opcode.removesuffix("-start").removesuffix("-done")
            dcn = _dcn_kind(opcode, rest)
            if dcn:
                found[dcn][0] += times
                found[dcn][1] += times * _array_bytes(*_ARRAY.search(shape).groups())  # (data, context, token)
            elif kind in COLLECTIVE_KINDS:
                # An asynchronous pair counts at its start; its size is what the `-done` returns (the
                # start's result also holds the operand and, for a permute, synchronisation flags).
                found[kind][0] += times if not opcode.endswith("-done") else 0
                found[kind][1] += times * _result_bytes(shape) if not opcode.endswith("-start") else 0
            repeat = times * _trip_count(rest, by_name) if opcode == "while" else times
            for callee in callees(rest):
                visit(callee, repeat)

    visit(entry, 1)
    kinds = [k for k in COLLECTIVE_KINDS if k in found] + sorted(k for k in found if k.startswith("dcn "))
    return {kind: tuple(found[kind]) for kind in kinds}


def peak_bytes(memory) -> int:
    """What a device holds at the peak by a compiled step's `memory_analysis()`: arguments and outputs,
    less the outputs that reuse donated arguments, and the temporaries."""
    return (memory.argument_size_in_bytes + memory.output_size_in_bytes - memory.alias_size_in_bytes
            + memory.temp_size_in_bytes)


def summary(compiled: jax.stages.Compiled) -> str:
    """Per-device memory and the collectives per step of a compiled step, as lines a person reads."""
    mem = compiled.memory_analysis()
    gib = lambda n: f"{n / 2**30:.2f} GiB"  # noqa: E731
    lines = ["memory per device:"]
    for label, value in (("arguments", mem.argument_size_in_bytes), ("outputs", mem.output_size_in_bytes),
                         ("aliased (donated)", mem.alias_size_in_bytes), ("temporaries", mem.temp_size_in_bytes),
                         ("generated code", mem.generated_code_size_in_bytes)):
        lines.append(f"  {label:<18} {gib(value)}")
    peak = getattr(mem, "peak_memory_in_bytes", 0) or peak_bytes(mem)
    lines.append(f"  {'peak':<18} {gib(peak)}")
    lines.append("collectives per step (per device):")
    per_step = collectives_per_step(compiled.as_text())
    for kind, (count, size) in per_step.items():
        lines.append(f"  {kind:<22} {count:>6} x, {gib(size)}")
    if not per_step:
        lines.append("  none")
    return "\n".join(lines)
