"""Grouped-query attention on the XLA core, without repeating keys and values.

With G key/value heads for H query heads (G divides H, group size `r = H // G`), query
head h reads key/value head `h // r`: the r query heads of a group share one key/value
sequence. Rather than copy keys and values to H heads, the r query sequences of a group
are laid end to end on the query axis of one head-major call
(`flash_attention_heads_major` with q `[B, G, r * Tq, d]`), each keeping its own
positions through the query index vector (`q_index` tiled r times) and its own segment
ids, so keys and values stay `[B, G, Tk, d]` forward and backward (their gradients sum
over the group inside the core's key loop). Each group member's queries are padded to
whole tiles, so no tile mixes two members and a window's band stays as narrow as without
groups.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from iha_jax.ops.options import round_up
from iha_jax.ops.xla_attention import (
  attention_probabilities,
  default_block_size,
  flash_attention_heads_major,
)


def _pad_axis(x: jax.Array, total: int, axis: int, **pad) -> jax.Array:
  if x.shape[axis] == total:
    return x
  widths = [(0, total - x.shape[axis]) if a == axis else (0, 0) for a in range(x.ndim)]
  return jnp.pad(x, widths, **pad)


def grouped_attention_heads_major(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  *,
  segment_ids: jax.Array | None,
  window: int | None,
  causal: bool = True,
  block_q: int | None = None,
  block_k: int | None = None,
  precision: jax.lax.PrecisionLike = None,
  kv_segment_ids: jax.Array | None = None,
  q_index: jax.Array | None = None,
  k_index: jax.Array | None = None,
) -> jax.Array:
  """`flash_attention_heads_major` for `q: [B, H, Tq, d]` over `k: [B, G, Tk, d]`,
  `v: [B, G, Tk, dv]`, G dividing H: query head h attends with key/value head
  `h // (H // G)`. Arguments as `flash_attention_heads_major` (`segment_ids: [B, Tq]`,
  `kv_segment_ids: [B, Tk]`, `q_index: [Tq]`, `k_index: [Tk]`); G = H is that call itself.

  Returns:
    `[B, H, Tq, dv]` in q.dtype.
  """
  b, h, t_q, d = q.shape
  g, t_k = k.shape[1], k.shape[2]
  if g == h:
    return flash_attention_heads_major(
      q,
      k,
      v,
      segment_ids=segment_ids,
      window=window,
      causal=causal,
      block_q=block_q,
      block_k=block_k,
      precision=precision,
      kv_segment_ids=kv_segment_ids,
      q_index=q_index,
      k_index=k_index,
    )
  r = h // g
  if kv_segment_ids is None and segment_ids is not None:
    if t_q != t_k:
      raise ValueError("kv_segment_ids must be given when queries and keys differ in length")
    kv_segment_ids = segment_ids
  if q_index is None and k_index is None and window is not None and window >= max(t_q, t_k):
    window = None  # the band covers everything (the core's own shortcut, before indexing)
  block_q = block_q or default_block_size(t_q, window)
  tq = round_up(t_q, block_q)
  if q_index is None:
    q_index = jnp.arange(t_q, dtype=jnp.int32)
  # Padded queries repeat the last index (no extra tiles) and are sliced off below.
  q_index = _pad_axis(jnp.asarray(q_index, jnp.int32), tq, 0, mode="edge")
  # Head h = group * r + member: a free reshape puts a group's members on one axis.
  q = _pad_axis(q.reshape(b, g, r, t_q, d), tq, 3).reshape(b, g, r * tq, d)
  if segment_ids is not None:
    segment_ids = jnp.tile(_pad_axis(segment_ids, tq, 1), (1, r))
  out = flash_attention_heads_major(
    q,
    k,
    v,
    segment_ids=segment_ids,
    window=window,
    causal=causal,
    block_q=block_q,
    block_k=block_k,
    precision=precision,
    kv_segment_ids=kv_segment_ids,
    q_index=jnp.tile(q_index, r),
    k_index=k_index,
  )
  return out.reshape(b, g, r, tq, -1)[:, :, :, :t_q].reshape(b, h, t_q, -1)


def grouped_attention_probabilities(
  q: jax.Array,
  k: jax.Array,
  *,
  segment_ids: jax.Array | None,
  window: int | None,
  causal: bool = True,
  kv_segment_ids: jax.Array | None = None,
  q_index: jax.Array | None = None,
  k_index: jax.Array | None = None,
  precision: jax.lax.PrecisionLike = None,
) -> jax.Array:
  """`attention_probabilities` for `q: [B, H, Tq, d]` over `k: [B, G, Tk, d]` (G dividing
  H, grouped as `grouped_attention_heads_major`): float32 `[B, H, Tq, Tk]`."""
  b, h, t_q, d = q.shape
  g, t_k = k.shape[1], k.shape[2]
  r = h // g
  if r > 1:
    if kv_segment_ids is None and segment_ids is not None:
      if t_q != t_k:
        raise ValueError("kv_segment_ids must be given when queries and keys differ in length")
      kv_segment_ids = segment_ids
    if q_index is None and k_index is None and window is not None and window >= max(t_q, t_k):
      window = None
    q_index = jnp.tile(jnp.arange(t_q, dtype=jnp.int32) if q_index is None else q_index, r)
    segment_ids = None if segment_ids is None else jnp.tile(segment_ids, (1, r))
    q = q.reshape(b, g, r * t_q, d)
  probs = attention_probabilities(
    q,
    k,
    segment_ids=segment_ids,
    window=window,
    causal=causal,
    kv_segment_ids=kv_segment_ids,
    q_index=q_index,
    k_index=k_index,
    precision=precision,
  )
  return probs.reshape(b, h, t_q, t_k)
