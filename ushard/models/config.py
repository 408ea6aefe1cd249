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

    def differences(self, other: "ModelConfig", function_only: bool = False) -> list[str]:
        """The settings that differ ("model.k=<self's> there but <other's> here"); with `function_only`,
        only those that define the model's function."""
        skip = self.IMPLEMENTATION_SETTINGS if function_only else ()
        return [f"model.{k}={getattr(self, k)!r} there but {getattr(other, k)!r} here"
                for k in self.__dataclass_fields__ if k not in skip and getattr(self, k) != getattr(other, k)]

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)
