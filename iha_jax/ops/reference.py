"""Dense scaled dot-product attention over a flat sequence: the oracle.

Materialises the full `[B, H, T, T]` score matrix in float32 at highest matmul
precision. Written for clarity, not memory: use it for tests and small shapes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from iha_jax.ops.masking import MASK_VALUE, visible

_HIGHEST = jax.lax.Precision.HIGHEST


def attention_probs(
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
    q: rotated queries `[B, Tq, H, d]`; k: rotated keys `[B, Tk, H, d]`.
    q_index, k_index: flat virtual indices `[Tq]`, `[Tk]` (masked by `visible`).
    window: sliding window in virtual tokens, or None.
    q_segment, k_segment: optional segment ids `[B, Tq]`, `[B, Tk]` (0 = padding).
    k_valid: optional `[Tk]` bool, False for keys that do not exist (empty cache slots).
    causal: the causal rule (`s <= t`) or, False, bidirectional (see `visible`).
  """
  scale = q.shape[-1] ** -0.5
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
) -> jax.Array:
  """Attention over a flat sequence, `q, k: [B, T, H, d]` (already rotated), `v: [B, T, H, dv]`.

  `segment_ids: [B, T]` (0 = padding) or None (one unpadded sequence per row).
  Returns `[B, T, H, dv]` in q.dtype; padding queries output zeros.
  """
  index = jnp.arange(q.shape[1])
  probs = attention_probs(
    q, k, index, index, window=window, q_segment=segment_ids, k_segment=segment_ids, causal=causal
  )
  out = jnp.einsum("bhts,bshd->bthd", probs, v.astype(jnp.float32), precision=_HIGHEST)
  if segment_ids is not None:
    out = jnp.where((segment_ids != 0)[:, :, None, None], out, 0.0)
  return out.astype(q.dtype)
