"""KV caches and per-layer cached attention for decoding `TransformerLM` (docs/design.md §1.2-1.7).

Every layer's cache is a ring buffer over token slots: token `n` lives in slot
`n % C`. Global layers use `C = max_len` (the ring never wraps); window layers keep
only the tokens a window can see (`window_tokens`). Caches are head-major, the layout of
the XLA attention core that a decoding step runs (`iha_jax.ops.flash_attention_heads_major`,
the same core and mask as the training forward on CPU). A kind decodes when its record
says so (`AttentionKind.decodes`: it reads as pseudo-head attention, `pseudo_heads` and
`collapse`). Two layouts for IHA layers:

- "source": the SOURCE-head k and v before mixing and RoPE, `[B, G, C, d]` (the size
  of an MHA cache with as many key/value heads). Every step rebuilds the pseudo-keys and
  pseudo-values from them (mix with alpha_k / alpha_v, RoPE at virtual positions
  `pos*P + p`).
- "pseudo": the rotated pseudo-keys and the pseudo-values, `[B, G, C*P, d]` (P times
  larger; slot c holds virtual tokens `c*P .. c*P+P-1`), so a step only mixes and
  rotates the new token.

G is the layer's key/value heads (`num_kv_heads`; G = H without grouped-query
attention), so a grouped-query layer's cache is G/H of a multi-head one. MHA layers
(M, S) always store rotated keys and values, `[B, G, C, d]`, which is the "pseudo" layout
with P = 1 and no mixing. The new token's pseudo-queries sit at virtual
indices `n*P + p` and see the cached keys at their virtual indices under the training
mask (flat causal over the virtual sequence, plus the window; empty slots are padding),
so decoding computes the full forward's function.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx, struct

from iha_jax import kinds
from iha_jax.core.grouped import grouped_attention_heads_major
from iha_jax.core.validation import default_positions
from iha_jax.models.config import TransformerConfig
from iha_jax.nn import (
  AttentionConfig,
  project_qkv,
  pseudo_heads,
  rotated_pseudo_heads,
  to_compute_dtype,
  virtual_per_token,
)
from iha_jax.ops import virtual_positions

CACHE_MODES = ("source", "pseudo")
_HIGHEST = jax.lax.Precision.HIGHEST


class LayerCache(struct.PyTreeNode):
  """One layer's ring buffer: `k, v: [B, G, C, d]` ("source" IHA or MHA) or `[B, G, C*P, d]`
  (G key/value heads)."""

  k: jax.Array
  v: jax.Array


class KVCache(struct.PyTreeNode):
  """The caches of every layer of a `TransformerLM` and the number of tokens written.

  Attributes:
    layers: one `LayerCache` per decoder block.
    length: int32 scalar, tokens written so far = position of the next token.
    mode: "source" or "pseudo" (layout of the IHA layers), static.
    max_len: tokens the cache can hold in all (capacity of the global layers), static.
  """

  layers: tuple[LayerCache, ...]
  length: jax.Array
  mode: str = struct.field(pytree_node=False)
  max_len: int = struct.field(pytree_node=False)

  @property
  def nbytes(self) -> int:
    """Bytes of all cached keys and values."""
    return sum(leaf.nbytes for layer in self.layers for leaf in (layer.k, layer.v))


def check_cache_mode(cache_mode: str) -> None:
  """Raises ValueError naming `cache_mode` unless it is one of `CACHE_MODES`."""
  if cache_mode not in CACHE_MODES:
    raise ValueError(f"cache_mode must be one of {CACHE_MODES}, got {cache_mode!r}")


def _stores_source(cfg: AttentionConfig, mode: str) -> bool:
  return cfg.interleaved and mode == "source"


def window_tokens(cfg: AttentionConfig, max_len: int) -> int:
  """Token slots C of a layer's ring buffer.

  A window of `w` virtual tokens lets query `n*P + p` see keys down to `n*P - w + 1`,
  which belong to tokens `n - ceil((w-1)/P) .. n`: `ceil((w-1)/P) + 1` tokens (`w` for
  MHA, P = 1). Global layers, and windows longer than the sequence, need `max_len`.
  """
  if cfg.window is None:
    return max_len
  span = -(-(cfg.window - 1) // virtual_per_token(cfg)) + 1
  return min(span, max_len)


def slot_tokens(position: jax.Array, capacity: int) -> jax.Array:
  """Token held by each of `capacity` slots once token `position` is written, `[C]` int32.

  Slot j holds the latest token `t <= position` with `t % C == j`; negative = empty.
  """
  return position - jnp.mod(position - jnp.arange(capacity, dtype=jnp.int32), capacity)


def init_layer_cache(
  cfg: AttentionConfig, batch: int, max_len: int, mode: str, dtype: Any
) -> LayerCache:
  """An empty ring buffer for a layer (zeros; slots are masked until written)."""
  per_token = 1 if _stores_source(cfg, mode) else virtual_per_token(cfg)
  shape = (batch, cfg.kv_heads, window_tokens(cfg, max_len) * per_token, cfg.head_dim)
  return LayerCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))


def decodable_letters() -> str:
  """Schedule letters whose kinds decode with a KV cache (I, L, M, S built in)."""
  return "".join(
    letter for letter in kinds.LETTER_DESCRIPTIONS if kinds.for_letter(letter)[0].decodes
  )


def check_decodable(config: TransformerConfig) -> None:
  """Raises ValueError unless a KV cache can decode a model with `config`: a causal LM
  (no encoder, no per-token output head) whose layers' kinds decode."""
  if not config.causal:
    raise ValueError(
      "KV-cache decoding needs a causal model; this one has causal=False "
      "(a bidirectional encoder: every position sees later tokens). Run the "
      "full forward instead."
    )
  if config.num_outputs is not None:
    raise ValueError(
      f"KV-cache decoding needs next-token logits; this model has a per-token "
      f"head (num_outputs={config.num_outputs})."
    )
  other = sorted(set(config.schedule) - set(decodable_letters()))
  if other:
    names = sorted({kinds.for_letter(letter)[0].name for letter in other})
    raise ValueError(
      f"KV-cache decoding supports schedule letters {decodable_letters()!r}; "
      f"attention_schedule {config.attention_schedule!r} has {other} ({', '.join(names)} "
      f"attention, which does not decode). Run the full forward for those models."
    )


