"""`ushard plan`: will a layout fit, how fast will it run, and which layout to use, without the hardware.

A config is laid out on stand-in devices exactly as training would lay it out (`ushard.build`):
simulated CPU devices for `--devices N` and `--gpus KIND:PERxHOSTS`, libtpu's compile-only devices
for `--topology` (the `tpu` extra). Then, per device:
- memory: `ushard.estimate` (state and batch exact, activations traced under the remat policy), set
  against the chip's HBM;
- time: `ushard.step_time` (compute from the FLOPs, collectives per mesh axis at the bandwidth of
  the link that axis crosses, the pipeline bubble, what hides behind compute and why);
- with `compile=True`, the real train step compiled for those devices, XLA's memory analysis and the
  collectives in its HLO, beside the estimate (`ushard.aot`).

`recommend` searches layouts (mesh shapes, ZeRO stage, remat policy, pipeline schedule and
microbatches, context mode, expert parallelism) and ranks those that fit by predicted step time.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field

from ushard.errors import UserError, install_hint

GIB = 2**30
GPU_FORM = "KIND:PERxHOSTS, e.g. h100:8x4 (4 hosts of 8 H100s) or h200:4"


@dataclass(frozen=True)
class Target:
    """The machine a plan is for: how many devices, what they are, and how they are grouped in hosts."""

    devices: tuple  # stand-in devices the config is laid out on (CPU, or compile-only TPU devices)
    hardware: object  # ushard.step_time.Hardware
    per_host: int  # devices joined by the fast link (NVLink, a TPU slice's ICI)
    what: str  # one phrase, e.g. "4 hosts of 8 h100"
    usable: float = 1.0  # the share of the chip's HBM a run may take (`usable_share`)
    usable_why: str = ""

    @property
    def count(self) -> int:
        return len(self.devices)

    @property
    def hbm_bytes(self) -> int:
        """What one device gives the run: the part of its HBM JAX lets a process allocate."""
        return int(self.hardware.hbm_bytes * self.usable)


# JAX preallocates this share of a GPU's memory for a process unless XLA_PYTHON_CLIENT_MEM_FRACTION
# says otherwise (JAX's GPU memory allocation docs); on TPUs a process has the whole HBM.
JAX_GPU_MEMORY_SHARE = 0.75


def usable_share(platform: str) -> tuple[float, str]:
    """(share of HBM a run gets, why), from the environment the run would have: this process's."""
    import os

    if platform != "gpu":
        return 1.0, ""
    given = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
    try:
        share = float(given) if given else JAX_GPU_MEMORY_SHARE
    except ValueError:
        raise UserError(f"XLA_PYTHON_CLIENT_MEM_FRACTION={given!r} is not a number.") from None
    source = ("from XLA_PYTHON_CLIENT_MEM_FRACTION" if given
              else "JAX's default, which XLA_PYTHON_CLIENT_MEM_FRACTION changes")
    return share, f"{share:.0%} of the HBM, {source}"


def parse_gpus(text: str) -> tuple[str, int, int]:
    """"h100:8x4" -> ("h100", 8 a host, 4 hosts); "h200:4" -> one host of 4."""
    kind, _, shape = text.partition(":")
    parts = shape.split("x") if shape else []
    if not kind or not 1 <= len(parts) <= 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise UserError(f"--gpus={text!r} is not a GPU cluster; write it as {GPU_FORM}.")
    per_host, hosts = int(parts[0]), int(parts[1]) if len(parts) == 2 else 1
    return kind.lower(), per_host, hosts


def cpu_devices(count: int) -> tuple:
    """`count` simulated CPU devices. Where this process has not started JAX yet and the user set no
    JAX_NUM_CPU_DEVICES, JAX is asked for that many; otherwise the devices it has must be enough."""
    import os

    import jax
    from jax._src import xla_bridge

    if not xla_bridge.backends_are_initialized() and "JAX_NUM_CPU_DEVICES" not in os.environ:
        jax.config.update("jax_num_cpu_devices", count)
    devices = jax.devices("cpu")
    if len(devices) < count:
        raise UserError(f"planning for {count} devices lays the config out on {count} simulated CPU devices, and "
                        f"this process has {len(devices)}; set JAX_NUM_CPU_DEVICES={count}.")
    return tuple(devices[:count])


