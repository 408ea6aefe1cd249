"""Hugging Face checkpoints in and out, for every model family (ushard/models/registry.py).

A checkpoint directory holds `config.json` and safetensors weights: `model.safetensors`, or shards
listed by `model.safetensors.index.json`. Each family computes the same function as its transformers
class given the same weights, so import and export are a renaming of tensors plus transposes and
reshapes: HF stores a linear layer as [out, in], ushard as [in, ...out] with heads split out, layers
stacked. What differs by family (config.json both ways, the tensors' names, the refusals) is the
family's `HFMap` (ushard/models/<family>/hf.py); this module holds what they share:

- `model_config` reads the architecture from config.json through the family of its `model_type`,
  which refuses, in one sentence naming the field, what ushard cannot compute.
- `tensor_map` is the family's name map, as data: each HF tensor, the ushard parameter it fills and
  how their axes line up. The fused layout (`model.fused_mlp`) holds two HF tensors in one
  parameter, side by side along one axis.
- `load_params` creates each parameter straight into its sharding: `jax.make_array_from_callback`
  asks for every local device's block, read from the memory-mapped safetensors by slicing, so a host
  only ever reads the blocks of its own devices, one parameter at a time.
- `save_hf` writes config.json and the safetensors files, one layer's parameters on the host at a time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from ushard.errors import UserError
from ushard.models.config import ModelConfig, MoEConfig, MTPConfig
from ushard.models.definition import ModelDef, dotted, model_definition
from ushard.models.hf_names import Tensor
from ushard.models.registry import family, family_for_model_type

# The model settings a Hugging Face config decides; the others say how ushard computes and trains.
HF_SETTINGS = ("family", "vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "head_dim",
               "sliding_window", "sliding_window_pattern", "local_rope_theta", "query_pre_attn_scalar", "rope_theta",
               "rope_scaling", "norm_eps", "tie_embeddings", "moe", "mla")  # of `moe`, those that define the function
# An imported model computes in float32 unless asked otherwise, like transformers' from_pretrained.
IMPORT_SETTINGS = {"compute_dtype": "float32", "param_dtype": "float32"}
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
MAX_FILE_BYTES = 2 * 1024**3  # export: a new safetensors file past this size (files are written whole)
DTYPE_NAMES = {"float32": np.float32, "bfloat16": jnp.bfloat16, "float16": np.float16}


# --------------------------------------------------------------------------- config.json


def read_config(directory: str) -> dict:
    """config.json of a Hugging Face checkpoint directory, as a dict."""
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        raise UserError(f"{directory} holds no config.json; a Hugging Face checkpoint directory has config.json and "
                        f"{SINGLE_FILE} (or shards listed in {INDEX_FILE}).")
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise UserError(f"{path} cannot be read as JSON ({e}).") from None
    if not isinstance(config, dict):
        raise UserError(f"{path} holds {type(config).__name__}, not a JSON object of settings.")
    return config


def decided_by_hf(key: str) -> bool:
    """Whether a model setting (dotted, as `ModelConfig.settings` names it) comes from a Hugging Face
    config.json: the architecture, not how it is computed or trained (model.moe.aux_loss_weight, ...)."""
    if key.startswith(("moe.", "mtp.")):
        return key not in ModelConfig.IMPLEMENTATION_SETTINGS
    return key.split(".")[0] in HF_SETTINGS


def model_config(hf: dict, directory: str, **settings) -> ModelConfig:
    """ushard's model settings for the checkpoint whose config.json is `hf`, read by the family of its
    model_type; `settings` set the others (dtypes, fused layouts, remat, ...). Raises UserError for
    what ushard cannot compute."""
    family = family_for_model_type(hf.get("model_type"), directory)
    values = family.hf.settings(hf, directory)
    moe_settings = dict(settings.pop("moe", None) or {})
    # model.mtp may be set over what config.json says: depth 0 imports a checkpoint stripped of its
    # multi-token prediction layers.
    mtp = MTPConfig(**{**values.pop("mtp", {}), **dict(settings.pop("mtp", None) or {})})
    named = [*settings, *(f"moe.{k}" for k in moe_settings)]
    decided = [k for k in named if decided_by_hf(k)]
    if decided:
        raise UserError(f"model.{decided[0]} of a Hugging Face checkpoint comes from its config.json; leave it out.")
    moe = MoEConfig(**{**values.pop("moe"), **moe_settings})  # the family may set training defaults (DeepSeek's)
    try:
        return ModelConfig(family=family.name, **values, moe=moe, mtp=mtp, **settings)
    except TypeError as e:  # a keyword ModelConfig does not have
        raise UserError(f"not a model setting: {e}.") from None


def stored_mtp(cfg: ModelConfig, directory: str, settings: dict) -> ModelConfig:
    """`cfg` with config.json's multi-token prediction modules only where the checkpoint holds their
    tensors: transformers writes DeepSeek-V3's num_nextn_predict_layers but saves no such layers, so
    a checkpoint without them imports with model.mtp.depth 0, unless the depth was asked for."""
    if not cfg.mtp.depth or "mtp" in settings:
        return cfg
    without = dataclasses.replace(cfg, mtp=dataclasses.replace(cfg.mtp, depth=0))
    modules = {t.name for t in tensor_map(cfg)} - {t.name for t in tensor_map(without)}
    with SafetensorsFiles(directory) as files:
        return cfg if modules <= files.names() else without


def hf_config(cfg: ModelConfig, dtype: str, max_positions: int) -> dict:
    """config.json for ushard's model `cfg`, as its family writes it."""
    return family(cfg.family).hf.config(cfg, dtype, max_positions)


