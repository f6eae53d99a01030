"""Query-blocked dense attention: the memory-efficient XLA path of the kinds whose score
mixing (Talking-Heads) or score shape (2-simplicial) does not fit an online softmax.

Queries are processed `block` at a time under `lax.map`; each block sees one static
slab of keys (all N for global layers, the window band around the block otherwise) and
runs the kind's dense math on it. The block function is rematerialised
(`jax.checkpoint`), so the forward keeps only one block's scores alive and the backward
recomputes them block by block: nothing `[B, H, N, N]`-sized exists in the forward or
is saved for the backward. Residuals are the inputs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from iha_jax.core.masking import visible
from iha_jax.core.options import pad_to


@dataclasses.dataclass(frozen=True)
class QueryBlocks:
  """Static plan: `num_blocks` query blocks of `block` tokens, each with a `slab` of keys.

  Attributes:
    length: N, the number of queries.
    block: queries per block (the last block is padded).
    slab: keys per block: all of them (global), or the window band: `block + window - 1`
      causal, `block + 2 * (window - 1)` bidirectional, capped at the key count.
    window: sliding window in tokens, or None.
    key_length: Nk, the number of keys (N unless the queries are a slice of the keys'
      sequence).
    q_offset: the first query's index on the keys' sequence (int or traced int32).
  """

  length: int
  block: int
  slab: int
  window: int | None
  key_length: int
  q_offset: Any = 0

  @property
  def num_blocks(self) -> int:
    return -(-self.length // self.block)

  def key_start(self, i: jax.Array) -> jax.Array | int:
    """First key of query block i's slab (clamped so the slab stays inside [0, Nk))."""
    if self.slab >= self.key_length:
      return 0
    first = self.q_offset + i * self.block - (self.window - 1)
    return jnp.clip(first, 0, self.key_length - self.slab)


def plan_query_blocks(
  length: int,
  block: int,
  window: int | None,
  causal: bool,
  *,
  key_length: int | None = None,
  q_offset: Any = 0,
) -> QueryBlocks:
  """The `QueryBlocks` for `length` queries (block capped at it) over `key_length` keys
  (default `length`), the first query at index `q_offset` of the keys' sequence."""
  block = max(1, min(block, length))
  key_length = length if key_length is None else key_length
  if window is None:
    slab = key_length
  else:
    slab = min(key_length, block + (window - 1) * (1 if causal else 2))
  return QueryBlocks(
    length=length, block=block, slab=slab, window=window, key_length=key_length, q_offset=q_offset
  )


Attend = Callable[
  [Sequence[jax.Array | None], Sequence[jax.Array | None], jax.Array, jax.Array], jax.Array
]


def map_query_blocks(
  attend: Attend,
  plan: QueryBlocks,
  queries: Sequence[jax.Array | None],
  keys: Sequence[jax.Array | None],
) -> jax.Array:
  """Runs `attend` on every query block and its key slab; returns `[B, N, ...]`.

  Args:
    attend: `(query blocks, key slabs, q_index [block], k_index [slab]) -> [B, block, ...]`;
      query blocks are `queries` sliced to `[B, block, ...]`, key slabs `keys` sliced to
      `[B, slab, ...]` (None entries stay None); indices are token indices on the keys'
      sequence (queries shifted by `plan.q_offset`).
    plan: the static blocking.
    queries, keys: arrays `[B, N, ...]` (or None), sliced along axis 1.
  """
  total = plan.num_blocks * plan.block
  queries = [None if x is None else pad_to(x, total, 1) for x in queries]

  def one_block(i):
    q_start, k_start = i * plan.block, plan.key_start(i)
    q_blocks = [
      None if x is None else jax.lax.dynamic_slice_in_dim(x, q_start, plan.block, 1)
      for x in queries
    ]
    k_slabs = [
      None if x is None else jax.lax.dynamic_slice_in_dim(x, k_start, plan.slab, 1) for x in keys
    ]
    q_index = plan.q_offset + q_start + jnp.arange(plan.block)
    return attend(q_blocks, k_slabs, q_index, k_start + jnp.arange(plan.slab))

  # Remat: only the block index and the closed-over inputs are saved for backward.
  out = jax.lax.map(jax.checkpoint(one_block), jnp.arange(plan.num_blocks))
  out = jnp.moveaxis(out, 0, 1)  # [B, blocks, block, ...]
  out = out.reshape(out.shape[0], total, *out.shape[3:])
  return out[:, : plan.length]


def block_mask(
  q_index: jax.Array,
  k_index: jax.Array,
  q_segment: jax.Array | None,
  k_segment: jax.Array | None,
  window: int | None,
  causal: bool,
) -> jax.Array:
  """Visibility `[B or 1, 1, Q, S]` of keys `k_index [S]` from queries `q_index [Q]`
  (token indices), with segment ids `[B, Q]`, `[B, S]` or None."""
  q_index, k_index = q_index[:, None], k_index[None, :]
  if q_segment is None:
    return visible(q_index, k_index, None, None, window, causal)[None, None]
  return visible(
    q_index, k_index, q_segment[:, None, :, None], k_segment[:, None, None, :], window, causal
  )


def zero_padding(out: jax.Array, segment_ids: jax.Array | None) -> jax.Array:
  """`out [B, N, H, ·]` with padding queries (segment 0) set to exact zeros."""
  if segment_ids is None:
    return out
  return jnp.where((segment_ids != 0)[:, :, None, None], out, 0.0)