# `--bandwidth NAME=GB/s`: the links a plan's collectives cross (ushard.step_time.Hardware's fields).
LINKS = {"intra_host": "intra_host_bw", "inter_host": "inter_host_bw", "p2p": "p2p_bw"}


def target_for(devices: int | None = None, topology: str | None = None, gpus: str | None = None,
               num_slices: int = 1, hbm_gib: float | None = None, hardware: str | None = None,
               bandwidths: list[str] = ()) -> Target:
    """The machine of `ushard plan`'s flags: `gpus` ("h100:8x4"), a TPU `topology` ("v5p:4x4x4", with
    `num_slices`), or `devices` of `hardware` (a preset name of ushard.step_time; default h100).
    `hbm_gib` is what one device gives the run (default: the chip's HBM, on GPUs the share JAX
    allocates, `usable_share`); `bandwidths`, "NAME=GB/s" items, the links' (`LINKS`)."""

    if sum(x is not None for x in (devices, topology, gpus)) != 1:
        raise UserError("name the machine once: --devices N, --topology GENERATION:SHAPE or --gpus KIND:PERxHOSTS.")
    if hbm_gib is not None and not hbm_gib > 0:
        raise UserError(f"--hbm={hbm_gib} must be a positive number of GiB.")
    if gpus is not None:
        kind, per_host, hosts = parse_gpus(gpus)
        chip = chip_named(kind, "--gpus")
        found, what = cpu_devices(per_host * hosts), f"{hosts} host(s) of {per_host} {kind}"
    elif topology is not None:
        from ushard import aot

        found = tuple(aot.tpu_devices(topology, num_slices))
        chip = chip_named(topology.split(":")[0], "--topology")
        per_host = len(found) // num_slices  # a slice's chips share its ICI; DCN joins the slices
        what = f"{num_slices} x {topology} ({len(found)} chips)"
    else:
        if devices < 1:
            raise UserError(f"--devices={devices} must be at least 1.")
        chip = chip_named(hardware or "h100", "--hardware")
        per_host = min(devices, chip.devices_per_host)
        found, what = cpu_devices(devices), f"{devices} {chip.name}"
    chip = chip.replace(devices_per_host=per_host)
    usable, why = usable_share(chip.platform)
    if hbm_gib is not None:
        chip, usable, why = chip.replace(hbm_bytes=int(hbm_gib * GIB)), 1.0, "--hbm"
    for item in bandwidths:
        name, _, value = item.partition("=")
        try:
            rate = float(value)
        except ValueError:
            rate = 0.0
        if name not in LINKS or not rate > 0:
            raise UserError(f"--bandwidth {item!r} is not NAME=GB/s with NAME one of {', '.join(LINKS)} and a "
                            f"positive rate.")
        chip = chip.replace(**{LINKS[name]: rate * 1e9})
    return Target(devices=found, hardware=chip, per_host=per_host, what=what, usable=usable, usable_why=why)


def chip_named(name: str, flag: str):
    from ushard import step_time

    if name.lower() not in step_time.HARDWARE:
        raise UserError(f"{flag} names {name!r}, a chip the planner has no figures for; choose one of: "
                        f"{', '.join(step_time.HARDWARE)}.")
    return step_time.hardware(name)


@dataclass
class Assessment:
    """One layout of one config on a target: its memory per device, its predicted step, and, where
    compiled, what XLA made of it."""

    overrides: dict  # the `--config.` settings that make this layout (recommend's), else {}
    setup: object
    memory: object | None  # ushard.estimate.MemoryEstimate; None where the estimate does not model it
    memory_note: str  # why the memory is unknown, else ""
    time: object | None  # ushard.step_time.StepTime
    parameters: int  # bytes per device, of the state above
    optimizer_state: int
    hbm_bytes: int  # the chip's
    compiled: dict | None = None  # {"peak_bytes", "argument_bytes", "temp_bytes", "collectives"}
    reasons: list = field(default_factory=list)  # why recommend chose it

    @property
    def fits(self) -> bool | None:
        return None if self.memory is None else self.memory.peak <= self.hbm_bytes


