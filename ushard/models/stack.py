"""The one place that runs a stack of layers: scan or unroll, the remat policy, ZeRO-3 kept-gathered weights.

A stack is an NNX module created stacked (every weight has a leading `layers` axis, see
`Llama.__init__`). Each layer is called as `layer(x, *args) -> (x, aux)`, `aux` a dict of scalars
(e.g. an MoE load-balancing term) that the stack sums over layers. A stack whose layers differ (a
dense layer every k-th, MoE otherwise) is a stack of periodic super-blocks, each holding its k layers.
When the layout splits the `layers` axis into pipeline stages, `run_layers` hands the stack to the
layout's `seams.run_stack` (ushard/parallel/pipeline.py, wired in by `build`), which runs
`scan_layers` on each stage's chunk of layers.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from ushard.kernels.attention import FUSED_ATTENTION
from ushard.models.low_rank import LowRankAdapted, adapter_names, scale_names
from ushard.sharding import current_layout, gathered


def _is_fused_attention(prim, *_, **__) -> bool:
    # The forward of a fused attention kernel (cuDNN's is `dot_product_attention_fwd`; ushard's Pallas
    # kernels name their outputs FUSED_ATTENTION instead): its output and softmax statistics are
    # small next to what recomputing it costs.
    return "attention" in prim.name


_saveable = jax.checkpoint_policies
# The routed experts' matmuls, batched (padded dispatch) or grouped (a kernel): the "dots" policies
# keep them as they keep XLA's unbatched dots (tagged in models/moe.py).
_expert_matmuls = _saveable.save_only_these_names("expert_matmul")
# What the backward pass may keep from the forward; everything else is recomputed. "none": no remat.
REMAT_POLICIES = {
    "none": None,
    "full": _saveable.nothing_saveable,
    "dots": _saveable.save_from_both_policies(_saveable.dots_saveable, _expert_matmuls),
    "dots_no_batch": _saveable.save_from_both_policies(_saveable.dots_with_no_batch_dims_saveable, _expert_matmuls),
}
REMAT_POLICIES["dots_attention"] = _saveable.save_from_both_policies(
    REMAT_POLICIES["dots_no_batch"],
    _saveable.save_from_both_policies(_is_fused_attention, _saveable.save_only_these_names(FUSED_ATTENTION)))
# ...and also the norm outputs and the SwiGLU product (tagged in models/layers.py): only rotary
# embeddings and activation functions are recomputed.
REMAT_POLICIES["dots_attention_norms"] = _saveable.save_from_both_policies(
    REMAT_POLICIES["dots_attention"], _saveable.save_only_these_names("norm_out", "mlp_hidden")
)


# A layer's input under remat: what a pipeline tick's remat boundary keeps beside the layers' own policy.
LAYER_INPUT = "layer_input"


def run_layers(layers: nnx.Module, x, *args, remat: str = "none", unroll: int = 1, compute_dtype=None):
    """x through every layer of the stacked module `layers`; returns (x, aux summed over layers).

    `args` go to every layer unchanged; when the layout splits the layers into pipeline stages they
    must be per-row arrays [batch, ...] (positions, segment ids), cut into microbatches with x.
    """
    graphdef, layer_states = nnx.split(layers)

    def stage(chunk, x, args):
        return scan_layers(graphdef, chunk, x, args, remat, unroll, compute_dtype)

    layout = current_layout()
    if layout is not None and layout.pipeline is not None:
        return layout.seams.run_stack(stage, layer_states, x, args, layout, tick_policy=tick_policy(remat, layout))
    return stage(layer_states, x, args)


def tick_policy(remat: str, layout):
    """What a GPipe or circular tick keeps for its backward pass (`run_stages`' `tick_policy`): what the
    layers' remat keeps, and each layer's input (`scan_layers` names it), which the layers' remat
    boundary keeps as its input. None (the tick keeps everything, its weights too) without remat, and
    with ZeRO-3's gathered weights kept on purpose (they are inputs of the layers' remat boundary)."""
    if remat == "none" or layout.zero.keep_gathered:
        return None
    return _saveable.save_from_both_policies(REMAT_POLICIES[remat], _saveable.save_only_these_names(LAYER_INPUT))


def scan_layers(graphdef, layer_states, x, args, remat: str, unroll: int, compute_dtype):
    """x through the stacked layers `layer_states` one after another: (x, aux summed over them)."""

    def one_layer(x, layer_state):
        return nnx.merge(graphdef, layer_state)(x, *args)

    if remat != "none":
        # Unrolled layers are one graph: unless CSE is blocked there, XLA merges the backward pass's
        # recomputation with the forward pass and keeps every activation, as if remat were off
        # (docs/dev-notes.md). A rolled scan keeps the two apart itself, and blocking costs speed there.
        remat_body = jax.checkpoint(one_layer, policy=REMAT_POLICIES[remat], prevent_cse=unroll > 1)
        one_layer = lambda x, layer_state: remat_body(checkpoint_name(x, LAYER_INPUT), layer_state)  # noqa: E731
    layout = current_layout()
    if layout is not None and layout.zero.keep_gathered:
        # Gathered outside the remat boundary, the weights become inputs the backward pass keeps.
        layer_body = one_layer
        one_layer = lambda x, layer_state: layer_body(x, weights_for_compute(layer_state, compute_dtype))  # noqa: E731
    x, aux = jax.lax.scan(one_layer, x, layer_states, unroll=unroll)
    return x, jax.tree.map(lambda per_layer: jnp.sum(per_layer, axis=0), aux)


def weights_for_compute(layer_state, compute_dtype):
    """One layer's matmul weights cast to the compute dtype and gathered (norm scales as they are)."""

    def prepare(variable):
        names = variable.get_metadata()["out_sharding"][1:]  # without the stacked `layers` axis
        return variable.replace(weight_for_compute(variable[...], names, compute_dtype))

    return jax.tree.map(prepare, layer_state, is_leaf=lambda v: isinstance(v, nnx.Variable))


def weight_for_compute(w, logical_names, compute_dtype):
    """A matmul weight cast to the compute dtype and gathered (ZeRO-3); a norm scale as it is. A
    LoRA-adapted weight's A and B are gathered as their names (`adapter_names`) say."""
    if "norm" in logical_names:
        return w
    if isinstance(w, LowRankAdapted):
        ins = w.a.ndim - 1 - w.lead
        a_names, b_names = adapter_names(logical_names, w.lead, ins)
        base = w.base if w.float8 else w.base.astype(compute_dtype)  # float8 gathers as float8
        scale = None if w.base_scale is None else gathered(w.base_scale, scale_names(logical_names, w.lead, ins))
        return dataclasses.replace(w, base=gathered(base, logical_names), base_scale=scale,
                                   a=gathered(w.a.astype(compute_dtype), a_names),
                                   b=gathered(w.b.astype(compute_dtype), b_names))
    return gathered(w.astype(compute_dtype), logical_names)
