"""The model-family seam: what a family (ushard/models/<family>/) gives the rest of ushard.

`ModelDef` builds the family's module; the Hugging Face import and export (ushard/hf.py) read and
write its `HFMap`; metrics, the step-time model and the memory estimate count FLOPs from its
`attention_shape`. Everything else (parameter counts, logical names, layouts) is read off the built
module's parameters, so a family states each of its shapes once, in its own modules.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ushard.models.config import ModelConfig


@dataclass(frozen=True)
class AttentionShape:
    """Attention's sizes in every layer, for FLOPs: the query heads, the size of one head in q·k and
    in the values, and each layer's sliding window (0: the layer attends to the whole context).
    `cache`: what a decoding cache holds for a token in each layer, (heads, its "k" size, its "v"
    size), where that is not the keys and values (latent attention caches its latent); None: the
    keys and values of model.n_kv_heads heads. It is also what context parallelism moves between
    the devices (`context_numbers`)."""

    heads: int
    qk_head_dim: int
    v_head_dim: int
    windows: tuple[int, ...]
    cache: tuple[int, int, int] | None = None

    def cache_dims(self, n_kv_heads: int) -> tuple[int, int, int]:
        """(heads, k size, v size) of one token's cache entries in one layer."""
        return self.cache or (n_kv_heads, self.qk_head_dim, self.v_head_dim)

    def context_numbers(self, n_kv_heads: int, tensor: int) -> int:
        """The numbers a token's keys and values take on each device where context parallelism moves
        them (ushard/parallel/context.py): the keys and values of its share of the KV heads, split
        `tensor` ways, or a cache's own entries (latent attention's latent and RoPE key), which every
        tensor rank holds whole, making its own heads' keys and values of them."""
        if self.cache is None:
            return max(1, n_kv_heads // tensor) * (self.qk_head_dim + self.v_head_dim)  # a rank holds one copy at least
        heads, k, v = self.cache
        return heads * (k + v)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs a token spends in attention's two matmuls (scores and values), forward and
        backward (x 3), over the keys it sees: causal, so on average about half the sequence, or a
        window's worth where the layer has one (the mean over the sequence's positions)."""
        per_key = 2 * self.heads * (self.qk_head_dim + self.v_head_dim)
        return 3 * per_key * sum(mean_visible_keys(seq_len, w) for w in self.windows)


def mean_visible_keys(seq_len: int, window: int = 0) -> float:
    """The keys a query sees, averaged over the positions of a `seq_len`-token causal sequence: half
    the sequence (the convention of PaLM's and MaxText's FLOPs counts), or with a window shorter than
    the sequence the exact mean of min(position + 1, window) over the positions."""
    if not window or window >= seq_len:
        return seq_len / 2
    return (window * (window + 1) / 2 + (seq_len - window) * window) / seq_len


def plain_attention_shape(cfg: ModelConfig) -> AttentionShape:
    """Every layer global, q·k and values of one head size: the Llama-style families' attention."""
    return AttentionShape(cfg.n_heads, cfg.head_dim, cfg.head_dim, (0,) * cfg.n_layers)


@dataclass(frozen=True)
class HFMap:
    """A family's Hugging Face checkpoints: the config.json model types it reads, its config both ways
    (`settings(hf, directory) -> ModelConfig keywords`, refusing in one sentence what it cannot
    compute; `config(cfg, dtype, max_positions) -> config.json`), its tensors' names
    (`tensors(cfg) -> [Tensor]`, ushard/models/hf_names.py) and `check_export(cfg)`, which refuses a
    model transformers would compute differently. `ignored(cfg, name)`: whether a checkpoint's tensor
    that the map does not read is left out on import rather than refused (DeepSeek-V3's multi-token
    prediction modules, which transformers does not load either)."""

    model_types: tuple[str, ...]
    settings: Callable
    config: Callable
    tensors: Callable
    check_export: Callable
    ignored: Callable = lambda cfg, name: False


@dataclass(frozen=True)
class Family:
    """One architecture: `build(cfg, rngs)` creates its NNX module (a `Decoder`), `check(cfg)` refuses
    the settings it does not compute, `attention_shape(cfg)` states attention's sizes for FLOPs."""

    name: str
    build: Callable
    hf: HFMap
    check: Callable = lambda cfg: None
    attention_shape: Callable = plain_attention_shape
