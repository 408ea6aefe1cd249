"""Compiler settings derived from the config, per platform. XLA reads its flags once, when JAX starts
its backend, so entry points (the CLI, tools/) apply them before the first device is touched.

Where a setting means something on one platform only, it acts there and is reported elsewhere: a
line from `ignored_settings` (printed with the layout at start-up) says it does nothing on this
platform, rather than leaving it to act silently or not at all. No GPU setting has a libtpu
(`LIBTPU_INIT_ARGS`) equivalent that was seen to work (docs/dev-notes.md), so none is translated.
"""

from __future__ import annotations

import glob
import os

COMBINED_COLLECTIVES = ("all_gather", "reduce_scatter")


def flags_for(config) -> list[str]:
    """`parallel.collective_combine_mib`: XLA merges all-gathers (and reduce-scatters) of neighbouring
    weights up to this size into one collective. A whole layer per collective lets the scheduler start
    it a layer ahead instead of just before its first use (docs/benchmarks.md). 0 keeps XLA's default."""
    p, flags = config.parallel, []
    if p.collective_combine_mib:
        threshold = p.collective_combine_mib * 2**20
        flags += [f"--xla_gpu_{kind}_combine_threshold_bytes={threshold}" for kind in COMBINED_COLLECTIVES]
    return flags


def apply(config) -> None:
    """Puts the config's flags in front of XLA_FLAGS: a flag the user set there comes later and wins."""
    current = os.environ.get("XLA_FLAGS", "")
    flags = [f for f in flags_for(config) if f not in current.split()]  # applying twice adds nothing
    if flags:
        os.environ["XLA_FLAGS"] = " ".join(flags + [current]).strip()


def ignored_settings(config, platform: str) -> list[str]:
    """One line for each setting of `config` that has no effect on `platform` ("cpu", "gpu", "tpu")."""
    p, notes = config.parallel, []
    if p.collective_combine_mib and platform != "gpu":
        notes.append(f"parallel.collective_combine_mib={p.collective_combine_mib} sets XLA's GPU collective "
                     f"combiner; ignored on {platform}.")
    if not p.reshard_after_forward and platform == "tpu":
        notes.append("parallel.reshard_after_forward=false is a GPU setting; ignored on tpu, where it turned the "
                     "gradients' reduce-scatters into all-reduces.")
    return notes


# PCI vendor ids: Google's (TPU chips), NVIDIA's and AMD's (GPUs).
ACCELERATOR_VENDORS = ("0x1ae0", "0x10de", "0x1002")


def accelerators_present(root: str = "/") -> bool:
    """Whether this machine shows a TPU chip or a GPU: a PCI device of their vendors (TPU VMs and GPU
    hosts list theirs under /sys/bus/pci) or a GPU driver's device files, read without starting JAX."""
    for path in glob.glob(os.path.join(root, "sys/bus/pci/devices/*/vendor")):
        try:
            with open(path) as f:
                if f.read().strip() in ACCELERATOR_VENDORS:
                    return True
        except OSError:
            continue
    dev = os.path.join(root, "dev")
    return bool(glob.glob(os.path.join(dev, "nvidia[0-9]*")) or glob.glob(os.path.join(dev, "accel*"))
                or os.path.exists(os.path.join(dev, "kfd")))


def skip_an_absent_tpu() -> None:
    """JAX_PLATFORMS=cpu on a machine without an accelerator, unless the user set JAX_PLATFORMS: with
    libtpu installed (the tpu extra), JAX otherwise tries the TPU backend at start-up and libtpu prints
    its errors about the missing chip before every command. Compiling for a TPU topology (`ushard
    compile`, `ushard plan --topology`) needs no TPU backend: libtpu compiles under JAX_PLATFORMS=cpu.
    `import ushard` calls it, before JAX starts; where JAX started first, it changes nothing."""
    if "JAX_PLATFORMS" not in os.environ and not accelerators_present():
        os.environ["JAX_PLATFORMS"] = "cpu"
