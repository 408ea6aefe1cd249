"""Per-device memory of a train step, estimated without compiling it (groundwork of the planner, issue 27).

What is counted, per device:
- The training state (parameters, optimizer state, step counters) and the batch: exact, the bytes of
  each array's shard under the layout's shardings.
- Saved activations: what the backward pass keeps of the forward, as JAX lists it (`saved_residuals`
  under the model's remat policy), traced for one device's work: its rows of the batch, its part of
  the sequence (context parallelism), its stage's layers and microbatches in flight (1F1B pipelines), its
  experts' dispatch buffers (expert parallelism). Each device's share of a residual split by tensor
  parallelism is found from the residual's dimensions (`device_elements`); with sequence parallelism
  the residual stream's residuals (token dimensions and the model width) are split over `tensor` too.
- One layer's full activations (the layer whose backward pass runs; under remat, the one recomputed)
  and the residual stream's gradient entering and leaving it.
- The gradients in float32, laid out as the ZeRO stage lays them out (twice with gradient
  accumulation: the running sum and one microbatch's). A 1F1B pipeline adds its own buffers: the
  stage's weights prepared for compute, its float32 weight-gradient accumulator, the activations and
  gradients passed between stages.
- GPipe and circular pipelines: autodiff of the tick loop stacks each tick's residuals (the stage's
  for one microbatch through one chunk, and without remat the chunk's weights the tick sliced out),
  and the backward pass of a tick pulls back through a chunk (`layer_working_set`); on TPUs the tick
  loop's float32 weight gradient and the stage cast for compute (`tick_loop_buffers`). The MTP
  modules after their stages run microbatch by microbatch (`residual_shapes`).
- A ragged MoE dispatch on TPUs: the grouped matmul's backward writes six more arrays of the receive
  buffer's size (`grouped_matmul_backward`).

How dimensions are attributed: model code names logical axes, but a residual is only a shape. The
model is traced a second time with every dimension that tensor parallelism splits scaled by its own
prime (`SCALES`: KV heads, query heads per KV head, head size, MLP width, vocabulary, length). The
factor by which each dimension of a residual grew says which logical dimensions it holds, also where
several are flattened into one, and so which mesh axes divide it. Context parallelism and expert
dispatch are traced through stand-ins of their shard_map code (`trace_layout`) that compute one
device's shapes without communicating: the ring keeps each device's queries, keys, values, output and
log-sum-exp (its custom VJP), the all-gather mode the gathered keys and values and the scores of the
local queries against them; the experts' buffers are those of `ushard.models.dispatch` (padded) or of
`ushard.parallel.expert.receive_rows` (ragged).

Beside these, named terms for what the compiler holds around the weights and the vocabulary:
- The held dtype: XLA:CPU computes bfloat16 matmuls in float32 and drops the round trips this makes,
  so on CPU everything of the compute dtype is held (and traced) in float32 (`held_dtype`).
  On TPUs (and GPUs) the compute dtype is held as it is.
- Fused attention: where the plan runs a fused kernel (splash on TPUs, cuDNN or ours on GPUs), the
  trace runs a stand-in with flash attention's residuals (`traced_attention`): never XLA's [T, T]
  scores, which "auto" would mean on the host the trace runs on. Its output and log-sum-exp carry the
  fused kernels' name (`kernels.attention.FUSED_ATTENTION`), so a policy that keeps fused attention
  (dots_attention) keeps them in the trace as the kernels' are kept on the device.
- The logits' gradient (`logits_gradient`, TPU only): the TPU compiler materialises the gradient of the
  [tokens, vocabulary] logits as the backward pass starts, while every saved activation (the logits
  among them), the vocabulary's buffers and the gradients are live: a third phase (`MemoryEstimate.phases`).
  On CPU the grid matches without it, so it is not charged there; nor on TPUs for a fully unrolled
  stack, whose head fuses the loss's backward into both its matmuls. The layers' gradients are live
  there only where a scanned stack's backward loop has allocated their stacked buffer; a fully
  unrolled stack writes each layer's as its backward pass runs (`MemoryEstimate.gradients_at_loss`).
- The vocabulary's buffers as the forward pass starts (`vocabulary_buffers`): the embedding table and
  LM head as computed (gathered under ZeRO-3, or cast), and the embedding's float32 gradient, rows
  scattered into zeros of the whole table, allocated ahead of the forward pass and kept to the end.
- Kept state (`kept_state`): with train.on_nonfinite "skip", copies of the old optimizer moments
  (not on TPUs, whose compiles peak the same with "skip" and "stop").
- Kept weights (`kept_weights`): ZeRO-3's gathered layer weights where they live from the forward pass
  to the backward (reshard_after_forward false, or no remat in a fully unrolled stack); on TPUs, a
  rolled stack's weight shards cast to the compute dtype once, ahead of the layer loops (`hoisted_cast`).
The peak holds the kept weights and the largest of the phases: the backward pass's (activations,
gradients, pipeline buffers), the forward pass's start (vocabulary's buffers and kept state), on
TPUs the loss's (saved activations, the logits' gradient, the vocabulary's buffers, the gradients)
and, on GPUs without remat, the backward pass's end (below).

GPU rules, where XLA:GPU holds other buffers than the trace saves (platform "gpu" only; fitted to and
checked against measured peaks, jax's peak_bytes_in_use from tools/bench.py on H100s and H200s, not
against a compile; CPU and TPU estimates are unchanged):
- RMSNorm's float32 residuals (`gpu_stream_bytes`): with a 16-bit compute dtype the trace saves each
  norm's input upcast to float32 and that times rsqrt of its mean square, two float32 [tokens, width]
  arrays. Both are elementwise of the 16-bit residual stream, and XLA:GPU fuses them into the backward
  pass's fusions, keeping the 16-bit input instead: one 16-bit array for the pair, a quarter of the
  bytes. (The trace's weight casts, by contrast, are real: ZeRO-0 rows need every layer's.)
- Sequence parallelism (`gpu_stream_bytes`): the 16-bit residuals of the residual stream's shape (the
  norms' outputs; under remat also the layers' inputs and the attention projection's outputs) are held
  whole along the sequence, as the all-gather made them for the column-parallel matmuls and as the
  row-parallel matmul left them before its reduce-scatter, not split as the trace splits the stream.
- No remat, no pipeline, a fully unrolled stack (`gpu_without_remat`): the backward pass frees each
  layer's activations as it writes that layer's gradients, so the peak is every saved activation and
  no gradient, and the layer pulled back holds nothing beyond its saved activations and the stream's
  gradient (`MemoryEstimate.gradients_apart`: the gradients count in a phase of their own, the pass's
  end). The trace's weight casts are then ZeRO-3's kept weights, not a second copy (`kept_weights`).
The rows they were fitted to, and the kind of row they do not match (remat "full" over long sequences
under fsdp), are in docs/benchmarks.md ("The planner's memory on GPUs").

Not counted: XLA's own scratch buffers, the transient buffers of collectives, and kernels' workspace
beyond what JAX's residuals name. Not modelled (`estimate` refuses them): pipelines over two layer
stacks (leading dense MoE layers). Context parallelism on fused blocks (cuDNN, splash, flash) is
traced as a custom VJP that keeps what the ring's does, in both modes (checked against libtpu's
compile of splash blocks, slow tier). The gradients are held as the ZeRO stage lays them out but for
two compilers' own choices (`gradient_bytes`: TPUs hold ZeRO-1's split, XLA:CPU some of ZeRO-2's
whole). Known to fall short (not refused): data-only meshes with an unrolled stack on CPU (0.87 of
the compiled peak for bench_1b), and an unrolled stack under ZeRO-3 on TPUs (1.47 for bench_1b's
shrunk one on v5p:2x2x2; a scanned one, llama3_8b's, 0.96).
Checked against XLA's memory analysis in tests/test_estimate.py (CPU; TPU through libtpu, slow tier);
the GPU rules against measured GPU peaks (above).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax._src import ad_checkpoint
from jax.ad_checkpoint import checkpoint_name

from ushard.config import MESH_AXES
from ushard.kernels.attention import traced_off_the_chip
from ushard.mesh import build_mesh
from ushard.models import dispatch
from ushard.models.definition import model_definition
from ushard.models.mtp import with_mtp_fields
from ushard.models.stack import tick_policy
from ushard.parallel.expert import EXPERT_MATMUL, receive_rows
from ushard.parallel.pipeline import ring_size
from ushard.sharding import Layout, Seams, use_layout
from ushard.training.objectives import objective_terms

# Each dimension tensor parallelism splits, scaled by a prime of its own in the second trace. The
# model's width is heads x head size, so it grows by kv_heads x groups x head_dim.
SCALES = {"kv_heads": 2, "head_dim": 3, "groups": 5, "mlp": 7, "vocab": 11, "length": 13}


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per device."""

    state: int  # parameters, optimizer state, counters
    batch: int
    saved_activations: int  # kept by the forward pass for the backward pass (all microbatches in flight)
    layer_activations: int  # one layer's activations while its backward pass runs
    gradients: int  # float32, laid out as the ZeRO stage lays them out
    pipeline_buffers: int = 0  # 1F1B: prepared weights, gradient accumulators, activations between stages;
    # GPipe and circular on TPUs: the tick loop's weight gradient and the stage cast (`tick_loop_buffers`)
    vocabulary_buffers: int = 0  # as the forward pass starts: the outer weights as computed, the embedding's gradient
    kept_state: int = 0  # the old optimizer moments, copied to keep them for a step found non-finite
    kept_weights: int = 0  # ZeRO-3: every layer's gathered weights, kept from the forward pass to the backward
    logits_gradient: int = 0  # the loss's gradient of the logits [tokens, vocabulary], as the backward pass starts
    # GPUs without remat (`gradients_apart`): the backward pass frees each layer's saved activations as it
    # writes that layer's gradients, so the two peak apart, at the pass's start and at its end.
    gradients_apart: bool = False
    # TPUs: whether the layers' gradients are live at the loss (a scanned stack's stacked buffer).
    gradients_at_loss: bool = True
    # TPUs: the loss is a phase of its own, also where no logits' gradient is written (an unrolled stack).
    loss_phase: bool = False

    def phases(self) -> dict[str, dict[str, int]]:
        """What the step holds beside the state at each of its peaks, term by term (the fields the terms
        come from); the phases peak at different times:
        - the backward pass: saved and one layer's activations, the gradients (with `gradients_apart`,
          as it starts: no gradient yet) and a pipeline's buffers;
        - the forward pass's start: the vocabulary's buffers and the copied moments, which cannot go in
          the donated state buffers the copies free (`kept_state`);
        - the loss (TPUs), where the logits' gradient is materialised (none for an unrolled stack,
          `logits_gradient`): every saved activation (the logits among them), the logits' gradient,
          the vocabulary's buffers (the head's weights it multiplies by, the embedding's gradient
          allocated ahead) and, where a scanned stack's backward loop holds them already
          (`gradients_at_loss`), the gradients;
        - with `gradients_apart`, the backward pass's end: every gradient, the residual stream's
          gradient and the vocabulary's buffers (the embedding's gradient among them)."""
        phases = {
            "the backward pass": {"saved_activations": self.saved_activations,
                                  "layer_activations": self.layer_activations,
                                  "gradients": 0 if self.gradients_apart else self.gradients,
                                  "pipeline_buffers": self.pipeline_buffers},
            "the forward pass's start": {"vocabulary_buffers": self.vocabulary_buffers, "kept_state": self.kept_state},
            "the loss": {},
        }
        if self.logits_gradient or self.loss_phase:
            phases["the loss"] = {"saved_activations": self.saved_activations, "logits_gradient": self.logits_gradient,
                                  "vocabulary_buffers": self.vocabulary_buffers,
                                  "gradients": self.gradients if self.gradients_at_loss else 0}
        if self.gradients_apart:
            phases["the backward pass's end"] = {
                "gradients": self.gradients, "layer_activations": self.layer_activations,
                "vocabulary_buffers": self.vocabulary_buffers}
        return phases

    @property
    def backward_phase(self) -> int:
        """What the backward pass holds beside the state (`phases`)."""
        return sum(self.phases()["the backward pass"].values())

    @property
    def peak_phase(self) -> str:
        """The phase whose terms make the peak (ties: the first of `phases`)."""
        sums = {name: sum(terms.values()) for name, terms in self.phases().items()}
        return max(sums, key=sums.get)

    @property
    def temporaries(self) -> int:
        # The phases peak at different times: the largest counts. Kept weights live through all.
        return self.kept_weights + max(sum(terms.values()) for terms in self.phases().values())

    @property
    def peak(self) -> int:
        return self.state + self.batch + self.temporaries

    @property
    def breakdown(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.type == "int"}


