"""Writes docs/config.md: every key of `ushard.config.default_config()` with its default and meaning.

    python tools/config_reference.py          # rewrite docs/config.md
    python tools/config_reference.py --check  # exit 1 if docs/config.md is stale or a key is undocumented

The defaults come from `default_config()` itself; the meanings are the one-line entries of
DESCRIPTIONS below. A key added to the config without an entry here (or an entry for a key that no
longer exists) fails `--check` and tests/test_docs.py, so the reference cannot fall behind.
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUTPUT = os.path.join(ROOT, "docs", "config.md")

GROUPS = {
    "model": "The model's function and how it is computed (`ushard/models/config.py`).",
    "train": ("The learning-rate schedule and the training loop. Every schedule warms up linearly from 0 to "
              "`train.lr` over `train.warmup_steps`. WSD (`train.schedule='wsd'`, warmup-stable-decay) then holds "
              "`lr` until the last `train.decay_fraction` of `train.steps` and decays to `lr * min_lr_ratio` by "
              "`train.wsd_decay` (`linear`, `cosine`, or `sqrt`: 1 - sqrt of the decay's progress, Hägele et al. "
              "2024). The schedule is a function of the step and `train.steps` alone, so a WSD run is extended by "
              "resuming a checkpoint of its stable phase with a larger `train.steps`: it stays at `lr` until the "
              "new decay starts, and the decay can be run several times from one stable run."),
    "optim": ("The optimizer (`ushard/training/optim.py`'s registry; README, Optimizers). The keys directly under "
              "`optim` are AdamW's, and Muon's for the parameters it does not take; each other optimizer's own "
              "settings are its group. Before this group they were `train.weight_decay`, `train.b1`, `train.b2` "
              "and `train.eps`: a config that sets one of those is refused with a sentence naming its new key."),
    "checkpoint": "Checkpoints in `WORKDIR/checkpoints` (orbax).",
    "mesh": "Device mesh axis sizes; the product of all sizes is the device count (docs/parallelism.md).",
    "parallel": "How the parallelisms run (ZeRO stage, pipeline schedule, context parallelism).",
    "data": "Documents, the tokenizer and the token stream the batches are cut from (docs/training.md, Data).",
    "metrics": "Where the rows of `WORKDIR/metrics.jsonl` go besides it and TensorBoard (docs/finetuning.md).",
}

_DCN = ("how many slices / hosts `mesh.{axis}` spans (multi-slice TPU, multi-node GPU): that many "
        "groups of devices connected by the data-centre network; must divide `mesh.{axis}`")
_MESH = {
    "pipeline": "pipeline stages: the layers split into that many contiguous stages",
    "data": "data parallelism with replicated states (DDP; with `mesh.fsdp` > 1: HSDP)",
    "fsdp": "data parallelism with states sharded by `parallel.zero_stage`; -1: all devices the other axes leave",
    "expert": "MoE experts split over devices (all-to-all); a batch axis everywhere else",
    "sequence": "context parallelism: activations split along the sequence (`parallel.context_parallel`)",
    "tensor": "Megatron tensor parallelism: heads, MLP columns and the vocabulary split over devices",
}

DESCRIPTIONS = {
    # model
    "model.family": "the architecture: `llama` (Llama 2/3, Mistral, Mixtral), `qwen3` (dense and MoE: QK-norm), "
                    "`gemma3` (sliding windows, four norms a block, GeGLU), `deepseek` (DeepSeek-V2 and V3: latent "
                    "attention, shared experts); docs/huggingface.md",
    "model.vocab_size": "rows of the embedding and LM head; at least the tokenizer's vocabulary",
    "model.d_model": "width of the residual stream",
    "model.n_layers": "transformer blocks",
    "model.n_heads": "query heads",
    "model.head_dim": "the size of one attention head (even); 0: d_model / n_heads",
    "model.sliding_window": "gemma3: a local layer's query sees itself and this many - 1 tokens before it; "
                            "0: no window",
    "model.sliding_window_pattern": "gemma3: every this-many-th layer attends globally, the others locally; 0: none "
                                    "globally",
    "model.local_rope_theta": "gemma3: the local layers' RoPE base (unscaled); 0: rope_theta",
    "model.query_pre_attn_scalar": "attention scores are scaled by this ** -0.5 (Gemma's); 0: head_dim",
    "model.n_kv_heads": "key/value heads (grouped-query attention); divides n_heads",
    "model.d_ff": "hidden width of the gated MLP (SwiGLU; Gemma's GeGLU)",
    "model.rope_theta": "RoPE base frequency",
    "model.rope_scaling.type": "`none`, `llama3` (Llama 3.1's long-context frequency scaling; the keys below), "
                               "`linear` (every frequency divided by factor; Gemma 3's global layers) or `yarn` "
                               "(YaRN: DeepSeek-V2 and V3)",
    "model.rope_scaling.factor": "llama3: long wavelengths are divided by this; linear: every one; yarn: the slow "
                                 "ones",
    "model.rope_scaling.low_freq_factor": "llama3: wavelengths above original_max_position_embeddings / this are "
                                          "scaled",
    "model.rope_scaling.high_freq_factor": "llama3: wavelengths below original_max_position_embeddings / this are kept",
    "model.rope_scaling.original_max_position_embeddings": "llama3, yarn: the context length the model was trained "
                                                           "with",
    "model.rope_scaling.beta_fast": "yarn: frequencies turning more often than this over the original context are "
                                    "kept",
    "model.rope_scaling.beta_slow": "yarn: frequencies turning less often than this are divided by factor (a linear "
                                    "ramp between)",
    "model.rope_scaling.mscale": "yarn: with mscale_all_dim, rotated q and k are multiplied by mscale(factor, this) "
                                 "/ mscale(factor, mscale_all_dim); 0: unset",
    "model.rope_scaling.mscale_all_dim": "yarn: see mscale; DeepSeek's softmax scale is also multiplied by "
                                         "mscale(factor, this) ** 2; 0: unset",
    "model.norm_eps": "RMSNorm epsilon (Hugging Face `rms_norm_eps`)",
    "model.tie_embeddings": "the LM head reuses the embedding table",
    "model.compute_dtype": "dtype of activations and matmuls: float32, bfloat16 or float16",
    "model.param_dtype": "dtype parameters and optimizer state are stored in",
    "model.attention_impl": "`auto` (cuDNN flash attention on GPUs in 16-bit compute, ushard's `flash` inside "
                            "pipeline stages, where cuDNN cannot run; splash on TPUs; else XLA), `xla`, `cudnn`, "
                            "`splash` or `flash` (ushard's own GPU kernel: documents, GQA, pipeline stages)",
    "model.remat": "what the backward pass recomputes: none, full, dots, dots_no_batch, dots_attention, "
                   "dots_attention_norms",
    "model.document_mask": "packed documents never attend to each other (segment ids)",
    "model.scan_unroll": "layers per iteration of the layer scan; n_layers unrolls fully (faster, longer compile)",
    "model.fused_mlp": "one weight and one matmul for the SwiGLU gate and up projections",
    "model.fp8": "the blocks' matmuls in FP8 (Hopper GPUs or newer)",
    "model.moe.num_experts": "routed experts per MoE layer; 0: a dense model",
    "model.moe.top_k": "routed experts per token",
    "model.moe.capacity_factor": "an expert takes at most ceil(factor * tokens * top_k / num_experts) tokens; 0: "
                                 "dropless",
    "model.moe.num_shared_experts": "experts every token goes through beside its routed ones",
    "model.moe.expert_d_ff": "hidden width of one expert; 0: model.d_ff",
    "model.moe.every": "after the first dense layers, every `every`-th layer is an MoE layer",
    "model.moe.first_dense_layers": "leading layers that stay dense",
    "model.moe.score_func": "router scores from its logits: softmax or sigmoid",
    "model.moe.normalize_gates": "divide a token's top_k scores by their sum",
    "model.moe.routed_scale": "the routed experts' gates are multiplied by this",
    "model.moe.num_groups": "group-limited routing: experts in this many equal groups (1: no limit)",
    "model.moe.top_groups": "group-limited routing: a token picks experts from its best this-many groups",
    "model.moe.group_score": "group-limited routing: a group scores `top2_sum`, its two best experts' sum "
                             "(DeepSeek-V3), or `max`, its best (DeepSeek-V2)",
    "model.moe.aux_loss_weight": "weight of the load-balancing loss",
    "model.moe.aux_loss_per_sequence": "the load-balancing loss of each sequence, averaged (DeepSeek's seq_aux), "
                                       "instead of the whole batch's",
    "model.moe.z_loss_weight": "weight of the router z-loss",
    "model.moe.bias_update_rate": "auxiliary-loss-free balancing: each step's move of an expert's routing bias; 0: off",
    "model.moe.dispatch": "with mesh.expert > 1: `padded` all-to-all of fixed-capacity buffers or `ragged` (only the "
                          "rows used)",
    "model.moe.dispatch_headroom": "with `ragged`: each device's receive buffer in multiples of an even load (its "
                                   "memory; the Pallas grouped matmuls compute only the rows in use, to an eighth "
                                   "of the buffer); a step that needs more stops the run",
    "model.moe.exchange": "with `ragged`: how routed rows move between devices: `auto` (`all_gather` on GPUs, "
                          "`ragged_all_to_all` on TPUs, `all_to_all` on CPUs), `all_to_all` (a dense all-to-all of "
                          "a buffer per pair of devices, `dispatch_headroom` times an even share), "
                          "`ragged_all_to_all` (XLA's), `all_gather` (tokens gathered to every device of the "
                          "expert group, outputs reduce-scattered back; only a device's total rows can overflow)",
    "model.moe.grouped_matmul_impl": "the dropless experts' grouped matmul: `auto` (JAX's Pallas Mosaic-GPU kernel "
                                     "on Hopper GPUs in 16-bit compute, megablox on TPUs, else XLA), `xla` "
                                     "(ragged_dot), `mosaic_gpu`, `megablox`",
    "model.lora.alpha": "LoRA: the update is scaled by alpha / rank (peft's `lora_alpha`)",
    "model.lora.base_dtype": 'LoRA: the frozen base stored in `compute` (model.compute_dtype: no float32 copy), '
        '`param` (model.param_dtype) or `float8` (the adapted weights in float8 e4m3 with per-output-channel '
        'scales, cast for their matmuls; the rest in compute)',
    "model.lora.dropout": "LoRA: dropout on the adapters' inputs (peft's `lora_dropout`); a step's microbatches "
        'share its masks',
    "model.lora.rank": 'LoRA adapters of this rank on the frozen model (docs/finetuning.md); 0: every weight trained',
    "model.lora.targets": 'LoRA: the weights that get adapters, comma-separated (`wq`, `w_up`, `experts.w_up`: a '
        'name matches each weight whose path ends with it), or `all`: every projection of '
        'attention, the MLPs and the experts',
    "model.mtp.depth": "multi-token prediction modules (DeepSeek-V3's; ushard/models/mtp.py): module k predicts "
                       "the token k + 1 places after the next; 0: none. Families: llama, qwen3, deepseek",
    "model.mtp.loss_weight": "the objective adds this times the mean over depths of each depth's cross-entropy "
                             "(logged as `aux/mtp_loss`); DeepSeek-V3: 0.3, later 0.1",
    "model.mla.q_lora_rank": "latent attention (model.family='deepseek'): the queries' low-rank bottleneck; 0: "
                             "one projection",
    "model.mla.kv_lora_rank": "latent attention: the per-token latent keys and values are expanded from; 0: none "
                              "(the other families)",
    "model.mla.qk_nope_head_dim": "latent attention: a head's q·k dimensions without positions",
    "model.mla.qk_rope_head_dim": "latent attention: a head's q·k dimensions rotated by RoPE (one key for all heads)",
    "model.mla.v_head_dim": "latent attention: a head's value size",
    # train
    "train.steps": "optimizer steps of the run",
    "train.batch_size": "global batch, in sequences",
    "train.seq_len": "tokens per sequence",
    "train.lr": "peak learning rate",
    "train.min_lr_ratio": "the schedule ends at lr * min_lr_ratio",
    "train.warmup_steps": "linear warm-up from 0 to lr",
    "train.schedule": "after warm-up: `cosine` or `linear` decay to lr * min_lr_ratio at train.steps, `constant`, "
                      "or `wsd` (warmup-stable-decay: lr until the last decay_fraction of the steps, then the decay "
                      "of wsd_decay); a run resumed with a longer train.steps follows the longer schedule",
    "train.decay_fraction": "`wsd`: the share of train.steps at the end that decays to lr * min_lr_ratio",
    "train.wsd_decay": "`wsd`'s decay: `linear`, `cosine` (half a cosine) or `sqrt` (1 - sqrt of the decay's progress)",
    "train.grad_clip": "clip the gradient's global norm to this; 0: no clipping",
    "train.grad_accum": "microbatches per step (gradient accumulation); divides batch_size",
    "train.seed": "seeds the initial parameters and the data order",
    "train.log_every": "steps between rows of metrics.jsonl",
    "train.eval_every": "steps between held-out loss evaluations; 0: none",
    "train.eval_batches": "batches per evaluation",
    "train.on_nonfinite": "a NaN/inf loss or gradient: `skip` the update, `rollback` to the last checkpoint past the "
                          "batch, or `stop`",
    "train.max_nonfinite_steps": "skip / rollback give up after this many non-finite steps in a row",
    "train.process_timeout_s": ("with several processes: seconds a process waits for one that went silent (killed, a "
                                "lost host) or holds up a checkpoint's barrier; then it stops, naming it"),
    "train.objective": "what the step minimises: `lm` (next-token cross-entropy: pre-training, SFT) or `dpo` "
                       "(direct preference optimisation on `data.source='preference'` pairs: docs/finetuning.md)",
    "train.dpo.beta": "DPO: β, how far the policy may move from the reference policy",
    "train.dpo.loss_type": "DPO: `sigmoid` (DPO; with label smoothing, conservative DPO), `robust` (rDPO) or `ipo` "
                           "(IPO, length-normalised), as TRL's loss types of those names",
    "train.dpo.label_smoothing": "DPO: ε in [0, 0.5), the assumed share of pairs whose preference is flipped "
                                 "(`sigmoid`, `robust`); 0: none",
    "train.dpo.reference": "DPO: the reference policy's log-probs from `frozen` (a copy of the initial parameters in "
                           "the compute dtype, sharded like them, in the train state and checkpoints) or "
                           "`precomputed` (one forward pass over the pairs before training; DIR/dpo_reference.npz)",
    # optim
    "optim.name": "`adamw`, `muon` (matrices; AdamW for the embedding, LM head, norms and routing biases), `lion` "
                  "or `adafactor`; a checkpoint resumes only under its own",
    "optim.weight_decay": "decoupled weight decay, times the learning rate (adamw, muon's both parts, lion); norm "
                          "scales are never decayed",
    "optim.b1": "AdamW's first-moment decay",
    "optim.b2": "AdamW's second-moment decay",
    "optim.eps": "AdamW's denominator term",
    "optim.muon.momentum": "Muon's Nesterov momentum (optax's bias-corrected form)",
    "optim.muon.ns_steps": "iterations of the quintic Newton-Schulz orthogonalisation",
    "optim.muon.ns_dtype": "the iteration's dtype: `bfloat16` (as published) or `float32`",
    "optim.muon.scale": "the orthogonalised update's factor: `moonlight` (rms * sqrt(max(fan_in, fan_out)): AdamW's "
                        "update RMS, so its learning rate and weight decay carry over), `jordan` (sqrt(max(1, "
                        "fan_out / fan_in))) or `none`",
    "optim.muon.rms": "`moonlight`: the update RMS to match; Moonlight's 0.2",
    "optim.muon.layout": "where each matrix's iteration runs: `owners` (whole matrices bucketed by shape and spread "
                         "over the devices that split the optimizer state, one all-to-all in and one out), `gspmd` "
                         "(on the sharded momentum, XLA's collectives in every product) or `auto` (owners where the "
                         "state is split; the plan says which)",
    "optim.lion.b1": "Lion's interpolation between momentum and gradient for the update's sign",
    "optim.lion.b2": "Lion's momentum decay",
    "optim.adafactor.decay_rate": "Adafactor's second-moment decay exponent (1 - step^-decay_rate)",
    "optim.adafactor.clipping_threshold": "Adafactor's update clipping by its block RMS; 0: none",
    "optim.adafactor.min_dim_size_to_factor": "an array whose two largest dimensions are both at least this is "
                                              "factored (row and column statistics)",
    "optim.adafactor.parameter_scale": "scale the update by each array's RMS (a relative step size; lr then means "
                                       "that)",
    "optim.adafactor.weight_decay_rate": "Adafactor's weight decay, not multiplied by the learning rate; 0: none",
    # checkpoint
    "checkpoint.every": "steps between checkpoints; 0: only at the end and on SIGTERM",
    "checkpoint.keep": "newest checkpoints kept",
    "checkpoint.async_save": "write checkpoints in the background (training waits only for the device-to-host copy)",
    "checkpoint.init_from": "a new run starts from these parameters (a workdir or a Hugging Face checkpoint) with a "
                            "fresh optimizer; empty: none",
    "checkpoint.restart": "when no checkpoint in the workdir can be read (all damaged): true moves them to "
                          "checkpoints-damaged/ and starts over from step 0; false stops with a sentence",
    # mesh
    **{f"mesh.{axis}": text for axis, text in _MESH.items()},
    **{f"mesh.dcn.{axis}": _DCN.format(axis=axis) for axis in _MESH},
    # parallel
    "parallel.zero_stage": "what the fsdp axis shards: 0 nothing, 1 optimizer state, 2 + gradients, 3 + parameters",
    "parallel.collective_combine_mib": "GPU: merge neighbouring all-gathers / reduce-scatters up to this many MiB; 0: "
                                       "XLA's default",
    "parallel.context_keep_kv": "mesh.sequence > 1: the backward pass reuses the forward's keys and values instead of "
                                "passing them around (ring) or gathering them (all_gather) again; a third less "
                                "traffic, K/V memory growing with mesh.sequence (every layer's received blocks held "
                                "until its backward pass)",
    "parallel.reshard_after_forward": "ZeRO-3: gather each layer's weights again for the backward pass (false keeps "
                                      "the forward's copy)",
    "parallel.sequence_parallel": "Megatron sequence parallelism: activations between blocks also split along the "
                                  "sequence over tensor",
    "parallel.context_parallel": "attention with mesh.sequence > 1: `ring` (K/V passed around) or `all_gather`",
    "parallel.pipeline_schedule": "with mesh.pipeline > 1: gpipe, circular or 1f1b",
    "parallel.expert_split": "what `mesh.expert` splits in MoE layers: `experts` (each device holds "
                             "`num_experts / mesh.expert` whole experts; rows reach them as `model.moe.dispatch` "
                             "says) or `width` (each device holds a slice of every expert's hidden width, gathers "
                             "its expert group's tokens and reduce-scatters the outputs back: the same work on every "
                             "device however the router spreads the tokens, and no buffer to overflow)",
    "parallel.expert_width_parts": "with `expert_split=width`: each device's sequences go through the gather, the "
                                   "experts and the reduce-scatter in this many parts (whole sequences each), so "
                                   "one part's collectives can run while another's experts compute; must divide "
                                   "the sequences a device holds (not yet measured on GPUs)",
    "parallel.pipeline_head": "with mesh.pipeline > 1, where the embedding and LM head run: `split` (the "
                              "vocabulary over the stages; hidden-size all-reduces over the stage axis each 1F1B "
                              "tick), `whole` (every stage holds the whole vocabulary; under 1F1B only the stages' "
                              "own sends cross the stage axis in a tick), `auto` (`whole` when mesh.dcn.pipeline > 1, "
                              "else `split`)",
    "parallel.pipeline_microbatches": "microbatches per step (per grad_accum part) flowing through the stages",
    "parallel.pipeline_repeats": "circular schedule: chunks of layers (virtual stages) per device",
    # data
    "data.source": "`stdlib` (the Python standard library's .py files), `text` (a file per document), `jsonl`, "
                   "`parquet` (a row per document), `tokens` (.npy files of token ids, documents ending in EOS), "
                   "`chat` (JSONL conversations, `{\"messages\": [{\"role\", \"content\"}, ...]}`: "
                   "docs/finetuning.md) or `preference` (JSONL / Parquet records of `prompt`, `chosen`, "
                   "`rejected`, for `train.objective='dpo'`)",
    "data.paths": "a glob of data files, or several separated by commas (each one component of data.weights)",
    "data.jsonl_field": "jsonl: the field of each record that holds the text",
    "data.parquet_column": "parquet: the string column that holds the text (null rows are skipped)",
    "data.tokenizer": "`byte` (256 bytes and an end-of-document token) or the path of a Hugging Face tokenizer.json",
    "data.weights": "a weighted mixture: one weight per glob of data.paths, its share of the training tokens "
                    "(e.g. `0.7,0.3`); empty: each document once an epoch",
    "data.eval_fraction": "share of the pieces of documents held out for the eval loss",
    "data.chunk_tokens": "documents are cut into pieces of at most this many tokens; 0: 2 * (seq_len + 1)",
    "data.restart": "on resume, start a fresh data order if the checkpoint's cannot be continued",
    "data.train_on": "fine-tuning examples (`chat`, or records with `data.prompt_field`): `assistant` counts only "
                     "the assistant turns (each with its end token) or the completion in the loss; `all` counts "
                     "every token",
    "data.prompt_field": "jsonl / parquet: the field (column) of a prompt; set with `data.completion_field`, each "
                         "record is one example packed whole, the loss on the completion",
    "data.completion_field": "jsonl / parquet: the field (column) of the completion that follows "
                             "`data.prompt_field`'s prompt",
    # metrics
    "metrics.wandb": "also log every row of metrics.jsonl and the config to Weights & Biases (the `wandb` "
                     "extra), from process 0, into one W&B run per workdir (resumed after a restart)",
    "metrics.wandb_project": "the W&B project",
    "metrics.wandb_name": "the W&B run's display name; empty: the workdir's name",
}


def flat_defaults(config, prefix: str = "") -> dict:
    """{"model.moe.top_k": 2, ...}: every leaf of a ConfigDict by its dotted key, in the dict's order."""
    flat = {}
    for key, value in config.items():
        if hasattr(value, "items"):
            flat.update(flat_defaults(value, f"{prefix}{key}."))
        else:
            flat[prefix + key] = value
    return flat


