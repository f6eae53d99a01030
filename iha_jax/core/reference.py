"""Dense scaled dot-product attention over a flat sequence: the oracle.

Materialises the full `[B, H, T, T]` score matrix in float32 at highest matmul
precision. Written for clarity, not memory: use it for tests and small shapes.
Grouped-query keys and values (G heads, G dividing the H query heads) are repeated to H
heads here, query head h reading key/value head `h // (H // G)`: an oracle may spend the
memory that the other implementations save.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from iha_jax.core.masking import MASK_VALUE, visible

_HIGHEST = jax.lax.Precision.HIGHEST


def repeat_kv_heads(x: jax.Array, num_heads: int) -> jax.Array:
  """`[B, T, G, d]` -> `[B, T, H, d]`, head h a copy of head `h // (H // G)`; x itself
  when G = H (so multi-head attention runs exactly as without groups)."""
  groups = num_heads // x.shape[2]
  return x if groups == 1 else jnp.repeat(x, groups, axis=2)


def dense_attention_probabilities(
  q: jax.Array,
  k: jax.Array,
  q_index: jax.Array,
  k_index: jax.Array,
  *,
  window: int | None,
  q_segment: jax.Array | None = None,
  k_segment: jax.Array | None = None,
  k_valid: jax.Array | None = None,
  causal: bool = True,
) -> jax.Array:
  """Softmax attention probabilities over a flat virtual sequence, float32 `[B, H, Tq, Tk]`.

  Args:
    q: rotated queries `[B, Tq, H, d]`; k: rotated keys `[B, Tk, G, d]` (G divides H).
    q_index, k_index: flat virtual indices `[Tq]`, `[Tk]` (masked by `visible`).
    window: sliding window in virtual tokens, or None.
    q_segment, k_segment: optional segment ids `[B, Tq]`, `[B, Tk]` (0 = padding).
    k_valid: optional `[Tk]` bool, False for keys that do not exist (empty cache slots).
    causal: the causal rule (`s <= t`) or, False, bidirectional (see `visible`).
  """
  scale = q.shape[-1] ** -0.5
  k = repeat_kv_heads(k, q.shape[2])
  scores = (
    jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), k.astype(jnp.float32), precision=_HIGHEST)
    * scale
  )
  q_seg = None if q_segment is None else q_segment[:, None, :, None]
  k_seg = None if k_segment is None else k_segment[:, None, None, :]
  mask = visible(q_index[:, None], k_index[None, :], q_seg, k_seg, window, causal)
  if k_valid is not None:
    mask &= k_valid
  return jax.nn.softmax(jnp.where(mask, scores, MASK_VALUE), axis=-1)


def dense_attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  *,
  segment_ids: jax.Array | None,
  window: int | None,
  causal: bool = True,
  kv_segment_ids: jax.Array | None = None,
  q_offset: int | jax.Array = 0,
) -> jax.Array:
  """Attention over a flat sequence, `q: [B, Tq, H, d]`, `k: [B, Tk, G, d]` (already
  rotated), `v: [B, Tk, G, dv]`; G divides H, query head h reads key/value head
  `h // (H // G)`.

  `segment_ids: [B, Tq]` (0 = padding) or None (one unpadded sequence per row);
  `kv_segment_ids: [B, Tk]` the keys' (default `segment_ids`); `q_offset`: index of the
  first query on the keys' sequence (queries that are a slice of it; default 0).
  Returns `[B, Tq, H, dv]` in q.dtype; padding queries output zeros.
  """
  q_index = q_offset + jnp.arange(q.shape[1])
  k_index = jnp.arange(k.shape[1])
  k_segment = segment_ids if kv_segment_ids is None else kv_segment_ids
  q_segment = segment_ids
  if q_segment is None and k_segment is not None:  # keys with padding, queries without
    q_segment = jnp.ones(q.shape[:2], jnp.int32)
  probs = dense_attention_probabilities(
    q, k, q_index, k_index, window=window, q_segment=q_segment, k_segment=k_segment, causal=causal
  )
  v = repeat_kv_heads(v, q.shape[2])
  out = jnp.einsum("bhts,bshd->bthd", probs, v.astype(jnp.float32), precision=_HIGHEST)
  if segment_ids is not None:
    out = jnp.where((segment_ids != 0)[:, :, None, None], out, 0.0)
  return out.astype(q.dtype)
