"""`ushard sample`: continue a prompt with the model in the newest checkpoint of DIR/checkpoints.

The model's settings come from the config saved with the checkpoint; only the parameters are read
(not the optimizer state), onto one device, whatever mesh they were trained on. The prompt is
prefilled into a KV cache in one call, then tokens are generated one at a time by a jitted step:
greedy at temperature 0, else sampled from softmax(logits / temperature), optionally among the top-k.
"""

from __future__ import annotations

import codecs
import math
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from ushard.checkpoint import ITEMS, restore_newest, saved_model_config
from ushard.data.tokenizer import TOKENIZERS, get_tokenizer
from ushard.errors import UserError
from ushard.train.state import ModelDef


def _saved_settings(saved: dict):
    """(model config, tokenizer name, training seq_len) from a checkpoint's saved config JSON."""
    model_cfg = saved_model_config(saved)
    tokenizer = saved.get("data", {}).get("tokenizer", "byte")
    if tokenizer not in TOKENIZERS:
        raise UserError(f"the checkpoint was trained with tokenizer {tokenizer!r}, which this ushard does not have.")
    return model_cfg, tokenizer, saved.get("train", {}).get("seq_len")


def load_params(workdir: str, device=None, log=print):
    """(step, model config, tokenizer name, training seq_len, params) from the newest readable checkpoint.

    Params are placed on `device` (default: the first device) in the dtype they were saved in.
    """
    device = jax.devices()[0] if device is None else device
    directory = os.path.abspath(os.path.join(workdir, "checkpoints"))
    if not os.path.isdir(directory):
        raise UserError(f"{directory} does not exist; train a model first with `ushard train --workdir {workdir}`.")
    options = ocp.CheckpointManagerOptions(create=False)
    sharding = jax.sharding.SingleDeviceSharding(device)

    def restore(step):
        saved = manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"]
        model_cfg, tokenizer, seq_len = _saved_settings(saved)
        shapes = ModelDef(model_cfg).shapes
        abstract = {"params": jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding), shapes)}
        # Only the params: the optimizer state and step counters stay on disk.
        params_only = ocp.args.PyTreeRestore(
            item=abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract), partial_restore=True
        )
        state = manager.restore(step, args=ocp.args.Composite(state=params_only))["state"]
        return model_cfg, tokenizer, seq_len, state["params"]

    with ocp.CheckpointManager(directory, options=options, item_names=ITEMS) as manager:
        found = restore_newest(manager, restore, log)
    if found is None:
        raise UserError(f"{directory} holds no complete checkpoint; train a model first with `ushard train --workdir {workdir}`.")
    step, (model_cfg, tokenizer, seq_len, params) = found
    return step, model_cfg, tokenizer, seq_len, params


def _choose(logits, key, temperature: float, top_k: int):
    """The next token from logits [batch, vocab]: argmax at temperature 0, else a seeded sample."""
    logits = logits.astype(jnp.float32)
    if temperature == 0:
        return jnp.argmax(logits, axis=-1)
    logits = logits / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1)


def make_step(model: ModelDef, temperature: float, top_k: int, vocab: int):
    """A jitted (params, cache, tokens [B, T], key) -> (next tokens [B], cache): runs the T tokens at the
    positions after the cache's filled slots and picks the token after the last one among the first
    `vocab` ids (those the tokenizer can emit). The key is folded with the position, so a seed fixes
    the whole continuation."""

    def step(params, cache, tokens, key):
        length = cache["length"]
        positions = jnp.broadcast_to(length + jnp.arange(tokens.shape[1]), tokens.shape)
        logits, cache = model.decode(params, tokens, positions, cache)
        return _choose(logits[:, -1, :vocab], jax.random.fold_in(key, length), temperature, top_k), cache

    return jax.jit(step, donate_argnums=1)


def generate(model: ModelDef, params, prompt_tokens, max_new_tokens: int, temperature=0.0, top_k=0, seed=0,
             eos_id=None, vocab=None):
    """Yields up to `max_new_tokens` token ids (ints) continuing `prompt_tokens` (1-D); stops at `eos_id`
    (not yielded). The cache is sized for the prompt and every new token, so it is never outgrown."""
    prompt = jnp.asarray(np.asarray(prompt_tokens, np.int32)[None])
    vocab = model.cfg.vocab_size if vocab is None else min(vocab, model.cfg.vocab_size)
    step = make_step(model, temperature, top_k, vocab)
    device = jax.tree.leaves(params)[0].devices().pop()
    with jax.default_device(device):
        cache = model.init_cache(1, prompt.shape[1] + max_new_tokens)
        key = jax.random.key(seed)
    token, cache = step(params, cache, prompt, key)  # prefill: the whole prompt in one call
    for i in range(max_new_tokens):
        value = int(token[0])
        if value == eos_id:
            return
        yield value
        if i + 1 < max_new_tokens:
            token, cache = step(params, cache, token[:, None], key)


def check_arguments(prompt: str, max_new_tokens: int, temperature: float, top_k: int) -> None:
    if not prompt:
        raise UserError("--prompt is empty; give some text for the model to continue.")
    if max_new_tokens < 1:
        raise UserError(f"--max_new_tokens={max_new_tokens} must be at least 1.")
    if not math.isfinite(temperature) or temperature < 0:
        raise UserError(f"--temperature={temperature} must be a finite number >= 0 (0 picks the likeliest token).")
    if top_k < 0:
        raise UserError(f"--top_k={top_k} must be >= 0 (0 samples from the whole vocabulary).")


def sample(workdir: str, prompt: str, max_new_tokens: int = 200, temperature: float = 0.8, top_k: int = 40,
           seed: int = 0, out=None, log=None) -> str:
    """Prints the prompt and its continuation to `out` as they come; returns the continuation."""
    out = sys.stdout if out is None else out
    log = (lambda line: print(line, file=sys.stderr)) if log is None else log
    check_arguments(prompt, max_new_tokens, temperature, top_k)
    step, model_cfg, tokenizer_name, seq_len, params = load_params(workdir, log=log)
    tokenizer = get_tokenizer(tokenizer_name)
    prompt_tokens = tokenizer.encode(prompt)
    model = ModelDef(model_cfg)
    device = jax.tree.leaves(params)[0].devices().pop()
    log(f"ushard: sampling from the checkpoint at step {step} ({model.num_params() / 1e6:.1f}M params, "
        f"{model_cfg.compute_dtype}) on {device}")
    total = len(prompt_tokens) + max_new_tokens
    if seq_len and total > seq_len:
        log(f"ushard: note: the model was trained on {seq_len}-token windows; text past that ({total} tokens here) "
            f"may degrade.")
    # The byte tokenizer's ids stream through an incremental UTF-8 decoder (the same text as
    # tokenizer.decode), so a character split over several tokens prints whole.
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    out.write(prompt)
    out.flush()
    pieces = []
    for token in generate(model, params, prompt_tokens, max_new_tokens, temperature, top_k, seed,
                          eos_id=tokenizer.eos_id, vocab=tokenizer.vocab_size):
        text = decoder.decode(bytes([token])) if token < 256 else ""
        pieces.append(text)
        out.write(text)
        out.flush()
    tail = decoder.decode(b"", final=True)
    pieces.append(tail)
    out.write(tail + "\n")
    out.flush()
    return "".join(pieces)
