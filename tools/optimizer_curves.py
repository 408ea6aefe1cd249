"""Training quality of the optimizers: `tiny` on the default corpus, each optimizer at each learning
rate, the held-out loss every `--eval-every` steps; then the best learning rate of each (the lowest
final eval loss) plotted against the others'.

    python tools/optimizer_curves.py run --optimizer adamw --lrs 1e-3,3e-3,1e-2 --out runs/curves-adamw.json
    python tools/optimizer_curves.py run --optimizer muon --lrs 1e-3,3e-3,1e-2 --out runs/curves-muon.json
    python tools/optimizer_curves.py plot runs/curves-adamw.json runs/curves-muon.json --png docs/optimizer_curves.png

`run` trains in this process (one device unless JAX_NUM_CPU_DEVICES says otherwise), writing nothing
but the JSON: {optimizer, lr: [[step, eval_loss], ...]}. `plot` prints a table of every run's final
eval loss and draws each optimizer's best run (matplotlib, the `plot` extra).
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def run(optimizer: str, lrs: list[float], steps: int, eval_every: int, out: str) -> None:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import ushard

    curves = {}
    for lr in lrs:
        config = ushard.load_config("tiny", {"optim.name": optimizer, "train.lr": lr, "train.steps": steps,
                                             "train.eval_every": eval_every, "train.log_every": eval_every})
        rows = ushard.train(config)
        curves[str(lr)] = [[r["step"], r["eval_loss"]] for r in rows if "eval_loss" in r]
        print(f"{optimizer} lr={lr:g}: final eval loss {curves[str(lr)][-1][1]:.4f}", flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"optimizer": optimizer, "steps": steps, "curves": curves}, f, indent=1)


def plot(paths: list[str], png: str | None) -> None:
    results = [json.load(open(p)) for p in paths]
    print("| optimizer | learning rate | final eval loss |\n|---|---|---|")
    best = {}
    for r in results:
        for lr, curve in sorted(r["curves"].items(), key=lambda kv: float(kv[0])):
            print(f"| {r['optimizer']} | {float(lr):g} | {curve[-1][1]:.4f} |")
        lr = min(r["curves"], key=lambda k: r["curves"][k][-1][1])
        best[r["optimizer"]] = (lr, r["curves"][lr])
    for name, (lr, curve) in best.items():
        print(f"best {name}: lr {float(lr):g}, final eval loss {curve[-1][1]:.4f}")
    if png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for name, (lr, curve) in best.items():
            ax.plot(*zip(*curve), marker="o", label=f"{name}, lr {float(lr):g}")
        ax.set_xlabel("step")
        ax.set_ylabel("eval loss (nats per byte)")
        ax.set_title("tiny on the default corpus: each optimizer at its best of three learning rates")
        ax.legend()
        fig.tight_layout()
        fig.savefig(png, dpi=100)
        print(f"wrote {png}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run")
    r.add_argument("--optimizer", required=True)
    r.add_argument("--lrs", default="1e-3,3e-3,1e-2")
    r.add_argument("--steps", type=int, default=400)
    r.add_argument("--eval-every", type=int, default=50)
    r.add_argument("--out", required=True)
    p = sub.add_parser("plot")
    p.add_argument("paths", nargs="+")
    p.add_argument("--png")
    args = parser.parse_args()
    if args.command == "run":
        run(args.optimizer, [float(x) for x in args.lrs.split(",")], args.steps, args.eval_every, args.out)
    else:
        plot(args.paths, args.png)


if __name__ == "__main__":
    main()
