"""`ushard train --config NAME_OR_PATH [--config.a.b=value ...] [--workdir DIR]`,
`ushard sample --workdir DIR --prompt TEXT [--max_new_tokens N] [--temperature T] [--top_k K] [--seed S]`,
`ushard eval (--workdir DIR | --hf PATH) [--config.data.a=value ...] [--batches N]` (perplexity) or
`ushard eval (--workdir DIR | --hf PATH) --tasks NAME[,NAME] [--include_path DIR] [--num_fewshot K] [--limit N]`
(lm-evaluation-harness),
`ushard convert --from-hf DIR --to WORKDIR`, `ushard convert --from WORKDIR --to-hf DIR [--dtype D]` and
`ushard compile --config NAME_OR_PATH [--config.a.b=value ...] --topology v5p:4x4x4 [--num_slices N]` and
`ushard plan --config NAME_OR_PATH [--config.a.b=value ...] (--devices N | --topology T | --gpus h100:8x4)
[--hbm GiB] [--compile] [--recommend] [--json] [--chart PATH]`.

A user's mistake (`UserError`) ends with one sentence on stderr and exit status 2, no traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from ushard import xla_flags
from ushard.errors import Preempted, UserError, install_hint


def _split_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    """Separates `--config.a.b=v` / `--config.a.b v` overrides from the other arguments."""
    rest, overrides = [], []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("--config."):
            item = arg[len("--config."):]
            if "=" not in item:
                if i + 1 >= len(argv):
                    raise UserError(f"override {arg} has no value; write {arg}=VALUE.")
                item = f"{item}={argv[i + 1]}"
                i += 1
            overrides.append(item)
        else:
            rest.append(arg)
        i += 1
    return rest, overrides


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ushard", description="SPMD training of transformer language models.")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser(
        "train", help="train a model", description="Train a model from a config.",
        epilog="Any config key can be set after --config: --config.a.b=value (or --config.a.b value), e.g. "
               "--config.train.steps=500 --config.mesh.tensor=2; docs/config.md lists every key, its default and "
               "its meaning. A wrong key or value is refused before anything runs, with the keys it could mean.")
    train.add_argument("--config", required=True, help="a shipped config name (e.g. tiny) or a path to a config .py")
    train.add_argument("--workdir", help="where metrics.jsonl and TensorBoard events go (default: runs/NAME-TIME)")
    train.add_argument("--coordinator_address", help="HOST:PORT of process 0, for multi-process runs")
    train.add_argument("--num_processes", type=int, help="number of processes in a multi-process run")
    train.add_argument("--process_id", type=int, help="this process's index in a multi-process run")
    sample = sub.add_parser(
        "sample", help="generate text from a trained model",
        description="Continue a prompt with the model in the newest checkpoint of DIR/checkpoints.",
    )
    sample.add_argument("--workdir", required=True, help="the training run's directory (the one holding checkpoints/)")
    sample.add_argument("--prompt", required=True, help="the text to continue")
    sample.add_argument("--max_new_tokens", type=int, default=200, help="at most this many tokens (default: 200)")
    sample.add_argument("--temperature", type=float, default=0.8, help="0 picks the likeliest token (default: 0.8)")
    sample.add_argument("--top_k", type=int, default=40,
                        help="sample among the k likeliest tokens; 0: all (default: 40)")
    sample.add_argument("--seed", type=int, default=0, help="random seed of the sampling (default: 0)")
    _add_eval_parser(sub)
    convert = sub.add_parser(
        "convert", help="convert between Hugging Face checkpoints and ushard workdirs",
        description="--from-hf DIR --to WORKDIR: a Hugging Face checkpoint (config.json + safetensors) into a "
                    "workdir's checkpoint; --from WORKDIR --to-hf DIR: a workdir's newest checkpoint into a "
                    "Hugging Face checkpoint (a LoRA run's merged into its base); --from WORKDIR --to-peft DIR: "
                    "a LoRA run's adapters as a PEFT adapter.",
    )
    convert.add_argument("--from-hf", dest="from_hf", metavar="DIR",
                         help="a Hugging Face checkpoint directory to import")
    convert.add_argument("--to", metavar="WORKDIR", help="the new workdir to write the imported checkpoint into")
    convert.add_argument("--from", dest="from_workdir", metavar="WORKDIR",
                         help="a workdir whose newest checkpoint to export")
    convert.add_argument("--to-hf", dest="to_hf", metavar="DIR",
                         help="the new directory to write the Hugging Face checkpoint into")
    convert.add_argument("--to-peft", dest="to_peft", metavar="DIR",
                         help="the new directory to write a LoRA run's adapters into (peft's format)")
    convert.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                         help="--to-hf: the weights' dtype on disk (default: the parameters')")
    aot = sub.add_parser(
        "compile", help="compile the train step for a TPU topology, without a TPU",
        description="Compile the train step of a config for a named TPU topology (needs libtpu: the tpu extra) "
                    "and print its memory per chip and its collectives per step.",
    )
    aot.add_argument("--config", required=True, help="a shipped config name (e.g. llama3_8b) or a path to a config .py")
    aot.add_argument("--topology", required=True, help="GENERATION:SHAPE, e.g. v5p:4x4x4, v5e:4x4, v6e:4x4, v4:2x2x2")
    aot.add_argument("--num_slices", type=int, default=1,
                     help="slices of that topology (default: 1); mesh.dcn.* spans them")
    _add_plan_parser(sub)
    return parser


def _add_plan_parser(sub) -> None:
    plan = sub.add_parser(
        "plan", help="will a layout fit, how fast will it run, which layout to use: without the hardware",
        description="Per device: memory (state, activations, gradients) against the chip's HBM; per mesh axis: the "
                    "bytes each kind of collective moves and their time on the link the axis crosses; the pipeline "
                    "bubble, the predicted step time and MFU. Name the machine with one of --devices, --topology "
                    "or --gpus.",
    )
    plan.add_argument("--config", required=True,
                      help="a shipped config name (e.g. llama3_8b) or a path to a config .py")
    plan.add_argument("--devices", type=int, metavar="N", help="N devices of --hardware (one host of up to 8)")
    plan.add_argument("--hardware", metavar="KIND", help="with --devices: h100 (default), h200, v5p, v5e, v4, ...")
    plan.add_argument("--topology", metavar="T", help="a TPU topology, e.g. v5p:4x4x4 (needs the tpu extra)")
    plan.add_argument("--num_slices", type=int, default=1, help="with --topology: slices of it (default: 1)")
    plan.add_argument("--gpus", metavar="KIND:PERxHOSTS", help="a GPU cluster, e.g. h100:8x4: 4 hosts of 8 H100s")
    plan.add_argument("--hbm", type=float, metavar="GiB", help="the memory of one chip (default: the chip's)")
    plan.add_argument("--bandwidth", action="append", default=[], metavar="NAME=GB/s",
                      help="a link's rate a device: intra_host (NVLink, ICI), p2p (neighbour sends), inter_host "
                           "(InfiniBand, DCN); repeat for several")
    plan.add_argument("--compile", action="store_true",
                      help="also compile the train step (simulated CPU devices, or the TPU topology) and print XLA's "
                           "memory analysis and collectives beside the estimate")
    plan.add_argument("--recommend", action="store_true",
                      help="search mesh shapes, ZeRO stage, remat, pipeline and expert layouts; print the fastest "
                           "that fit")
    plan.add_argument("--top", type=int, default=3, help="with --recommend: how many layouts (default: 3)")
    plan.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    plan.add_argument("--chart", metavar="PATH", help="write a PNG of the memory and time per layout (plot extra)")


def _add_eval_parser(sub) -> None:
    evaluate = sub.add_parser(
        "eval", help="score a trained model: perplexity on data, or lm-evaluation-harness tasks",
        description="Without --tasks: the mean loss and perplexity on the run's held-out split (the batches its "
                    "eval_loss was logged on), or on the data --config.data.* overrides name. With --tasks: "
                    "lm-evaluation-harness tasks (needs the eval extra).",
    )
    source = evaluate.add_mutually_exclusive_group(required=True)
    source.add_argument("--workdir", help="a training run's directory: the model in its newest checkpoint")
    source.add_argument("--hf", metavar="PATH", help="a Hugging Face checkpoint directory (config.json + safetensors)")
    evaluate.add_argument("--batches", type=int, metavar="N",
                          help="perplexity: eval batches of train.batch_size rows (default: train.eval_batches)")
    evaluate.add_argument("--seq_len", type=int, metavar="N",
                          help="tokens per row (default: the run's train.seq_len; --hf: up to 2048)")
    evaluate.add_argument("--batch_size", type=int, metavar="ROWS",
                          help="rows per forward pass (default: 8, rounded up to a multiple of --devices)")
    evaluate.add_argument("--devices", type=int, default=1, metavar="N",
                          help="split the model over the first N devices (default: 1)")
    evaluate.add_argument("--tasks", metavar="NAME[,NAME]", help="lm-eval task names, separated by commas")
    evaluate.add_argument("--include_path", metavar="DIR", help="--tasks: a directory of your own task YAML files")
    evaluate.add_argument("--num_fewshot", type=int, metavar="K", help="--tasks: examples shown before each question")
    evaluate.add_argument("--limit", type=float, metavar="N",
                          help="--tasks: at most this many examples per task (below 1: a fraction of them)")
    evaluate.add_argument("--output", metavar="PATH",
                          help="--tasks: write lm-eval's results, with every example's requests and scores, as JSON")
    evaluate.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def _cluster_launched() -> bool:
    """True under launchers whose environment jax.distributed reads by itself: SLURM, multi-host TPU."""
    return (
        int(os.environ.get("SLURM_NTASKS", "1")) > 1
        or "," in os.environ.get("TPU_WORKER_HOSTNAMES", "")
        or bool(os.environ.get("MEGASCALE_COORDINATOR_ADDRESS"))
    )


def _check_address(address: str) -> None:
    """UserError unless `address` is HOST:PORT with a port of 1-65535 (JAX's own checks crash on some:
    an IndexError, a segmentation fault, or a port past 65535 taken)."""
    host, colon, port = address.rpartition(":")
    if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UserError(f"--coordinator_address={address!r} is not HOST:PORT with a port from 1 to 65535 "
                        f"(process 0's host name or address, e.g. 10.0.0.1:1234).")


def start_processes(args, timeout_s: int = 60) -> None:
    """Joins a multi-process run: from the three flags, or detected on SLURM and TPU VMs. JAX's own
    heartbeat check gets `timeout_s` (train.process_timeout_s) and a margin: ushard's watch
    (training/processes.py) names a lost process first, where JAX's aborts with a native stack."""
    flags = (args.coordinator_address, args.num_processes, args.process_id)
    given = [f is not None for f in flags]
    if any(given) and not all(given):
        raise UserError("a multi-process run needs all of --coordinator_address HOST:PORT, --num_processes N "
                        "and --process_id I.")
    if not all(given) and not _cluster_launched():
        return
    import jax

    if all(given):
        _check_address(args.coordinator_address)
        if args.num_processes < 1:
            raise UserError(f"--num_processes={args.num_processes} must be 1 or more.")
        if not 0 <= args.process_id < args.num_processes:
            raise UserError(f"--process_id={args.process_id} must be between 0 and "
                            f"--num_processes-1={args.num_processes - 1}.")
        jax.distributed.initialize(args.coordinator_address, args.num_processes, args.process_id,
                                   heartbeat_timeout_seconds=timeout_s + 30)
    else:
        jax.distributed.initialize(heartbeat_timeout_seconds=timeout_s + 30)


