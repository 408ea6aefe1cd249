"""Compiler settings derived from the config, per platform. XLA reads its flags once, when JAX starts
its backend, so entry points (the CLI, tools/) apply them before the first device is touched.

Where a setting means something on one platform only, it acts there and is reported elsewhere: a
line from `ignored_settings` (printed with the layout at start-up) says it does nothing on this
platform, rather than leaving it to act silently or not at all. No GPU setting has a libtpu
(`LIBTPU_INIT_ARGS`) equivalent that was seen to work (docs/dev-notes.md), so none is translated.
"""

from __future__ import annotations

import os

from ushard.errors import UserError

COMBINED_COLLECTIVES = ("all_gather", "reduce_scatter")


SYMMETRIC_BUFFERS = "--xla_gpu_experimental_enable_nccl_symmetric_buffers=true"


def flags_for(config) -> list[str]:
    """`parallel.collective_combine_mib`: XLA merges all-gathers (and reduce-scatters) of neighbouring
    weights up to this size into one collective. A whole layer per collective lets the scheduler start
    it a layer ahead instead of just before its first use (docs/benchmarks.md). 0 keeps XLA's default.
    `parallel.nccl_symmetric_buffers`: XLA allocates the collectives' buffers so that NCCL can register
    them and copy straight into its peers' memory."""
    p, flags = config.parallel, []
    if p.collective_combine_mib:
        flags += [f"--xla_gpu_{kind}_combine_threshold_bytes={p.collective_combine_mib * 2**20}" for kind in COMBINED_COLLECTIVES]
    if p.nccl_symmetric_buffers:
        flags.append(SYMMETRIC_BUFFERS)
    return flags


def check_compiles(config, cudnn_blocks: bool) -> None:
    """UserError for a compiler setting that XLA cannot compile with this layout. `cudnn_blocks`: whether
    the blocks of a split sequence run on cuDNN (`split_blocks`)."""
    p = config.parallel
    if p.nccl_symmetric_buffers and p.context_parallel == "ring" and cudnn_blocks:
        raise UserError("parallel.nccl_symmetric_buffers=true cannot compile with ring attention on cuDNN blocks: "
                        "XLA's GPU compiler aborts on a program holding both a collective-permute and a cuDNN "
                        "attention (JAX 0.11.2); use parallel.context_parallel='all_gather' with it, or turn it off.")


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
    if p.nccl_symmetric_buffers and platform != "gpu":
        notes.append(f"parallel.nccl_symmetric_buffers=true sets an XLA GPU flag for NCCL; ignored on {platform}.")
    if not p.reshard_after_forward and platform == "tpu":
        notes.append("parallel.reshard_after_forward=false is a GPU setting; ignored on tpu, where it turned the "
                     "gradients' reduce-scatters into all-reduces.")
    return notes