@dataclass(frozen=True)
class DeviceWork:
    """What one device computes, in the terms the traces need (read from the layout and plan)."""

    rows: int  # sequences per device in one microbatch (pipeline) or gradient-accumulation part
    length: int  # tokens of a sequence on this device
    layers: int  # layers one chunk of the stack runs: a pipeline stage's per round, else all
    stages: int  # pipeline stages (1 without a pipeline)
    tensor_ways: int  # how many ways query heads and MLP columns are split
    kv_ways: int  # how many ways the K/V heads are split (fewer than tensor_ways where they are repeated)
    vocab_ways: int
    residual_ways: int  # the residual stream's extra split along its length (sequence parallelism)
    context: str | None  # "ring" / "all_gather" where the sequence is split
    context_ways: int
    keep_kv: bool
    fused_blocks: bool  # the split sequence's blocks run on a fused kernel (cuDNN, splash), not XLA's
    expert_groups: int  # devices the experts are split over
    dispatch: str | None  # "padded" / "ragged" for an MoE model
    experts_gathered: bool  # expert weights stored split over axes they are gathered from (ZeRO-3)
    expert_width: int = 1  # devices every expert's hidden width is split over (parallel.expert_split="width")

    @property
    def split_by_tensor(self) -> bool:
        return max(self.tensor_ways, self.vocab_ways, self.residual_ways) > 1


