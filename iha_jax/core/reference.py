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

from iha_jax.core.masking import MASK_VALUE, Mask, visible

_HIGHEST = jax.lax.Precision.HIGHEST


def repeat_kv_heads(x: jax.Array, num_heads: int) -> jax.Array:
  """`[B, T, G, d]` -> `[B, T, H, d]`, head h a copy of head `h // (H // G)`; x itself
  when G = H (so multi-head attention runs exactly as without groups)."""
  groups = num_heads // x.shape[2]
  return x if groups == 1 else jnp.repeat(x, groups, axis=2)


def dense_attention_probabilities(q: jax.Array, k: jax.Array, mask: Mask) -> jax.Array:
  """Softmax attention probabilities over a flat virtual sequence, float32 `[B, H, Tq, Tk]`.

  q: rotated queries `[B, Tq, H, d]`; k: rotated keys `[B, Tk, G, d]` (G divides H);
  `mask`: which keys each query sees (`Mask`; indices default to `arange`, the keys'
  segment ids to the queries'; keys with segment ids and queries without: every query
  one unpadded sequence's).
  """
  scale = q.shape[-1] ** -0.5
  k = repeat_kv_heads(k, q.shape[2])
  scores = (
    jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), k.astype(jnp.float32), precision=_HIGHEST)
    * scale
  )
  q_index = jnp.arange(q.shape[1]) if mask.q_index is None else mask.q_index
  k_index = jnp.arange(k.shape[1]) if mask.k_index is None else mask.k_index
  q_segment = mask.segment_ids
  k_segment = q_segment if mask.kv_segment_ids is None else mask.kv_segment_ids
  if q_segment is None and k_segment is not None:  # keys with padding, queries without
    q_segment = jnp.ones(q.shape[:2], jnp.int32)
  q_seg = None if q_segment is None else q_segment[:, None, :, None]
  k_seg = None if k_segment is None else k_segment[:, None, None, :]
  allowed = visible(q_index[:, None], k_index[None, :], q_seg, k_seg, mask.window, mask.causal)
  return jax.nn.softmax(jnp.where(allowed, scores, MASK_VALUE), axis=-1)


def dense_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: Mask) -> jax.Array:
  """Attention over a flat sequence, `q: [B, Tq, H, d]`, `k: [B, Tk, G, d]` (already
  rotated), `v: [B, Tk, G, dv]`; G divides H, query head h reads key/value head
  `h // (H // G)`; `mask` as `dense_attention_probabilities`. Returns `[B, Tq, H, dv]` in
  q.dtype; padding queries output zeros."""
  probs = dense_attention_probabilities(q, k, mask)
  v = repeat_kv_heads(v, q.shape[2])
  out = jnp.einsum("bhts,bshd->bthd", probs, v.astype(jnp.float32), precision=_HIGHEST)
  if mask.segment_ids is not None:
    out = jnp.where((mask.segment_ids != 0)[:, :, None, None], out, 0.0)
  return out.astype(q.dtype)
