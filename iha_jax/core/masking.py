"""Which virtual key each virtual query may see (docs/design.md §1.5 and 6).

One predicate, used by the dense references on the full grid and by the blockwise
paths on one tile at a time, so every implementation masks identically; one record of
its inputs (`Mask`), which every core that attends over a flat sequence takes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# Finite, so fully masked rows (padding queries) give no NaNs in softmax or its VJP.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class Mask:
  """Which keys each query sees, for attention over a flat (virtual) sequence: the rule
  of `visible` and its inputs (a pytree: the arrays are its leaves).

  Attributes:
    causal: keys at or before the query only; False: bidirectional.
    window: sliding window in the sequence's units (virtual tokens for IHA: a query sees
      keys with `t - s < window`, or `|t - s| < window` when not causal), or None.
    segment_ids: `[B, Tq]` int32 query ids, 0 = padding (outputs zeros, never seen); None:
      one unpadded sequence per row.
    kv_segment_ids: `[B, Tk]` the keys' ids (None: `segment_ids`, which needs Tq == Tk); a
      key of id 0 is never seen (padding, an empty cache slot).
    q_index, k_index: `[Tq]`, `[Tk]` int32 positions t and s of the queries and keys on
      the flat sequence (None: `arange`): queries and keys that are a slice of a longer
      sequence. Any order is correct; the blockwise core skips the most tiles when sorted.
  """

  causal: bool = dataclasses.field(default=True, metadata=dict(static=True))
  window: int | None = dataclasses.field(default=None, metadata=dict(static=True))
  segment_ids: Any = None
  kv_segment_ids: Any = None
  q_index: Any = None
  k_index: Any = None

  def replace(self, **changes: Any) -> Mask:
    return dataclasses.replace(self, **changes)


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


def ranges_meet(t_first, t_last, s_first, s_last, window: int | None, causal: bool = True):
  """Whether some query index in `[t_first, t_last]` sees some key index in `[s_first,
  s_last]` by `visible`'s rule without segments: the differences `t - s` of the rectangle
  span `[t_first - s_last, t_last - s_first]` and each is attained, so the band meets it
  iff that interval meets the rule's. Any array module, or Python ints (True: always).
  The one statement of the band: the XLA path's key blocks (`xla_attention`) and the
  kernels' tile schedule (`iha_jax.kernels.flash.plan`) both ask it."""
  meet = s_first <= t_last if causal else True
  if window is not None:
    meet = meet & (s_last > t_first - window)
    if not causal:
      meet = meet & (s_first < t_last + window)
  return meet


def visible_keys(length: int, window: int | None, causal: bool = True) -> np.ndarray:
  """`[length]` int64: the keys each query t of one head sees under `visible` (no
  segments): causal `min(t+1, w)`; bidirectional `min(t, w-1) + min(L-1-t, w-1) + 1`."""
  t = np.arange(length, dtype=np.int64)
  w = length if window is None else min(window, length)
  if causal:
    return np.minimum(t + 1, w)
  return np.minimum(t, w - 1) + np.minimum(length - 1 - t, w - 1) + 1


def visible_pairs(length: int, window: int | None, causal: bool = True) -> int:
  """Visible (query, key) pairs of one head over `length` positions (FLOP counting)."""
  return int(visible_keys(length, window, causal).sum())


def visible_triples(length: int, window: int | None, causal: bool = True) -> int:
  """Visible (query, key j, key l) triples of one head (j and l both visible): the sum of
  the squared key counts."""
  keys = visible_keys(length, window, causal)
  return int(np.dot(keys, keys))  # int64: exact below ~2e6 positions