def train(args, overrides) -> None:
    import ushard

    config = ushard.load_config(args.config, overrides)
    xla_flags.apply(config)  # before anything starts JAX's backend
    start_processes(args, config.train.process_timeout_s)
    name = os.path.splitext(os.path.basename(args.config))[0]
    workdir = args.workdir or os.path.join("runs", f"{name}-{time.strftime('%Y%m%d-%H%M%S')}")
    records = ushard.train(config, workdir)
    if records:
        print(f"done: final loss {records[-1]['loss']:.4f}; metrics in {os.path.join(workdir, 'metrics.jsonl')}, "
              f"checkpoints in {os.path.join(workdir, 'checkpoints')}")


def _writable_directory(path: str, flag: str) -> None:
    """Creates `path` (a conversion's output) before any work, or says in a sentence why it cannot."""
    try:
        os.makedirs(path, exist_ok=True)
    except FileExistsError:
        raise UserError(f"{flag} {path} exists and is not a directory; give a directory.") from None
    except OSError as e:
        raise UserError(f"cannot create {flag} {path}: {e.strerror}; give a writable directory.") from None
    if not os.access(path, os.W_OK):
        raise UserError(f"cannot write into {flag} {path}: permission denied; give a writable directory.")


def convert(args) -> None:
    from ushard import hf_convert as hf

    importing = (args.from_hf, args.to)
    exporting = (args.from_workdir, args.to_hf)
    if args.to_peft and args.from_workdir and not (args.to_hf or any(importing) or args.dtype):
        _writable_directory(args.to_peft, "--to-peft")
        hf.convert_to_peft(args.from_workdir, args.to_peft)
    elif all(importing) and not any(exporting) and not args.to_peft:
        if args.dtype:
            raise UserError("--dtype applies to --to-hf; an imported checkpoint keeps float32 parameters.")
        _writable_directory(args.to, "--to")
        hf.convert_from_hf(args.from_hf, args.to)
    elif all(exporting) and not any(importing) and not args.to_peft:
        _writable_directory(args.to_hf, "--to-hf")
        hf.convert_to_hf(args.from_workdir, args.to_hf, args.dtype)
    else:
        raise UserError("convert takes --from-hf DIR --to WORKDIR (import), --from WORKDIR --to-hf DIR (export) or "
                        "--from WORKDIR --to-peft DIR (a LoRA run's adapters).")