def init_cache(config: TransformerConfig, batch: int, max_len: int, mode: str) -> KVCache:
  """Empty caches for every layer of a model with `config` (computation dtype)."""
  check_decodable(config)
  check_cache_mode(mode)
  layers = tuple(
    init_layer_cache(config.attention_config(letter), batch, max_len, mode, config.dtype)
    for letter in config.schedule
  )
  return KVCache(layers=layers, length=jnp.zeros((), jnp.int32), mode=mode, max_len=max_len)


def _write(buf: jax.Array, new: jax.Array, start: jax.Array, per_token: int) -> jax.Array:
  """Writes tokens `start .. start+n-1` into a ring buffer, keeping the last C of them.

  `buf: [B, G, C*per_token, d]`, `new: [B, n*per_token, G, d]`; token t goes to slot t % C.
  """
  b, h, size, d = buf.shape
  capacity, n = size // per_token, new.shape[1] // per_token
  kept = min(n, capacity)  # Older tokens would be overwritten anyway; keeps slots unique.
  new = new[:, (n - kept) * per_token :].reshape(b, kept, per_token, h, d).astype(buf.dtype)
  new = jnp.transpose(new, (0, 3, 1, 2, 4))  # [B, G, kept, per_token, d]
  slots = jnp.mod(start + n - kept + jnp.arange(kept, dtype=jnp.int32), capacity)
  ring = buf.reshape(b, h, capacity, per_token, d)
  return ring.at[:, :, slots].set(new).reshape(buf.shape)