# What a GPU reports as its device kind: the planner chooses kernels per chip (ushard/plan.py).
GPU_KINDS = {"h100": "NVIDIA H100 80GB HBM3", "h200": "NVIDIA H200"}


def assess(config, target: Target, compile: bool = False, overrides: dict | None = None) -> Assessment:
    """Lays `config` out on `target` and estimates its memory and step time (and compiles it). For a GPU
    target the layout is traced with the GPU's kernels (`GPU_KINDS`) on the simulated devices."""
    from ushard import estimate, step_time
    from ushard.build import build
    from ushard.kernels.attention import traced_off_the_chip

    gpu = target.hardware.platform == "gpu"
    setup = build(config, list(target.devices), *(("gpu", GPU_KINDS[target.hardware.name]) if gpu else ()))
    parameters, optimizer_state, _ = estimate_state_bytes(setup)
    try:
        with traced_off_the_chip():
            memory, note = estimate.estimate(setup), ""
    except NotImplementedError as e:
        memory, note = None, str(e)
    time = step_time.predict(setup, target.hardware)
    result = Assessment(overrides=dict(overrides or {}), setup=setup, memory=memory, memory_note=note,
                        time=time, parameters=parameters, optimizer_state=optimizer_state,
                        hbm_bytes=target.hbm_bytes)
    if compile:
        add_compiled(result, target)
    return result


def add_compiled(a: Assessment, target: Target) -> None:
    """Compiles `a`'s train step for the target's stand-in devices, with their own kernels (a GPU
    target's simulated CPU devices cannot compile cuDNN), and records XLA's figures in `a.compiled`."""
    from ushard.build import build

    setup = a.setup
    if setup.plan.platform != target.devices[0].platform:
        setup = build(setup.config, list(target.devices))
    a.compiled = compiled_figures(setup)


def compiled_figures(setup) -> dict:
    """XLA's view of the train step on `setup`'s own devices: its memory analysis per device and its
    collectives per step, and the estimate of that same program (on simulated CPU devices it runs the
    CPU's kernels, e.g. XLA attention, which may differ from the target's)."""
    from ushard import aot, estimate

    try:
        estimated = estimate.estimate(setup).peak
    except NotImplementedError:
        estimated = None
    compiled = aot.compile_train_step(setup)
    memory = compiled.memory_analysis()
    peak = aot.peak_bytes(memory)
    collectives = {kind: {"count": count, "bytes": size}
                   for kind, (count, size) in aot.collectives_per_step(compiled.as_text()).items()}
    return {"peak_bytes": int(peak), "argument_bytes": int(memory.argument_size_in_bytes),
            "temp_bytes": int(memory.temp_size_in_bytes), "collectives": collectives,
            "platform": setup.plan.platform, "estimate_peak_bytes": estimated}


# --------------------------------------------------------------------------- the report

# What each term of the estimate is, in the report's words (fields of estimate.MemoryEstimate).
TERMS = {
    "saved_activations": "activations kept for the backward pass",
    "layer_activations": "working set of the layers being pulled back",
    "gradients": "gradients (float32)",
    "pipeline_buffers": "pipeline buffers",
    "vocabulary_buffers": "vocabulary's buffers (outer weights, embedding gradient)",
    "kept_state": "old optimizer moments kept (on_nonfinite=skip)",
    "logits_gradient": "logits' gradient",
}


def lasting_parts(a: Assessment) -> list[tuple[str, int]]:
    """(label, bytes) of what lives through the whole step: the state, the batch, kept weights."""
    m = a.memory
    return [("parameters", a.parameters), ("optimizer state", m.state - a.parameters), ("batch", m.batch),
            ("gathered layer weights kept (ZeRO-3)", m.kept_weights)]


def memory_parts(a: Assessment) -> list[tuple[str, int]]:
    """(label, bytes) of the peak by part, summing to it: what lasts, then the peak phase's terms."""
    peak_terms = a.memory.phases()[a.memory.peak_phase]
    return lasting_parts(a) + [(TERMS[name], n) for name, n in peak_terms.items()]


def _gib(n: int) -> str:
    return f"{n / GIB:8.2f} GiB"