def compile_step(args, overrides) -> None:
    import ushard
    from ushard import aot

    config = ushard.load_config(args.config, overrides)
    setup = aot.build_for(config, args.topology, args.num_slices)
    print(setup.describe().rstrip("\n"))
    print(f"compiling the train step for {args.num_slices} x {args.topology}", flush=True)
    print(aot.summary(aot.compile_train_step(setup)))


def plan(args, overrides) -> None:
    import ushard
    from ushard import planner

    config = ushard.load_config(args.config, overrides)
    target = planner.target_for(args.devices, args.topology, args.gpus, args.num_slices, args.hbm, args.hardware,
                                args.bandwidth)
    if args.recommend:
        found = planner.recommend(config, target, args.top, log=_to_stderr)
        if not found:
            raise UserError(f"no layout of this config fits {target.what} ({target.hbm_bytes / 2**30:.0f} GiB a "
                            f"device); add devices, lower train.batch_size or train.seq_len.")
        if args.compile:
            for a in found:
                planner.add_compiled(a, target)
    else:
        found = [planner.assess(config, target, compile=args.compile)]
    if args.chart:
        planner.chart(found, target, args.chart)
    if args.json:
        objects = [planner.as_json(a, target) for a in found]
        print(json.dumps({"layouts": objects} if args.recommend else objects[0]))
    elif args.recommend:
        print(planner.recommendations(found, target))
    else:
        print(planner.report(found[0], target))