def shard_bytes(tree) -> int:
    """The bytes of one device's shard of every array in `tree` (ShapeDtypeStructs with shardings)."""
    return sum(math.prod(leaf.sharding.shard_shape(leaf.shape)) * jnp.dtype(leaf.dtype).itemsize
               for leaf in jax.tree.leaves(tree))


def estimate(setup) -> MemoryEstimate:
    """The per-device memory of `setup`'s train step (ushard.build's Setup); module docstring."""
    refuse_unmodelled(setup)
    state = setup.steps.abstract_state()
    t = setup.config.train
    token_ids = jax.ShapeDtypeStruct((t.batch_size, t.seq_len), jnp.int32, sharding=setup.layout.batch)
    # Without document masking nothing reads the segment ids, and the compiled step drops them.
    read = [k for k in setup.steps.batch_shardings if k != "segment_ids" or setup.model_config.document_mask]
    batch = shard_bytes(dict.fromkeys(read, token_ids))
    work, pipeline = device_work(setup), setup.layout.pipeline
    # The traces, each run once: one layer's (or MoE period's) activations without remat, and under a
    # pipeline one chunk's residuals under the model's remat and everything outside the stack.
    layer = stack_and_outer(setup, work, "none", layers=layer_period(setup))[0]
    chunk = stack_and_outer(setup, work, setup.model_config.remat, work.layers) if pipeline is not None else None
    # With gradient accumulation the running sum and one microbatch's gradients exist together.
    copies = 2 if t.grad_accum > 1 else 1
    one_f_one_b = pipeline is not None and pipeline.name == "1f1b"
    return MemoryEstimate(
        state=shard_bytes(state), batch=batch, saved_activations=saved_activations(setup, work, layer, chunk),
        vocabulary_buffers=vocabulary_buffers(setup), kept_state=kept_state(setup, state),
        kept_weights=kept_weights(setup),
        layer_activations=layer_working_set(setup, work, layer, chunk),
        gradients=copies * gradient_bytes(setup, state),
        pipeline_buffers=(one_f_one_b_buffers(setup, work) if one_f_one_b
                          else tick_loop_buffers(setup) if pipeline is not None else 0),
        logits_gradient=logits_gradient(setup, work),
        gradients_apart=gpu_without_remat(setup),
        gradients_at_loss=setup.model_config.scan_unroll < setup.model_config.n_layers,
        loss_phase=setup.plan.platform == "tpu",
    )


def gradient_bytes(setup, state) -> int:
    """One device's bytes of one set of float32 gradients, laid out as the ZeRO stage lays them out,
    but for two compilers' own choices, found against their memory analyses (tests/test_estimate.py):
    - On TPUs under ZeRO-1 the optimizer reads only its shard of each gradient, and the TPU compiler
      turns the gradients' all-reduce into a reduce-scatter: they are held split as the optimizer state
      is (as ZeRO-2 lays them out).
    - On CPUs under ZeRO-2, XLA:CPU all-reduces whole the gradients that no scan carries (the
      embedding's and head's, and the layers' of an unrolled stack) and keeps them so before slicing
      them: those are held as ZeRO-1 lays them out."""
    layout, model, platform, stage = setup.layout, setup.model, setup.plan.platform, setup.plan.zero_stage
    if setup.adapters:  # LoRA: the adapters' gradients, as the step pins them
        shardings = setup.steps.shardings.grads
    elif platform == "tpu" and stage == 1:
        shardings = layout.shardings(model.logical, "opt_state")
    elif platform == "cpu" and stage == 2:
        stack, others = model.split_stack(model.logical)
        stack_kind = "grads" if setup.model_config.scan_unroll == 1 else "compute"
        shardings = model.join_stack(layout.shardings(stack, stack_kind), layout.shardings(others, "compute"))
    else:
        shardings = setup.steps.shardings.grads
    gradients = jax.tree.map(lambda p, s: jax.ShapeDtypeStruct(p.shape, jnp.float32, sharding=s), state.params,
                             shardings)
    return shard_bytes(gradients)


def gathers_weights(setup) -> bool:
    """Whether ZeRO-3 splits the weights over fsdp and gathers them for compute."""
    return setup.plan.zero_stage == 3 and setup.layout.mesh.shape["fsdp"] > 1


def held_dtype(setup):
    """The dtype the compiler holds compute-dtype buffers in. XLA:CPU has no 16-bit matmuls: it computes
    them in float32 and drops the float32 -> bfloat16 -> float32 round trips this makes, so on CPU the
    weights and activations of a bfloat16 model are held in float32."""
    return jnp.dtype(jnp.float32 if setup.plan.platform == "cpu" else setup.model_config.compute_dtype)


def vocabulary_buffers(setup) -> int:
    """The outer weights (embedding table, LM head: the vocabulary's) and the embedding's gradient, as
    the forward pass starts. The weights are gathered whole for compute (ZeRO-3) or cast to the held
    dtype; the compiler gathers the head's early, as the embedding's lookup runs. The embedding's
    gradient is a float32 sum of rows scattered into zeros of the whole table (ushard.models.layers.
    embed_lookup), which the compiler allocates ahead of the forward pass and keeps to the backward's
    end; it is whole on every device before gradients are reduced to their ZeRO layout."""
    model, layout = setup.model, setup.layout
    table = model.shapes["embedding"]
    table_names = model.logical["embedding"]
    gradient = shard_bytes(jax.ShapeDtypeStruct(table.shape, jnp.float32, sharding=layout.sharding(table_names)))
    if setup.adapters:  # LoRA: the table is frozen, nothing differentiates it
        gradient = 0
    return vocabulary_weights(setup) + gradient


def vocabulary_weights(setup) -> int:
    """The outer weights of the vocabulary (embedding table, LM head) as computed, where that makes a
    copy: gathered whole for compute (ZeRO-3) or cast to the held dtype."""
    model, layout, dtype = setup.model, setup.layout, held_dtype(setup)
    outer_names, outer_shapes = model.split_stack(model.logical)[1], model.split_stack(model.shapes)[1]
    gathered = gathers_weights(setup)
    total = 0
    for shape, names in zip(jax.tree.leaves(outer_shapes), jax.tree.leaves(outer_names, is_leaf=_is_names)):
        if "vocab" in names and (gathered or dtype != shape.dtype):
            total += shard_bytes(jax.ShapeDtypeStruct(shape.shape, dtype, sharding=layout.sharding(names)))
    return total


