"""Which point-to-point transfers (collective-permutes) of a scheduled step have compute between their
start and done: those are the transfers the schedule lets overlap compute. Whether the hardware then
overlaps them is another matter: on GPUs it did not (docs/benchmarks.md).

    python tools/permute_schedule.py step.hlo.txt   # a scheduled executable's HLO (profile_step.py --dump)
    JAX_PLATFORMS=cpu python tools/permute_schedule.py --config bench_1b --topology v5p:2x2x2 [--config.a.b=v ...]

The second form compiles the train step for a TPU topology as `ushard compile` does (the `tpu` extra,
no TPU) and reads its HLO.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ushard.aot import Instruction, callees, computations  # noqa: E402

COMPUTE = ("convolution", "dot", "custom-call")  # matmuls (TPU: convolutions), kernels (splash, cuDNN, cuBLAS)


def permutes_beside_compute(hlo_text: str) -> tuple[int, int]:
    """(how many asynchronous collective-permutes have a matmul or kernel scheduled between their start
    and done, how many there are), over the computations of a scheduled executable's HLO. Each permute
    of the text counts once, loops or not."""
    by_name, _ = computations(hlo_text)

    def computes(instruction: Instruction) -> bool:
        if instruction.opcode in COMPUTE:
            return True
        inner = callees(instruction.rest) if instruction.opcode == "fusion" else ()
        return any(i.opcode in COMPUTE for callee in inner for i in by_name.get(callee, ()))

    beside = total = 0
    for instructions in by_name.values():
        started = {}  # a start's name -> whether compute has run since
        for instruction in instructions:
            if instruction.opcode == "collective-permute-start":
                started[instruction.name] = False
            elif instruction.opcode == "collective-permute-done":
                start = instruction.rest.split(")")[0].split(",")[0].strip().lstrip("%")
                total, beside = total + 1, beside + started.pop(start, False)
            elif started and computes(instruction):
                started = dict.fromkeys(started, True)
    return beside, total


def report(hlo_text: str) -> str:
    beside, permutes = permutes_beside_compute(hlo_text)
    if not permutes:
        return "no asynchronous collective-permutes in the program's text"
    return (f"collective-permutes with compute scheduled between start and done: {beside} of {permutes} "
            "in the program's text")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("hlo", nargs="?", help="a file of HLO text; without it, compile --config for --topology")
    parser.add_argument("--config", default="bench_1b")
    parser.add_argument("--topology", default="v5p:2x2x2")
    parser.add_argument("--num_slices", type=int, default=1)
    args, overrides = parser.parse_known_args(argv)
    unknown = [o for o in overrides if not o.startswith("--config.")]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.hlo:
        with open(args.hlo, encoding="utf-8") as f:
            print(report(f.read()))
        return
    import ushard

    config = ushard.load_config(args.config, [o.removeprefix("--config.") for o in overrides])
    print(report(ushard.compile_for(config, args.topology, args.num_slices).as_text()))


if __name__ == "__main__":
    main()