# --------------------------------------------------------------------------- the name map


def tensor_map(cfg: ModelConfig) -> list[Tensor]:
    """Every HF tensor of a checkpoint of `cfg`, as its family names them."""
    return family(cfg.family).hf.tensors(cfg)


def _named(tensors: list[Tensor], shapes: dict):
    """(HF name, Tensor, stack item or None, HF layer or None) for every tensor of every layer, in the
    order files hold them: the embedding, the layers in order, the rest."""
    before = [(t.name, t, None, None) for t in tensors if not t.stacked and t.param == "embedding"]
    layers = [(t.name.format(layer=t.hf_layer(i)), t, i, t.hf_layer(i)) for t in tensors if t.stacked
              for i in range(shapes[t.param][0])]
    layers.sort(key=lambda entry: entry[3])  # stable: within a layer, the family's order
    after = [(t.name, t, None, None) for t in tensors if not t.stacked and t.param != "embedding"]
    return before + layers + after


# --------------------------------------------------------------------------- reading


class SafetensorsFiles:
    """The tensors of a checkpoint directory by name, read by slices from memory-mapped files."""

    def __init__(self, directory: str):
        self.directory = directory
        self._files = contextlib.ExitStack()
        self._open: dict[str, object] = {}
        index, single = os.path.join(directory, INDEX_FILE), os.path.join(directory, SINGLE_FILE)
        if os.path.isfile(index):
            try:
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
                self.location = {name: os.path.join(directory, file) for name, file in weight_map.items()}
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
                raise UserError(f"{index} is not a safetensors index (a JSON object with a weight_map): {e}.") from None
        elif os.path.isfile(single):
            self.location = dict.fromkeys(self._file(single).keys(), single)
        else:
            bins = [f for f in os.listdir(directory) if f.endswith(".bin")]
            hint = " (it has PyTorch .bin files: save it again with safe_serialization=True)" if bins else ""
            raise UserError(f"{directory} holds neither {SINGLE_FILE} nor {INDEX_FILE}{hint}.")

    def _file(self, path: str):
        if path not in self._open:
            try:
                self._open[path] = self._files.enter_context(safe_open(path, framework="numpy"))
            except (OSError, SafetensorError) as e:
                raise UserError(f"cannot read {path} as safetensors ({e}).") from None
        return self._open[path]

    def names(self) -> set[str]:
        return set(self.location)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._file(self.location[name]).get_slice(name).get_shape())

    def read(self, name: str, slices: tuple[slice, ...]) -> np.ndarray:
        return self._file(self.location[name]).get_slice(name)[slices]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._files.close()


