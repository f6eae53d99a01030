"""2-simplicial attention (Roy et al. 2025, arXiv 2507.02754), the paper's App. D baseline.

Each query attends to PAIRS of keys through a trilinear form, no RoPE:

    A[i, j, l] = sum_c q[i, c] k1[j, c] k2[l, c] / sqrt(d)    (j, l each visible from i)
    S[i]       = softmax of A[i] over the pair (j, l), float32
    out[i]     = sum_{j, l} S[i, j, l] (v1[j] * v2[l])        (elementwise product)

Visibility of j and of l follows the causal / window / segment rule of the other kinds
(window in tokens). Scores are `[N, N]` per query, so memory is O(N^2) per query by
construction: the XLA path runs a block of queries at a time (`iha_jax.core.query_blocks`;
global layers see all N keys, window layers only the band), and both paths refuse
shapes whose scores in flight exceed `MAX_SCORES` float32 elements.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from iha_jax.core.masking import MASK_VALUE
from iha_jax.core.options import AttentionOptions
from iha_jax.core.query_blocks import (
  QueryBlocks,
  block_mask,
  map_query_blocks,
  plan_query_blocks,
  zero_padding,
)

_HIGHEST = jax.lax.Precision.HIGHEST
# Most float32 score elements alive at once (2**27 = 512 MiB): the reference holds
# B*H*N^3 of them, the XLA path B*H*block*slab^2 for one query block.
MAX_SCORES = 2**27
DEFAULT_BLOCK = 32  # queries per block of the XLA path (halved until the block fits)


def _attend(q, k1, k2, v1, v2, mask, precision):
  """Dense math on one block: q `[B, Q, H, d]`, keys/values `[B, S, H, d]`, mask
  bool broadcastable to `[B, 1, Q, S]` (per key) -> float32 `[B, Q, H, d]`."""
  b, n_q, h, d = q.shape
  s = k1.shape[1]
  f32 = lambda x: x.astype(jnp.float32)
  scores = (
    jnp.einsum("bqhc,bjhc,blhc->bhqjl", f32(q), f32(k1), f32(k2), precision=precision) * d**-0.5
  )
  pair_mask = mask[..., :, None] & mask[..., None, :]  # j and l both visible
  scores = jnp.where(pair_mask, scores, MASK_VALUE).reshape(b, h, n_q, s * s)
  weights = jax.nn.softmax(scores, axis=-1).reshape(b, h, n_q, s, s)
  return jnp.einsum("bhqjl,bjhc,blhc->bqhc", weights, f32(v1), f32(v2), precision=precision)


def _refuse(what: str, elements: int, shape: tuple[int, ...], hint: str) -> None:
  if elements > MAX_SCORES:
    b, n, h, _ = shape
    raise ValueError(
      f"simplicial_attention: {what} would hold {elements:,} float32 scores "
      f"(B={b}, N={n}, H={h}), above the limit of {MAX_SCORES:,} "
      f"(iha_jax.core.simplicial.MAX_SCORES); {hint}"
    )


def simplicial_reference(q, k1, k2, v1, v2, options: AttentionOptions):
  """Dense `[B, H, N, N, N]` math in float32 at highest precision (the test oracle)."""
  window, causal = options.window, options.causal
  b, n, h, _ = q.shape
  _refuse(
    "the dense reference",
    b * h * n * k1.shape[1] ** 2,
    q.shape,
    "use implementation='xla', which holds one block of queries at a time.",
  )
  q_index = options.query_offset + jnp.arange(n)
  mask = block_mask(
    q_index, jnp.arange(k1.shape[1]), options.segment_ids, options.key_segment_ids, window, causal
  )
  out = _attend(q, k1, k2, v1, v2, mask, _HIGHEST)
  return zero_padding(out, options.segment_ids).astype(q.dtype)


def _plan(
  shape: tuple[int, ...], block: int, window: int | None, causal: bool, **keys: Any
) -> QueryBlocks:
  """The largest query block (<= `block`) whose scores fit `MAX_SCORES`; refuses if none.
  `keys`: `plan_query_blocks`' key_length and q_offset."""
  b, n, h, _ = shape
  plan = plan_query_blocks(n, block, window, causal, **keys)
  while plan.block > 1 and b * h * plan.block * plan.slab**2 > MAX_SCORES:
    plan = plan_query_blocks(n, plan.block // 2, window, causal, **keys)
  _refuse(
    "one query",
    b * h * plan.block * plan.slab**2,
    shape,
    "use a window, a smaller batch or fewer heads.",
  )
  return plan


def simplicial_xla(q, k1, k2, v1, v2, options: AttentionOptions):
  """Query-blocked math: `[B, H, block, slab, slab]` scores at a time, recomputed in
  backward."""
  segment_ids, window, causal = options.segment_ids, options.window, options.causal
  block = (options.block_sizes.block_q if options.block_sizes else None) or DEFAULT_BLOCK
  plan = _plan(
    q.shape, block, window, causal, key_length=k1.shape[1], q_offset=options.query_offset
  )

  def attend(q_side, k_side, q_index, k_index):
    (q_blk, q_seg), (k1_s, k2_s, v1_s, v2_s, k_seg) = q_side, k_side
    mask = block_mask(q_index, k_index, q_seg, k_seg, window, causal)
    return _attend(q_blk, k1_s, k2_s, v1_s, v2_s, mask, None).astype(q.dtype)

  keys = (k1, k2, v1, v2, options.key_segment_ids)
  out = map_query_blocks(attend, plan, (q, segment_ids), keys)
  return zero_padding(out, segment_ids)