def _cache_entries(
  params: dict[str, jax.Array],
  cfg: AttentionConfig,
  mode: str,
  k: jax.Array,
  v: jax.Array,
  positions: jax.Array,
) -> tuple[jax.Array, jax.Array]:
  """What a layer caches for source k, v `[B, n, G, d]` at token `positions: [B, n]`."""
  if _stores_source(cfg, mode):
    return k, v
  return (rotated_pseudo_heads(params, cfg, "k", k, positions), pseudo_heads(params, cfg, "v", v))


def prefill_layer(attn: nnx.Module, x: jax.Array, cache: LayerCache, mode: str) -> LayerCache:
  """Writes the keys and values of tokens `0 .. L0-1` into an empty layer cache.

  `x: [B, L0, D]` is the layer's normalised input (the attention module's input).
  """
  cfg = attn.config
  params, x = to_compute_dtype(attn.param_values(), x, cfg)
  _, k, v = project_qkv(params, x)
  positions = default_positions(x, None)
  k, v = _cache_entries(params, cfg, mode, k, v, positions)
  per_token = k.shape[1] // x.shape[1]
  start = jnp.zeros((), jnp.int32)
  return LayerCache(k=_write(cache.k, k, start, per_token), v=_write(cache.v, v, start, per_token))


def _heads_major(x: jax.Array) -> jax.Array:
  return jnp.swapaxes(x, 1, 2)


def decode_layer(
  attn: nnx.Module, x: jax.Array, cache: LayerCache, position: jax.Array, mode: str
) -> tuple[jax.Array, LayerCache]:
  """Attention output of one new token at `position`, and the cache with it written.

  Args:
    attn: the layer's attention module (a kind that decodes: IHA or MHA built in).
    x: the token's normalised layer input `[B, 1, D]`.
    cache: the layer's cache holding tokens `< position`.
    position: int32 scalar, the token's position.
    mode: "source" or "pseudo".

  Returns:
    `([B, 1, D], cache)`, equal to the full forward's output at `position`.
  """
  cfg = attn.config
  params, x = to_compute_dtype(attn.param_values(), x, cfg)
  p = virtual_per_token(cfg)
  q, k, v = project_qkv(params, x)
  pos = jnp.full(x.shape[:2], position, jnp.int32)
  k_new, v_new = _cache_entries(params, cfg, mode, k, v, pos)
  per_token = k_new.shape[1]
  cache = LayerCache(
    k=_write(cache.k, k_new, position, per_token), v=_write(cache.v, v_new, position, per_token)
  )
  tokens = slot_tokens(position, cache.k.shape[2] // per_token)  # [C], negative = empty
  if _stores_source(cfg, mode):
    # Rebuild every cached token's pseudo-keys/values: less memory, more work per step.
    slot_pos = jnp.broadcast_to(tokens, (x.shape[0], tokens.shape[0]))
    keys = _heads_major(rotated_pseudo_heads(params, cfg, "k", _heads_major(cache.k), slot_pos))
    values = _heads_major(pseudo_heads(params, cfg, "v", _heads_major(cache.v)))
  else:
    keys, values = cache.k, cache.v
  queries = _heads_major(rotated_pseudo_heads(params, cfg, "q", q, pos))  # [B, H, P, d]
  filled = jnp.repeat((tokens >= 0).astype(jnp.int32), p)  # empty slots: padding segments
  # queries [B, H, P, d] over keys [B, G, C*P, d]: query head h reads key head h // (H/G).
  out = grouped_attention_heads_major(
    queries,
    keys,
    values,
    segment_ids=jnp.ones((x.shape[0], p), jnp.int32),
    kv_segment_ids=jnp.broadcast_to(filled, (x.shape[0], filled.shape[0])),
    q_index=virtual_positions(pos[:1], p)[0],
    k_index=virtual_positions(tokens[None], p)[0],
    window=cfg.window,
  )
  out = cfg.record.collapse(params, cfg, _heads_major(out))  # [B, 1, H, d]
  return jnp.einsum("bnhd,hdD->bnD", out, params["wo"]), cache
