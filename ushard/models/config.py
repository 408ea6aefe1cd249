"""The model's settings as a typed, frozen value, built once from `config.model` and validated there.

Model code reads `ModelConfig` fields only (never the ConfigDict), so a setting has one spelling, one
type and one check. The mixture-of-experts settings are a nested group, `model.moe.*` (`MoEConfig`),
and so are multi-head latent attention's, `model.mla.*` (`MLAConfig`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ushard.errors import UserError
from ushard.kernels.attention import IMPLS as ATTENTION_IMPLS
from ushard.kernels.grouped_matmul import IMPLS as GROUPED_MATMUL_IMPLS
from ushard.models.stack import REMAT_POLICIES

DTYPES = ("float32", "bfloat16", "float16")
SCORE_FUNCS = ("softmax", "sigmoid")
DISPATCHES = ("padded", "ragged")
EXCHANGES = ("auto", "all_to_all", "ragged_all_to_all", "all_gather")
GROUP_SCORES = ("top2_sum", "max")


def _check_at_least(owner, keys, low: int, prefix: str) -> None:
    for key in keys:
        value = getattr(owner, key)
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise UserError(f"{prefix}{key}={value!r} must be a number >= {low}.")


def _check_finite(owner, keys, prefix: str, allow_zero: bool) -> None:
    for key in keys:
        value = getattr(owner, key)
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not ok or value < 0 or (value == 0 and not allow_zero):
            raise UserError(f"{prefix}{key}={value!r} must be a finite number {'>=' if allow_zero else '>'} 0.")


@dataclass(frozen=True)
class MoEConfig:
    """Mixture-of-experts feed-forward layers (ushard/models/moe.py); `num_experts=0`: a dense model."""

    num_experts: int = 0
    top_k: int = 2  # routed experts per token
    # Each expert takes at most ceil(capacity_factor * T * top_k / num_experts) of a sequence's T tokens
    # (the drop rule: ushard/models/moe.py). 0: dropless, every token reaches its top_k experts.
    capacity_factor: float = 0.0
    num_shared_experts: int = 0  # experts every token goes through, beside its routed ones
    expert_d_ff: int = 0  # hidden size of one expert (routed or shared); 0: model.d_ff
    # Layer i is an MoE layer if i >= first_dense_layers and (i - first_dense_layers) % every == 0;
    # the others are dense. (n_layers - first_dense_layers) must be a multiple of `every`.
    every: int = 1
    first_dense_layers: int = 0
    score_func: str = "softmax"  # softmax | sigmoid: router scores from the router logits
    normalize_gates: bool = True  # divide a token's top_k scores by their sum
    routed_scale: float = 1.0  # the routed experts' gates are multiplied by this
    # Group-limited routing: experts in num_groups equal groups; a token picks its experts from its
    # top_groups best groups. 1 and 1: no limit.
    num_groups: int = 1
    top_groups: int = 1
    # What a group scores: "top2_sum", the sum of its two best experts' scores (DeepSeek-V3), or "max",
    # its best expert's (DeepSeek-V2's group_limited_greedy).
    group_score: str = "top2_sum"
    aux_loss_weight: float = 0.01  # the load-balancing loss's weight in the objective
    # The load-balancing loss of each sequence, averaged over the batch (DeepSeek's "seq_aux"), instead
    # of the loss of the whole (micro)batch's statistics.
    aux_loss_per_sequence: bool = False
    z_loss_weight: float = 0.001  # the router z-loss's weight
    # Auxiliary-loss-free balancing: each step, every expert's routing bias moves by this much against
    # its load (up if under-loaded, down if over-loaded). 0: the bias stays zero.
    bias_update_rate: float = 0.0
    # How assignments reach experts split over devices (mesh.expert > 1; ushard/parallel/expert.py):
    # "padded" all_to_all of fixed-capacity buffers, or "ragged" (ragged_all_to_all: only the rows used).
    dispatch: str = "padded"
    # The ragged dispatch's receive buffer, in multiples of the rows a device gets when the load is
    # even: the grouped matmul runs over all of it; a step whose load needs more stops the run.
    dispatch_headroom: float = 2.0
    # How the ragged dispatch moves rows between devices (ushard/parallel/expert.py): "auto" ("all_gather"
    # on GPUs, XLA's ragged_all_to_all on TPUs, "all_to_all" elsewhere), "all_to_all" (a dense all_to_all
    # of a buffer per pair of devices), "ragged_all_to_all", or "all_gather" (tokens gathered to every
    # device of the expert group, outputs reduce-scattered back).
    exchange: str = "auto"
    # The dropless experts' grouped matmul (ushard/kernels/grouped_matmul.py): "auto" runs JAX's Pallas
    # Mosaic-GPU kernel on Hopper GPUs in 16-bit compute, else "xla" (ragged_dot).
    grouped_matmul_impl: str = "auto"

    def __post_init__(self):
        p = "model.moe."
        _check_at_least(self, ("num_experts", "num_shared_experts", "expert_d_ff", "first_dense_layers"), 0, p)
        _check_at_least(self, ("top_k", "every", "num_groups", "top_groups"), 1, p)
        _check_finite(self, ("capacity_factor", "aux_loss_weight", "z_loss_weight", "bias_update_rate"), p,
                      allow_zero=True)
        _check_finite(self, ("routed_scale",), p, allow_zero=False)
        if not self.dispatch_headroom >= 1:
            raise UserError(f"{p}dispatch_headroom={self.dispatch_headroom!r} must be at least 1 (the rows of an "
                            f"even load).")
        for key, valid in (("score_func", SCORE_FUNCS), ("dispatch", DISPATCHES), ("exchange", EXCHANGES),
                           ("grouped_matmul_impl", GROUPED_MATMUL_IMPLS), ("group_score", GROUP_SCORES)):
            if getattr(self, key) not in valid:
                raise UserError(f"{p}{key}={getattr(self, key)!r} is not valid; choose one of: {', '.join(valid)}.")
        for key in ("normalize_gates", "aux_loss_per_sequence"):
            if not isinstance(getattr(self, key), bool):
                raise UserError(f"{p}{key}={getattr(self, key)!r} must be true or false.")
        if not self.num_experts:
            return
        if self.top_k > self.num_experts:
            raise UserError(f"{p}top_k={self.top_k} is more than {p}num_experts={self.num_experts}; a token picks "
                            "distinct experts.")
        if self.num_experts % self.num_groups:
            raise UserError(f"{p}num_experts={self.num_experts} does not split into {p}num_groups={self.num_groups} "
                            "equal groups; use a divisor.")
        if self.top_groups > self.num_groups:
            raise UserError(f"{p}top_groups={self.top_groups} is more than {p}num_groups={self.num_groups}.")
        if self.top_k > self.top_groups * (self.num_experts // self.num_groups):
            within = self.top_groups * (self.num_experts // self.num_groups)
            raise UserError(f"{p}top_k={self.top_k} is more than the {within} "
                            f"experts in {p}top_groups={self.top_groups} groups; raise top_groups.")


@dataclass(frozen=True)
class MTPConfig:
    """Multi-token prediction (DeepSeek-V3's; ushard/models/mtp.py): `depth` extra modules, module k
    predicting the token k + 1 places after the next one; 0: none."""

    depth: int = 0
    # The MTP loss's weight: the objective adds loss_weight times the mean of the depths' cross-entropies
    # (DeepSeek-V3's lambda: 0.3 for its first 10T tokens, then 0.1).
    loss_weight: float = 0.3

    def __post_init__(self):
        _check_at_least(self, ("depth",), 0, "model.mtp.")
        _check_finite(self, ("loss_weight",), "model.mtp.", allow_zero=True)


LORA_BASE_DTYPES = ("compute", "param", "float8")


@dataclass(frozen=True)
class LoraConfig:
    """LoRA adapters on the frozen model (ushard/training/lora.py); rank 0: none, every weight trained."""

    rank: int = 0
    alpha: float = 16.0  # the update is scaled by alpha / rank, as peft's lora_alpha
    dropout: float = 0.0  # of the adapters' inputs, as peft's lora_dropout
    # Comma-separated weight names (`wq`, `w_up`, `experts.w_up`, ...: a name matches every weight whose
    # dotted path ends with it), or `all`: every projection of attention, the MLPs and the experts.
    targets: str = "all"
    # How the frozen base is stored: `compute` (model.compute_dtype, no float32 copy), `param`, or
    # `float8` (the adapted weights in float8 e4m3 with per-output-channel scales, the rest in compute).
    base_dtype: str = "compute"

    def __post_init__(self):
        _check_at_least(self, ("rank",), 0, "model.lora.")
        _check_finite(self, ("alpha",), "model.lora.", allow_zero=False)
        if not isinstance(self.dropout, (int, float)) or not 0 <= self.dropout < 1:
            raise UserError(f"model.lora.dropout={self.dropout!r} must be a number in [0, 1).")
        if self.base_dtype not in LORA_BASE_DTYPES:
            raise UserError(f"model.lora.base_dtype={self.base_dtype!r} is not valid; choose one of: "
                            f"{', '.join(LORA_BASE_DTYPES)}.")
        if not isinstance(self.targets, str) or not self.targets.strip(","):
            raise UserError(f"model.lora.targets={self.targets!r} must name weights (comma-separated) or be 'all'.")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2 and V3; ushard/models/mla.py). Each token's keys and
    values are expanded from one latent of kv_lora_rank numbers, its queries (where q_lora_rank > 0)
    from another; a head's q·k spans qk_nope_head_dim dimensions without positions and
    qk_rope_head_dim rotated by RoPE, whose key is one for all heads; its values have v_head_dim.
    `kv_lora_rank=0`: no latent attention (every other field 0 too), the other families' attention."""

    q_lora_rank: int = 0  # the queries' bottleneck; 0: queries projected from the residual stream directly
    kv_lora_rank: int = 0  # the latent the keys and values are expanded from; 0: no latent attention
    qk_nope_head_dim: int = 0  # a head's q·k dimensions without positions
    qk_rope_head_dim: int = 0  # a head's q·k dimensions rotated by RoPE (the key's shared by all heads)
    v_head_dim: int = 0  # a head's value size

    def __post_init__(self):
        p = "model.mla."
        keys = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        _check_at_least(self, keys, 0, p)
        if not self.kv_lora_rank:
            for key in keys:
                if getattr(self, key):
                    raise UserError(f"{p}{key}={getattr(self, key)} is set but {p}kv_lora_rank=0, which means no "
                                    "latent attention; set kv_lora_rank too, or leave the group at its defaults.")
            return
        _check_at_least(self, ("qk_rope_head_dim", "v_head_dim"), 1, p)
        if self.qk_rope_head_dim % 2:
            raise UserError(f"{p}qk_rope_head_dim={self.qk_rope_head_dim} must be even for rotary embeddings.")

    @property
    def qk_head_dim(self) -> int:
        """A head's size in q·k."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim


ROPE_SCALING_TYPES = ("none", "llama3", "linear", "yarn")


@dataclass(frozen=True)
class RopeScaling:
    """`model.rope_scaling`: how RoPE's frequencies are stretched for contexts longer than training's.

    "llama3" is Llama 3.1's (Hugging Face `rope_type: llama3`, same key names): wavelengths longer than
    original_max_position_embeddings / low_freq_factor are divided by `factor`, those shorter than
    original_max_position_embeddings / high_freq_factor are kept, and the ones between are blended.
    "linear" divides every frequency by `factor` (Hugging Face `rope_type: linear`; Gemma 3's global
    layers). "yarn" is YaRN's (Hugging Face `rope_type: yarn`, same key names; DeepSeek-V2 and V3):
    frequencies that turn fewer than beta_slow times over original_max_position_embeddings are divided
    by `factor`, those that turn more than beta_fast times are kept, and the ones between are blended
    linearly by their index; the rotated q and k are each multiplied by the attention factor
    mscale(factor, mscale) / mscale(factor, mscale_all_dim) where both are set (> 0), else by
    mscale(factor, 1), where mscale(s, m) = 0.1 * m * ln(s) + 1 (1 for s <= 1). DeepSeek's attention
    also multiplies its softmax scale by mscale(factor, mscale_all_dim) ** 2 (ushard/models/mla.py).
    "none" uses the plain frequencies (the other keys are then unused).
    """

    type: str = "none"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0  # 0: not set
    mscale_all_dim: float = 0.0  # 0: not set

    def check(self) -> None:
        if self.type not in ROPE_SCALING_TYPES:
            raise UserError(f"model.rope_scaling.type={self.type!r} is not valid; "
                            f"choose one of: {', '.join(ROPE_SCALING_TYPES)}.")
        for key in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings", "beta_fast",
                    "beta_slow"):
            value = getattr(self, key)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
                raise UserError(f"model.rope_scaling.{key}={value!r} must be a finite number > 0.")
        _check_finite(self, ("mscale", "mscale_all_dim"), "model.rope_scaling.", allow_zero=True)
        if self.high_freq_factor <= self.low_freq_factor:
            raise UserError(f"model.rope_scaling.high_freq_factor={self.high_freq_factor!r} must be larger than "
                            f"model.rope_scaling.low_freq_factor={self.low_freq_factor!r} (the blend between them "
                            "divides by the gap).")
        if self.beta_fast <= self.beta_slow:
            raise UserError(f"model.rope_scaling.beta_fast={self.beta_fast!r} must be larger than "
                            f"model.rope_scaling.beta_slow={self.beta_slow!r} (YaRN blends the frequencies between "
                            "them).")


@dataclass(frozen=True)
class ModelConfig:
    """Every model setting with its default: `default_config().model` is made from these fields."""

    # The architecture (ushard/models/registry.py): llama (Llama 2/3, Mistral, Mixtral), qwen3 (dense
    # and MoE: QK-norm), gemma3 (sliding windows, four norms a block, GeGLU), deepseek (DeepSeek-V2 and
    # V3: multi-head latent attention, `mla`; MoE with shared experts).
    family: str = "llama"
    vocab_size: int = 512
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 4
    d_ff: int = 768
    head_dim: int = 0  # the size of one attention head; 0: d_model / n_heads
    # Local attention: a query sees itself and the sliding_window - 1 tokens before it (0: no window).
    # Every sliding_window_pattern-th layer attends globally instead (Gemma 3: 6; 0: every layer is local).
    sliding_window: int = 0
    sliding_window_pattern: int = 6
    local_rope_theta: float = 0.0  # the windowed layers' RoPE base where the family has one (0: rope_theta)
    query_pre_attn_scalar: float = 0.0  # attention scores are scaled by this ** -0.5 (0: head_dim)
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    compute_dtype: str = "bfloat16"
    param_dtype: str = "float32"
    attention_impl: str = "auto"  # auto: the platform's fused kernel (ushard/kernels/attention.py), else XLA
    remat: str = "none"  # none | full | dots | dots_no_batch | dots_attention | dots_attention_norms
    document_mask: bool = True  # packed documents never attend to each other
    # Layers per iteration of the layer scan. 1 keeps compile time flat in depth; n_layers unrolls
    # fully, which lets XLA keep saved activations in place (see docs/benchmarks.md).
    scan_unroll: int = 1
    # One weight and one GEMM for the SwiGLU gate and up projections together.
    fused_mlp: bool = False
    # The transformer blocks' matmuls in FP8 (ushard/models/fp8.py; Hopper GPUs or newer). The LM head
    # and attention's softmax stay in the compute dtype.
    fp8: bool = False
    moe: MoEConfig = MoEConfig()
    mtp: MTPConfig = MTPConfig()
    lora: LoraConfig = LoraConfig()  # low-rank adapters on the frozen weights (model.lora.rank > 0)
    mla: MLAConfig = MLAConfig()  # multi-head latent attention (model.family='deepseek')

    # How the model is computed (or trained), not what it computes: a run may resume with these
    # changed. Every other setting (new ones included, unless added here) defines the model's function.
    IMPLEMENTATION_SETTINGS = ("compute_dtype", "attention_impl", "remat", "scan_unroll", "fused_mlp",
                               "fp8", "moe.aux_loss_weight", "moe.aux_loss_per_sequence", "moe.z_loss_weight",
                               "moe.bias_update_rate",
                               "moe.dispatch", "moe.dispatch_headroom", "moe.exchange",
                               "moe.grouped_matmul_impl", "mtp.loss_weight", "lora.dropout",
                               "lora.base_dtype")

    @classmethod
    def from_config(cls, model_cfg, ignore_unknown: bool = False) -> "ModelConfig":
        """From the `model` group of a config (a ConfigDict or a plain nested dict, such as a checkpoint's
        saved JSON); raises UserError if invalid. `ignore_unknown` drops keys this version does not
        know; missing keys take their defaults."""
        values = model_cfg.to_dict() if hasattr(model_cfg, "to_dict") else dict(model_cfg)
        groups = {key: dict(values.pop(key, {})) for key in NESTED_GROUPS}
        if ignore_unknown:
            values = {k: v for k, v in values.items() if k in cls.__dataclass_fields__}
            groups = {key: {k: v for k, v in group.items() if k in NESTED_GROUPS[key].__dataclass_fields__}
                      for key, group in groups.items()}
        return cls(**values, **{key: NESTED_GROUPS[key](**group) for key, group in groups.items()})

    @property
    def expert_d_ff(self) -> int:
        return self.moe.expert_d_ff or self.d_ff

    @property
    def moe_layers(self) -> int:
        """How many layers are MoE layers (0 for a dense model)."""
        if not self.moe.num_experts:
            return 0
        return (self.n_layers - self.moe.first_dense_layers) // self.moe.every

    def settings(self) -> dict:
        """{"rope_theta": 10000.0, ..., "moe.top_k": 2, ...}: every setting by its dotted name under `model.`."""
        flat = {}
        for key, value in dataclasses.asdict(self).items():
            if isinstance(value, dict):  # a nested group (moe, mla, rope_scaling)
                flat.update({f"{key}.{k}": v for k, v in value.items()})
            else:
                flat[key] = value
        return flat

    def __post_init__(self):
        if not isinstance(self.rope_scaling, RopeScaling):  # a group of the config (ConfigDict) or saved JSON (dict)
            object.__setattr__(self, "rope_scaling", _rope_scaling(self.rope_scaling))
        self.rope_scaling.check()
        if isinstance(self.mla, dict):  # a family's Hugging Face settings (ushard/models/deepseek/hf.py)
            object.__setattr__(self, "mla", MLAConfig(**self.mla))
        _check_at_least(self, ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "scan_unroll"), 1,
                        "model.")
        _check_at_least(self, ("head_dim", "sliding_window", "sliding_window_pattern"), 0, "model.")
        _check_finite(self, ("rope_theta", "norm_eps"), "model.", allow_zero=False)
        _check_finite(self, ("local_rope_theta", "query_pre_attn_scalar"), "model.", allow_zero=True)
        if not isinstance(self.family, str) or not self.family:
            raise UserError(f"model.family={self.family!r} must name a model family, such as 'llama'.")
        for key, valid in (("remat", tuple(REMAT_POLICIES)), ("attention_impl", ATTENTION_IMPLS),
                           ("compute_dtype", DTYPES), ("param_dtype", DTYPES)):
            if getattr(self, key) not in valid:
                raise UserError(f"model.{key}={getattr(self, key)!r} is not valid; choose one of: {', '.join(valid)}.")
        if not self.head_dim:  # derived: recorded resolved, so a saved config states its head size
            if self.d_model % self.n_heads:
                raise UserError(f"model.d_model={self.d_model} is not divisible by model.n_heads={self.n_heads}; "
                                "pick sizes so head_dim is whole, or set model.head_dim.")
            object.__setattr__(self, "head_dim", self.d_model // self.n_heads)
        if self.head_dim % 2:
            raise UserError(f"model.head_dim={self.head_dim} must be even for rotary embeddings.")
        if self.n_heads % self.n_kv_heads:
            raise UserError(f"model.n_heads={self.n_heads} is not divisible by model.n_kv_heads={self.n_kv_heads}; "
                            "grouped-query attention needs whole groups.")
        moe = self.moe
        if moe.num_experts:
            rest = self.n_layers - moe.first_dense_layers
            if rest < moe.every or rest % moe.every:
                raise UserError(
                    f"model.n_layers={self.n_layers} minus model.moe.first_dense_layers={moe.first_dense_layers} "
                    f"leaves {rest} layers, not a positive multiple of model.moe.every={moe.every}; the layers "
                    f"after the dense ones repeat a pattern of `every` layers."
                )

    def differences(self, other: "ModelConfig", function_only: bool = False, only=None) -> list[str]:
        """The settings that differ ("model.k=<self's> there but <other's> here"); with `function_only`,
        only those that define the model's function; with `only`, only those top-level keys."""
        skip = self.IMPLEMENTATION_SETTINGS if function_only else ()
        mine, theirs = self.settings(), other.settings()
        return [f"model.{k}={mine[k]!r} there but {theirs[k]!r} here" for k in mine
                if k not in skip and (only is None or k.split(".")[0] in only) and mine[k] != theirs[k]]


# The nested groups `from_config` builds from their own dicts: model.<key>.* -> the dataclass.
NESTED_GROUPS = {"moe": MoEConfig, "mla": MLAConfig, "mtp": MTPConfig, "lora": LoraConfig}


def _rope_scaling(group) -> RopeScaling:
    """`model.rope_scaling` from a ConfigDict or a dict (a saved config). Keys this version does not
    know (a newer checkpoint's) are ignored, as `saved_model_config` ignores unknown model keys."""
    known = RopeScaling.__dataclass_fields__
    if not hasattr(group, "items"):
        raise UserError(f"model.rope_scaling={group!r} is not valid; it is a group with keys {', '.join(known)}.")
    return RopeScaling(**{k: v for k, v in group.items() if k in known})
