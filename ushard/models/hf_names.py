"""What the families' Hugging Face maps are made of: `Tensor` (one HF tensor and its place in a
ushard parameter), the helpers that read config.json's common fields, and the tensors the
Llama-style layers share (attention, norms, gated MLPs, experts)."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass

from ushard.errors import UserError
from ushard.models.config import RopeScaling


@dataclass(frozen=True)
class Tensor:
    """One HF tensor and its place in a ushard parameter (for the stacked layers: in one item's slice).

    The tensor's *view* is the HF weight, transposed when `transposed` (HF's [out, in] against ushard's
    [in, out]), reshaped so that its first `rows` dimensions split the weight's (oriented) first axis
    and the rest its second. A parameter is its one tensor's view, or with `part` = (axis, start, stop)
    the concatenation along `axis` of several views (the fused layouts). A stacked parameter's item i
    holds HF layer `first + i * step` (a stack of periods holds every step-th layer in each position).
    With `order`, entry j of the parameter's last axis is entry order[j] of the view's (latent
    attention's RoPE columns, which HF stores in interleaved pairs: `rope_pairs_to_halves`).
    """

    name: str  # the HF name; "{layer}" stands for the layer's index
    param: str  # the ushard parameter, as a dotted path
    rows: int = 1
    transposed: bool = True
    part: tuple[int, int, int] | None = None
    first: int = 0
    step: int = 1
    order: tuple[int, ...] | None = None

    @property
    def stacked(self) -> bool:
        return "{layer}" in self.name

    def hf_layer(self, item: int) -> int:
        return self.first + item * self.step

    def view_shape(self, param_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The view's shape, given the shape of (one layer's slice of) its parameter."""
        if self.part is None:
            return tuple(param_shape)
        axis, start, stop = self.part
        return (*param_shape[:axis], stop - start, *param_shape[axis + 1:])

    def hf_shape(self, param_shape) -> tuple[int, ...]:
        view = self.view_shape(param_shape)
        oriented = (math.prod(view[:self.rows]), math.prod(view[self.rows:]))
        if self.rows == len(view):
            return oriented[:1]  # a vector (norm scales)
        return oriented[::-1] if self.transposed else oriented


def rope_pairs_to_halves(size: int, rope: int) -> tuple[int, ...]:
    """The `order` (see `Tensor`) of a last axis of `size` entries whose final `rope` are RoPE dimensions
    in interleaved pairs (x0, x1), (x2, x3), ... (DeepSeek's layout): those become rotate-half's
    layout, the pairs' first entries then their second (x0, x2, ..., x1, x3, ...), the others stay.
    Applied to q's and k's rotated columns alike it leaves every q·k as it was, and ushard's `rotary`
    on the new layout computes what DeepSeek's interleaved rotation computes on the old."""
    start = size - rope
    return (*range(start), *range(start, size, 2), *range(start + 1, size, 2))


def placed(tensors: list[Tensor], prefix: str, first: int, step: int) -> list[Tensor]:
    """One layer's tensors (params named from the layer, "attn.wq") in the stack item at `prefix`
    ("blocks", "blocks.layer2") that holds HF layers first, first + step, ..."""
    return [dataclasses.replace(t, param=f"{prefix}.{t.param}", first=first, step=step) for t in tensors]


LAYER = "model.layers.{layer}."


def norm_tensor(hf_name: str, param: str) -> Tensor:
    """A layer's norm scale: HF's `model.layers.{layer}.<hf_name>.weight`, ushard's `<param>.scale`."""
    return Tensor(LAYER + f"{hf_name}.weight", f"{param}.scale")


def stacked_tensors(stacks, layer_tensors) -> list[Tensor]:
    """Every layer's tensors in the stack item that holds it: `stacks` are the family's `Stack`s in
    order (ushard/models/decoder.py), `layer_tensors(i)` HF layer i's tensors with params named from
    the layer ("attn.wq"). A stack of periods holds position j of every period at `<name>.layer<j>`."""
    tensors, first = [], 0
    for stack in stacks:
        for j in range(stack.per_item):
            prefix = stack.name if stack.per_item == 1 else f"{stack.name}.layer{j}"
            tensors += placed(layer_tensors(first + j), prefix, first + j, stack.per_item)
        first += stack.items * stack.per_item
    return tensors


def refuse_other_routing(cfg, routing: dict, architecture: str) -> None:
    """Refuses to export an MoE model whose `model.moe` settings differ from `routing`, the
    architecture's (the drop rule is let through: it only limits a training batch; the export routes
    dropless)."""
    if not cfg.moe.num_experts:
        return
    for key, theirs in routing.items():
        value = getattr(cfg.moe, key)
        if key != "capacity_factor" and value != theirs:
            raise UserError(f"model.moe.{key}={value!r} cannot be exported: {architecture} has {key}={theirs!r}.")


def attention_tensors(qk_norm: bool = False) -> list[Tensor]:
    """A Llama-style layer's attention projections (and Qwen3's / Gemma 3's QK-norm scales)."""
    tensors = [Tensor(LAYER + f"self_attn.{x}_proj.weight", f"attn.w{x}") for x in "qkv"]
    tensors.append(Tensor(LAYER + "self_attn.o_proj.weight", "attn.wo", rows=2))
    if qk_norm:
        tensors += [Tensor(LAYER + f"self_attn.{x}_norm.weight", f"attn.{x}_norm.scale") for x in "qk"]
    return tensors


def gated_mlp_tensors(fused: bool, prefix: str = "mlp", block: str = "mlp") -> list[Tensor]:
    """A gated MLP's gate, up and down projections (`fused`: gate and up in one parameter), HF's under
    `block` (DeepSeek's shared experts: "mlp.shared_experts")."""
    if fused:  # gate, then up
        gate_up = [Tensor(LAYER + f"{block}.gate_proj.weight", f"{prefix}.w_gate_up", part=(1, 0, 1)),
                   Tensor(LAYER + f"{block}.up_proj.weight", f"{prefix}.w_gate_up", part=(1, 1, 2))]
    else:
        gate_up = [Tensor(LAYER + f"{block}.{x}_proj.weight", f"{prefix}.w_{x}") for x in ("gate", "up")]
    return [*gate_up, Tensor(LAYER + f"{block}.down_proj.weight", f"{prefix}.w_down")]


def expert_tensors(num_experts: int, block: str, router: str, names: tuple[str, str, str]) -> list[Tensor]:
    """An MoE block's router and each expert's gate, down and up projections (HF's names `names`, in
    that order), each one expert's slice (along the `experts` axis) of the stacked experts' weight."""
    experts = [Tensor(LAYER + f"{block}.experts.{e}.{w}.weight", f"mlp.experts.{param}", rows=2, part=(0, e, e + 1))
               for e in range(num_experts) for w, param in zip(names, ("w_gate", "w_down", "w_up"))]
    return [Tensor(LAYER + f"{block}.{router}.weight", "mlp.router"), *experts]


def end_tensors(tied: bool) -> list[Tensor]:
    """The embedding, the final norm and (untied) the LM head."""
    tensors = [Tensor("model.embed_tokens.weight", "embedding", transposed=False),
               Tensor("model.norm.weight", "final_norm.scale")]
    return tensors if tied else [*tensors, Tensor("lm_head.weight", "lm_head")]


# --------------------------------------------------------------------------- config.json


def refuse(directory: str, field: str, value, why: str):
    raise UserError(f"{directory}: config.json's {field}={json.dumps(value)} is not supported: {why}.")


def require_whole(hf: dict, directory: str, keys) -> None:
    for key in keys:
        if not isinstance(hf.get(key), int) or isinstance(hf.get(key), bool):
            refuse(directory, key, hf.get(key), "it must be a whole number")


def refuse_common(hf: dict, directory: str, activations: tuple[str, ...] = ("silu",),
                  activation_key: str = "hidden_act") -> None:
    """Refuses the settings none of ushard's families computes: biases, partial RoPE, quantization,
    another activation than the family's (`activations`: the names it goes by, the first one's the
    default)."""
    if hf.get(activation_key, activations[0]) not in activations:
        refuse(directory, activation_key, hf[activation_key], f"this family's MLP uses {activations[0]}")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            refuse(directory, key, hf[key], "ushard's projections have no biases")
    if hf.get("partial_rotary_factor", 1.0) != 1.0:
        refuse(directory, "partial_rotary_factor", hf["partial_rotary_factor"], "ushard rotates the whole head")
    if hf.get("quantization_config"):
        refuse(directory, "quantization_config", hf["quantization_config"].get("quant_method", "?"),
               "ushard imports unquantized weights")


def sizes(hf: dict) -> dict:
    """The model sizes every family reads the same way, as ModelConfig keywords."""
    return dict(vocab_size=hf["vocab_size"], d_model=hf["hidden_size"], n_layers=hf["num_hidden_layers"],
                n_heads=hf["num_attention_heads"],
                n_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
                d_ff=hf["intermediate_size"], norm_eps=float(hf.get("rms_norm_eps", 1e-6)))  # transformers' default


ROPE_TYPES = ("default", "llama3", "linear")  # transformers' rope_type values ushard computes
YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")


def rope(params: dict, field: str, directory: str, theta_key: str = "rope_theta",
         types: tuple[str, ...] = ROPE_TYPES) -> tuple[float, RopeScaling]:
    """(theta, scaling) from one RoPE group of config.json (`field` names it in messages), whose type
    key is `rope_type` (once `type`), of one of `types`."""
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in types:
        refuse(directory, f"{field}.rope_type", kind, f"ushard computes RoPE of types {', '.join(types)}")
    theta = params.get(theta_key)
    if not isinstance(theta, (int, float)) or isinstance(theta, bool):
        key = theta_key if field == "rope_scaling" else f"{field}.{theta_key}"
        refuse(directory, key, theta, "it must be a number")
    if kind == "default":
        return float(theta), RopeScaling()
    if kind == "yarn":
        return float(theta), _yarn(params, field, directory)
    keys = ["factor"] if kind == "linear" else ["factor", "low_freq_factor", "high_freq_factor",
                                                 "original_max_position_embeddings"]
    missing = [k for k in keys if k not in params]
    if missing:
        refuse(directory, field, params, f"the {kind} type needs {', '.join(missing)}")
    return float(theta), RopeScaling(kind if kind == "linear" else "llama3", **{k: params[k] for k in keys})


def _yarn(params: dict, field: str, directory: str) -> RopeScaling:
    """YaRN's settings; unset optional keys as transformers takes them (beta_fast 32, beta_slow 1, no
    mscale), and a refusal for the two it has that ushard does not compute."""
    missing = [k for k in ("factor", "original_max_position_embeddings") if params.get(k) is None]
    if missing:
        refuse(directory, field, params, f"the yarn type needs {', '.join(missing)}")
    if params.get("attention_factor") is not None:
        refuse(directory, f"{field}.attention_factor", params["attention_factor"],
               "ushard derives YaRN's attention factor from factor, mscale and mscale_all_dim")
    if params.get("truncate", True) is not True:
        refuse(directory, f"{field}.truncate", params["truncate"], "ushard rounds YaRN's ramp to whole dimensions")
    values = {k: params.get(k) or default for k, default in
              (("beta_fast", 32.0), ("beta_slow", 1.0), ("mscale", 0.0), ("mscale_all_dim", 0.0))}
    return RopeScaling("yarn", factor=params["factor"],
                       original_max_position_embeddings=params["original_max_position_embeddings"], **values)


def model_rope(hf: dict, directory: str, types: tuple[str, ...] = ROPE_TYPES) -> tuple[float, RopeScaling]:
    """(rope_theta, scaling) from either spelling: transformers 5's `rope_parameters` (theta inside), or
    top-level `rope_theta` and `rope_scaling`."""
    if isinstance(hf.get("rope_parameters"), dict):
        return rope(hf["rope_parameters"], "rope_parameters", directory, types=types)
    return rope({"rope_theta": hf.get("rope_theta", 10000.0), **(hf.get("rope_scaling") or {})}, "rope_scaling",
                directory, types=types)


def rope_json(scaling: RopeScaling) -> dict | None:
    """config.json's `rope_scaling` for `scaling` (None: unscaled)."""
    if scaling.type == "none":
        return None
    if scaling.type == "linear":
        return {"rope_type": "linear", "factor": scaling.factor}
    if scaling.type == "yarn":
        values = {k: getattr(scaling, k) for k in YARN_KEYS}
        return {"rope_type": "yarn", **{k: v for k, v in values.items() if v or k not in ("mscale", "mscale_all_dim")}}
    llama3 = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    return {"rope_type": "llama3", **{k: getattr(scaling, k) for k in llama3}}