def problems(defaults: dict) -> list[str]:
    """Keys of the config without a description, and descriptions of keys the config no longer has."""
    missing = [f"{k} has no entry in DESCRIPTIONS" for k in defaults if k not in DESCRIPTIONS]
    stale = [f"DESCRIPTIONS has {k}, which default_config() does not" for k in DESCRIPTIONS if k not in defaults]
    return missing + stale


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render(defaults: dict) -> str:
    lines = [
        "# Config reference",
        "",
        "Every key `ushard.config.default_config()` defines, with its default. Set them in a config file",
        "(`c.train.steps = 50`), on the command line (`--config.train.steps=50`) or from Python",
        "(`ushard.load_config(name, {\"train.steps\": 50})`). A key not listed here does not exist, and",
        "setting one is an error.",
        "",
        "Generated by `python tools/config_reference.py` from the defaults and the descriptions kept in",
        "that file; `tests/test_docs.py` fails when this page is stale or a key is undocumented.",
    ]
    for group, intro in GROUPS.items():
        keys = [k for k in defaults if k.split(".")[0] == group]
        lines += ["", f"## {group}", "", intro, "", "| key | default | meaning |", "|---|---|---|"]
        lines += [f"| `{k}` | `{_cell(repr(defaults[k]))}` | {_cell(DESCRIPTIONS[k])} |" for k in keys]
    return "\n".join(lines) + "\n"


def reference() -> str:
    """docs/config.md as it should read now; raises SystemExit naming every undocumented key."""
    sys.path.insert(0, ROOT)
    from ushard.config import default_config

    defaults = flat_defaults(default_config())
    unknown_groups = sorted({k.split(".")[0] for k in defaults} - set(GROUPS))
    found = problems(defaults) + [f"group {g!r} has no entry in GROUPS" for g in unknown_groups]
    if found:
        raise SystemExit("config_reference: " + "; ".join(found))
    return render(defaults)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="fail if docs/config.md is not current")
    args = parser.parse_args(argv)
    text = reference()
    if args.check:
        with open(OUTPUT, encoding="utf-8") as f:
            if f.read() != text:
                print(f"{OUTPUT} is stale; run python tools/config_reference.py", file=sys.stderr)
                return 1
        return 0
    with open(OUTPUT, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"wrote {OUTPUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
