"""Memory-efficient attention in pure JAX (the "xla" implementation of IHA and MHA).

Flash-attention style: queries are processed block by block, each block streams
over exactly the key blocks that its causal (and window) band touches, with an
online softmax in float32. No `[T, T]` score or mask tensor ever exists:
- global causal layers: memory O(T * block), work ~ T^2 / 2 (upper-triangle blocks
  are never visited); bidirectional: every block, work T^2;
- window layers: memory O(T * block), work O(T * (window + block)) (twice the band
  when bidirectional: the window is symmetric).
The backward pass is a custom VJP that recomputes score tiles from the saved
log-sum-exp (as FlashAttention-2 does), so training memory is O(T * d) too.
Attention dropout (`dropout_rate`, `dropout_rng`) drops each weight of a tile with a
mask drawn from the key folded with the tile's (query block, key block) numbers, so the
backward pass redraws exactly the forward's masks; the softmax normaliser is the
undropped one (as `jax.nn.dot_product_attention`'s reference and flax's attention).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from iha_jax.core.masking import MASK_VALUE, Mask, ranges_meet, visible
from iha_jax.core.options import pad_to, round_up

# Keys padded onto a tile boundary get this index: after every query, so the causal rule
# hides them (bidirectional calls also mark them as padding segments).
_PAD_INDEX = 2**30


def block_ranges(q_index, k_index, block_q: int, block_k: int, window, causal: bool):
  """Which tiles meet: key blocks `[kv_lo[i], kv_hi[i])` for query block i and query
  blocks `[q_lo[j], q_hi[j])` for key block j, from the padded index vectors `[Tq]`,
  `[Tk]` (each block's first..last needed tile, so any index order is correct and a
  sorted one is tight; a block that needs none gets an empty range)."""
  q_blocks = q_index.reshape(-1, block_q)
  k_blocks = k_index.reshape(-1, block_k)
  q_min, q_max = q_blocks.min(1)[:, None], q_blocks.max(1)[:, None]  # [nq, 1]
  k_min, k_max = k_blocks.min(1)[None, :], k_blocks.max(1)[None, :]  # [1, nk]
  needed = jnp.broadcast_to(
    ranges_meet(q_min, q_max, k_min, k_max, window, causal), (q_min.shape[0], k_min.shape[1])
  )

  def first_last(rows):  # bool [n, m] -> [n] first true, [n] one past the last true
    any_true = rows.any(1)
    first = jnp.argmax(rows, axis=1)
    last = rows.shape[1] - jnp.argmax(rows[:, ::-1], axis=1)
    return jnp.where(any_true, first, 0), jnp.where(any_true, last, 0)

  kv_lo, kv_hi = first_last(needed)
  q_lo, q_hi = first_last(needed.T)
  return kv_lo, kv_hi, q_lo, q_hi


def _block(x: jax.Array | None, i, size: int, axis: int) -> jax.Array | None:
  """Block `i` of `size` rows on `axis` (None stays None)."""
  start = i * size
  return None if x is None else jax.lax.dynamic_slice_in_dim(x, start, size, axis=axis)


def _dot(spec: str, a: jax.Array, b: jax.Array, precision) -> jax.Array:
  return jnp.einsum(spec, a, b, precision=precision, preferred_element_type=jnp.float32)


def _tile_mask(q_index, k_index, seg_q, seg_k, window: int | None, causal: bool) -> jax.Array:
  """bool `[B or 1, 1, bq, bk]` visibility of one tile, from its query / key indices
  `[bq]`, `[bk]` and segment ids `[B, bq]`, `[B, bk]` (or None)."""
  q_index, k_index = q_index[:, None], k_index[None, :]
  if seg_q is None:
    return visible(q_index, k_index, None, None, window, causal)
  return visible(q_index, k_index, seg_q[:, None, :, None], seg_k[:, None, None, :], window, causal)


def _kept(dropout, i, j, p: jax.Array) -> jax.Array:
  """`p` with attention dropout applied (`dropout = (rate, key)`; None: `p`): the weights of
  tile (query block i, key block j) kept with probability `1 - rate` and scaled by
  `1 / (1 - rate)`. The mask depends only on the key and (i, j): the backward redraws it."""
  if dropout is None:
    return p
  rate, key = dropout
  keep = jax.random.bernoulli(jax.random.fold_in(jax.random.fold_in(key, i), j), 1 - rate, p.shape)
  return jnp.where(keep, p / (1 - rate), 0.0)


class _Tiles(NamedTuple):
  """The static arguments of the core: the band, tile edges, matmul precision and the
  attention dropout rate (0: none)."""

  window: int | None
  causal: bool
  block_q: int
  block_k: int
  precision: Any
  rate: float = 0.0


def _forward(q, k, v, segments, indices, tiles: _Tiles, key=None):
  """`q, k: [B, H, T, d]`, `v: [B, H, T, dv]`, `segments` None or the (query, key) ids
  `[B, T]`, `indices` the (query, key) positions `[T]`, padded to tile multiples -> (out
  `[B, H, Tq, dv]`, lse `[B, H, Tq]`). `key`: attention dropout's (`_kept`)."""
  window, causal, block_q, block_k, precision, rate = tiles
  (seg_q, seg_k), (q_index, k_index) = segments or (None, None), indices
  dropout = (rate, key) if rate else None
  b, h, tq, d = q.shape
  dv = v.shape[-1]
  scale = d**-0.5
  kv_lo, kv_hi, _, _ = block_ranges(q_index, k_index, block_q, block_k, window, causal)

  def query_block(i):
    q_i, sq_i = _block(q, i, block_q, 2), _block(seg_q, i, block_q, 1)
    qi_i = _block(q_index, i, block_q, 0)

    def key_block(j, carry):
      m, l, acc = carry
      k_j, v_j = _block(k, j, block_k, 2), _block(v, j, block_k, 2)
      sk_j, ki_j = _block(seg_k, j, block_k, 1), _block(k_index, j, block_k, 0)
      s = _dot("bhqd,bhkd->bhqk", q_i, k_j, precision) * scale
      s = jnp.where(_tile_mask(qi_i, ki_j, sq_i, sk_j, window, causal), s, MASK_VALUE)
      m_new = jnp.maximum(m, s.max(axis=-1))
      correction = jnp.exp(m - m_new)
      p = jnp.exp(s - m_new[..., None])
      l = l * correction + p.sum(axis=-1)
      acc = acc * correction[..., None] + _dot(
        "bhqk,bhkd->bhqd", _kept(dropout, i, j, p).astype(v.dtype), v_j, precision
      )
      return m_new, l, acc

    init = (
      jnp.full((b, h, block_q), MASK_VALUE, jnp.float32),
      jnp.zeros((b, h, block_q), jnp.float32),
      jnp.zeros((b, h, block_q, dv), jnp.float32),
    )
    m, l, acc = jax.lax.fori_loop(kv_lo[i], kv_hi[i], key_block, init)
    # A query that sees no key (a padding or out-of-range query) outputs zeros.
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]
    if sq_i is not None:
      out = jnp.where((sq_i != 0)[:, None, :, None], out, 0.0)
    return out.astype(q.dtype), m + jnp.log(jnp.where(l > 0, l, 1.0))

  out, lse = jax.lax.map(query_block, jnp.arange(tq // block_q))  # [nq, B, H, bq, ...]
  out = jnp.moveaxis(out, 0, 2).reshape(b, h, tq, dv)
  lse = jnp.moveaxis(lse, 0, 2).reshape(b, h, tq)
  return out, lse


def _backward(q, k, v, segments, indices, out, lse, d_out, tiles: _Tiles, key=None):
  """FlashAttention-2 backward: loop over key blocks, recompute tiles, accumulate dq. With
  dropout the output is `D(P) V` (`D` the tile masks and scale of `_kept`): dV takes
  `D(P)`, dP the masked and scaled `dO V^T`, and `delta = rowsum(dO * out)` still equals
  `rowsum(P * dP)`."""
  window, causal, block_q, block_k, precision, rate = tiles
  (seg_q, seg_k), (q_index, k_index) = segments or (None, None), indices
  dropout = (rate, key) if rate else None
  b, h, tq, d = q.shape
  dv = v.shape[-1]
  tk = k.shape[2]
  scale = d**-0.5
  _, _, q_lo, q_hi = block_ranges(q_index, k_index, block_q, block_k, window, causal)
  if seg_q is not None:
    # Padding queries output constant zeros: nothing flows back through them.
    d_out = jnp.where((seg_q != 0)[:, None, :, None], d_out, 0)
  d_out = d_out.astype(q.dtype)
  delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)  # [B, H, Tq]

  def key_block(dq, j):
    k_j, v_j = _block(k, j, block_k, 2), _block(v, j, block_k, 2)
    sk_j, ki_j = _block(seg_k, j, block_k, 1), _block(k_index, j, block_k, 0)

    def query_block(i, carry):
      dq, dk_j, dv_j = carry
      q_i, do_i = _block(q, i, block_q, 2), _block(d_out, i, block_q, 2)
      lse_i, delta_i = _block(lse, i, block_q, 2), _block(delta, i, block_q, 2)
      sq_i, qi_i = _block(seg_q, i, block_q, 1), _block(q_index, i, block_q, 0)
      s = _dot("bhqd,bhkd->bhqk", q_i, k_j, precision) * scale
      mask = _tile_mask(qi_i, ki_j, sq_i, sk_j, window, causal)
      p = jnp.where(mask, jnp.exp(s - lse_i[..., None]), 0.0)
      dv_j += _dot("bhqk,bhqd->bhkd", _kept(dropout, i, j, p).astype(d_out.dtype), do_i, precision)
      dp = _kept(dropout, i, j, _dot("bhqd,bhkd->bhqk", do_i, v_j, precision))
      ds = (p * (dp - delta_i[..., None]) * scale).astype(q.dtype)
      dk_j += _dot("bhqk,bhqd->bhkd", ds, q_i, precision)
      dq_i = _block(dq, i, block_q, 2) + _dot("bhqk,bhkd->bhqd", ds, k_j, precision)
      dq = jax.lax.dynamic_update_slice_in_dim(dq, dq_i, i * block_q, axis=2)
      return dq, dk_j, dv_j

    zeros_k = jnp.zeros((b, h, block_k, d), jnp.float32)
    zeros_v = jnp.zeros((b, h, block_k, dv), jnp.float32)
    dq, dk_j, dv_j = jax.lax.fori_loop(q_lo[j], q_hi[j], query_block, (dq, zeros_k, zeros_v))
    return dq, (dk_j.astype(k.dtype), dv_j.astype(v.dtype))

  dq = jnp.zeros((b, h, tq, d), jnp.float32)
  dq, (dk, dv_blocks) = jax.lax.scan(key_block, dq, jnp.arange(tk // block_k))
  dk = jnp.moveaxis(dk, 0, 2).reshape(b, h, tk, d)
  d_v = jnp.moveaxis(dv_blocks, 0, 2).reshape(b, h, tk, dv)
  return dq.astype(q.dtype), dk, d_v


# Attention dropout's key (None without dropout) is an argument; its rate is static.
@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _flash(q, k, v, segments, indices, key, tiles):
  return _forward(q, k, v, segments, indices, tiles, key)[0]


def _flash_fwd(q, k, v, segments, indices, key, tiles):
  out, lse = _forward(q, k, v, segments, indices, tiles, key)
  return out, (q, k, v, segments, indices, key, out, lse)


def _flash_bwd(tiles, residuals, d_out):
  q, k, v, segments, indices, key, out, lse = residuals
  dq, dk, dv = _backward(q, k, v, segments, indices, out, lse, d_out, tiles, key)
  return dq, dk, dv, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def default_block_size(seq_len: int, window: int | None) -> int:
  """Block edge for the XLA path: large for few loop trips, capped by the window.

  A window layer visits about `T * (window + 2 * block)` query-key pairs, so the
  block shrinks with the window to keep the band's waste small. The sequence is then
  split into that many blocks as evenly as possible (a multiple of 8), so padding
  stays under 8 rows per block: T = 592 takes 2 blocks of 296, not 2 of 512.
  """
  block = 512 if window is None else max(16, min(512, round_up(window, 16) // 2))
  num_blocks = -(-seq_len // block)
  return round_up(-(-seq_len // num_blocks), 8)


def effective_mask(mask: Mask, t_q: int, t_k: int) -> Mask:
  """`mask` for `t_q` queries and `t_k` keys: the keys' own segment ids (the queries' when
  they share the sequence), and no window where the band covers everything (the cheaper
  global path)."""
  kv_segment_ids = mask.kv_segment_ids
  if kv_segment_ids is None and mask.segment_ids is not None:
    if t_q != t_k:
      raise ValueError("kv_segment_ids must be given when queries and keys differ in length")
    kv_segment_ids = mask.segment_ids
  window = mask.window
  if mask.q_index is None and mask.k_index is None and window is not None:
    if window >= max(t_q, t_k):
      window = None
  return mask.replace(kv_segment_ids=kv_segment_ids, window=window)


def _prepare(q, k, v, mask: Mask, block_q, block_k, precision, rate=0.0):
  """q, k, v, segments, indices padded to tile multiples, and the `_Tiles`."""
  t_q, t_k = q.shape[2], k.shape[2]
  mask = effective_mask(mask, t_q, t_k)
  segment_ids, kv_segment_ids = mask.segment_ids, mask.kv_segment_ids
  block_q = block_q or default_block_size(t_q, mask.window)
  block_k = block_k or default_block_size(t_k, mask.window)
  tq, tk = round_up(t_q, block_q), round_up(t_k, block_k)
  q, k, v = pad_to(q, tq, 2), pad_to(k, tk, 2), pad_to(v, tk, 2)
  if kv_segment_ids is None and not mask.causal and tk != t_k:
    # Causality hides padded key slots (their indices lie after every query); without it
    # they need segment id 0 like any padding. Padded queries are sliced off.
    kv_segment_ids = jnp.ones((k.shape[0], t_k), jnp.int32)
    segment_ids = jnp.ones((q.shape[0], t_q), jnp.int32)
  if kv_segment_ids is not None and segment_ids is None:
    segment_ids = jnp.ones((q.shape[0], t_q), jnp.int32)
  segments = (
    None if segment_ids is None else (pad_to(segment_ids, tq, 1), pad_to(kv_segment_ids, tk, 1))
  )
  if mask.q_index is None:
    q_index = jnp.arange(tq, dtype=jnp.int32)
  else:  # padded queries repeat the last index: they add no tiles and are sliced off
    q_index = jnp.pad(jnp.asarray(mask.q_index, jnp.int32), (0, tq - t_q), mode="edge")
  if mask.k_index is None:
    k_index = jnp.arange(tk, dtype=jnp.int32)
  else:
    k_index = jnp.asarray(mask.k_index, jnp.int32)
    k_index = jnp.pad(k_index, (0, tk - t_k), constant_values=_PAD_INDEX)
  tiles = _Tiles(mask.window, mask.causal, block_q, block_k, precision, rate)
  return q, k, v, segments, (q_index, k_index), tiles


def flash_attention_heads_major(
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
  """Blockwise attention over a flat sequence, head-major layout.

  Args:
    q: `[B, H, Tq, d]` and k: `[B, H, Tk, d]`, already rotated; v: `[B, H, Tk, dv]`.
    mask: which keys each query sees (`Mask`: causal, window, segment ids of the queries
      and keys, their positions on the flat sequence for a slice of a longer one).
    block_q, block_k: tile edges; Tq, Tk need not divide them (padded and masked).
    precision: matmul precision of the score and value contractions.
    dropout_rate, dropout_rng: attention dropout (module docstring): each weight dropped
      with probability `dropout_rate` (0: none), masks drawn from the key `dropout_rng`.

  Returns:
    `[B, H, Tq, dv]` in q.dtype.
  """
  t_q = q.shape[2]
  *arrays, tiles = _prepare(q, k, v, mask, block_q, block_k, precision, dropout_rate)
  out = _flash(*arrays, dropout_rng if dropout_rate else None, tiles)
  return out if out.shape[2] == t_q else out[:, :, :t_q]


def attention_probabilities(
  q: jax.Array, k: jax.Array, mask: Mask, *, precision: jax.lax.PrecisionLike = None
) -> jax.Array:
  """The attention weights `flash_attention_heads_major` applies, float32 `[B, H, Tq, Tk]`
  (arguments as there): the blockwise forward's log-sum-exp, then each query block's
  row of weights `exp(s - lse)` under the same tile mask. Rows of padding queries, and
  of queries that see no key, are zeros. Dense in Tk: for attention maps."""
  t_q, t_k = q.shape[2], k.shape[2]
  v = jnp.zeros((*k.shape[:3], 1), q.dtype)
  q, k, v, segments, indices, tiles = _prepare(q, k, v, mask, None, None, precision)
  _, lse = _forward(q, k, v, segments, indices, tiles)
  (seg_q, seg_k), (q_index, k_index) = segments or (None, None), indices
  window, causal, block_q = tiles[:3]
  scale = q.shape[-1] ** -0.5

  def query_block(i):
    s = _dot("bhqd,bhkd->bhqk", _block(q, i, block_q, 2), k, precision)
    sq_i = _block(seg_q, i, block_q, 1)
    mask = _tile_mask(_block(q_index, i, block_q, 0), k_index, sq_i, seg_k, window, causal)
    lse_i = _block(lse, i, block_q, 2)
    return jnp.where(mask, jnp.exp(s * scale - lse_i[..., None]), 0.0)

  probs = jax.lax.map(query_block, jnp.arange(q.shape[2] // block_q))  # [nq, B, H, bq, Tk]
  probs = jnp.moveaxis(probs, 0, 2).reshape(*q.shape[:2], -1, k.shape[2])
  return probs[:, :, :t_q, :t_k]
