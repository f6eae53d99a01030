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
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from iha_jax.ops.masking import MASK_VALUE, visible
from iha_jax.ops.options import round_up


def _kv_block_range(
  i, block_q: int, block_k: int, num_k_blocks: int, window: int | None, causal: bool
):
  """Key blocks [lo, hi) that query block i can see (i may be traced)."""
  last_query = (i + 1) * block_q - 1
  if causal:
    hi = jnp.minimum(num_k_blocks, last_query // block_k + 1)
  elif window is None:
    hi = num_k_blocks
  else:  # symmetric window: keys up to last_query + window - 1
    hi = jnp.minimum(num_k_blocks, (last_query + window - 1) // block_k + 1)
  if window is None:
    return 0, hi
  return jnp.maximum(0, i * block_q - window + 1) // block_k, hi


def _q_block_range(
  j, block_q: int, block_k: int, num_q_blocks: int, window: int | None, causal: bool
):
  """Query blocks [lo, hi) that can see key block j (j may be traced)."""
  if causal:
    lo = (j * block_k) // block_q
  elif window is None:
    lo = 0
  else:  # symmetric window: queries from the block's first key - window + 1
    lo = jnp.maximum(0, j * block_k - window + 1) // block_q
  if window is None:
    return lo, num_q_blocks
  last_query = (j + 1) * block_k - 1 + window - 1
  return lo, jnp.minimum(num_q_blocks, last_query // block_q + 1)


def _pad_to(x: jax.Array, total: int, axis: int) -> jax.Array:
  """Zero-pads `axis` to `total`; a no-op (no op at all, so no pad in the VJP) if full."""
  if x.shape[axis] == total:
    return x
  return jnp.pad(x, [(0, total - x.shape[axis]) if a == axis else (0, 0) for a in range(x.ndim)])


def _slice(x: jax.Array, start, size: int, axis: int) -> jax.Array:
  return jax.lax.dynamic_slice_in_dim(x, start, size, axis=axis)


def _tile_mask(
  i,
  j,
  block_q: int,
  block_k: int,
  seg_q: jax.Array | None,
  seg_k: jax.Array | None,
  window: int | None,
  causal: bool,
) -> jax.Array:
  """bool `[B or 1, 1, bq, bk]` visibility of one (query block i, key block j) tile."""
  q_index = i * block_q + jnp.arange(block_q)[:, None]
  k_index = j * block_k + jnp.arange(block_k)[None, :]
  if seg_q is None:
    return visible(q_index, k_index, None, None, window, causal)
  return visible(q_index, k_index, seg_q[:, None, :, None], seg_k[:, None, None, :], window, causal)


def _slice_segments(seg: jax.Array | None, start, size: int) -> jax.Array | None:
  return None if seg is None else _slice(seg, start, size, 1)


def _forward(q, k, v, seg_q, seg_k, *, window, causal, block_q, block_k, precision):
  """`q, k: [B, H, T, d]`, `v: [B, H, T, dv]` padded to block multiples
  -> (out [B, H, Tq, dv], lse [B, H, Tq])."""
  b, h, tq, d = q.shape
  dv = v.shape[-1]
  num_q_blocks, num_k_blocks = tq // block_q, k.shape[2] // block_k
  scale = d**-0.5

  def query_block(i):
    q_i = _slice(q, i * block_q, block_q, 2)
    sq_i = _slice_segments(seg_q, i * block_q, block_q)

    def key_block(j, carry):
      m, l, acc = carry
      k_j = _slice(k, j * block_k, block_k, 2)
      v_j = _slice(v, j * block_k, block_k, 2)
      sk_j = _slice_segments(seg_k, j * block_k, block_k)
      s = (
        jnp.einsum(
          "bhqd,bhkd->bhqk", q_i, k_j, precision=precision, preferred_element_type=jnp.float32
        )
        * scale
      )
      s = jnp.where(_tile_mask(i, j, block_q, block_k, sq_i, sk_j, window, causal), s, MASK_VALUE)
      m_new = jnp.maximum(m, s.max(axis=-1))
      correction = jnp.exp(m - m_new)
      p = jnp.exp(s - m_new[..., None])
      l = l * correction + p.sum(axis=-1)
      acc = acc * correction[..., None] + jnp.einsum(
        "bhqk,bhkd->bhqd",
        p.astype(v.dtype),
        v_j,
        precision=precision,
        preferred_element_type=jnp.float32,
      )
      return m_new, l, acc

    init = (
      jnp.full((b, h, block_q), MASK_VALUE, jnp.float32),
      jnp.zeros((b, h, block_q), jnp.float32),
      jnp.zeros((b, h, block_q, dv), jnp.float32),
    )
    lo, hi = _kv_block_range(i, block_q, block_k, num_k_blocks, window, causal)
    m, l, acc = jax.lax.fori_loop(lo, hi, key_block, init)
    out = acc / l[..., None]
    if sq_i is not None:
      out = jnp.where((sq_i != 0)[:, None, :, None], out, 0.0)
    return out.astype(q.dtype), m + jnp.log(l)

  out, lse = jax.lax.map(query_block, jnp.arange(num_q_blocks))  # [nq, B, H, bq, ...]
  out = jnp.moveaxis(out, 0, 2).reshape(b, h, tq, dv)
  lse = jnp.moveaxis(lse, 0, 2).reshape(b, h, tq)
  return out, lse


def _backward(
  q, k, v, seg_q, seg_k, out, lse, d_out, *, window, causal, block_q, block_k, precision
):
  """FlashAttention-2 backward: loop over key blocks, recompute tiles, accumulate dq."""
  b, h, tq, d = q.shape
  dv = v.shape[-1]
  tk = k.shape[2]
  num_q_blocks, num_k_blocks = tq // block_q, tk // block_k
  scale = d**-0.5
  if seg_q is not None:
    # Padding queries output constant zeros: nothing flows back through them.
    d_out = jnp.where((seg_q != 0)[:, None, :, None], d_out, 0)
  d_out = d_out.astype(q.dtype)
  delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)  # [B, H, Tq]

  def key_block(dq, j):
    k_j = _slice(k, j * block_k, block_k, 2)
    v_j = _slice(v, j * block_k, block_k, 2)
    sk_j = _slice_segments(seg_k, j * block_k, block_k)

    def query_block(i, carry):
      dq, dk_j, dv_j = carry
      q_i = _slice(q, i * block_q, block_q, 2)
      do_i = _slice(d_out, i * block_q, block_q, 2)
      lse_i = _slice(lse, i * block_q, block_q, 2)
      delta_i = _slice(delta, i * block_q, block_q, 2)
      sq_i = _slice_segments(seg_q, i * block_q, block_q)
      s = (
        jnp.einsum(
          "bhqd,bhkd->bhqk", q_i, k_j, precision=precision, preferred_element_type=jnp.float32
        )
        * scale
      )
      mask = _tile_mask(i, j, block_q, block_k, sq_i, sk_j, window, causal)
      p = jnp.where(mask, jnp.exp(s - lse_i[..., None]), 0.0)
      dv_j += jnp.einsum(
        "bhqk,bhqd->bhkd",
        p.astype(d_out.dtype),
        do_i,
        precision=precision,
        preferred_element_type=jnp.float32,
      )
      dp = jnp.einsum(
        "bhqd,bhkd->bhqk", do_i, v_j, precision=precision, preferred_element_type=jnp.float32
      )
      ds = (p * (dp - delta_i[..., None]) * scale).astype(q.dtype)
      dk_j += jnp.einsum(
        "bhqk,bhqd->bhkd", ds, q_i, precision=precision, preferred_element_type=jnp.float32
      )
      dq_i = _slice(dq, i * block_q, block_q, 2) + jnp.einsum(
        "bhqk,bhkd->bhqd", ds, k_j, precision=precision, preferred_element_type=jnp.float32
      )
      dq = jax.lax.dynamic_update_slice_in_dim(dq, dq_i, i * block_q, axis=2)
      return dq, dk_j, dv_j

    zeros_k = jnp.zeros((b, h, block_k, d), jnp.float32)
    zeros_v = jnp.zeros((b, h, block_k, dv), jnp.float32)
    lo, hi = _q_block_range(j, block_q, block_k, num_q_blocks, window, causal)
    dq, dk_j, dv_j = jax.lax.fori_loop(lo, hi, query_block, (dq, zeros_k, zeros_v))
    return dq, (dk_j.astype(k.dtype), dv_j.astype(v.dtype))

  dq = jnp.zeros((b, h, tq, d), jnp.float32)
  dq, (dk, dv_blocks) = jax.lax.scan(key_block, dq, jnp.arange(num_k_blocks))
  dk = jnp.moveaxis(dk, 0, 2).reshape(b, h, tk, d)
  d_v = jnp.moveaxis(dv_blocks, 0, 2).reshape(b, h, tk, dv)
  return dq.astype(q.dtype), dk, d_v


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8))
def _flash(q, k, v, segment_ids, window, causal, block_q, block_k, precision):
  return _flash_fwd(q, k, v, segment_ids, window, causal, block_q, block_k, precision)[0]