def gpu_without_remat(setup) -> bool:
    """A GPU step without remat, without a pipeline and with the layer stack fully unrolled, where
    XLA:GPU's backward pass trades each layer's saved activations for its gradients (measured: the peak
    is every saved activation and no gradient, `MemoryEstimate.gradients_apart`), and the layer it pulls
    back holds no activations beyond its saved ones (`layer_working_set`). A scanned stack cannot: its
    backward loop holds the stacked saved activations whole while it writes the stacked gradients
    (llama3_8b rolled, `tensor=2 x fsdp=2`: 114.4 GiB, the unrolled 94.5 plus its 15 GiB of gradients).
    Not so on CPU (the grid of tests/test_estimate.py matches only with gradients and working set
    counted together), nor checked on TPUs."""
    m = setup.model_config
    return (setup.plan.platform == "gpu" and m.remat == "none" and setup.layout.pipeline is None
            and m.scan_unroll >= m.n_layers)


def logits_gradient(setup, work: DeviceWork) -> int:
    """The gradient of the logits [rows, length, vocabulary] in the compute dtype, which the TPU
    compiler materialises as the backward pass starts, while the saved logits and the vocabulary's
    buffers are still live (measured through libtpu's memory analysis, tests/test_estimate.py). Not
    charged on CPU, where the grid matches without it (not investigated further), nor on GPUs, where
    it has not been checked.

    Nor with a fully unrolled stack: there the loss's backward (softmax minus one-hot, elementwise on
    the saved logits, ushard/training/loss.py) fuses into both matmuls of the LM head that read it, and
    the head's weight gradient is scheduled after the layers' backward pass: the logits stay live
    through that pass (among the saved activations) and no [tokens, vocabulary] gradient is written
    (libtpu's buffers for qwen3_1_7b and its Llama twin at four unrolled layers, and for tiny at a 32k
    vocabulary; docs/dev-notes.md). The loss stays a phase there (`MemoryEstimate.loss_phase`): the
    saved activations and the vocabulary's buffers peak together (bench_1b's shrunk rows)."""
    cfg = setup.model_config
    if setup.plan.platform != "tpu" or cfg.scan_unroll >= cfg.n_layers:
        return 0
    return work.rows * work.length * cfg.vocab_size // work.vocab_ways * jnp.dtype(cfg.compute_dtype).itemsize


def kept_state(setup, state) -> int:
    """With train.on_nonfinite "skip", the step keeps the old state where its numbers are not finite
    (`jnp.where(finite, new, old)`). The new optimizer moments are written into the donated buffers of
    the old ones before that choice, so the compiler first copies the old moments (ahead of the forward
    pass); the parameters' new values are computed within the choice and need no copy. The copies free
    the donated buffers, which the compiler reuses for buffers no larger than a state shard (the
    layers' activations), not for the vocabulary's whole buffers: the copies count beside the latter."""
    if not setup.steps.skip_nonfinite or setup.plan.platform == "tpu":
        # libtpu's compile of the same step peaks the same with on_nonfinite "skip" and "stop"
        # (bench_1b, v5p:2x2x2, ZeRO-0 and 1): it holds no copy of the moments at its peak.
        return 0
    return shard_bytes(state.opt_state)


def kept_weights(setup) -> int:
    """ZeRO-3's gathered layer weights (matmul weights in the held dtype, tensor splits kept) where they
    live from the forward pass to the backward: with parallel.reshard_after_forward false by design;
    without remat in a fully unrolled stack because the backward pass's all-gather of a weight is then
    the forward's, which XLA merges (CSE). A rolled scan gathers again in its backward loop. A
    1F1B pipeline prepares its stage's weights itself (`one_f_one_b_buffers`); GPipe and circular keep
    the stage's gathered layers like a stack without stages."""
    layout, cfg, model = setup.layout, setup.model_config, setup.model
    gathered = gathers_weights(setup)
    merged = cfg.remat == "none" and cfg.scan_unroll >= cfg.n_layers
    one_f_one_b = layout.pipeline is not None and layout.pipeline.name == "1f1b"
    if gathered and not layout.zero.keep_gathered and hoisted_cast(setup):
        return cast_layer_shards(setup)
    if not gathered or one_f_one_b or not (layout.zero.keep_gathered or merged):
        return 0
    if gpu_without_remat(setup):
        # Without remat the trace's saved residuals already hold each layer's weights as computed (the
        # cast the layer makes of them, kept for its backward pass): on GPUs those are the kept weights
        # (measured), not a second copy. (On CPU the trace holds float32 weights as they are, no cast.)
        return 0
    stack_names, stack_shapes = model.split_stack(model.logical)[0], model.split_stack(model.shapes)[0]
    dtype = held_dtype(setup)
    return sum(shard_bytes(jax.ShapeDtypeStruct(shape.shape, dtype, sharding=layout.sharding(names)))
               for shape, names in zip(jax.tree.leaves(stack_shapes), jax.tree.leaves(stack_names, is_leaf=_is_names))
               if "norm" not in names)


def hoisted_cast(setup) -> bool:
    """Whether the TPU compiler casts the whole stack of layer weight shards to the compute dtype once,
    ahead of the rolled layer loop, and keeps the cast for the backward loop: every layer then gathers
    its 16-bit shard (ZeRO-3). Seen in libtpu's buffers of each scanned ZeRO-3 step read (qwen3_1_7b,
    gemma3_1b, qwen3_30b_a3b: `convert` of the stacked shards, live across both loops). Not in a fully
    unrolled stack, which casts each layer's as it runs; not where the weights are stored in the
    compute dtype; not under a pipeline (not checked; 1F1B prepares its stage's weights itself,
    `one_f_one_b_buffers`). CPUs hold float32 (no cast, `held_dtype`); GPUs have not been checked."""
    cfg = setup.model_config
    stored = jnp.dtype(setup.adapters.base_dtype if setup.adapters else cfg.param_dtype)  # LoRA: the frozen base's
    return (setup.plan.platform == "tpu" and setup.layout.pipeline is None and cfg.scan_unroll < cfg.n_layers
            and stored != jnp.dtype(cfg.compute_dtype))


def cast_layer_shards(setup) -> int:
    """One device's bytes of the layer stack's matmul weight shards, split as stored, in the compute
    dtype: the cast `hoisted_cast` keeps (norm scales are used as stored, `weight_for_compute`)."""
    model, dtype = setup.model, jnp.dtype(setup.model_config.compute_dtype)
    shapes, shardings = model.split_stack(model.shapes)[0], model.split_stack(setup.steps.shardings.model_params)[0]
    names = jax.tree.leaves(model.split_stack(model.logical)[0], is_leaf=_is_names)
    return sum(shard_bytes(jax.ShapeDtypeStruct(p.shape, dtype, sharding=s))
               for p, s, n in zip(jax.tree.leaves(shapes), jax.tree.leaves(shardings), names) if "norm" not in n)


