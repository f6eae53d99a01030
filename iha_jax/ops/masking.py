"""Which virtual key each virtual query may see (docs/design.md §1.5 and 6).

One predicate, used by the dense references on the full grid and by the blockwise
paths on one tile at a time, so every implementation masks identically.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Finite, so fully masked rows (padding queries) give no NaNs in softmax or its VJP.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def visible(
  q_index: jax.Array,
  k_index: jax.Array,
  q_segment: jax.Array | None,
  k_segment: jax.Array | None,
  window: int | None,
  causal: bool = True,
) -> jax.Array:
  """Broadcasting mask: key s is visible to query t.

  Args:
    q_index: flat virtual query indices t, `[..., Tq, 1]`.
    k_index: flat virtual key indices s, `[..., 1, Tk]`.
    q_segment: query segment ids, broadcastable like q_index.
    k_segment: key segment ids, broadcastable like k_index (0 = padding).
    window: sliding window in virtual tokens, or None for global.
    causal: `s <= t` and `t - s < window`; False: any s, and `|t - s| < window`.
    Segments may both be None: one unpadded sequence per row.

  Returns:
    bool `[..., Tq, Tk]`: the causal / window rule and the same nonzero segment.
  """
  delta = q_index - k_index
  mask = delta >= 0 if causal else jnp.ones_like(delta, dtype=bool)
  if window is not None:
    mask &= (delta if causal else jnp.abs(delta)) < window
  if q_segment is not None:
    mask &= (q_segment == k_segment) & (k_segment != 0)
  return mask
