"""LoRA adapters as a PEFT adapter directory: `adapter_model.safetensors` + `adapter_config.json`, which
`peft.PeftModel.from_pretrained(transformers_model, directory)` loads onto the base model.

peft's LoRA layer computes W x + (alpha / r) lora_B(lora_A(x)) with lora_A.weight [r, in] and
lora_B.weight [out, r] on the Hugging Face projection; ushard's adapter of a weight stored [ins...,
outs...] is A [ins..., r], B [r, outs...] (ushard/training/lora.py). Each maps through the same
tensor map as the base weight (ushard/hf.py): A flattened over the inputs and transposed, B over
the outputs; a fused weight's shared A goes to each of its HF projections, B's part to each.
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np
from safetensors.numpy import save_file

from ushard.errors import UserError
from ushard.hf import _named, _on_host, _param_shapes, tensor_map
from ushard.models.definition import ModelDef
from ushard.training.lora import Adapters

ADAPTER_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"


def _module(hf_name: str) -> str:
    return hf_name[:-len(".weight")] if hf_name.endswith(".weight") else hf_name


def peft_tensors(adapters: Adapters, trained) -> dict[str, np.ndarray]:
    """{peft tensor name: float32 array} of the adapters `trained` (the run's trained parameters)."""
    model: ModelDef = adapters.model
    shapes = {path: s.shape for path, s in _param_shapes(model).items()}
    by_param = {}
    for entry in _named(tensor_map(model.cfg), shapes):
        by_param.setdefault(entry[1].param, []).append(entry)
    out = {}
    for w in adapters.weights:
        if w.lead:
            raise UserError(f"the experts' adapters ({w.path}) have no PEFT form here (transformers stores the "
                            "experts fused); export the merged model with --to-hf instead.")
        node = trained
        for key in w.path.split("."):
            node = node[key]
        a_all, b_all = _on_host(node["lora_a"]), _on_host(node["lora_b"])
        for hf_name, tensor, item, layer in by_param[w.path]:
            if tensor.rows != w.ins or not tensor.transposed:
                raise UserError(f"{w.path}'s adapter has no PEFT form: its Hugging Face tensor {hf_name} is not "
                                "a plain [out, in] projection of it; export the merged model with --to-hf.")
            a = a_all[item] if layer is not None else a_all
            b = b_all[item] if layer is not None else b_all
            if tensor.part is not None:  # a fused weight: this projection's share of B's output axes
                axis, start, stop = tensor.part
                b = np.take(b, np.arange(start, stop), axis=axis - w.ins + 1)
            if tensor.order is not None:
                b = b[..., np.argsort(tensor.order)]
            rank = a.shape[-1]
            module = f"base_model.model.{_module(hf_name)}"
            out[f"{module}.lora_A.weight"] = np.ascontiguousarray(a.reshape(-1, rank).T.astype(np.float32))
            out[f"{module}.lora_B.weight"] = np.ascontiguousarray(b.reshape(rank, -1).T.astype(np.float32))
    return out


def save_peft(adapters: Adapters, trained, directory: str, base: str | None) -> None:
    """Writes the adapters `trained` as a PEFT adapter directory; `base`: the base model's path (config)."""
    tensors = peft_tensors(adapters, trained)
    cfg = adapters.cfg
    modules = sorted({name.split(".")[-3] for name in tensors})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": cfg.rank, "lora_alpha": cfg.alpha,
              "lora_dropout": cfg.dropout, "target_modules": modules, "bias": "none", "fan_in_fan_out": False,
              "use_rslora": False, "init_lora_weights": True, "base_model_name_or_path": base,
              "inference_mode": True}
    if jax.process_index() != 0:
        return
    os.makedirs(directory, exist_ok=True)
    save_file(tensors, os.path.join(directory, ADAPTER_FILE), metadata={"format": "pt"})
    with open(os.path.join(directory, CONFIG_FILE), "w") as f:
        json.dump(config, f, indent=2)
