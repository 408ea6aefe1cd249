"""The config schema, its defaults, loading from files and `--config.a.b=value` overrides, validation.

Every key a user may set exists in `default_config()`; the dict is locked, so a misspelt key is an
error rather than a silently ignored value. `validate()` checks everything that can be checked before
any device work starts and raises `UserError` with one sentence naming the value and what would be valid.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import importlib.util
import math
import numbers
import os
import re
import traceback
from importlib import resources

import ml_collections

from ushard.data.corpus import mixture_weights
from ushard.data.sources import packs_whole
from ushard.data.tokenizer import get_tokenizer
from ushard.errors import UserError
from ushard.models.config import ModelConfig
from ushard.models.definition import model_definition
from ushard.parallel import context
from ushard.parallel.pipeline import SCHEDULES as PIPELINE_SCHEDULES
from ushard.training import muon as muon_lib
from ushard.training import optim

MESH_AXES = ("pipeline", "data", "fsdp", "expert", "sequence", "tensor")
SCHEDULES = optim.SCHEDULES
NONFINITE_POLICIES = ("skip", "rollback", "stop")
DATA_SOURCES = ("stdlib", "text", "jsonl", "parquet", "tokens", "chat", "preference")
OBJECTIVES = ("lm", "dpo")
DPO_LOSS_TYPES = ("sigmoid", "robust", "ipo")  # ushard/training/dpo.py
DPO_REFERENCES = ("frozen", "precomputed")
TRAIN_ON = ("assistant", "all")


def default_config() -> ml_collections.ConfigDict:
    """Every key ushard understands, with its default. Shipped configs start from this."""
    c = ml_collections.ConfigDict()

    # The model's keys, defaults and their meaning: ushard/models/config.py (ModelConfig; its nested
    # groups, such as `model.moe`, are nested here too).
    # head_dim's default is 0 (d_model / n_heads), not the default model's resolved size.
    c.model = ml_collections.ConfigDict({**dataclasses.asdict(ModelConfig()), "head_dim": 0})

    c.train = ml_collections.ConfigDict()
    c.train.steps = 1000
    c.train.batch_size = 32  # global, in sequences
    c.train.seq_len = 256
    c.train.lr = 3e-4
    c.train.min_lr_ratio = 0.1  # the schedule ends at lr * min_lr_ratio
    c.train.warmup_steps = 100
    c.train.schedule = "cosine"  # cosine | linear | constant | wsd (warmup-stable-decay)
    # wsd: the last decay_fraction of train.steps decays to lr * min_lr_ratio, by wsd_decay: linear,
    # cosine or sqrt (1 - sqrt of the progress); lr until then.
    c.train.decay_fraction = 0.2
    c.train.wsd_decay = "linear"
    c.train.grad_clip = 1.0  # global norm; 0 disables clipping
    c.train.grad_accum = 1  # microbatches per step
    c.train.seed = 0
    c.train.log_every = 10
    c.train.eval_every = 100  # 0 disables eval
    c.train.eval_batches = 4
    # A step whose loss or gradient is NaN/inf: "skip" its update (and count it), "rollback" to the
    # last checkpoint and move past the offending batch, or "stop" with a message.
    c.train.on_nonfinite = "skip"
    # "skip" and "rollback" give up (one sentence, exit 2) after this many non-finite steps in a row:
    # a NaN that does not go away is a diverged run, not a bad batch.
    c.train.max_nonfinite_steps = 5
    # With several processes: how long one waits for another that went silent (killed, lost host) or
    # that holds up a checkpoint's barrier, before the run stops with a sentence naming it.
    c.train.process_timeout_s = 60
    # What the step minimises: "lm" (next-token cross-entropy: pre-training, SFT) or "dpo" (direct
    # preference optimisation on data.source="preference" pairs; ushard/training/dpo.py).
    c.train.objective = "lm"
    c.train.dpo = ml_collections.ConfigDict()
    c.train.dpo.beta = 0.1  # how far the policy may move from the reference (the KL penalty's weight)
    # sigmoid: -log σ(βΔ) (with label_smoothing ε > 0: conservative DPO); robust: rDPO; ipo: IPO,
    # length-normalised (as TRL's loss types of those names)
    c.train.dpo.loss_type = "sigmoid"
    c.train.dpo.label_smoothing = 0.0  # ε: the assumed share of pairs whose preference is flipped, in [0, 0.5)
    # The reference policy's log-probs: "frozen" (a copy of the initial parameters in the compute dtype,
    # sharded like them, part of the train state) or "precomputed" (one forward pass over the pairs
    # before training; the batches carry them, no second model on the devices).
    c.train.dpo.reference = "frozen"

    # The optimizer (ushard/training/optim.py's registry): adamw | muon | lion | adafactor. The keys
    # directly here are AdamW's; Muon updates the parameters it does not take (embedding, LM head,
    # norms, routing biases) with them. Each other optimizer's own settings are its group below.
    c.optim = ml_collections.ConfigDict()
    c.optim.name = "adamw"
    c.optim.weight_decay = 0.1  # decoupled, multiplied by the learning rate (adamw, muon, lion)
    c.optim.b1 = 0.9
    c.optim.b2 = 0.95
    c.optim.eps = 1e-8
    for name, entry in optim.OPTIMIZERS.items():
        if entry.settings:
            c.optim[name] = ml_collections.ConfigDict(dict(entry.settings))

    c.checkpoint = ml_collections.ConfigDict()
    c.checkpoint.every = 0  # steps between checkpoints in DIR/checkpoints; 0: only at the end and on SIGTERM
    c.checkpoint.keep = 3  # newest checkpoints kept
    c.checkpoint.async_save = True  # write in the background; training is blocked only for the device->host copy
    # A new run (a workdir without checkpoints) starts from the parameters in this directory, with a
    # fresh optimizer at step 0: a workdir (its newest checkpoint, e.g. written by `ushard convert`) or a
    # Hugging Face checkpoint (config.json + safetensors). The model settings must match it. "": none.
    c.checkpoint.init_from = ""
    c.checkpoint.restart = False  # start over from step 0 when no checkpoint in the workdir can be read

    c.mesh = ml_collections.ConfigDict()
    for axis in MESH_AXES:
        c.mesh[axis] = 1
    c.mesh.fsdp = -1  # -1: all devices not used by the other axes
    c.mesh.dcn = ml_collections.ConfigDict()
    for axis in MESH_AXES:
        c.mesh.dcn[axis] = 1

    c.parallel = ml_collections.ConfigDict()
    c.parallel.zero_stage = 3
    # Neighbouring weights' all-gathers / reduce-scatters are merged up to this many MiB (GPU); 0: XLA's default.
    c.parallel.collective_combine_mib = 0
    # ZeRO-3: gather each layer's weights again for the backward pass (true), or keep the forward's
    # gathered copy in the compute dtype until then (false: half the all-gathers, one more weight copy).
    c.parallel.reshard_after_forward = True
    # Megatron sequence parallelism over `tensor`: the residual stream and norms between the blocks are
    # split along the sequence too, so activations shrink with the tensor size (same communication).
    c.parallel.sequence_parallel = False
    # How attention splits the sequence when mesh.sequence > 1 (ushard/parallel/context.py): "ring"
    # passes keys and values around the devices, "all_gather" gathers them all on every device.
    c.parallel.context_parallel = "ring"
    # The backward pass reuses the keys and values that reached each device in the forward pass instead
    # of passing them around or gathering them again: a third less traffic, K/V memory growing with
    # mesh.sequence (like reshard_after_forward=false for ZeRO-3's weights).
    c.parallel.context_keep_kv = False
    # mesh.pipeline > 1 splits the layers into that many stages (ushard/parallel/pipeline.py):
    # "gpipe", "circular" (pipeline_repeats chunks of layers per stage, the bubble divided by them) or
    # "1f1b" (GPipe's bubble, activation memory bounded by the stages instead of the microbatches).
    c.parallel.pipeline_schedule = "gpipe"
    c.parallel.pipeline_microbatches = 8  # per step (per train.grad_accum part when that is > 1)
    c.parallel.pipeline_repeats = 1  # circular only: virtual stages per device
    # The embedding and LM head with a pipeline: "split" (the vocabulary over the stages: each computes
    # its share every tick, at the price of hidden-size all-reduces over the stage axis each tick),
    # "whole" (every stage holds the whole vocabulary; under 1F1B the last stage's head counts, and
    # only the stages' own transfers cross the stage axis), "auto" (whole where the stages span the
    # data-centre network, mesh.dcn.pipeline > 1; split otherwise).
    c.parallel.pipeline_head = "auto"
    # What mesh.expert splits in an MoE layer (ushard/parallel/expert.py): "experts" (each device holds
    # num_experts / mesh.expert whole experts and runs the rows routed to them), or "width" (each device
    # holds a 1 / mesh.expert slice of every expert's hidden width, gathers its expert group's tokens,
    # runs all of them through its slices and reduce-scatters the sums back: every device does the same
    # work however unevenly the router spreads the tokens, and no buffer can overflow).
    c.parallel.expert_split = "experts"
    # With expert_split "width": each device's sequences in an MoE layer go through the gather, the
    # experts and the reduce-scatter in this many parts (whole sequences each), so that one part's
    # collectives can run while another part's experts compute. Nothing is sized by a headroom there,
    # so parts cannot overflow. 1: one piece.
    c.parallel.expert_width_parts = 1

    c.data = ml_collections.ConfigDict()
    # stdlib | text | jsonl | parquet | tokens (.npy files of token ids) | chat (JSONL conversations) |
    # preference (JSONL or Parquet records of prompt / chosen / rejected, for train.objective="dpo")
    c.data.source = "stdlib"
    c.data.paths = ""  # a glob, or several separated by commas
    c.data.jsonl_field = "text"
    c.data.parquet_column = "text"
    c.data.tokenizer = "byte"  # byte, or the path of a Hugging Face tokenizer.json
    # A weighted mixture: one weight per glob of data.paths ("0.7,0.3"), each glob's share of the
    # training tokens. "": every document as often as the others.
    c.data.weights = ""
    c.data.eval_fraction = 0.02  # share of the tokens (by pieces of documents) held out for eval loss
    c.data.chunk_tokens = 0  # documents are cut into pieces of at most this many tokens; 0: 2 * (seq_len + 1)
    c.data.restart = False  # on resume, start a fresh data order if the checkpoint's cannot be continued
    # Fine-tuning data (chat, or jsonl / parquet with both fields below): "assistant" counts only the
    # tokens a model should learn to write (assistant turns, completions) in the loss; "all" counts all.
    c.data.train_on = "assistant"
    # jsonl / parquet: a prompt and a completion per record (fields, or columns), packed whole, the
    # loss on the completion only. "": records are plain text (data.jsonl_field, data.parquet_column).
    c.data.prompt_field = ""
    c.data.completion_field = ""

    c.metrics = ml_collections.ConfigDict()
    # Weights & Biases (the `wandb` extra): every row of metrics.jsonl and the config, from process 0,
    # into one W&B run per workdir (resumed after a restart). WANDB_MODE=offline works without a login.
    c.metrics.wandb = False
    c.metrics.wandb_project = "ushard"
    c.metrics.wandb_name = ""  # the run's display name; "": the workdir's name

    c.lock()
    return c


# --------------------------------------------------------------------------- loading


def shipped_config_names() -> list[str]:
    files = resources.files("ushard.configs")
    return sorted(p.name[:-3] for p in files.iterdir() if p.name.endswith(".py") and p.name != "__init__.py")


def _resolve_config_path(name: str) -> str:
    if os.path.isfile(name):
        return name
    bare = os.path.splitext(os.path.basename(name))[0]
    if os.sep not in name.rstrip(os.sep) or name.startswith("configs" + os.sep):
        candidate = resources.files("ushard.configs").joinpath(bare + ".py")
        if candidate.is_file():
            return str(candidate)
    raise UserError(
        f"--config {name!r} is neither a file nor a shipped config; shipped configs are: "
        f"{', '.join(shipped_config_names())}."
    )


def load_config(name: str, overrides=()) -> ml_collections.ConfigDict:
    """Loads `name` (a path, or the bare name of a shipped config) and applies overrides: `a.b=v`
    strings (`--config.` prefix optional) or a dict `{"a.b": v}` (see `apply_overrides`)."""
    path = _resolve_config_path(name)
    spec = importlib.util.spec_from_file_location("_ushard_user_config", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # the user's config file is user input
        raise UserError(f"config file {path} failed to load: {_reason(e)}.") from None
    if not hasattr(module, "get_config"):
        raise UserError(f"config file {path} defines no get_config() function returning the config.")
    try:
        config = module.get_config()
    except AttributeError as e:
        moved = [old for old in optim.MOVED_KEYS if f'"{old.split(".")[1]}" does not exist' in str(e)
                 and "'grad_accum'" in str(e)]  # train's own fields listed: the key was set on train
        if moved:
            raise UserError(f"config file {path}{_file_line(e, path)} sets {moved[0]}, which is now "
                            f"{optim.MOVED_KEYS[moved[0]]} (the optimizer's settings moved to the optim group); "
                            f"set that instead.") from None
        raise UserError(f"config file {path}{_file_line(e, path)} sets a key ushard does not know: "
                        f"{_unknown_key(e)}.") from None
    except TypeError as e:  # a locked ConfigDict refuses a value of another type
        raise UserError(f"config file {path}{_file_line(e, path)} sets a value of the wrong type: "
                        f"{_reason(e, typed=False)}.") from None
    except Exception as e:
        raise UserError(f"config file {path}: get_config() failed with {_reason(e)}.") from None
    if not isinstance(config, ml_collections.ConfigDict):
        raise UserError(
            f"config file {path}: get_config() returned {type(config).__name__}, not a ConfigDict; "
            f"start from ushard.config.default_config() and return it."
        )
    apply_overrides(config, overrides)
    return config


def _file_line(e: Exception, path: str) -> str:
    """', line N (the line)' of the config file's last frame in `e`'s traceback, or ''."""
    # Compared as real paths: samefile would raise on a frame of no file ("<frozen ...>", "<string>").
    here = os.path.realpath(path)
    frames = [f for f in traceback.extract_tb(e.__traceback__) if os.path.realpath(f.filename) == here]
    if not frames:
        return ""
    return f", line {frames[-1].lineno} ({(frames[-1].line or '').strip()}),"


def _unknown_key(e: AttributeError) -> str:
    """ml_collections' refusal of a new key in a locked group, as the command line says it: the key,
    and the closest of the group's keys (its message lists them in a dict's repr, nested groups too)."""
    text = str(e)
    key = re.search(r'Key "([^"]+)" does not exist', text)
    if not key:
        return _reason(e, typed=False)
    present = re.findall(r"\\?'(\w+)\\?':", text.partition("Other fields present")[2])  # quotes escaped or not
    close = difflib.get_close_matches(key[1], present, n=1)
    return f"{key[1]!r}" + (f" (did you mean {close[0]!r}?)" if close else "")


def _reason(e: Exception, typed: bool = True) -> str:
    """An exception as one line without a closing full stop, to sit inside a sentence."""
    text = " ".join(str(e).split()).rstrip(".")
    return f"{type(e).__name__}: {text}" if typed else text


def apply_overrides(config: ml_collections.ConfigDict, overrides) -> None:
    """Applies overrides in place, each converted to the type of the value it replaces.

    `overrides` is a list of `a.b=value` strings (the CLI's, `--config.` prefix optional) or a dict
    `{"a.b": value}` (the Python API's). A string value is parsed as on the command line; any other
    value must already have the key's type (an int is accepted for a float).
    """
    if isinstance(overrides, dict):
        apply_override_dict(config, overrides)
        return
    if isinstance(overrides, str):
        overrides = [overrides]
    for item in overrides or ():
        if not isinstance(item, str):
            raise UserError(f"override {item!r} is not a string; write overrides like 'train.steps=50', "
                            "or pass a dict.")
        item = item.removeprefix("--config.")
        if "=" not in item:
            raise UserError(f"override --config.{item} has no value; write --config.{item}=VALUE.")
        key, text = item.split("=", 1)
        parent, leaf = _lookup_parent(config, key)
        old = parent[leaf]
        with parent.ignore_type():
            parent[leaf] = _parse_like(old, text, key)


def apply_override_dict(config: ml_collections.ConfigDict, overrides: dict, prefix: str = "") -> None:
    """`{"train.steps": 50, "model": {"remat": "full"}}`: dotted keys, or nested dicts for groups."""
    for key, value in overrides.items():
        if not isinstance(key, str):
            raise UserError(f"override key {key!r} is not a string; write keys like 'train.steps'.")
        key = prefix + key.removeprefix("--config.")
        parent, leaf = _lookup_parent(config, key)
        old = parent[leaf]
        if isinstance(old, ml_collections.ConfigDict) and isinstance(value, dict):
            apply_override_dict(config, value, key + ".")
            continue
        with parent.ignore_type():
            parent[leaf] = _parse_like(old, value, key) if isinstance(value, str) else _check_like(old, value, key)


def _check_like(old, value, key: str):
    """A Python value for `key`, with the type of `old`: the dict path's counterpart of `_parse_like`."""
    if isinstance(old, ml_collections.ConfigDict):
        raise UserError(f"override {key} is a group of settings, not a value; set one of its keys instead.")
    if old is None:
        return value
    number = not isinstance(value, bool)  # bool is an int to Python, never to a config
    if isinstance(old, bool):
        ok, new = isinstance(value, bool), value
    elif isinstance(old, int):
        ok = number and isinstance(value, numbers.Integral)  # numpy integers too
        new = int(value) if ok else None
    elif isinstance(old, float):
        ok = number and isinstance(value, numbers.Real)  # an int is a fine float
        new = float(value) if ok else None
    elif isinstance(old, (tuple, list)):
        ok = isinstance(value, (tuple, list))
        new = type(old)(value) if ok else None
    else:
        ok, new = isinstance(value, type(old)), value
    if not ok:
        raise UserError(f"override {key}={value!r} is not a valid {type(old).__name__} (current value {old!r}).")
    return new


def _lookup_parent(config, key):
    if key in optim.MOVED_KEYS:
        raise UserError(f"{key} is now {optim.MOVED_KEYS[key]} (the optimizer's settings moved to the optim "
                        f"group); set that instead.")
    parts = key.split(".")
    node = config
    for depth, part in enumerate(parts):
        if not isinstance(node, ml_collections.ConfigDict) or part not in node:
            where = ".".join(parts[:depth]) or "the config"
            names = sorted(node.keys()) if isinstance(node, ml_collections.ConfigDict) else []
            close = difflib.get_close_matches(part, names, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise UserError(
                f"unknown config key {key!r}: {where} has no {part!r}{hint}; "
                f"valid keys there: {', '.join(names) or 'none'}."
            )
        if depth == len(parts) - 1:
            return node, part
        node = node[part]


def _parse_like(old, text: str, key: str):
    if isinstance(old, ml_collections.ConfigDict):
        raise UserError(f"--config.{key} is a group of settings, not a value; set one of its keys instead.")
    try:
        if isinstance(old, bool):
            low = text.lower()
            if low not in ("true", "false", "1", "0"):
                raise ValueError
            return low in ("true", "1")
        if isinstance(old, int):
            return int(text)
        if isinstance(old, float):
            return float(text)
        if isinstance(old, str) or old is None:
            return text
        return type(old)(ast.literal_eval(text))
    except (ValueError, SyntaxError):
        raise UserError(
            f"--config.{key}={text!r} is not a valid {type(old).__name__} (current value {old!r})."
        ) from None


# --------------------------------------------------------------------------- validation


def _choice(value, valid, key):
    if value not in valid:
        raise UserError(f"{key}={value!r} is not valid; choose one of: {', '.join(map(str, valid))}.")


def _positive(value, key, allow_zero=False):
    low = 0 if allow_zero else 1
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < low:
        raise UserError(f"{key}={value!r} must be a number >= {low}.")


def _check_optimizer(o) -> None:
    """AdamW's moment decays live in [0, 1): at 1 a moment never forgets its start and the bias
    correction divides by zero. eps > 0 keeps m / (sqrt(v) + eps) finite where a gradient is exactly 0
    (rows of the embedding that the data never uses). Lion's and Muon's decays likewise."""
    _choice(o.name, tuple(optim.OPTIMIZERS), "optim.name")
    _positive(o.weight_decay, "optim.weight_decay", allow_zero=True)
    decays = [("b1", o.b1, "AdamW's decay rate; typical: b1=0.9, b2=0.95"),
              ("b2", o.b2, "AdamW's decay rate; typical: b1=0.9, b2=0.95"),
              ("lion.b1", o.lion.b1, "Lion's interpolation; typical: 0.9"),
              ("lion.b2", o.lion.b2, "Lion's momentum decay; typical: 0.99"),
              ("muon.momentum", o.muon.momentum, "Muon's momentum; typical: 0.95"),
              ("adafactor.decay_rate", o.adafactor.decay_rate, "Adafactor's decay exponent; typical: 0.8")]
    for key, value, what in decays:
        if not (isinstance(value, (int, float)) and 0.0 <= value < 1.0):
            raise UserError(f"optim.{key}={value!r} must be >= 0 and < 1 ({what}).")
    if not (math.isfinite(o.eps) and o.eps > 0):
        raise UserError(f"optim.eps={o.eps!r} must be a finite number > 0 (AdamW's denominator term; typical: 1e-8).")
    m = o.muon
    _positive(m.ns_steps, "optim.muon.ns_steps")
    _positive(m.rms, "optim.muon.rms", allow_zero=True)
    _positive(o.adafactor.min_dim_size_to_factor, "optim.adafactor.min_dim_size_to_factor")
    _positive(o.adafactor.clipping_threshold, "optim.adafactor.clipping_threshold", allow_zero=True)
    _positive(o.adafactor.weight_decay_rate, "optim.adafactor.weight_decay_rate", allow_zero=True)
    for key, value, valid in (("muon.ns_dtype", m.ns_dtype, ("bfloat16", "float32")),
                              ("muon.scale", m.scale, muon_lib.SCALES), ("muon.layout", m.layout, optim.MUON_LAYOUTS)):
        _choice(value, valid, f"optim.{key}")


def resolve_mesh_shape(mesh_cfg, num_devices: int) -> dict[str, int]:
    """Axis sizes with the one -1 filled in; the product must equal the device count."""
    sizes = {axis: int(mesh_cfg[axis]) for axis in MESH_AXES}
    fill = [a for a, s in sizes.items() if s == -1]
    for axis, size in sizes.items():
        if size == 0 or size < -1:
            raise UserError(f"mesh.{axis}={size} is not valid; use a positive size or -1 for the remaining devices.")
    if len(fill) > 1:
        raise UserError(f"mesh axes {', '.join('mesh.' + a for a in fill)} are all -1; at most one axis may be -1.")
    fixed = math.prod(s for s in sizes.values() if s != -1)
    if fill:
        if num_devices % fixed:
            raise UserError(
                f"the fixed mesh axes multiply to {fixed}, which does not divide the {num_devices} devices, "
                f"so mesh.{fill[0]}=-1 cannot be filled; choose sizes whose product divides {num_devices}."
            )
        sizes[fill[0]] = num_devices // fixed
    product = math.prod(sizes.values())
    if product != num_devices:
        shown = " x ".join(f"{a}={s}" for a, s in sizes.items() if s != 1) or "all 1"
        raise UserError(
            f"the mesh ({shown}) has {product} devices but {num_devices} are available; "
            f"make the product of the mesh.* sizes {num_devices}, or set one axis to -1."
        )
    return sizes


PIPELINE_HEADS = ("auto", "split", "whole")
EXPERT_SPLITS = ("experts", "width")


def pipeline_head_split(config) -> bool:
    """Whether the vocabulary splits over the pipeline's stages (parallel.pipeline_head, 'auto' resolved)."""
    head = config.parallel.pipeline_head
    return head == "split" or (head == "auto" and config.mesh.dcn.pipeline == 1)


def check_settings(config) -> ModelConfig:
    """Checks every setting that needs no devices; returns the model's settings, validated."""
    t, d = config.train, config.data
    model_cfg = ModelConfig.from_config(config.model)
    model_definition(model_cfg)  # the family exists and takes these settings
    for key in ("steps", "batch_size", "seq_len", "grad_accum", "log_every", "max_nonfinite_steps",
                "process_timeout_s"):
        _positive(t[key], f"train.{key}")
    for key in ("pipeline_microbatches", "pipeline_repeats", "expert_width_parts"):
        _positive(config.parallel[key], f"parallel.{key}")
    for key in ("warmup_steps", "eval_every", "eval_batches", "grad_clip", "lr"):
        _positive(t[key], f"train.{key}", allow_zero=True)
    _positive(config.checkpoint.every, "checkpoint.every", allow_zero=True)
    _positive(config.checkpoint.keep, "checkpoint.keep")
    for key, valid in (("train.schedule", SCHEDULES), ("train.wsd_decay", optim.WSD_DECAYS),
                       ("train.on_nonfinite", NONFINITE_POLICIES), ("train.objective", OBJECTIVES),
                       ("data.source", DATA_SOURCES), ("data.train_on", TRAIN_ON),
                       ("parallel.zero_stage", (0, 1, 2, 3)), ("parallel.context_parallel", context.MODES),
                       ("parallel.pipeline_schedule", PIPELINE_SCHEDULES), ("parallel.pipeline_head", PIPELINE_HEADS),
                       ("parallel.expert_split", EXPERT_SPLITS)):
        group, name = key.split(".")
        _choice(config[group][name], valid, key)
    if config.parallel.collective_combine_mib < 0:
        raise UserError(f"parallel.collective_combine_mib={config.parallel.collective_combine_mib} is negative; "
                        "use 0 for XLA's default or a size in MiB.")
    if not 0.0 < d.eval_fraction < 1.0:
        raise UserError(f"data.eval_fraction={d.eval_fraction!r} must be strictly between 0 and 1.")
    _check_optimizer(config.optim)
    if not 0.0 <= t.decay_fraction <= 1.0:
        raise UserError(f"train.decay_fraction={t.decay_fraction!r} must be between 0 and 1 (the share of "
                        f"train.steps a wsd schedule decays over).")
    if not 0 <= t.seed < 2**32:  # JAX would wrap a negative seed silently; 32 bits is plenty and fits every PRNG impl
        raise UserError(f"train.seed={t.seed!r} must be between 0 and 2**32-1={2**32 - 1}.")
    if not 0.0 <= t.min_lr_ratio <= 1.0:
        raise UserError(f"train.min_lr_ratio={t.min_lr_ratio!r} must be between 0 and 1.")
    tokens = get_tokenizer(d.tokenizer).vocab_size
    if model_cfg.vocab_size < tokens:
        raise UserError(f"model.vocab_size={model_cfg.vocab_size} is smaller than the {d.tokenizer!r} tokenizer's "
                        f"{tokens} tokens; use at least that.")
    if d.source != "stdlib" and not d.paths:
        raise UserError(f"data.source={d.source!r} needs data.paths, a glob of files to read.")
    mixture_weights(d)
    _check_fine_tuning_data(d)
    _check_objective(t, d, model_cfg)
    if t.batch_size % t.grad_accum:
        raise UserError(f"train.batch_size={t.batch_size} is not divisible by train.grad_accum={t.grad_accum}; "
                        f"use a multiple of {t.grad_accum}.")
    return model_cfg


def _check_fine_tuning_data(d) -> None:
    """The prompt / completion fields and the chat source against the other data settings."""
    pair = (d.prompt_field, d.completion_field)
    if any(pair) and not all(pair):
        raise UserError(f"data.prompt_field={d.prompt_field!r} and data.completion_field={d.completion_field!r} go "
                        f"together: set both (a prompt and a completion per record) or neither.")
    if any(pair) and d.source not in ("jsonl", "parquet"):
        raise UserError(f"data.prompt_field and data.completion_field name fields of jsonl or parquet records, but "
                        f"data.source={d.source!r}; use data.source='chat' for conversations.")
    if packs_whole(d) and d.chunk_tokens:
        raise UserError(f"data.chunk_tokens={d.chunk_tokens} cuts documents into pieces, but fine-tuning examples "
                        f"are packed whole; leave it 0.")


def _check_objective(t, d, model_cfg) -> None:
    """train.objective and train.dpo.* against the data and the model."""
    if (t.objective == "dpo") != (d.source == "preference"):
        raise UserError(f"train.objective={t.objective!r} with data.source={d.source!r}: DPO trains on preference "
                        f"pairs and preference pairs are for DPO; set both train.objective='dpo' and "
                        f"data.source='preference', or neither.")
    if t.objective != "dpo":
        return
    p = t.dpo
    for key, valid in (("loss_type", DPO_LOSS_TYPES), ("reference", DPO_REFERENCES)):
        _choice(p[key], valid, f"train.dpo.{key}")
    if not p.beta > 0:
        raise UserError(f"train.dpo.beta={p.beta!r} must be positive (typical: 0.1).")
    if not 0.0 <= p.label_smoothing < 0.5:
        raise UserError(f"train.dpo.label_smoothing={p.label_smoothing!r} must be in [0, 0.5) (0: plain DPO).")
    if p.label_smoothing and p.loss_type == "ipo":
        raise UserError(f"train.dpo.label_smoothing={p.label_smoothing!r} applies to the sigmoid and robust losses, "
                        f"not train.dpo.loss_type='ipo'; set it to 0.")
    if model_cfg.mtp.depth:
        raise UserError(f"model.mtp.depth={model_cfg.mtp.depth} with train.objective='dpo': multi-token "
                        f"prediction is a pre-training objective; set model.mtp.depth=0.")
    if d.weights:
        raise UserError(f"data.weights={d.weights!r} weighs a mixture of documents; preference pairs are used "
                        f"each once an epoch, so leave it empty.")


def check_mesh(config, num_devices: int) -> dict[str, int]:
    """The mesh's axis sizes for `num_devices`, checked against what is implemented and the dcn split."""
    mesh = resolve_mesh_shape(config.mesh, num_devices)
    if mesh["expert"] > 1 and not config.model.moe.num_experts:
        raise UserError(f"mesh.expert={mesh['expert']} splits the experts of an MoE model, but this model has none "
                        f"(model.moe.num_experts=0); use mesh.data or mesh.fsdp for data parallelism.")
    for axis in MESH_AXES:
        dcn = config.mesh.dcn[axis]
        if not isinstance(dcn, int) or dcn < 1 or mesh[axis] % dcn:
            raise UserError(f"mesh.dcn.{axis}={dcn!r} must be a positive divisor of mesh.{axis}={mesh[axis]}.")
    return mesh


def check_pipeline(config, mesh: dict[str, int]) -> None:
    """What the pipeline schedule needs of the layers, the batch and the other mesh axes."""
    p, t, layers, stages = config.parallel, config.train, config.model.n_layers, mesh["pipeline"]
    schedule, count, repeats = p.pipeline_schedule, p.pipeline_microbatches, p.pipeline_repeats
    if repeats > 1 and schedule != "circular":
        raise UserError(
            f"parallel.pipeline_repeats={repeats} needs parallel.pipeline_schedule='circular' "
            f"(it is {schedule!r}); set pipeline_repeats=1 or choose the circular schedule."
        )
    if stages == 1:
        return
    model_cfg = ModelConfig.from_config(config.model)
    stacks = model_definition(model_cfg).stacks()
    if schedule == "1f1b" and len(stacks) > 1:
        why = {"dense_blocks": "model.moe.first_dense_layers=0",
               "tail_blocks": "model.n_layers a multiple of model.sliding_window_pattern"}
        fix = " or ".join(why[name] for name, _, _ in stacks if name in why)
        raise UserError(
            f"parallel.pipeline_schedule='1f1b' runs one stack of layers through its ticks, and this model has "
            f"{len(stacks)} ({', '.join(f'{name}: {n} layers' for name, n, _ in stacks)}); use "
            f"pipeline_schedule='gpipe' or 'circular', which pipeline each stack in turn, or {fix}."
        )
    if layers % (stages * repeats):
        raise UserError(
            f"model.n_layers={layers} does not split into mesh.pipeline={stages} stages x "
            f"parallel.pipeline_repeats={repeats} chunks of equal size; make n_layers a multiple of {stages * repeats}."
        )
    if schedule == "circular" and count < stages:
        raise UserError(
            f"parallel.pipeline_microbatches={count} is fewer than the circular schedule needs: a "
            f"microbatch must leave the last stage before it starts its next round on the first, so use "
            f"at least mesh.pipeline={stages} microbatches."
        )
    rows = t.batch_size // t.grad_accum
    if rows % count:
        raise UserError(
            f"the {rows} sequences of a step (train.batch_size={t.batch_size} / train.grad_accum={t.grad_accum}) "
            f"do not split into parallel.pipeline_microbatches={count} microbatches; make {rows} a multiple of {count}."
        )


def validate(config, num_devices: int) -> dict[str, int]:
    """Checks the whole config against itself and the device count; returns the resolved mesh shape.

    Whether the model and the batch split over the mesh is one generic rule: every dimension of every
    parameter (in each ZeRO stage's table) and of a microbatch must divide by the mesh axes its
    logical name maps to. The activations' other dimensions (heads, mlp, vocab) are the parameters'.
    """
    from ushard.models.definition import model_definition
    from ushard.sharding import BATCH_NAMES, RESIDUAL_NAMES, ZeroRules, check_divisible, mesh_axes

    model_cfg, mesh, t, p = check_settings(config), check_mesh(config, num_devices), config.train, config.parallel
    check_pipeline(config, mesh)
    split_kv = check_kv_heads(model_cfg.n_kv_heads, mesh["tensor"])
    zero = ZeroRules.for_stage(p.zero_stage, sequence_parallel=p.sequence_parallel, split_kv_heads=split_kv,
                               pipeline_size=mesh["pipeline"], split_head=pipeline_head_split(config),
                               expert_width=config.parallel.expert_split == "width")
    parameters = model_definition(model_cfg).named_shapes()
    for rules in (zero.params, zero.grads, zero.opt_state):
        check_divisible(parameters, rules, mesh)
    rows, split = t.batch_size // t.grad_accum, f"train.batch_size={t.batch_size} / train.grad_accum={t.grad_accum}"
    if mesh["pipeline"] > 1:
        rows = rows // p.pipeline_microbatches
        split = f"{split} / parallel.pipeline_microbatches={p.pipeline_microbatches}"
    what = f"a microbatch ({split} sequences of train.seq_len={t.seq_len})"
    micro = (rows, t.seq_len)
    check_divisible({what: (BATCH_NAMES, micro)}, zero.compute, mesh)
    parts = p.expert_width_parts
    if parts > 1 and config.model.moe.num_experts and p.expert_split == "width" and mesh["expert"] > 1:
        axes = [a for a in mesh_axes("act_batch", zero.compute) if mesh[a] > 1]
        held = rows // math.prod(mesh[a] for a in axes)
        if held % parts:
            over = " x ".join(f"mesh.{a}={mesh[a]}" for a in axes)
            raise UserError(f"parallel.expert_width_parts={parts} does not divide the {held} sequences each device "
                            f"holds in an MoE layer ({split} over {over}); use a divisor of {held}.")
    if p.sequence_parallel:
        check_divisible({f"with parallel.sequence_parallel, {what}": (RESIDUAL_NAMES, micro)}, zero.compute, mesh)
    context.check_length(t.seq_len, math.prod(mesh[a] for a in mesh_axes("act_length", zero.compute)))
    return mesh


def check_kv_heads(n_kv_heads: int, tensor: int) -> bool:
    """Whether the K/V heads split over mesh.tensor (else each is repeated on tensor/n_kv_heads ranks)."""
    from ushard.sharding import kv_heads_split

    if kv_heads_split(n_kv_heads, tensor):
        return True
    if tensor % n_kv_heads:
        raise UserError(
            f"model.n_kv_heads={n_kv_heads} and mesh.tensor={tensor}: each tensor rank needs whole key/value "
            f"heads, so one must be a multiple of the other; choose mesh.tensor among the divisors or multiples "
            f"of {n_kv_heads}."
        )
    return False