def _is_names(x) -> bool:
    return isinstance(x, tuple)


def stream_gradients(setup, work: DeviceWork) -> int:
    """The residual stream's gradient entering and leaving the layer whose backward pass runs (float32)."""
    return 2 * work.rows * work.length * setup.model_config.d_model * 4 // work.residual_ways


def refuse_unmodelled(setup) -> None:
    """Raises NotImplementedError for layouts whose memory this module does not model (module docstring)."""
    plan, moe = setup.plan, setup.model_config.moe
    if plan.pipeline is not None and moe.num_experts and moe.first_dense_layers:
        raise NotImplementedError("the memory estimate does not model a pipeline over two layer stacks "
                                  "(model.moe.first_dense_layers > 0)")


def device_work(setup) -> DeviceWork:
    layout, plan, cfg, t = setup.layout, setup.plan, setup.model_config, setup.config.train
    rows = t.batch_size // t.grad_accum // layout.size("act_batch")
    if setup.steps.objective.name == "dpo":  # a row each for a pair's chosen and rejected sequence
        rows *= 2
    stages, chunks = layout.size("layers"), 1
    if plan.pipeline is not None:
        rows //= plan.pipeline.microbatches
        chunks = stages * (plan.pipeline.repeats if plan.pipeline.name == "circular" else 1)
    tensor = layout.size("act_heads")
    # Repeated K/V heads (kv_heads_split false): each rank computes one KV head's copy.
    kv = tensor if plan.split_kv_heads else min(tensor, cfg.n_kv_heads)
    return DeviceWork(
        rows=rows, length=t.seq_len // layout.size("act_length"), layers=cfg.n_layers // chunks, stages=stages,
        tensor_ways=tensor, kv_ways=kv, vocab_ways=layout.size("act_vocab"),
        residual_ways=layout.size("act_residual_length") // layout.size("act_length"), context=plan.context_mode,
        context_ways=layout.size("act_length"), keep_kv=plan.context_keep_kv,
        fused_blocks=plan.context_blocks is not None and plan.context_blocks.name != "xla",
        expert_groups=layout.size("experts"),
        dispatch=plan.expert_dispatch,
        experts_gathered=gathers_weights(setup) and not layout.zero.keep_gathered,
        expert_width=plan.size("expert") if plan.expert_split == "width" else 1,
    )


def saved_activations(setup, work: DeviceWork, layer: int, chunk: tuple[int, int] | None) -> int:
    """The residuals every microbatch in flight keeps at once (module docstring), given one layer's
    activations without remat and, under a pipeline, a chunk's (stack, outer) residuals."""
    pipeline, remat = setup.layout.pipeline, setup.model_config.remat
    if pipeline is None:
        return device_residual_bytes(setup, work, remat, setup.model_config.n_layers)
    stack, outer = chunk
    if pipeline.name != "1f1b":
        # GPipe and circular: autodiff of the tick loop stacks every tick's residuals, the stage's for
        # one microbatch through one chunk, and where the tick keeps them (no remat boundary of its own:
        # `models.stack.tick_policy`) the chunk's weights, which the tick slices out of the stage's
        # rounds (so they are not an argument). Embedding, head and loss run outside the pipeline, on
        # every microbatch at once.
        weights = chunk_weights(setup, work) if tick_policy(remat, setup.layout) is None else 0
        return ticks(pipeline, work.stages) * (stack + weights) + pipeline.microbatches * outer
    # 1F1B: its ring holds `ring_size` microbatches' residuals of the
    # stage's layers whatever their number. The ring is a carry of the tick loop that each tick
    # rewrites in a conditional: the loop holds it twice (in and out), and the forward slot holds the
    # residuals it is writing, or while it computes them one layer's activations, as the backward slot
    # holds another layer's. Embedding, head and loss run on one microbatch at a time.
    return 2 * ring_size(work.stages) * stack + max(stack, layer) + outer


def ticks(pipeline, stages: int) -> int:
    """Clock ticks of a GPipe or circular step (ushard.parallel.pipeline.forward_table)."""
    rounds = pipeline.repeats if pipeline.name == "circular" else 1
    return rounds * pipeline.microbatches + stages - 1


def chunk_weights(setup, work: DeviceWork, dtype=None) -> int:
    """One device's bytes of one chunk's layer weights (`work.layers` layers) in the held dtype (or
    `dtype`), as the tick slices them: out of the stored shard, or, where ZeRO-3 keeps the gathered
    weights (reshard_after_forward false), out of the gathered ones."""
    model, layout, dtype = setup.model, setup.layout, dtype or held_dtype(setup)
    stack = model.split_stack(model.shapes)[0]
    if layout.zero.keep_gathered:  # ZeRO-3 over fsdp, reshard_after_forward false
        names = model.split_stack(model.logical)[0]
        sliced = jax.tree.map(layout.sharding, names, is_leaf=_is_names)
    else:
        sliced = model.split_stack(setup.steps.shardings.model_params)[0]
    held = jax.tree.map(lambda shape, sharding: jax.ShapeDtypeStruct(shape.shape, dtype, sharding=sharding),
                        stack, sliced)
    return shard_bytes(held) * work.layers * work.stages // setup.model_config.n_layers