def memory_lines(a: Assessment, target: Target) -> list[str]:
    zero = a.setup.plan.zero_stage
    lines = [f"memory per device (estimate; ZeRO-{zero}, remat {a.setup.model_config.remat!r}):"]
    if a.memory is None:
        lines.append(f"  not estimated: {a.memory_note}")
    else:
        m, phases = a.memory, a.memory.phases()
        lines += [f"  {label:<60}{_gib(n)}" for label, n in lasting_parts(a) if n]
        lines.append(f"  at its peak, {m.peak_phase}:")
        lines += [f"    {TERMS[name]:<58}{_gib(n)}" for name, n in phases[m.peak_phase].items() if n]
        others = [f"{name} {sum(terms.values()) / GIB:.2f} GiB" for name, terms in phases.items()
                  if terms and name != m.peak_phase]
        if others:
            lines.append(f"  (the other phases: {', '.join(others)})")
        verdict = "fits" if a.fits else "does NOT fit"
        usable = f" ({target.usable_why})" if target.usable_why else ""
        lines.append(f"  {'peak':<60}{_gib(a.memory.peak)}  of {a.hbm_bytes / GIB:.1f} GiB{usable}: {verdict}")
    if a.compiled is not None:
        peak, estimated = a.compiled["peak_bytes"], a.compiled["estimate_peak_bytes"]
        ratio = f"  (its estimate: {estimated / peak:.2f} of it)" if estimated and peak else ""
        lines.append(f"  {'compiled peak (XLA memory analysis)':<60}{_gib(peak)}{ratio}")
        if a.compiled["platform"] != a.setup.plan.platform:
            lines.append(f"  (compiled for the {a.compiled['platform'].upper()} devices here, with their kernels)")
    return lines


def compiled_collective_lines(a: Assessment) -> list[str]:
    if a.compiled is None:
        return []
    lines = ["collectives in the compiled step (per step, per device):"]
    for kind, c in sorted(a.compiled["collectives"].items()):
        lines.append(f"  {kind:<28}{c['count']:6d} x, {c['bytes'] / 2**20:12.1f} MiB")
    return lines + ([] if a.compiled["collectives"] else ["  none"])


def report(a: Assessment, target: Target) -> str:
    """The text `ushard plan` prints for one layout."""

    head = (f"ushard plan: {a.setup.model.num_params() / 1e9:.2f}B parameters on {target.what} "
            f"({target.count} devices, {target.per_host} a {target.hardware.host})")
    hw = target.hardware
    links = (f"links (GB/s a device): intra_host {hw.intra_host_bw / 1e9:.0f}, p2p {hw.p2p_bw / 1e9:.0f}, "
             f"inter_host {hw.inter_host_bw / 1e9:.1f} (--bandwidth NAME=GB/s to change)")
    lines = [head, a.setup.plan.describe().rstrip("\n"), links, ""]
    lines += memory_lines(a, target)
    lines += [""] + a.time.describe().split("\n")
    if a.compiled is not None:
        lines += [""] + compiled_collective_lines(a)
    return "\n".join(lines)


def as_json(a: Assessment, target: Target) -> dict:
    """`ushard plan --json`: the same content as one object."""
    plan = a.setup.plan
    memory = None if a.memory is None else {
        "peak_bytes": a.memory.peak, "parameters_bytes": a.parameters, "optimizer_state_bytes": a.optimizer_state,
        **{f"{name}_bytes": value for name, value in a.memory.breakdown.items() if name != "state"},
        "fits": a.fits}
    out = {
        "target": {"what": target.what, "devices": target.count, "per_host": target.per_host,
                   "hardware": target.hardware.name, "hbm_bytes": a.hbm_bytes,
                   "bandwidths_bytes_per_s": {name: getattr(target.hardware, field) for name, field in LINKS.items()}},
        "layout": {"mesh": {axis: size for axis, size in plan.mesh_shape if size > 1}, "zero_stage": plan.zero_stage,
                   "remat": a.setup.model_config.remat, "sequence_parallel": plan.sequence_parallel,
                   "pipeline": None if plan.pipeline is None else dataclasses.asdict(plan.pipeline),
                   "context_mode": plan.context_mode, "expert_dispatch": plan.expert_dispatch},
        "estimate": {"peak_bytes": None if a.memory is None else a.memory.peak, "memory": memory,
                     "memory_note": a.memory_note or None, **time_figures(a.time)},
        "overrides": overrides_text(a.overrides),
    }
    if a.compiled is not None:
        out["compiled"] = a.compiled
    if a.reasons:
        out["reasons"] = a.reasons
    return out


