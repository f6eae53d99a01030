"""Autoregressive generation with a KV cache for `TransformerLM`.

`prefill` runs the prompt through the model with empty caches (every attention layer's
cached call, `iha_jax.nn.cache`: the same per-layer API a model of your own uses,
docs/your_model.md), so its logits are the model's and the caches hold the prompt;
`decode_step` feeds one token per call; `generate` jit-compiles prefill plus a
`lax.scan` over the new tokens with static cache shapes. Prompts may differ in length
(`prompt_mask`, padded on either side): each row keeps its own length in the cache, its
real tokens at positions `0, 1, ..` as in the default full forward, and each row's tokens
depend only on its prompt and, when sampling, its own key. See `iha_jax.nn.cache` for the
cache layouts.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from iha_jax.checks import is_int, is_traced
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


def check_prompt(
  tokens: jax.Array, prompt_mask: jax.Array | None, max_len: int, name: str, new_tokens: int = 0
) -> jax.Array | None:
  """Checks a prompt `tokens: [B, L0]` and its `prompt_mask` (`[B, L0]` bool, True = a
  real token, or None: all) for a cache of `max_len` tokens per row that must also hold
  `new_tokens` more; returns the mask as a bool array (None without one). ValueError
  naming the argument otherwise (a traced mask's counts are not checked)."""
  check_tokens(tokens, name)
  longest = tokens.shape[1]
  if prompt_mask is not None:
    if jnp.shape(prompt_mask) != jnp.shape(tokens):
      raise ValueError(
        f"prompt_mask has shape {jnp.shape(prompt_mask)}; it marks each row's real tokens "
        f"of {name} (True; padding False, on either side), shaped as {name} "
        f"{jnp.shape(tokens)}"
      )
    prompt_mask = jnp.asarray(prompt_mask) != 0
    if is_traced(prompt_mask):
      return prompt_mask
    counts = jnp.sum(prompt_mask, axis=1).tolist()
    if min(counts) < 1:
      raise ValueError(
        f"prompt_mask leaves row {counts.index(min(counts))} without a real token: every "
        "row needs at least one (its next token's logits come from its last)"
      )
    longest = max(counts)
  if longest > max_len:
    raise ValueError(
      f"{name} has {longest} tokens in its longest row, longer than the cache (max_len={max_len})"
    )
  if longest + new_tokens > max_len:
    raise ValueError(
      f"max_new_tokens={new_tokens} after a {longest}-token prompt exceeds the cache "
      f"(max_len={max_len})"
    )
  return prompt_mask


def _prefill(
  model: TransformerLM, tokens: jax.Array, mask: jax.Array | None, max_len: int, cache_mode: str
) -> tuple[jax.Array, KVCache]:
  cache = init_cache(model.config, tokens.shape[0], max_len, cache_mode)
  segment_ids = None if mask is None else mask.astype(jnp.int32)  # 0: padding
  return model(tokens, segment_ids=segment_ids, cache=cache)


def _decode_step(
  model: TransformerLM, token: jax.Array, cache: KVCache
) -> tuple[jax.Array, KVCache]:
  logits, cache = model(token[:, None], cache=cache)
  return logits[:, 0], cache


@functools.partial(jax.jit, static_argnames=("graphdef", "max_len", "cache_mode"))
def _prefill_jit(state, tokens, mask, *, graphdef, max_len, cache_mode):
  return _prefill(nnx.merge(graphdef, state), tokens, mask, max_len, cache_mode)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _decode_step_jit(state, token, cache, *, graphdef):
  return _decode_step(nnx.merge(graphdef, state), token, cache)


def prefill(
  model: TransformerLM,
  tokens: jax.Array,
  *,
  max_len: int,
  cache_mode: str = "source",
  prompt_mask: jax.Array | None = None,
) -> tuple[jax.Array, KVCache]:
  """Runs the prompt through the model and returns its logits and a filled cache.

  Args:
    model: the language model.
    tokens: prompt `[B, L0]` int.
    max_len: total tokens the cache must hold per row (prompt plus every token fed later).
    cache_mode: "source" or "pseudo" layout of the IHA layers.
    prompt_mask: `[B, L0]` bool, each row's real tokens (True; padding False, on either
      side: a ragged batch); None: every token.

  Returns:
    `(logits [B, L0, V] float32, cache)`, the logits in the prompt's columns (padding's
    are the model's output for a zero vector: ignore them), `cache.length` each row's
    real tokens.
  """
  check_model(model, "prefill")
  check_decodable(model.config)
  check_cache_mode(cache_mode)
  mask = check_prompt(tokens, prompt_mask, max_len, "tokens")
  graphdef, state = nnx.split(model)
  return _prefill_jit(
    state, tokens, mask, graphdef=graphdef, max_len=max_len, cache_mode=cache_mode
  )


def decode_step(
  model: TransformerLM, token: jax.Array, cache: KVCache
) -> tuple[jax.Array, KVCache]:
  """Feeds one token per row, row b's at its position `cache.length[b]`.

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
  a categorical draw from `softmax(logits / temperature)`, restricted to the `top_k` best,
  with row b's own key `rng[b]` (`[B]` keys: a row's draw does not depend on the batch)."""
  if temperature == 0.0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  logits = logits / temperature
  if top_k is not None:
    kth_best = jax.lax.top_k(logits, top_k)[0][:, -1:]
    logits = jnp.where(logits < kth_best, -jnp.inf, logits)
  return jax.vmap(jax.random.categorical)(rng, logits).astype(jnp.int32)


@functools.partial(
  jax.jit,
  static_argnames=("graphdef", "max_new_tokens", "max_len", "cache_mode", "temperature", "top_k"),
)
def _generate_jit(
  state, prompt, mask, rng, *, graphdef, max_new_tokens, max_len, cache_mode, temperature, top_k
):
  model = nnx.merge(graphdef, state)
  sample = functools.partial(sample_tokens, temperature=temperature, top_k=top_k)
  keys = jnp.swapaxes(jax.vmap(lambda key: jax.random.split(key, max_new_tokens))(rng), 0, 1)
  logits, cache = _prefill(model, prompt, mask, max_len, cache_mode)
  # Each row's next token comes from its last real one.
  last = prompt.shape[1] - 1 if mask is None else _last_true(mask)
  first = sample(jnp.take_along_axis(logits, jnp.reshape(last, (-1, 1, 1)), axis=1)[:, 0], keys[0])

  def step(carry, key):
    token, cache = carry
    logits, cache = _decode_step(model, token, cache)
    token = sample(logits, key)
    return (token, cache), token

  # The last sampled token is never fed back: max_new_tokens - 1 decode steps.
  _, rest = jax.lax.scan(step, (first, cache), keys[1:])
  return jnp.concatenate([prompt, first[:, None], rest.T.astype(prompt.dtype)], axis=1)


def _last_true(mask: jax.Array) -> jax.Array:
  """`[B]` int32: the column of each row's last True in `mask: [B, L]`."""
  return mask.shape[1] - 1 - jnp.argmax(mask[:, ::-1], axis=1).astype(jnp.int32)


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
  prompt_mask: jax.Array | None = None,
) -> jax.Array:
  """Continues every prompt by `max_new_tokens` tokens with a KV cache.

  Args:
    model: the language model.
    prompt_tokens: `[B, L0]` int, the prompts (padded, with `prompt_mask`).
    max_new_tokens: tokens to generate, >= 1.
    cache_mode: "source" (IHA caches source-head k/v, `[B, G, S, d]`, G key/value heads)
      or "pseudo" (rotated pseudo-keys and pseudo-values, `[B, G, S*P, d]`).
    temperature: 0 is greedy (argmax); > 0 samples from `softmax(logits / temperature)`.
    top_k: sample only among the `top_k` most likely tokens (None = all).
    rng: required when `temperature > 0`: a PRNG key (split into one per row), or `[B]`
      keys, one per row: a row's tokens depend only on its prompt and its key.
    max_len: cache capacity in tokens per row, default `L0 + max_new_tokens`.
    prompt_mask: `[B, L0]` bool, each row's real prompt tokens (True; padding False, on
      either side: prompts of different lengths); None: every token.

  Returns:
    `[B, L0 + max_new_tokens]` tokens: the prompt as given, then each row's new tokens.
  """
  check_model(model, "generate")
  check_decodable(model.config)
  check_cache_mode(cache_mode)
  check_tokens(prompt_tokens, "prompt_tokens")
  if not is_int(max_new_tokens, 1):
    raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
  max_len = prompt_tokens.shape[1] + max_new_tokens if max_len is None else max_len
  mask = check_prompt(prompt_tokens, prompt_mask, max_len, "prompt_tokens", max_new_tokens)
  if not temperature >= 0.0:
    raise ValueError(f"temperature must be >= 0, got {temperature!r}")
  if temperature > 0.0 and rng is None:
    raise ValueError("rng must be a PRNG key when temperature > 0")
  vocab = model.config.vocab_size
  if top_k is not None and not (is_int(top_k, 1) and top_k <= vocab):
    raise ValueError(f"top_k must be None or an integer in [1, {vocab}], got {top_k!r}")
  batch = prompt_tokens.shape[0]
  rng = jax.random.key(0) if rng is None else rng  # Unused by greedy decoding.
  if not jnp.issubdtype(jnp.result_type(rng), jax.dtypes.prng_key):
    rng = jax.random.wrap_key_data(rng)  # raw uint32 keys, [2] or [B, 2]
  if jnp.shape(rng) == ():
    rng = jax.random.split(rng, batch)
  elif jnp.shape(rng) != (batch,):
    raise ValueError(
      f"rng has shape {jnp.shape(rng)}: a PRNG key, or [B] = ({batch},) keys, one per row"
    )
  graphdef, state = nnx.split(model)
  return _generate_jit(
    state,
    jnp.asarray(prompt_tokens),
    mask,
    rng,
    graphdef=graphdef,
    max_new_tokens=max_new_tokens,
    max_len=max_len,
    cache_mode=cache_mode,
    temperature=float(temperature),
    top_k=top_k,
  )