def check_tensors(files: SafetensorsFiles, cfg: ModelConfig, model: ModelDef) -> None:
    """Refuses a checkpoint whose tensors are not exactly the ones `cfg` has, in name and shape."""
    shapes = {path: s.shape for path, s in _param_shapes(model).items()}
    expected = {name: t.hf_shape(shapes[t.param][1:] if t.stacked else shapes[t.param])
                for name, t, _, _ in _named(tensor_map(cfg), shapes)}
    missing = sorted(set(expected) - files.names())
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise UserError(f"{files.directory} has no tensor {missing[0]}{more}, which its config.json's model needs.")
    for name, shape in expected.items():
        if files.shape(name) != shape:
            raise UserError(f"{files.directory}: tensor {name} is {list(files.shape(name))}, but config.json's "
                            f"sizes make it {list(shape)}.")
    # Copies of the embedding (tied) and RoPE tables some exporters add are not weights of their own.
    ignored = {"lm_head.weight"} if cfg.tie_embeddings else set()
    unread = family(cfg.family).hf.ignored
    extra = sorted(n for n in files.names() - set(expected) - ignored
                   if not n.endswith("rotary_emb.inv_freq") and not unread(cfg, n))
    if extra:
        raise UserError(f"{files.directory} holds tensor {extra[0]}, which ushard's {cfg.family} model has no place "
                        f"for; it is another architecture than its config.json says.")


def _param_shapes(model: ModelDef) -> dict:
    return {dotted(path): s for path, s in jax.tree_util.tree_flatten_with_path(model.shapes)[0]}


def _flat_indices(indices, dims) -> np.ndarray:
    """Row-major flat indices, in an array of shape `dims`, of the block spanned by `indices` (one
    array of indices per dimension)."""
    if not dims:
        return np.zeros(1, np.int64)
    grid = np.meshgrid(*indices, indexing="ij")
    return np.ravel_multi_index(grid, dims).ravel()


def _read_view(files: SafetensorsFiles, name: str, tensor: Tensor, view_shape, ranges) -> np.ndarray:
    """The block `ranges` (one range per dimension) of `tensor`'s view, reading only the rectangle of
    the stored weight that covers it (with an `order`, the view's entries its last axis takes)."""
    indices = [np.arange(r.start, r.stop) for r in ranges]
    if tensor.order is not None:
        indices[-1] = np.asarray(tensor.order)[indices[-1]]
    rows = _flat_indices(indices[:tensor.rows], view_shape[:tensor.rows])
    cols = _flat_indices(indices[tensor.rows:], view_shape[tensor.rows:])
    r0, r1, c0, c1 = rows.min(), rows.max() + 1, cols.min(), cols.max() + 1
    if tensor.rows == len(view_shape):
        region = files.read(name, (slice(r0, r1),))[:, None]
    elif tensor.transposed:
        region = files.read(name, (slice(c0, c1), slice(r0, r1))).T
    else:
        region = files.read(name, (slice(r0, r1), slice(c0, c1)))
    return region[np.ix_(rows - r0, cols - c0)].reshape([len(r) for r in ranges])


