"""Compiles a config's train step (compile only) with AdamW and with Muon's two layouts and prints the
collectives per step and the FLOPs of each, so that what Muon's Newton-Schulz adds can be read off:

    JAX_NUM_CPU_DEVICES=8 JAX_PLATFORMS=cpu python tools/muon_layouts.py --config bench_1b \\
        [--config.parallel.zero_stage=3 ...]

`owners` moves each matrix whole onto one device of the state's split and back; `gspmd` iterates on
the sharded momentum and leaves the collectives to XLA's partitioner (ushard/training/muon.py).
"""

from __future__ import annotations

import argparse
import sys

VARIANTS = {
    "adamw": ["optim.name=adamw"],
    "muon owners": ["optim.name=muon", "optim.muon.layout=owners"],
    "muon gspmd": ["optim.name=muon", "optim.muon.layout=gspmd"],
}


def measure(config_name: str, overrides: list[str]) -> dict[str, dict]:
    """{variant: {"collectives": {kind: (count, bytes)}, "bytes": total, "flops": compiled FLOPs}}."""
    from ushard.aot import collectives_per_step, compile_train_step
    from ushard.build import build
    from ushard.config import load_config

    out = {}
    for name, variant in VARIANTS.items():
        setup = build(load_config(config_name, [*overrides, *variant]))
        compiled = compile_train_step(setup)
        collectives = collectives_per_step(compiled.as_text())
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        out[name] = {"collectives": collectives, "bytes": sum(b for _, b in collectives.values()),
                     "flops": float(cost.get("flops", 0.0)), "plan": setup.plan.optimizer_why}
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="bench_1b")
    args, rest = parser.parse_known_args(argv)
    overrides = [r.removeprefix("--config.") for r in rest]
    results = measure(args.config, overrides)
    base = results["adamw"]
    for name, r in results.items():
        print(f"{name}: collectives {r['bytes'] / 2**30:.3f} GiB per device per step "
              f"({(r['bytes'] - base['bytes']) / 2**30:+.3f} against adamw), "
              f"FLOPs {r['flops'] / 1e12:.2f} T ({(r['flops'] - base['flops']) / 1e12:+.3f} T)")
        for kind, (count, size) in r["collectives"].items():
            print(f"    {kind:<20} {count:>5} x {size / 2**30:.3f} GiB")
        print(f"    plan: {r['plan']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
