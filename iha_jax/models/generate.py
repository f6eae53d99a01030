"""Autoregressive generation with a KV cache for `TransformerLM`.

`prefill` runs the prompt through the model with empty caches (every attention layer's
cached call, `iha_jax.nn.cache`: the same per-layer API a model of your own uses,
docs/your_model.md), so its logits are the model's and the caches hold the prompt;
`decode_step` feeds one token per call; `generate` jit-compiles prefill plus a
`lax.scan` over the new tokens with static cache shapes. All rows of a batch share one
position (prompts of equal length, no padding); positions are `arange` as in the
default full forward. See `iha_jax.nn.cache` for the cache layouts.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from iha_jax.checks import is_int
from iha_jax.models.kv_cache import KVCache, check_cache_mode, check_decodable, init_cache
from iha_jax.models.transformer import TransformerLM, check_tokens


def check_model(model: object, name: str) -> None:
  """Raises TypeError unless `model` is a `TransformerLM` (a model of your own decodes
  through its attention layers' `cache=` call instead)."""
  if not isinstance(model, TransformerLM):
    raise TypeError(
      f"{name} runs an iha_jax.models.TransformerLM, got {type(model).__name__}; in a model "
      "of your own, call each attention layer with cache= (layer.init_cache(batch, max_len), "
      "then y, cache = layer(x, cache=cache); docs/your_model.md)"
    )


def _prefill(
  model: TransformerLM, tokens: jax.Array, max_len: int, cache_mode: str
) -> tuple[jax.Array, KVCache]:
  cache = init_cache(model.config, tokens.shape[0], max_len, cache_mode)
  return model(tokens, cache=cache)


def _decode_step(
  model: TransformerLM, token: jax.Array, cache: KVCache
) -> tuple[jax.Array, KVCache]:
  logits, cache = model(token[:, None], cache=cache)
  return logits[:, 0], cache


@functools.partial(jax.jit, static_argnames=("graphdef", "max_len", "cache_mode"))
def _prefill_jit(state, tokens, *, graphdef, max_len, cache_mode):
  return _prefill(nnx.merge(graphdef, state), tokens, max_len, cache_mode)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _decode_step_jit(state, token, cache, *, graphdef):
  return _decode_step(nnx.merge(graphdef, state), token, cache)


def prefill(
  model: TransformerLM, tokens: jax.Array, *, max_len: int, cache_mode: str = "source"
) -> tuple[jax.Array, KVCache]:
  """Runs the prompt through the model and returns its logits and a filled cache.

  Args:
    model: the language model.
    tokens: prompt `[B, L0]` int.
    max_len: total tokens the cache must hold (prompt plus every token fed later).
    cache_mode: "source" or "pseudo" layout of the IHA layers.

  Returns:
    `(logits [B, L0, V] float32, cache)` with `cache.length == L0`.
  """
  check_model(model, "prefill")
  check_decodable(model.config)
  check_cache_mode(cache_mode)
  check_tokens(tokens, "tokens")
  if tokens.shape[1] > max_len:
    raise ValueError(
      f"tokens has {tokens.shape[1]} tokens per row, longer than the cache (max_len={max_len})"
    )
  graphdef, state = nnx.split(model)
  return _prefill_jit(state, tokens, graphdef=graphdef, max_len=max_len, cache_mode=cache_mode)


def decode_step(
  model: TransformerLM, token: jax.Array, cache: KVCache
) -> tuple[jax.Array, KVCache]:
  """Feeds one token per row at position `cache.length`.

  `token: [B]` int. Returns `(logits [B, V] float32, cache)` with the token written. The
  caller keeps `cache.length < cache.max_len` (the length is traced, so not checked here).
  """
  check_model(model, "decode_step")
  batch = cache.layers[0].k.shape[0]
  if jnp.shape(token) != (batch,) or not jnp.issubdtype(jnp.result_type(token), jnp.integer):
    raise ValueError(
      f"token must be an integer array [B={batch}], got shape "
      f"{tuple(jnp.shape(token))} dtype {jnp.result_type(token)}"
    )
  graphdef, state = nnx.split(model)
  return _decode_step_jit(state, jnp.asarray(token, jnp.int32), cache, graphdef=graphdef)


def sample_tokens(
  logits: jax.Array, rng: jax.Array, *, temperature: float, top_k: int | None
) -> jax.Array:
  """Next tokens `[B]` int32 from `logits: [B, V]`: argmax when `temperature == 0`, else
  a categorical draw from `softmax(logits / temperature)`, restricted to the `top_k` best."""
  if temperature == 0.0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  logits = logits / temperature
  if top_k is not None:
    kth_best = jax.lax.top_k(logits, top_k)[0][:, -1:]
    logits = jnp.where(logits < kth_best, -jnp.inf, logits)
  return jax.random.categorical(rng, logits, axis=-1).astype(jnp.int32)


@functools.partial(
  jax.jit,
  static_argnames=("graphdef", "max_new_tokens", "max_len", "cache_mode", "temperature", "top_k"),
)
def _generate_jit(
  state, prompt, rng, *, graphdef, max_new_tokens, max_len, cache_mode, temperature, top_k
):
  model = nnx.merge(graphdef, state)
  sample = functools.partial(sample_tokens, temperature=temperature, top_k=top_k)
  keys = jax.random.split(rng, max_new_tokens)
  logits, cache = _prefill(model, prompt, max_len, cache_mode)
  first = sample(logits[:, -1], keys[0])

  def step(carry, key):
    token, cache = carry
    logits, cache = _decode_step(model, token, cache)
    token = sample(logits, key)
    return (token, cache), token

  # The last sampled token is never fed back: max_new_tokens - 1 decode steps.
  _, rest = jax.lax.scan(step, (first, cache), keys[1:])
  return jnp.concatenate([prompt, first[:, None], rest.T.astype(prompt.dtype)], axis=1)


def generate(
  model: TransformerLM,
  prompt_tokens: jax.Array,
  *,
  max_new_tokens: int,
  cache_mode: str = "source",
  temperature: float = 0.0,
  top_k: int | None = None,
  rng: jax.Array | None = None,
  max_len: int | None = None,
) -> jax.Array:
  """Continues every prompt by `max_new_tokens` tokens with a KV cache.

  Args:
    model: the language model.
    prompt_tokens: `[B, L0]` int, equal-length prompts.
    max_new_tokens: tokens to generate, >= 1.
    cache_mode: "source" (IHA caches source-head k/v, `[B, G, S, d]`, G key/value heads)
      or "pseudo" (rotated pseudo-keys and pseudo-values, `[B, G, S*P, d]`).
    temperature: 0 is greedy (argmax); > 0 samples from `softmax(logits / temperature)`.
    top_k: sample only among the `top_k` most likely tokens (None = all).
    rng: PRNG key, required when `temperature > 0`; the same key gives the same tokens.
    max_len: cache capacity in tokens, default `L0 + max_new_tokens`.

  Returns:
    `[B, L0 + max_new_tokens]` tokens: the prompt, then the generated tokens.
  """
  check_model(model, "generate")
  check_decodable(model.config)
  check_cache_mode(cache_mode)
  check_tokens(prompt_tokens, "prompt_tokens")
  if not is_int(max_new_tokens, 1):
    raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
  prompt_len = prompt_tokens.shape[1]
  max_len = prompt_len + max_new_tokens if max_len is None else max_len
  if prompt_len > max_len:
    raise ValueError(
      f"prompt_tokens has {prompt_len} tokens per row, longer than the cache (max_len={max_len})"
    )
  if prompt_len + max_new_tokens > max_len:
    raise ValueError(
      f"max_new_tokens={max_new_tokens} after a {prompt_len}-token prompt "
      f"exceeds the cache (max_len={max_len})"
    )
  if not temperature >= 0.0:
    raise ValueError(f"temperature must be >= 0, got {temperature!r}")
  if temperature > 0.0 and rng is None:
    raise ValueError("rng must be a PRNG key when temperature > 0")
  vocab = model.config.vocab_size
  if top_k is not None and not (is_int(top_k, 1) and top_k <= vocab):
    raise ValueError(f"top_k must be None or an integer in [1, {vocab}], got {top_k!r}")
  rng = jax.random.key(0) if rng is None else rng  # Unused by greedy decoding.
  graphdef, state = nnx.split(model)
  return _generate_jit(
    state,
    jnp.asarray(prompt_tokens),
    rng,
    graphdef=graphdef,
    max_new_tokens=max_new_tokens,
    max_len=max_len,
    cache_mode=cache_mode,
    temperature=float(temperature),
    top_k=top_k,
  )