def time_figures(t) -> dict:
    """A StepTime (ushard.step_time) as JSON: the step and its parts, and every collective."""
    return {"step_s": t.step_s, "compute_s": t.compute_s, "compute_parts_s": dict(t.compute_parts),
            "exposed_communication_s": t.exposed_s, "bubble_s": t.bubble_s, "bubble_fraction": t.bubble_fraction,
            "tokens_per_s": t.tokens_per_s, "tflops_per_device": t.tflops_per_device, "mfu": t.mfu,
            "collectives": [dataclasses.asdict(c) for c in t.collectives]}


def time_parts(t) -> list[tuple[str, float]]:
    """The step's seconds by part, for the chart: compute, exposed communication, the bubble."""
    return [("compute", t.compute_s), ("exposed communication", t.exposed_s), ("pipeline bubble", t.bubble_s)]


def overrides_text(overrides: dict) -> list[str]:
    return [f"--config.{key}={value}" for key, value in overrides.items()]


# --------------------------------------------------------------------------- recommend

# Remat policies from the least recomputation to the most: the search takes the first that fits.
REMAT_ORDER = ("none", "dots_attention", "dots", "full")
# Sequences from this long are candidates for context parallelism (`mesh.sequence`).
LONG_SEQUENCE = 16384


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def mesh_candidates(config, target: Target, forced: bool = False) -> list[tuple[dict, list[str]]]:
    """Mesh shapes to try, each with the reasons it follows the rule of thumb: tensor parallelism
    inside a host; pipeline stages across hosts (or, with `forced`, wherever memory needs them);
    context parallelism for long sequences; for an MoE model, experts split before tensor; ZeRO over
    the rest (`fsdp`), and also replicas across hosts (`data`) with ZeRO inside each."""
    n, per_host = target.count, target.per_host
    hosts = n // per_host
    moe = config.model.moe.num_experts
    long = config.train.seq_len >= LONG_SEQUENCE
    pipelines = [1] + [p for p in divisors(n) if p > 1 and (forced or (hosts > 1 and hosts % p == 0))]
    shapes = []
    for pipeline, tensor in itertools.product(pipelines, divisors(per_host)):
        if (n // pipeline) % tensor:
            continue
        rest = n // pipeline // tensor
        for sequence in [1] + [s for s in divisors(rest) if s > 1 and (long or forced)]:
            experts = [e for e in divisors(rest // sequence) if moe and moe % e == 0] or [1]
            if moe and tensor > 1:
                experts = [max(experts)]  # tensor-parallel experts only once they are split as far as they go
            for expert in experts:
                ways = rest // sequence // expert
                mesh = {"pipeline": pipeline, "data": 1, "fsdp": ways, "expert": expert, "sequence": sequence,
                        "tensor": tensor}
                reasons = _mesh_reasons(mesh, per_host, hosts, moe, forced, target.hardware.host)
                shapes.append((mesh, reasons))
                replicas = hosts // pipeline
                if replicas > 1 and ways % replicas == 0 and ways > replicas:
                    shapes.append((dict(mesh, data=replicas, fsdp=ways // replicas),
                                   reasons + [f"data={replicas}: a replica a {target.hardware.host}, fsdp "
                                              "inside it"]))
    return shapes


def _mesh_reasons(mesh: dict, per_host: int, hosts: int, moe: int, forced: bool, host: str = "host") -> list[str]:
    reasons = []
    if mesh["tensor"] > 1:
        reasons.append(f"tensor={mesh['tensor']} inside a {host} of {per_host}")
    if mesh["pipeline"] > 1:
        reasons.append(f"pipeline={mesh['pipeline']}: " + ("nothing without stages fits" if forced else
                                                           f"stages across the {hosts} {host}s"))
    if mesh["sequence"] > 1:
        reasons.append(f"sequence={mesh['sequence']}: context parallelism for the long sequence")
    if mesh["expert"] > 1:
        reasons.append(f"expert={mesh['expert']}: the {moe} experts' work split over {mesh['expert']} devices")
    return reasons


def layout_variants(config, mesh: dict, unroll: bool = False) -> list[tuple[dict, list[str]]]:
    """The settings beyond the mesh to try with it, each with its reasons: every pipeline schedule (at
    the most microbatches up to four a stage that the batch divides into), for a split sequence both
    context modes, for split experts both ways of splitting them (whole experts a device, or every
    expert's hidden width), and with `unroll` (GPUs, where it was measured) a rolled layer loop also
    unrolled, outside pipelines."""
    base = {f"mesh.{axis}": size for axis, size in mesh.items()}
    base["parallel.sequence_parallel"] = mesh["tensor"] > 1
    moe = config.model.moe.num_experts
    splits = [({}, [])]
    if moe and mesh["expert"] > 1:
        base["model.moe.dispatch"] = "ragged"
        splits = [({"parallel.expert_split": "experts"},
                   [f"whole experts: {moe // mesh['expert']} of the {moe} a device, tokens exchanged to them"]),
                  ({"parallel.expert_split": "width"},
                   ["every expert's hidden width split: even work whatever the routing, nothing to overflow"])]
    pipelines = [({}, [])]
    if mesh["pipeline"] > 1:
        count = _microbatches(config, mesh)
        pipelines = [({"parallel.pipeline_schedule": schedule, "parallel.pipeline_microbatches": count,
                       "parallel.pipeline_repeats": 2 if schedule == "circular" else 1},
                      [f"{schedule} schedule, {count} microbatches"]) for schedule in ("1f1b", "gpipe", "circular")]
    contexts = [({}, [])]
    if mesh["sequence"] > 1:
        contexts = [({"parallel.context_parallel": mode}, [f"context parallelism by {mode}"])
                    for mode in ("ring", "all_gather")]
    loops = [({}, [])]
    layers = config.model.n_layers
    if unroll and mesh["pipeline"] == 1 and config.model.scan_unroll < layers:
        # Listed second: where unrolling gains nothing, the configured loop wins the tie.
        loops.append(({"model.scan_unroll": layers},
                      [f"the {layers}-layer loop unrolled: no stacked buffers to copy, and without remat each "
                       f"layer's activations freed as its gradients are written (compiles take longer)"]))
    return [({**base, **pipe, **context, **split, **loop}, why + more + how + unrolled)
            for (pipe, why), (context, more), (split, how), (loop, unrolled)
            in itertools.product(pipelines, contexts, splits, loops)]


def _microbatches(config, mesh: dict) -> int:
    """The most microbatches up to four per stage that the batch splits into evenly (a smaller bubble)."""
    t = config.train
    rows = t.batch_size // t.grad_accum
    split = mesh["data"] * mesh["fsdp"] * mesh["expert"]
    for count in range(4 * mesh["pipeline"], mesh["pipeline"] - 1, -1):
        if rows % count == 0 and (rows // count) % split == 0:
            return count
    return mesh["pipeline"]


def recommend(config, target: Target, top: int = 3, log=None) -> list[Assessment]:
    """The fastest `top` layouts that fit, by predicted step time, each with its reasons: per mesh
    shape (`mesh_candidates`), the least recomputation whose lowest fitting ZeRO stage fits. Pipeline
    stages within a host are tried only when nothing else fits; where nothing fits at all, the batch
    in more gradient-accumulation parts (`train.grad_accum`), doubling, while each part still gives
    every device a row."""
    found = _search(config, target, forced=False, log=log) or _search(config, target, forced=True, log=log)
    accumulate = config.train.grad_accum
    while not found and config.train.batch_size // (2 * accumulate) >= target.count:
        accumulate *= 2
        candidate = config.copy_and_resolve_references()
        candidate.train.grad_accum = accumulate
        if _leanest_fits(candidate, target):  # the full search only where the leanest layout fits
            found = _search(candidate, target, forced=False, log=log)
    for a in found:
        if accumulate != config.train.grad_accum:
            a.overrides["train.grad_accum"] = accumulate
            a.reasons.append(f"train.grad_accum={accumulate}: the batch in {accumulate} parts, so their "
                             f"activations fit")
    found.sort(key=lambda a: a.time.step_s)
    return found[:top]


def _leanest_fits(config, target: Target) -> bool:
    """Whether the layout with the least memory a device short of pipeline stages fits: ZeRO-3 over
    every device, full remat."""
    from ushard.config import apply_override_dict

    lean = config.copy_and_resolve_references()
    mesh = dict.fromkeys(("pipeline", "data", "expert", "sequence", "tensor"), 1)
    apply_override_dict(lean, {**{f"mesh.{a}": s for a, s in mesh.items()}, "mesh.fsdp": target.count,
                               "parallel.zero_stage": 3, "model.remat": "full"})
    try:
        return bool(assess(lean, target).fits)
    except UserError:
        return False


# `--recommend` says how far its search has come every this many layouts (each takes up to a few
# estimates of a second or so on a CPU).
PROGRESS_EVERY = 10


def _search(config, target: Target, forced: bool, log=None) -> list[Assessment]:
    from ushard.config import apply_override_dict

    def assessed(overrides: dict) -> Assessment | None:
        candidate = config.copy_and_resolve_references()
        try:
            apply_override_dict(candidate, overrides)
            return assess(candidate, target, overrides=overrides)
        except UserError as e:  # a layout the model or batch does not divide into
            if log:
                log(f"skipped {' '.join(overrides_text(overrides))}: {e}")
            return None

    found = []
    candidates = [(variant, reasons + more) for mesh, reasons in mesh_candidates(config, target, forced)
                  for variant, more in layout_variants(config, mesh, unroll=target.hardware.platform == "gpu")]
    if log:
        log(f"searching {len(candidates)} layouts of {target.what}" + (" with pipeline stages" if forced else "")
            + ": each mesh shape's settings, from its leanest")
    for index, (variant, reasons) in enumerate(candidates, 1):
        if log and index % PROGRESS_EVERY == 0:
            log(f"  {index} of {len(candidates)} layouts searched, {len(found)} fit so far")
        # Its leanest setting first (ZeRO-3, the most recomputation): where that does not fit, no
        # other does, and the search moves on after one estimate instead of sixteen.
        leanest = assessed({**variant, "parallel.zero_stage": 3, "model.remat": REMAT_ORDER[-1]})
        if leanest is None or not leanest.fits:
            continue
        for remat in REMAT_ORDER:
            fitted = None
            for zero in range(4):
                a = assessed({**variant, "parallel.zero_stage": zero, "model.remat": remat})
                if a is None:
                    break
                if a.fits:
                    fitted = a
                    break
            if fitted is not None:
                fitted.reasons = reasons + [f"ZeRO-{fitted.setup.plan.zero_stage}: the lowest stage that fits "
                                            f"({fitted.memory.peak / GIB:.1f} of {target.hbm_bytes / GIB:.0f} GiB)",
                                            f"remat {remat!r}: the least recomputation that fits"]
                found.append(fitted)
                break  # more remat only adds recomputation
    return found


def recommendations(found: list[Assessment], target: Target) -> str:
    """`ushard plan --recommend`'s text: each layout's overrides, predicted step, memory and reasons."""
    lines = [f"ushard plan: the {len(found)} fastest layouts that fit {target.what} "
             f"({target.hbm_bytes / GIB:.0f} GiB a device), by predicted step time:"]
    for rank, a in enumerate(found, 1):
        t = a.time
        lines += ["", f"{rank}. {' '.join(overrides_text(a.overrides))}",
                  f"   step {t.step_s * 1e3:.1f} ms, {t.tflops_per_device:.0f} TFLOP/s a device, MFU "
                  f"{t.mfu:.1%}; peak {a.memory.peak / GIB:.1f} GiB a device"]
        if a.compiled is not None:
            c = a.compiled
            ratio = f" (its estimate: {c['estimate_peak_bytes'] / c['peak_bytes']:.2f} of it)" \
                if c["estimate_peak_bytes"] else ""
            lines.append(f"   compiled for the {c['platform'].upper()} devices here: peak "
                         f"{c['peak_bytes'] / GIB:.1f} GiB{ratio}")
        lines += [f"   - {reason}" for reason in a.reasons]
    return "\n".join(lines)


def chart(found: list[Assessment], target: Target, path: str) -> None:
    """A PNG: per layout, the memory per device by part (against the HBM) and the step time by part."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError(f"--chart needs matplotlib; {install_hint('plot')}.") from None
    names = [f"{i + 1}" if a.overrides else "this layout" for i, a in enumerate(found)]
    figure, (memory_axes, time_axes) = plt.subplots(1, 2, figsize=(12, 1.2 + 0.9 * len(found)))
    colours = {}  # one colour a part, the same in every layout's bar; labelled once
    for row, a in enumerate(found):
        left = 0.0
        if a.memory is not None:
            for label, n in memory_parts(a):
                new = label not in colours
                colour = colours.setdefault(label, plt.cm.tab20.colors[len(colours)])
                memory_axes.barh(row, n / GIB, left=left, color=colour, label=label if new else None)
                left += n / GIB
        left = 0.0
        for (label, seconds), colour in zip(time_parts(a.time), plt.cm.Set2.colors):
            time_axes.barh(row, seconds * 1e3, left=left, color=colour, label=label if row == 0 else None)
            left += seconds * 1e3
    memory_axes.axvline(target.hbm_bytes / GIB, color="black", linestyle="--", label="HBM")
    for axes, title in ((memory_axes, "memory per device, GiB"), (time_axes, "predicted step, ms")):
        axes.set_yticks(range(len(found)), names)
        axes.invert_yaxis()
        axes.set_title(title)
        axes.legend(fontsize="small", loc="lower right")
    figure.suptitle(f"ushard plan on {target.what}")
    figure.tight_layout()
    try:
        figure.savefig(path, dpi=120)
    except OSError as e:
        raise UserError(f"--chart={path} could not be written ({e.strerror or e}).") from None
    finally:
        plt.close(figure)


# --------------------------------------------------------------------------- before a run

def device_memory(setup) -> int | None:
    """The bytes one of this process's devices gives a run, where the device reports it (GPUs, TPUs)."""
    device = setup.mesh.local_devices[0]
    try:
        stats = device.memory_stats()
    except (NotImplementedError, RuntimeError):  # backends that keep no allocator statistics
        return None
    return (stats or {}).get("bytes_limit")


def estimate_state_bytes(setup) -> tuple[int, int, int]:
    """(parameters, optimizer state, float32 gradients): one device's bytes, from the shardings; with
    LoRA the parameters are the frozen base and the adapters, the rest the adapters'. The parameters
    include DPO's frozen reference copy where the state holds one."""
    from ushard import estimate

    state = setup.steps.abstract_state()
    return (estimate.shard_bytes((state.params, state.frozen, state.reference)), estimate.shard_bytes(state.opt_state),
            estimate.gradient_bytes(setup, state))


def check_state_fits(setup, limit: int | None = None) -> None:
    """Refuses, before anything is allocated, a layout whose training state alone (parameters,
    optimizer state and float32 gradients, laid out as the ZeRO stage lays them, the gradients as the
    compiler holds them: `estimate.gradient_bytes`) exceeds the device's memory, with the numbers.
    Nothing is traced: the activations' estimate stays with `ushard plan`, which says how much more a
    step needs."""
    limit = device_memory(setup) if limit is None else limit
    if not limit:
        return
    parameters, optimizer, gradients = estimate_state_bytes(setup)
    needed = parameters + optimizer + gradients
    if needed <= limit:
        return
    raise UserError(
        f"this layout cannot fit: its training state alone takes {needed / GIB:.1f} GiB a device (parameters "
        f"{parameters / GIB:.1f}, optimizer state {optimizer / GIB:.1f}, float32 gradients {gradients / GIB:.1f}) "
        f"and a device gives the run {limit / GIB:.1f} GiB; split the state over more devices (mesh.fsdp with "
        f"parallel.zero_stage=3), or run `ushard plan --recommend` for a layout that fits.")