def layer_working_set(setup, work: DeviceWork, layer: int, chunk: tuple[int, int] | None) -> int:
    """The activations of the layers whose backward pass runs, beside the residual stream's gradients.
    Without a pipeline or under 1F1B: one layer's (under remat, the one recomputed). Under GPipe or
    circular the backward pass of a tick pulls back through a whole chunk: the tick's residuals, sliced
    out of the stacked ones, and the chunk's activations (recomputed under remat). `layer`, `chunk`:
    as for `saved_activations`."""
    pipeline = setup.layout.pipeline
    if gpu_without_remat(setup):
        # The layer's activations are among the saved ones, which its backward pass frees as it goes.
        return stream_gradients(setup, work)
    extra = grouped_matmul_backward(setup, work)
    if pipeline is None or pipeline.name == "1f1b":
        return layer + extra + stream_gradients(setup, work)
    stack = chunk[0]
    if tick_policy(setup.model_config.remat, setup.layout) is not None:
        # Under a tick's own remat boundary (`models.stack.tick_policy`) the chunk's layers are pulled
        # back one at a time, each recomputed from its kept input, into the chunk's float32 weight
        # gradient, which the layer loop's backward stacks before the tick adds it to the stage's.
        return (stack + max(stack, layer) + chunk_weights(setup, work, jnp.float32) + extra
                + stream_gradients(setup, work))
    return stack + max(stack, layer * work.layers // layer_period(setup)) + extra + stream_gradients(setup, work)


def grouped_matmul_backward(setup, work: DeviceWork) -> int:
    """What the backward pass of an MoE layer's ragged dispatch holds beyond the layer's activations, on
    TPUs: the grouped matmul's backward (ushard/kernels/grouped_matmul.py `_backward`) writes its masked
    operands and row gradients, a Pallas kernel's operands being unfused, and with the recomputed
    output the layer's backward holds seven arrays of the receive buffer's rows by the model width
    where its activations (the trace) hold one: six more (libtpu's buffers of qwen3_30b_a3b's and
    deepseek_v3_layout's backward loops, docs/dev-notes.md). Not checked on GPUs; the CPU's
    `ragged_dot` is XLA's."""
    cfg, moe = setup.model_config, setup.model_config.moe
    if setup.plan.platform != "tpu" or not moe.num_experts or work.dispatch != "ragged" or work.expert_groups == 1:
        return 0
    local = moe.num_experts // work.expert_groups
    rows = receive_rows(work.rows * work.length * moe.top_k, work.expert_groups, local, moe.top_k,
                        moe.dispatch_headroom)
    return 6 * rows * cfg.d_model * jnp.dtype(cfg.compute_dtype).itemsize


def layer_period(setup) -> int:
    """Layers in one item of the scanned stack (an MoE model's period of `every` layers)."""
    moe = setup.model_config.moe
    return moe.every if moe.num_experts else 1


def stack_and_outer(setup, work: DeviceWork, remat: str, layers: int) -> tuple[int, int]:
    """(residual bytes of `layers` stacked layers, of everything else: embedding, head, loss, and an MoE
    model's leading dense layers), from traces of `layers` and twice as many (the scanned stack's
    residuals grow with its length) after the dense layers."""
    moe = setup.model_config.moe
    dense = moe.first_dense_layers if moe.num_experts else 0
    once = device_residual_bytes(setup, work, remat, dense + layers)
    twice = device_residual_bytes(setup, work, remat, dense + 2 * layers)
    return twice - once, 2 * once - twice


def one_f_one_b_buffers(setup, work: DeviceWork) -> int:
    """A 1F1B stage's own buffers (ushard/parallel/pipeline.py, one_f_one_b): its weights prepared for
    compute where that makes a copy (ZeRO-3 gathers them; another dtype casts them), the float32
    accumulators of its weights' and the outer parameters' gradients (per group of rows: whole over
    fsdp), and the activation and its gradient passed between stages. Every tick embeds one
    microbatch and finishes another, so the vocabulary's weights as computed live through the tick
    loop, beside a tick's two gradients of the outer parameters (the head's and loss's, the
    embedding's) before they join the accumulator."""
    layout, cfg, model = setup.layout, setup.model_config, setup.model
    stack_names, outer_names = model.split_stack(model.logical)
    stack_shapes, outer_shapes = model.split_stack(model.shapes)

    def compute_bytes(shapes, names, dtype):
        placed = jax.tree.map(lambda s, n: jax.ShapeDtypeStruct(s.shape, dtype or s.dtype,
                                                                sharding=layout.sharding(n)),
                              shapes, names, is_leaf=lambda x: isinstance(x, tuple))
        return shard_bytes(placed)

    compute_dtype = jnp.dtype(cfg.compute_dtype)
    copied = gathers_weights(setup) or compute_dtype != cfg.param_dtype
    prepared = compute_bytes(stack_shapes, stack_names, compute_dtype) if copied else 0
    accumulators = (compute_bytes(stack_shapes, stack_names, jnp.float32)
                    + compute_bytes(outer_shapes, outer_names, jnp.float32))
    passed = 2 * work.rows * work.length * cfg.d_model * compute_dtype.itemsize
    tick_gradients = 2 * compute_bytes(outer_shapes, outer_names, jnp.promote_types(cfg.param_dtype, held_dtype(setup)))
    return prepared + accumulators + passed + vocabulary_weights(setup) + tick_gradients


def tick_loop_buffers(setup) -> int:
    """GPipe's and circular's own buffers (ushard/parallel/pipeline.py, run_stages): the float32
    gradient of the stage's layer weights, laid out as computed (the stages' map takes the weights as
    computed: whole over fsdp), which the backward tick loop carries and, as it starts, holds beside
    the zeros it starts from; and the stage's weights in the compute dtype, cast once for every tick
    where that makes a copy. (libtpu's buffers of deepseek_v3_layout: the loop's carry, its zeros and
    the cast weights, re-laid-out for the rounds, are live together as the backward loop starts.) On
    TPUs only: the CPU grid of tests/test_estimate.py matches without them (XLA:CPU holds float32, and
    its peak is elsewhere); GPUs are not checked."""
    layout, cfg, model = setup.layout, setup.model_config, setup.model
    if setup.plan.platform != "tpu":
        return 0
    names, shapes = model.split_stack(model.logical)[0], model.split_stack(model.shapes)[0]

    def compute_bytes(dtype):
        return shard_bytes(jax.tree.map(lambda s, n: jax.ShapeDtypeStruct(s.shape, dtype, sharding=layout.sharding(n)),
                                        shapes, names, is_leaf=_is_names))

    compute_dtype = jnp.dtype(cfg.compute_dtype)
    copied = gathers_weights(setup) or compute_dtype != cfg.param_dtype
    return 2 * compute_bytes(jnp.float32) + (compute_bytes(compute_dtype) if copied else 0)


# --------------------------------------------------------------------------- traces


def device_residual_bytes(setup, work: DeviceWork, remat: str, n_layers: int) -> int:
    """The bytes of the residuals one device keeps for a forward pass of `work` over a model of
    `n_layers` layers under the remat policy `remat`: traced at one device's rows and length, and where
    tensor parallelism splits the residuals, traced again with its dimensions scaled (`SCALES`) to see
    which dimensions each residual holds."""
    reference = residual_shapes(setup, work, remat, n_layers, scaled=False)
    gpu = gpu_fusions(setup)
    if not work.split_by_tensor and not gpu:
        return sum(math.prod(shape) * size for shape, size in reference)
    scaled = residual_shapes(setup, work, remat, n_layers, scaled=True)
    if [len(s) for s, _ in reference] != [len(s) for s, _ in scaled]:
        raise NotImplementedError("the memory estimate could not match this model's residuals between its "
                                  "two traces (the model's structure changed with its sizes)")
    total = 0
    for (shape, size), (grown, _) in zip(reference, scaled):
        elements, stream = device_elements(shape, grown, work, with_stream=True)
        total += gpu_stream_bytes(setup, work, elements, size) if gpu and stream else math.ceil(elements) * size
    return total


def gpu_fusions(setup) -> bool:
    """Whether the residual stream's residuals are counted as XLA:GPU holds them (`gpu_stream_bytes`):
    on GPUs, with a 16-bit compute dtype held as it is."""
    return setup.plan.platform == "gpu" and held_dtype(setup).itemsize < 4


def gpu_stream_bytes(setup, work: DeviceWork, elements: float, itemsize: int) -> int:
    """One device's bytes of a residual of the residual stream's shape ([tokens, model width]) of
    `elements` (as `device_elements` splits it) as XLA:GPU holds it, against what the trace saves
    (measured peaks of bench_1b on H200s, the module docstring):
    - float32 ones are RMSNorm's statistics input and normalised input (x in float32, and x times
      rsqrt of its mean square; ushard/models/layers.py), elementwise of the 16-bit stream. XLA:GPU
      fuses both into the backward pass's fusions and keeps the 16-bit x instead: one x in the held
      dtype for each pair.
    - 16-bit ones (a norm's output; under remat the layer's input and the attention projection's
      output) are held whole along the sequence where sequence parallelism splits the stream: the norm's
      output as the all-gather made it for the column-parallel matmuls, the row-parallel matmul's output
      before its reduce-scatter."""
    if itemsize == 4:
        return math.ceil(elements * held_dtype(setup).itemsize / 2)
    return math.ceil(elements * work.residual_ways) * itemsize


def device_elements(shape, grown, work: DeviceWork, with_stream: bool = False):
    """One device's elements of a residual of `shape` (a whole-model trace's), given its shape `grown`
    in the scaled trace: each dimension divided by the ways its logical dimensions are split. With
    `with_stream`, (elements, whether the residual holds the residual stream's tokens and width)."""
    elements, width, tokens = 1.0, False, False
    for size, scaled_size in zip(shape, grown):
        held = dimensions_held(size, scaled_size)
        ways = 1
        if {"kv_heads", "groups", "head_dim"} <= held:  # the model's width
            width = True
        elif {"kv_heads", "groups"} <= held:  # query heads
            ways *= work.tensor_ways
        elif "kv_heads" in held:
            ways *= work.kv_ways
        elif "groups" in held:
            ways *= work.tensor_ways // work.kv_ways
        if "mlp" in held:
            ways *= work.tensor_ways
        if "vocab" in held:
            ways *= work.vocab_ways
        tokens = tokens or "length" in held
        elements *= size / ways
    if width and tokens:  # the residual stream: split along its length by sequence parallelism
        elements /= work.residual_ways
    return (elements, width and tokens) if with_stream else elements


def dimensions_held(size: int, scaled_size: int) -> set[str]:
    """The logical dimensions whose scaling (`SCALES`) made a dimension of `size` grow to
    `scaled_size`; none where the growth is not a product of them (a capacity rounded up, say)."""
    if size == 0 or scaled_size % size:
        return set()
    growth, held = scaled_size // size, set()
    for name, prime in SCALES.items():
        if growth % prime == 0:
            held.add(name)
            growth //= prime
            if growth % prime == 0:  # the same dimension twice in one: not a layout this model makes
                return set()
    return held if growth == 1 else set()


def residual_shapes(setup, work: DeviceWork, remat: str, n_layers: int, scaled: bool) -> list[tuple]:
    """(shape, itemsize) of each residual JAX saves for the backward pass of the objective (arguments
    excluded), for `work.rows` sequences of `work.length` tokens on a model of `n_layers` layers."""
    cfg = dataclasses.replace(setup.model_config, remat=remat, n_layers=n_layers,
                              compute_dtype=held_dtype(setup).name, attention_impl=traced_attention(setup))
    length = work.length
    if scaled:
        s = SCALES
        # Latent attention expands a key and a value for every query head: no groups to scale (its
        # query heads then read as K/V heads, split as they are).
        groups = 1 if cfg.mla.kv_lora_rank else s["groups"]
        cfg = dataclasses.replace(
            cfg, n_kv_heads=cfg.n_kv_heads * s["kv_heads"], n_heads=cfg.n_heads * s["kv_heads"] * groups,
            d_model=cfg.d_model * s["kv_heads"] * s["groups"] * s["head_dim"], head_dim=cfg.head_dim * s["head_dim"],
            d_ff=cfg.d_ff * s["mlp"],
            vocab_size=cfg.vocab_size * s["vocab"],
            moe=dataclasses.replace(cfg.moe, expert_d_ff=cfg.expert_d_ff * s["mlp"]))
        length *= s["length"]
    model = model_definition(cfg)
    params = local_experts(jax.eval_shape(lambda: model.init(0)), model.logical, work.expert_groups,
                           work.expert_width)
    token_ids = jax.ShapeDtypeStruct((work.rows, length), jnp.int32)
    batch = dict.fromkeys(setup.steps.batch_shardings, token_ids)

    # What training runs (`Steps._objective`), the multi-token prediction modules with it, but where a
    # GPipe or circular step runs them microbatch by microbatch under remat (`_objective_mtp_by_microbatch`):
    # there they keep nothing beyond their inputs for the backward pass.
    pipeline = setup.layout.pipeline
    by_microbatch = (pipeline is not None and pipeline.name != "1f1b" and pipeline.microbatches > 1
                     and cfg.remat != "none")
    depth = 0 if by_microbatch else cfg.mtp.depth

    def objective(params, batch):
        batch = with_mtp_fields(batch, depth)
        with use_layout(trace_layout(work)):
            if depth:
                logits, aux, mtp_logits = model.apply_for_training(params, batch)
            else:
                logits, aux = model.apply(params, batch["inputs"], batch["positions"], batch["segment_ids"])
                mtp_logits = ()
        return objective_terms(logits, aux, batch, mtp_logits, cfg.mtp.loss_weight)[0]

    with traced_off_the_chip():
        residuals = ad_checkpoint.saved_residuals(objective, params, batch)
    # Arguments are counted in the state; a constant (the embedding's table shape, kept by its custom
    # VJP only for its shape) is never materialised.
    return [(aval.shape, jnp.dtype(aval.dtype).itemsize) for aval, source in residuals
            if not source.startswith(("from the argument", "from a constant"))]


def traced_attention(setup) -> str:
    """The attention the trace runs: the plan's kernel where it is XLA's; for a fused kernel (cuDNN,
    splash) the stand-in with flash attention's residuals (queries, keys, values, output, log-sum-exp:
    `kernels.attention.FLASH_SHAPES`, which `traced_off_the_chip` swaps in for "cudnn"), since the
    trace runs on the host, where neither kernel exists and "auto" would mean XLA's [T, T] scores."""
    fused = setup.plan.attention_for(in_stage=setup.layout.pipeline is not None) != "xla"
    return "cudnn" if fused else "xla"


def local_experts(params, logical, groups: int, width: int = 1):
    """`params` with every routed expert weight cut to one device's block of experts (`groups`) and its
    slice of their hidden width (`width`, parallel.expert_split="width"): what the expert map
    receives as its argument."""
    def block(p, names):
        if "experts" not in names:
            return p
        ways = {"experts": groups, "expert_mlp": width}
        return jax.ShapeDtypeStruct(tuple(n // ways.get(name, 1) for n, name in zip(p.shape, names)), p.dtype)

    return jax.tree.map(block, params, logical, is_leaf=lambda x: isinstance(x, tuple))


# --------------------------------------------------------------------------- one device's stand-ins


class _TraceLayout(Layout):
    """A one-device layout under which the model runs one device's work: nothing is placed, but the
    sequence's and the experts' splits are reported as the real layout's, so that attention and MoE
    layers call the stand-ins of their parallel code (`_trace_seams`)."""

    def size(self, name, kind="compute"):
        return self.ways.get(name, 1)


def trace_layout(work: DeviceWork) -> Layout:
    mesh = build_mesh(dict.fromkeys(MESH_AXES, 1), devices=jax.devices()[:1])
    layout = _TraceLayout.create(mesh, zero_stage=0)
    object.__setattr__(layout, "seams", Seams(context_attention=_context_stand_in(work),
                                              routed_experts=_experts_stand_in(work)))
    object.__setattr__(layout, "ways", {"act_length": work.context_ways, "experts": work.expert_groups})
    return layout


def _context_stand_in(work: DeviceWork):
    """Context-parallel attention (ushard/parallel/context.py) as one device computes it, no transfers:
    the ring's custom VJP keeps the local queries, what travels (keys and values, or latent attention's
    latent, with the layer's weights that expand it), output and log-sum-exp (and, with keep_kv, the
    blocks that arrived); the all-gather mode on XLA blocks attends to gathered keys and values (made
    from the gathered latents) under autodiff. On fused blocks (`work.fused_blocks`) both modes are a
    custom VJP keeping what the ring's does, never [T, T] scores; with keep_kv the ring keeps the n - 1
    blocks that arrived, the all-gather mode the gathered blocks (segment ids with them)."""
    ways = work.context_ways

    def attention(q, kv, segment_ids, xla_block, _fused, window=0, expansion=None):
        t = q.shape[1]  # a window masks more scores but keeps the same residuals
        index = jnp.arange(t)[None]
        expand, weights = (lambda _, kv: kv, ()) if expansion is None else expansion[:2]
        if work.context == "all_gather" and not work.fused_blocks:
            gathered = [jnp.concatenate([a] * ways, axis=1) if a is not None else None for a in (*kv, segment_ids)]
            k, v = expand(weights, tuple(gathered[:-1]))
            all_index = jnp.arange(t * ways)[None]
            return xla_block(q, k, v, index, all_index, segment_ids, gathered[-1], window=window)[0].astype(q.dtype)

        def received(kv):
            """The blocks kept for the backward pass: (n - 1) arrived ones (ring), or all n (gathered)."""
            if not work.keep_kv:
                return None
            copies = ways if work.context == "all_gather" else ways - 1
            kept = tuple(kv) if not work.fused_blocks or segment_ids is None else (*kv, segment_ids)
            return tuple(jnp.concatenate([a] * copies, axis=1) for a in kept)

        def attend(q, weights, kv):
            k, v = expand(weights, kv)
            return xla_block(q, k, v, index, index, segment_ids, segment_ids, window=window)

        @jax.custom_vjp
        def ring(q, weights, kv):
            return attend(q, weights, kv)[0].astype(q.dtype)

        def forward(q, weights, kv):
            out, lse = attend(q, weights, kv)
            out = out.astype(q.dtype)
            return out, (q, weights, kv, out, lse, received(kv))

        def backward(residuals, d_out):
            return jax.tree.map(jnp.zeros_like, tuple(residuals[:3]))

        ring.defvjp(forward, backward)
        return ring(q, weights, tuple(kv))

    return attention


def _experts_stand_in(work: DeviceWork):
    """ushard/parallel/expert.py's routed experts as one device computes them: its experts' block of
    the weights, the padded dispatch's buffers (ushard/models/dispatch.py: every expert's capacity of
    this device's rows, which the all-to-all sends and receives whole), or the ragged dispatch's
    receive buffer (`receive_rows`)."""
    groups = work.expert_groups

    def routed(x, experts, gates, keep, weights, _names, expert_fn, row_capacity, how, headroom, _exchange="auto"):
        if work.experts_gathered:  # gathered inside the map: a copy that is not the map's argument
            weights = {name: w * jnp.ones((), w.dtype) for name, w in weights.items()}
        if work.expert_width > 1:
            return _width_stand_in(x, experts, gates, keep, weights, expert_fn, row_capacity,
                                   work.expert_width), jnp.float32(0)
        if groups == 1:
            return dispatch.on_device(x, experts, gates, keep, weights, expert_fn, row_capacity), jnp.float32(0)
        if how != "ragged":
            return dispatch.on_device(x, experts, gates, keep, weights, expert_fn, row_capacity, groups,
                                      exchange=lambda buffer: buffer), jnp.float32(0)
        return _ragged_stand_in(x, experts, gates, keep, weights, expert_fn, groups, headroom), jnp.float32(0)

    return routed


def _width_stand_in(x, experts, gates, keep, weights, expert_fn, row_capacity: int, ways: int):
    """`parallel.expert._width_split` on one device: the group's tokens (this device's `ways` times,
    as the all-gather delivers as many) through its slices of the experts, the partial outputs
    summed down to its own tokens (the reduce-scatter's result); both exchanged arrays kept."""
    tile = lambda a: jnp.concatenate([a] * ways, axis=0)  # noqa: E731
    every = checkpoint_name(tile(x), EXPERT_MATMUL)
    partial = dispatch.on_device(every, tile(experts), tile(gates), tile(keep), weights, expert_fn, row_capacity)
    return checkpoint_name(jnp.sum(partial.reshape(ways, *x.shape), axis=0), EXPERT_MATMUL)


def _ragged_stand_in(x, experts, gates, keep, weights, expert_fn, groups: int, headroom: float):
    local_experts, k = dispatch.experts_held(weights), experts.shape[-1]
    tokens, key, gates = dispatch.flat(x, experts, gates, keep, local_experts * groups)
    order, sizes, _ = dispatch.sort_by_expert(key, local_experts * groups)
    inverse = dispatch.inverse_of(order)
    rows = dispatch.assignment_rows(tokens, order, inverse, k)
    most = receive_rows(rows.shape[0], groups, local_experts, k, headroom)
    received = checkpoint_name(_resized(rows, most), EXPERT_MATMUL)
    computed = expert_fn(weights, received, sizes[:local_experts])
    out_sorted = checkpoint_name(_resized(computed, rows.shape[0]), EXPERT_MATMUL)
    return dispatch.unsort_and_combine(out_sorted, order, inverse, gates, x)


def _resized(rows, count: int):
    """`rows` [n, d] cut or zero-padded to `count` rows: a buffer of the exchange's size."""
    if count <= rows.shape[0]:
        return rows[:count]
    return jnp.pad(rows, ((0, count - rows.shape[0]), (0, 0)))