def _flash_fwd(q, k, v, segment_ids, window, causal, block_q, block_k, precision):
  seg_q, seg_k = segment_ids or (None, None)
  out, lse = _forward(
    q,
    k,
    v,
    seg_q,
    seg_k,
    window=window,
    causal=causal,
    block_q=block_q,
    block_k=block_k,
    precision=precision,
  )
  return out, (q, k, v, segment_ids, out, lse)


def _flash_bwd(window, causal, block_q, block_k, precision, residuals, d_out):
  q, k, v, segment_ids, out, lse = residuals
  seg_q, seg_k = segment_ids or (None, None)
  dq, dk, dv = _backward(
    q,
    k,
    v,
    seg_q,
    seg_k,
    out,
    lse,
    d_out,
    window=window,
    causal=causal,
    block_q=block_q,
    block_k=block_k,
    precision=precision,
  )
  return dq, dk, dv, None


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


def flash_attention_heads_major(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  *,
  segment_ids: jax.Array | None,
  window: int | None,
  causal: bool = True,
  block_q: int | None = None,
  block_k: int | None = None,
  precision: jax.lax.PrecisionLike = None,
) -> jax.Array:
  """Blockwise attention over a flat sequence, head-major layout.

  Args:
    q, k: `[B, H, T, d]`, already rotated; v: `[B, H, T, dv]`.
    segment_ids: `[B, T]` int32 with 0 = padding (outputs zeros, never seen), or
      None for one unpadded sequence per row (no segment masking at all).
    window: sliding window (a query sees keys with `t - s < window`, or
      `|t - s| < window` when not causal) or None.
    causal: keys at or before the query only; False: bidirectional.
    block_q, block_k: tile edges; T need not divide them (padded and masked).
    precision: matmul precision of the score and value contractions.

  Returns:
    `[B, H, T, dv]` in q.dtype.
  """
  t = q.shape[2]
  if window is not None and window >= t:
    window = None  # the band covers everything: take the cheaper global path
  default = default_block_size(t, window)
  block_q = block_q or default
  block_k = block_k or default
  tq, tk = round_up(t, block_q), round_up(t, block_k)
  q, k, v = _pad_to(q, tq, 2), _pad_to(k, tk, 2), _pad_to(v, tk, 2)
  if segment_ids is None and not causal and tk != t:
    # Causality hides padded key slots (they lie after every real query); without it
    # they need segment id 0 like any padding. Padded queries are sliced off.
    segment_ids = jnp.ones((q.shape[0], t), jnp.int32)
  segments = (
    None if segment_ids is None else (_pad_to(segment_ids, tq, 1), _pad_to(segment_ids, tk, 1))
  )
  out = _flash(q, k, v, segments, window, causal, block_q, block_k, precision)
  return out if tq == t else out[:, :, :t]
