"""`ushard sample`: continue a prompt with the model in the newest checkpoint of DIR/checkpoints.

The model's settings come from the config saved with the checkpoint; only the parameters are read
(not the optimizer state), onto one device, whatever mesh they were trained on. The prompt is
prefilled into a KV cache in one call, then tokens are generated one at a time by a jitted step:
greedy at temperature 0, else sampled from softmax(logits / temperature), optionally among the top-k.
"""

from __future__ import annotations

import math
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from ushard.data.tokenizer import get_tokenizer
from ushard.errors import UserError
from ushard.models.config import ModelConfig
from ushard.models.definition import ModelDef
from ushard.models.registry import family
from ushard.trained import load_model


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
    device = next(iter(jax.tree.leaves(params)[0].devices()))
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


# Peak memory of a generation step per cache position, in units of the cache itself: the cache in,
# the cache out (the scan over layers writes a new stack) and temporaries, which stay below a third
# copy (checked on CPU).
CACHE_COPIES = 3


def generation_bytes(cfg: ModelConfig, prompt_len: int, positions: int) -> int:
    """Estimated peak bytes of generating up to `positions` tokens after a `prompt_len`-token prompt: the
    KV cache (CACHE_COPIES times) and the prefill's float32 attention scores and probabilities, which
    span every cache slot."""
    heads, k_dim, v_dim = family(cfg.family).attention_shape(cfg).cache_dims(cfg.n_kv_heads)  # the family's entries
    cache = cfg.n_layers * heads * (k_dim + v_dim) * np.dtype(cfg.compute_dtype).itemsize
    scores = 2 * prompt_len * cfg.n_heads * 4
    return positions * (CACHE_COPIES * cache + scores)


def available_bytes(device) -> tuple[int, str]:
    """(bytes, what they are): the device's free memory where JAX reports it (GPU, TPU), else the
    host's physical memory (CPU), a generous bound."""
    stats = device.memory_stats() or {}
    if "bytes_limit" in stats:
        return stats["bytes_limit"] - stats.get("bytes_in_use", 0), f"free on {device}"
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "of host memory"


def check_memory(cfg: ModelConfig, prompt_len: int, max_new_tokens: int, device) -> None:
    """Refuses, before allocating, a generation whose KV cache cannot fit, naming the largest that can."""
    needed = generation_bytes(cfg, prompt_len, prompt_len + max_new_tokens)
    available, what = available_bytes(device)
    if needed <= available:
        return
    largest = available // generation_bytes(cfg, prompt_len, 1) - prompt_len
    advice = (f"the largest --max_new_tokens that fits is {largest}" if largest >= 1
              else "even one new token does not fit after this prompt; shorten it")
    raise UserError(
        f"--max_new_tokens={max_new_tokens} would need about {_size(needed)} for the KV cache of "
        f"{prompt_len + max_new_tokens} positions, more than the {_size(available)} {what}; {advice}."
    )


def _size(n: int) -> str:
    return f"{n / 1e9:,.1f} GB" if n >= 1e8 else f"{n / 1e6:,.1f} MB"


def sample(workdir: str, prompt: str, max_new_tokens: int = 200, temperature: float = 0.8, top_k: int = 40,
           seed: int = 0, out=None, log=None) -> str:
    """Prints the prompt and its continuation to `out` as they come; returns the continuation."""
    out = sys.stdout if out is None else out
    log = (lambda line: print(line, file=sys.stderr)) if log is None else log
    check_arguments(prompt, max_new_tokens, temperature, top_k)
    trained = load_model(workdir, log=log)
    model, params, seq_len = trained.model, trained.params, trained.seq_len
    tokenizer = get_tokenizer(trained.tokenizer)
    prompt_tokens = tokenizer.encode(prompt)
    device = next(iter(jax.tree.leaves(params)[0].devices()))
    check_memory(model.cfg, len(prompt_tokens), max_new_tokens, device)
    log(f"ushard: sampling from the checkpoint at step {trained.step} ({model.num_params() / 1e6:.1f}M params, "
        f"{model.cfg.compute_dtype}) on {device}")
    total = len(prompt_tokens) + max_new_tokens
    if seq_len and total > seq_len:
        log(f"ushard: note: the model was trained on {seq_len}-token windows; text past that ({total} tokens here) "
            f"may degrade.")
    decode = tokenizer.incremental_decoder()  # a character split over several tokens prints whole
    out.write(prompt)
    out.flush()
    pieces = []
    for token in generate(model, params, prompt_tokens, max_new_tokens, temperature, top_k, seed,
                          eos_id=tokenizer.eos_id, vocab=tokenizer.vocab_size):
        text = decode(token)
        pieces.append(text)
        out.write(text)
        out.flush()
    tail = decode(None, final=True)
    pieces.append(tail)
    out.write(tail + "\n")
    out.flush()
    return "".join(pieces)
