"""Dense scaled dot-product attention over a flat sequence: the oracle.

Materialises the full `[B, H, T, T]` score matrix in float32 at highest matmul
precision. Written for clarity, not memory: use it for tests and small shapes.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from iha_jax.ops.masking import MASK_VALUE, visible

_HIGHEST = jax.lax.Precision.HIGHEST


def dense_attention(q: jax.Array, k: jax.Array, v: jax.Array, *,
                    segment_ids: jax.Array | None, window: int | None) -> jax.Array:
  """Causal attention, `q, k, v: [B, T, H, d]` (already rotated).

  `segment_ids: [B, T]` (0 = padding) or None (one unpadded sequence per row).
  Returns `[B, T, H, d]` in q.dtype; padding queries output zeros.
  """
  if segment_ids is None:
    segment_ids = jnp.ones(q.shape[:2], jnp.int32)
  t = q.shape[1]
  scale = q.shape[-1] ** -0.5
  qf, kf, vf = (x.astype(jnp.float32) for x in (q, k, v))
  scores = jnp.einsum("bthd,bshd->bhts", qf, kf, precision=_HIGHEST) * scale
  index = jnp.arange(t)
  mask = visible(index[:, None], index[None, :], segment_ids[:, None, :, None],
                 segment_ids[:, None, None, :], window)
  probs = jax.nn.softmax(jnp.where(mask, scores, MASK_VALUE), axis=-1)
  out = jnp.einsum("bhts,bshd->bthd", probs, vf, precision=_HIGHEST)
  out = jnp.where((segment_ids != 0)[:, :, None, None], out, 0.0)
  return out.astype(q.dtype)
