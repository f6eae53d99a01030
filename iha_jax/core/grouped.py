"""Grouped-query attention on the XLA core, without repeating keys and values.

With G key/value heads for H query heads (G divides H, group size `r = H // G`), query
head h reads key/value head `h // r`: the r query heads of a group share one key/value
sequence. Rather than copy keys and values to H heads, the r query heads of a group are
interleaved on the query axis of one head-major call (`flash_attention_heads_major` with
q `[B, G, Tq * r, d]`, row `t * r + j` holding query t of member j), each row keeping its
position through the query index vector (`q_index` repeated r times) and its segment id,
so keys and values stay `[B, G, Tk, d]` forward and backward (their gradients sum over the
group inside the core's key loop). A query tile holds `r` times the positions' rows, so
the core makes as many loop trips over tiles of the same size as a multi-head call, and
each tile's band of keys is that of its positions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from iha_jax.core.masking import Mask
from iha_jax.core.options import pad_to, round_up
from iha_jax.core.xla_attention import (
  attention_probabilities,
  default_block_size,
  effective_mask,
  flash_attention_heads_major,
)


def grouped_attention_heads_major(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  mask: Mask,
  *,
  block_q: int | None = None,
  block_k: int | None = None,
  precision: jax.lax.PrecisionLike = None,
  dropout_rate: float = 0.0,
  dropout_rng: jax.Array | None = None,
) -> jax.Array:
  """`flash_attention_heads_major` for `q: [B, H, Tq, d]` over `k: [B, G, Tk, d]`,
  `v: [B, G, Tk, dv]`, G dividing H: query head h attends with key/value head
  `h // (H // G)`. Arguments as `flash_attention_heads_major` (`mask`: `segment_ids
  [B, Tq]`, `kv_segment_ids [B, Tk]`, `q_index [Tq]`, `k_index [Tk]`; attention dropout);
  G = H is that call itself.

  Returns:
    `[B, H, Tq, dv]` in q.dtype.
  """
  b, h, t_q, d = q.shape
  g = k.shape[1]
  options = dict(
    block_q=block_q,
    block_k=block_k,
    precision=precision,
    dropout_rate=dropout_rate,
    dropout_rng=dropout_rng,
  )
  if g == h:
    return flash_attention_heads_major(q, k, v, mask, **options)
  r = h // g
  mask = effective_mask(mask, t_q, k.shape[2])  # before interleaving hides its window rule
  block = block_q or default_block_size(t_q, mask.window)  # query positions per tile
  tq = round_up(t_q, block)
  q_index = jnp.arange(t_q, dtype=jnp.int32) if mask.q_index is None else mask.q_index
  # Padded positions repeat the last index (no extra tiles) and are sliced off below.
  q_index = pad_to(jnp.asarray(q_index, jnp.int32), tq, 0, mode="edge")
  # Head h = group * r + member: row t * r + member of the group's query axis.
  q = pad_to(q.reshape(b, g, r, t_q, d), tq, 3)
  q = jnp.swapaxes(q, 2, 3).reshape(b, g, tq * r, d)
  segment_ids = mask.segment_ids
  if segment_ids is not None:
    segment_ids = jnp.repeat(pad_to(segment_ids, tq, 1), r, axis=1)
  mask = mask.replace(segment_ids=segment_ids, q_index=jnp.repeat(q_index, r))
  out = flash_attention_heads_major(q, k, v, mask, **{**options, "block_q": block * r})
  out = jnp.swapaxes(out.reshape(b, g, tq, r, -1), 2, 3)
  return out[:, :, :, :t_q].reshape(b, h, t_q, -1)


def grouped_attention_probabilities(
  q: jax.Array, k: jax.Array, mask: Mask, *, precision: jax.lax.PrecisionLike = None
) -> jax.Array:
  """`attention_probabilities` for `q: [B, H, Tq, d]` over `k: [B, G, Tk, d]` (G dividing
  H, interleaved as in `grouped_attention_heads_major`): float32 `[B, H, Tq, Tk]`."""
  b, h, t_q, d = q.shape
  g, t_k = k.shape[1], k.shape[2]
  r = h // g
  if r > 1:
    mask = effective_mask(mask, t_q, t_k)
    q_index = jnp.arange(t_q, dtype=jnp.int32) if mask.q_index is None else mask.q_index
    segment_ids = mask.segment_ids
    mask = mask.replace(
      q_index=jnp.repeat(q_index, r),
      segment_ids=None if segment_ids is None else jnp.repeat(segment_ids, r, axis=1),
    )
    q = jnp.swapaxes(q.reshape(b, g, r, t_q, d), 2, 3).reshape(b, g, t_q * r, d)
  probs = attention_probabilities(q, k, mask, precision=precision)
  return jnp.swapaxes(probs.reshape(b, g, t_q, r, t_k), 2, 3).reshape(b, h, t_q, t_k)