def _read_block(files, tensors: list[Tensor], item, param_shape, ranges) -> np.ndarray:
    """The block `ranges` of one parameter (one stack item's slice of it, for the stacked layers)."""
    name = lambda t: t.name if item is None else t.name.format(layer=t.hf_layer(item))  # noqa: E731
    if tensors[0].part is None:
        return _read_view(files, name(tensors[0]), tensors[0], param_shape, ranges)
    axis = tensors[0].part[0]
    blocks = []
    for t in tensors:  # side by side along `axis`: the parts of those that overlap the block
        _, start, stop = t.part
        lo, hi = max(ranges[axis].start, start), min(ranges[axis].stop, stop)
        if lo < hi:
            local = (*ranges[:axis], range(lo - start, hi - start), *ranges[axis + 1:])
            blocks.append(_read_view(files, name(t), t, t.view_shape(param_shape), local))
    return np.concatenate(blocks, axis=axis)


def _load_param(files, tensors: list[Tensor], target: jax.ShapeDtypeStruct) -> jax.Array:
    """One parameter, created in `target`'s sharding from the blocks its local devices hold."""
    shape, dtype, stacked = target.shape, target.dtype, tensors[0].stacked
    blocks = {}  # devices holding the same block (replicas) read it once

    def block(index):
        ranges = tuple(range(*s.indices(n)) for s, n in zip(index, shape))
        key = tuple((r.start, r.stop) for r in ranges)
        if key not in blocks:
            if stacked:
                layers = [_read_block(files, tensors, i, shape[1:], ranges[1:]) for i in ranges[0]]
                blocks[key] = np.stack(layers).astype(dtype)
            else:
                blocks[key] = _read_block(files, tensors, None, shape, ranges).astype(dtype)
        return blocks[key]

    return jax.make_array_from_callback(shape, target.sharding, block)


def load_params(directory: str, cfg: ModelConfig, target):
    """The parameters of the checkpoint in `directory`, laid out as `target` (ShapeDtypeStructs with
    shardings, ushard's parameter tree of `cfg`) and cast to its dtypes."""
    model = model_definition(cfg)
    by_param: dict[str, list[Tensor]] = {}
    for t in tensor_map(cfg):
        by_param.setdefault(t.param, []).append(t)

    def load(path, target, is_bias):
        # MoE routing biases are ushard's own (auxiliary-loss-free balancing) unless the family's
        # checkpoints hold them (DeepSeek-V3's e_score_correction_bias).
        if is_bias and dotted(path) not in by_param:
            return _zeros(target)
        return _load_param(files, by_param[dotted(path)], target)

    with SafetensorsFiles(directory) as files:
        check_tensors(files, cfg, model)
        return jax.tree_util.tree_map_with_path(load, target, model.expert_biases)


def _zeros(target: jax.ShapeDtypeStruct) -> jax.Array:
    return jax.make_array_from_callback(target.shape, target.sharding,
                                        lambda index: np.zeros(target.shape, target.dtype)[index])


# --------------------------------------------------------------------------- writing


def _on_host(x: jax.Array) -> np.ndarray:
    if x.is_fully_addressable:
        return np.asarray(jax.device_get(x))
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def _hf_tensor(param: np.ndarray, tensor: Tensor) -> np.ndarray:
    """The HF weight held in (one layer's slice of) a parameter: the inverse of `_read_view`."""
    if tensor.part is not None:
        axis, start, stop = tensor.part
        param = np.take(param, np.arange(start, stop), axis=axis)
    if tensor.order is not None:
        param = param[..., np.argsort(tensor.order)]
    if tensor.rows == param.ndim:
        return param.reshape(-1)
    weight = param.reshape(math.prod(param.shape[:tensor.rows]), -1)
    return weight.T if tensor.transposed else weight


def _hf_tensors(params, named):
    """Each HF tensor of `named` in turn, as a host array; one layer's parameters on the host at a time."""
    flat = {dotted(path): x for path, x in jax.tree_util.tree_flatten_with_path(params)[0]}
    held = (None, {})  # (HF layer, {param: its item's slice on the host})
    for _, tensor, item, layer in named:
        if layer is None:
            yield _hf_tensor(_on_host(flat[tensor.param]), tensor)
            continue
        if held[0] != layer:
            held = (layer, {})
        if tensor.param not in held[1]:
            held[1][tensor.param] = _on_host(flat[tensor.param][item])
        yield _hf_tensor(held[1][tensor.param], tensor)


