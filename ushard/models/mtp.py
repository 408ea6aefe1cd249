"""Multi-token prediction (DeepSeek-V3's, its report's section 2.2), `model.mtp.depth` modules.

Module k (1 .. depth) predicts, at position i, the token k + 1 places after the next one (t_{i+k+1}).
It takes position i's representation at depth k - 1 (depth 0: the main model's last layer's output,
before the final norm) and the embedding of token t_{i+k}, normalises each (their own RMSNorms),
projects the two together back to d_model (one matmul over their concatenation), runs one transformer
block of the family's (causal over the sequence, with the same positions and documents), and
predicts through a final norm of its own and the model's output head. The embedding table and the
head are the model's (shared, as in the report); everything else is the module's own.

The objective adds `loss_weight` times the mean over depths of each depth's cross-entropy, summed
over the positions that count at that depth and divided by the main loss's token count (the report's
1/T; it then adds up over microbatches and devices as the main loss does). A position counts at
depth k where its target t_{i+k+1} lies within the sequence and in the same document, and is not
masked (`loss_mask`). The shifted inputs, targets and masks are added to a batch
once, before the train step reorders a split sequence (`with_mtp_fields`), so a device's positions
still see their own next tokens. An MTP block's auxiliary terms (an MoE block's balancing losses and
figures) are not added to the objective; its routing biases still move with its load.

Checkpoints keep the modules as parameters (`mtp<k>`); sampling never runs them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ushard.models.config import ModelConfig
from ushard.models.layers import BTD, RMSNorm, fan_in_init, param, project
from ushard.models.stack import REMAT_POLICIES
from ushard.sharding import constrain


def mtp_names(depth: int) -> tuple[str, ...]:
    """The params keys of the MTP modules, in order of depth."""
    return tuple(f"mtp{k}" for k in range(1, depth + 1))


class MTPModule(nnx.Module):
    """One depth of multi-token prediction (module docstring): `make_block(rngs)` creates its block;
    `norm_offset` is the family's RMSNorm offset."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, make_block, norm_offset: float = 0.0):
        d, dtype = cfg.d_model, jnp.dtype(cfg.param_dtype)
        norm = lambda: RMSNorm(d, cfg.norm_eps, dtype, rngs, offset=norm_offset)  # noqa: E731
        self.embed_norm = norm()
        self.hidden_norm = norm()
        # The projection of [normed embedding; normed hidden state] (DeepSeek's eh_proj), its two
        # halves of input rows stacked on the leading axis.
        self.proj = param(rngs, (2, d, d), (None, "embed", None), fan_in_init(2 * d), dtype)
        self.block = make_block(rngs)
        self.final_norm = norm()
        self.remat = cfg.remat

    def __call__(self, hidden, embedded, positions, segment_ids):
        """hidden: depth k - 1's representation, embedded: the embeddings of the tokens k places ahead,
        both [batch, length, d_model] -> depth k's representation (before `final_norm`)."""
        w = self.proj[...]
        x = (project("btd,de->bte", self.embed_norm(embedded), w[0])
             + project("btd,de->bte", self.hidden_norm(hidden), w[1]))
        x = constrain(x, BTD)
        graphdef, state = nnx.split(self.block)

        def block(state, x):
            return nnx.merge(graphdef, state)(x, positions, segment_ids)[0]

        if self.remat != "none":
            block = jax.checkpoint(block, policy=REMAT_POLICIES[self.remat])
        return block(state, x)


def shifted(x, k: int, fill=0):
    """x [batch, length] moved k places to the left (x[:, i + k] at i), `fill` in the last k places."""
    tail = jnp.full((x.shape[0], k), fill, x.dtype)
    return jnp.concatenate([x[:, k:], tail], axis=1)


def with_mtp_fields(batch: dict, depth: int) -> dict:
    """`batch` with, for each depth k, "mtp_inputs_k" (the token t_{i+k} at position i), "mtp_targets_k"
    (t_{i+k+1}) and "mtp_mask_k" (whether position i's depth-k target counts: within the sequence, in
    i's document, not masked). Unchanged when depth is 0."""
    if not depth:
        return batch
    out = dict(batch)
    segments = batch.get("segment_ids")
    for k in range(1, depth + 1):
        mask = shifted(batch["loss_mask"], k)
        if segments is not None:
            mask = mask * (shifted(segments, k, fill=-1) == segments).astype(mask.dtype)
        out[f"mtp_inputs_{k}"] = shifted(batch["inputs"], k)
        out[f"mtp_targets_{k}"] = shifted(batch["targets"], k)
        out[f"mtp_mask_{k}"] = mask
    return out


def mtp_tokens(batch: dict, depth: int) -> list:
    """The tokens each depth embeds, from a batch `with_mtp_fields` made."""
    return [batch[f"mtp_inputs_{k}"] for k in range(1, depth + 1)]
