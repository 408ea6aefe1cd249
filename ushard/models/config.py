"""The model's settings as a typed, frozen value, built once from `config.model` and validated there.

Model code reads `ModelConfig` fields only (never the ConfigDict), so a setting has one spelling, one
type and one check.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ushard.errors import UserError
from ushard.models.attention import ATTENTION_IMPLS
from ushard.models.stack import REMAT_POLICIES

DTYPES = ("float32", "bfloat16", "float16")
ROPE_SCALING_TYPES = ("none", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    """`model.rope_scaling`: how RoPE's frequencies are stretched for contexts longer than training's.

    "llama3" is Llama 3.1's (Hugging Face `rope_type: llama3`, same key names): wavelengths longer than
    original_max_position_embeddings / low_freq_factor are divided by `factor`, those shorter than
    original_max_position_embeddings / high_freq_factor are kept, and the ones between are blended.
    "none" uses the plain frequencies (the other keys are then unused).
    """

    type: str = "none"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def check(self) -> None:
        if self.type not in ROPE_SCALING_TYPES:
            raise UserError(f"model.rope_scaling.type={self.type!r} is not valid; choose one of: {', '.join(ROPE_SCALING_TYPES)}.")
        for key in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            value = getattr(self, key)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
                raise UserError(f"model.rope_scaling.{key}={value!r} must be a finite number > 0.")
        if self.high_freq_factor <= self.low_freq_factor:
            raise UserError(f"model.rope_scaling.high_freq_factor={self.high_freq_factor!r} must be larger than "
                            f"model.rope_scaling.low_freq_factor={self.low_freq_factor!r} (the blend between them divides by the gap).")


@dataclass(frozen=True)
class ModelConfig:
    """Every model setting with its default: `default_config().model` is made from these fields."""

    vocab_size: int = 512
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 4
    d_ff: int = 768
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    compute_dtype: str = "bfloat16"
    param_dtype: str = "float32"
    attention_impl: str = "auto"  # auto: cuDNN flash attention where available, else XLA
    remat: str = "none"  # none | full | dots | dots_no_batch | dots_attention | dots_attention_norms
    document_mask: bool = True  # packed documents never attend to each other
    # Layers per iteration of the layer scan. 1 keeps compile time flat in depth; n_layers unrolls
    # fully, which lets XLA keep saved activations in place (see docs/benchmarks.md).
    scan_unroll: int = 1
    # One weight and one GEMM for q, k and v together, and for the SwiGLU gate and up projections.
    fused_qkv: bool = False
    fused_mlp: bool = False
    # The transformer blocks' matmuls in FP8 (ushard/models/fp8.py; Hopper GPUs or newer). The LM head
    # and attention's softmax stay in the compute dtype.
    fp8: bool = False

    # How the model is computed, not what it computes: a run may resume with these changed. Every
    # other setting (new ones included, unless added here) defines the model's function.
    IMPLEMENTATION_SETTINGS = ("compute_dtype", "attention_impl", "remat", "scan_unroll", "fused_qkv",
                               "fused_mlp", "fp8")

    @classmethod
    def from_config(cls, model_cfg) -> "ModelConfig":
        """From the `model` group of a config (a ConfigDict or a plain dict); raises UserError if invalid."""
        return cls(**dict(model_cfg.items()))

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def __post_init__(self):
        if not isinstance(self.rope_scaling, RopeScaling):  # a group of the config (ConfigDict) or saved JSON (dict)
            object.__setattr__(self, "rope_scaling", _rope_scaling(self.rope_scaling))
        self.rope_scaling.check()
        for key in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "scan_unroll"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise UserError(f"model.{key}={value!r} must be a number >= 1.")
        for key in ("rope_theta", "norm_eps"):
            value = getattr(self, key)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise UserError(f"model.{key}={value!r} must be a finite number > 0.")
        for key, valid in (("remat", tuple(REMAT_POLICIES)), ("attention_impl", ATTENTION_IMPLS),
                           ("compute_dtype", DTYPES), ("param_dtype", DTYPES)):
            if getattr(self, key) not in valid:
                raise UserError(f"model.{key}={getattr(self, key)!r} is not valid; choose one of: {', '.join(valid)}.")
        if self.d_model % self.n_heads:
            raise UserError(f"model.d_model={self.d_model} is not divisible by model.n_heads={self.n_heads}; pick sizes so head_dim is whole.")
        if self.head_dim % 2:
            raise UserError(f"head_dim = d_model/n_heads = {self.head_dim} must be even for rotary embeddings.")
        if self.n_heads % self.n_kv_heads:
            raise UserError(f"model.n_heads={self.n_heads} is not divisible by model.n_kv_heads={self.n_kv_heads}; grouped-query attention needs whole groups.")

    def differences(self, other: "ModelConfig", function_only: bool = False, only=None) -> list[str]:
        """The settings that differ ("model.k=<self's> there but <other's> here"); with `function_only`,
        only those that define the model's function; with `only`, only those top-level keys."""
        skip = self.IMPLEMENTATION_SETTINGS if function_only else ()
        mine, theirs = self.flat(), other.flat()
        return [f"model.{k}={mine[k]!r} there but {theirs[k]!r} here" for k in mine
                if k.split(".")[0] not in skip and (only is None or k.split(".")[0] in only) and mine[k] != theirs[k]]

    def flat(self) -> dict:
        """{"d_model": 256, ..., "rope_scaling.type": "none", ...}: every setting by its config key."""
        flat = {}
        for key in self.__dataclass_fields__:
            value = getattr(self, key)
            if dataclasses.is_dataclass(value):
                flat.update({f"{key}.{k}": v for k, v in dataclasses.asdict(value).items()})
            else:
                flat[key] = value
        return flat

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


def _rope_scaling(group) -> RopeScaling:
    """`model.rope_scaling` from a ConfigDict or a dict (a saved config). Keys this version does not
    know (a newer checkpoint's) are ignored, as `saved_model_config` ignores unknown model keys."""
    known = RopeScaling.__dataclass_fields__
    if not hasattr(group, "items"):
        raise UserError(f"model.rope_scaling={group!r} is not valid; it is a group with keys {', '.join(known)}.")
    return RopeScaling(**{k: v for k, v in group.items() if k in known})