def _check_no_routing_bias(params, model: ModelDef, architecture: str, exported=()) -> None:
    """Refuses routing biases that steer the choice of experts where the architecture exported to has
    routers without one (Mixtral, Qwen3-MoE, DeepSeek-V2): those not among the `exported` parameters."""
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    biases = [x for (path, x), is_bias in zip(flat, jax.tree.leaves(model.expert_biases))
              if is_bias and dotted(path) not in exported]
    if any(np.any(_on_host(b)) for b in biases):
        raise UserError(f"the model's MoE routing biases (model.moe.bias_update_rate) are not zero, and Hugging "
                        f"Face's {architecture} router has none: transformers would send tokens to other experts.")


def _file_groups(sizes: list[int], max_bytes: int) -> list[list[int]]:
    """Consecutive tensors grouped into files of at most `max_bytes` (a larger tensor gets its own)."""
    groups, total = [[]], 0
    for i, size in enumerate(sizes):
        if groups[-1] and total + size > max_bytes:
            groups, total = [*groups, []], 0
        groups[-1].append(i)
        total += size
    return groups


def save_hf(params, cfg: ModelConfig, directory: str, dtype: str | None = None, max_positions: int = 2048,
            max_file_bytes: int = MAX_FILE_BYTES, token_ids: dict | None = None) -> None:
    """Writes `params` (ushard's parameter tree of `cfg`) as a Hugging Face checkpoint in `directory`:
    config.json and model.safetensors, or shards and an index past `max_file_bytes`. `dtype`: the
    weights' dtype on disk (default: the parameters'). `token_ids`: config.json's special-token ids
    (ushard/hf_tokenizer.py)."""
    dtype = dtype or cfg.param_dtype
    family(cfg.family).hf.check_export(cfg)
    tensors, config = tensor_map(cfg), {**hf_config(cfg, dtype, max_positions), **(token_ids or {})}
    if cfg.moe.num_experts:
        _check_no_routing_bias(params, model_definition(cfg), config["architectures"][0], {t.param for t in tensors})
    if dtype not in DTYPE_NAMES:
        raise UserError(f"dtype={dtype!r} is not one safetensors export takes; "
                        f"choose one of: {', '.join(DTYPE_NAMES)}.")
    np_dtype = np.dtype(DTYPE_NAMES[dtype])
    shapes = {path: s.shape for path, s in _param_shapes(model_definition(cfg)).items()}
    named = _named(tensors, shapes)
    sizes = [math.prod(t.hf_shape(shapes[t.param][1:] if t.stacked else shapes[t.param])) * np_dtype.itemsize
             for _, t, _, _ in named]
    groups = _file_groups(sizes, max_file_bytes)
    files = [SINGLE_FILE] if len(groups) == 1 else [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
                                                    for i in range(len(groups))]
    writer = jax.process_index() == 0
    if writer:
        os.makedirs(directory, exist_ok=True)
    arrays_in_order = _hf_tensors(params, named)
    for file, group in zip(files, groups):
        arrays = {named[i][0]: np.ascontiguousarray(next(arrays_in_order).astype(np_dtype)) for i in group}
        if writer:  # transformers refuses safetensors without this format tag
            save_file(arrays, os.path.join(directory, file), metadata={"format": "pt"})
    if not writer:
        return
    if len(files) > 1:
        index = {"metadata": {"total_size": sum(sizes)},
                 "weight_map": {named[i][0]: file for file, group in zip(files, groups) for i in group}}
        _write_json(os.path.join(directory, INDEX_FILE), index)
    _write_json(os.path.join(directory, "config.json"), config)


def _write_json(path: str, value) -> None:
    with open(path, "w") as f:
        json.dump(value, f, indent=2)
        f.write("\n")