def evaluate(args, overrides) -> None:
    import jax

    if not 1 <= args.devices <= jax.device_count():
        raise UserError(f"--devices={args.devices} must be between 1 and the {jax.device_count()} devices here.")
    devices = jax.devices()[:args.devices]
    if args.tasks:
        benchmarks(args, overrides, devices)
        return
    for flag in ("include_path", "num_fewshot", "limit", "output"):
        if getattr(args, flag) is not None:
            raise UserError(f"--{flag} applies to lm-eval tasks; name them with --tasks NAME[,NAME].")
    from ushard import evaluate as evaluation

    setup = evaluation.load(args.workdir, args.hf, overrides, args.seq_len, devices, log=_to_stderr)
    result = evaluation.perplexity(setup, args.batches, args.batch_size, log=_to_stderr)
    print(json.dumps(result.as_dict()) if args.json else result.describe())


def benchmarks(args, overrides, devices) -> None:
    """`ushard eval --tasks`: lm-evaluation-harness tasks on the model."""
    if args.batches is not None:
        raise UserError("--batches applies to perplexity, not to --tasks (see --limit).")
    for item in overrides:
        if not item.removeprefix("--config.").startswith("data.tokenizer="):
            raise UserError(f"with --tasks the only override is --config.data.tokenizer (the tasks bring their "
                            f"own text), not --config.{item}.")
    try:
        from ushard import lm_eval_adapter
    except ImportError as e:
        if e.name is None or not e.name.startswith("lm_eval"):
            raise
        raise UserError(f"--tasks needs lm-evaluation-harness; {install_hint('eval')}.") from None
    from ushard import evaluate as evaluation

    tasks = [name.strip() for name in args.tasks.split(",") if name.strip()]
    manager = lm_eval_adapter.task_manager(tasks, args.include_path)  # a misspelt task fails before the model loads
    setup = evaluation.load(args.workdir, args.hf, overrides, args.seq_len, devices, need_data=False,
                            log=_to_stderr)
    results = lm_eval_adapter.run_tasks(setup.trained, setup.config.data.tokenizer, setup.seq_len, tasks, manager,
                                        args.num_fewshot, args.limit, args.output, args.batch_size)
    if args.json:
        print(json.dumps({key: results[key] for key in ("results", "groups") if results.get(key)},
                         default=lm_eval_adapter.plain))
    else:
        print(lm_eval_adapter.results_table(results).rstrip("\n"))


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        rest, overrides = _split_overrides(argv)
        args = _parser().parse_args(rest)  # argparse reports its own usage errors with exit status 2
        if args.command == "train":
            train(args, overrides)
        elif args.command == "compile":
            compile_step(args, overrides)
        elif args.command == "plan":
            plan(args, overrides)
        elif args.command == "sample":
            if overrides:
                raise UserError(f"sample takes no --config overrides (--config.{overrides[0]}); the model's "
                                "settings come from its checkpoint.")
            from ushard.sample import sample

            sample(args.workdir, args.prompt, args.max_new_tokens, args.temperature, args.top_k, args.seed)
        elif args.command == "eval":
            evaluate(args, overrides)
        elif args.command == "convert":
            if overrides:
                raise UserError(f"convert takes no --config overrides (--config.{overrides[0]}); the model's "
                                "settings come from the checkpoint.")
            convert(args)
        return 0
    except UserError as e:
        print(f"ushard: error: {e}", file=sys.stderr)
        return 2
    except Preempted as e:
        print(f"ushard: {e}", file=sys.stderr)
        return 128 + e.signum
    except KeyboardInterrupt:  # a second Ctrl-C (the first stops at a safe point), or one before the run
        print("ushard: interrupted.", file=sys.stderr)
        # It may have cut into XLA's C++ (a compilation), whose threads then crash the interpreter's
        # teardown: leave without one. What the run had written was closed while the exception unwound.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130)


if __name__ == "__main__":
    sys.exit(main())
