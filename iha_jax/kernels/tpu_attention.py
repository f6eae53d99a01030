"""IHA and MHA on TPU: pseudo-heads mixed on the MXU in HBM, then flash attention.

IHA's P pseudo-queries, keys and values per head are linear in the source heads, so
they are made once per call by einsums (`bnmd,mhp->bhnpd`: the MXU, HBM-bound at these
sizes), rotated at their virtual positions `pos * P + p` and laid out head-major as the
`T = N * P` virtual rows each target head attends over; `iha_jax.kernels.tpu_flash` then
runs plain flash attention on them (no per-tile rebuild of pseudo tiles from all H
source heads, which bound the earlier fused kernels by the vector units), and the P
outputs collapse by one more einsum. The softmax scale `1/sqrt(d)` rides on `alpha_q`
(on q for MHA), so the kernels do no scaling.

What the custom VJP keeps for the backward: the source q, k, v (the caller's), the
mixing tensors, the pseudo output o (P times the MHA output, bfloat16 at bf16 inputs)
and the float32 log-sum-exp. Pseudo q/k/v are remade by the einsums in the backward (as
cheap as in the forward) rather than saved; o is saved rather than recomputed by a second
forward pass (its one full attention pass cost more than its memory: docs/performance.md).

Sequence shards (a query offset into longer keys, `iha_jax.parallel.context`): the keys
rotate at their own positions and carry their own segment ids; the offset reaches the
kernels as a scalar operand, so one compiled kernel serves every shard.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from iha_jax.kernels import tpu_flash
from iha_jax.kernels.tile_schedule import Tiles
from iha_jax.core.options import AttentionOptions, round_up
from iha_jax.core.rope import rope_frequencies
from iha_jax.core.validation import default_positions

DEFAULT_BLOCK_Q = 512  # rows; the estimate's choice at the paper's shape (performance.md)
DEFAULT_BLOCK_K = 512
SUBLANES = 16  # bf16 packs 16 rows per vreg: tiles are multiples of it


def _tile(rows: int, requested: int | None, default: int) -> tuple[int, int]:
  """(tile edge, padded rows): one tile for short sequences, else 128-multiples."""
  block = round_up(requested or default, tpu_flash.LANES)
  if rows <= block:
    block = round_up(rows, SUBLANES)
  return block, round_up(rows, block)


def _run(fn: Callable, *args):
  """`fn(*args, interpret=...)`: Mosaic on TPU, Pallas' interpreter elsewhere."""
  return lax.platform_dependent(
    *args,
    tpu=functools.partial(fn, interpret=False),
    default=functools.partial(fn, interpret=True),
  )


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(call: tpu_flash.Call, q, k, v, seg, offset):
  return _flash_fwd(call, q, k, v, seg, offset)[0]


def _flash_fwd(call, q, k, v, seg, offset):
  o, lse = _run(functools.partial(tpu_flash.forward, call), q, k, v, seg, offset)
  return o, (q, k, v, seg, offset, o, lse[..., 0])


def _flash_bwd(call, residuals, do):
  q, k, v, seg, offset, o, lse = residuals
  delta = jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), axis=-1)
  dq, dk, dv = _run(
    functools.partial(tpu_flash.backward, call), q, k, v, seg, offset, do.astype(q.dtype), lse,
    delta,
  )
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def _rotate_virtual(x: jax.Array, positions: jax.Array, num_pseudo: int, theta: float | None):
  """RoPE of `x: [B, Hx, N, P, d]` (float32) at virtual positions `pos * P + p`."""
  if theta is None:
    return x
  d = x.shape[-1]
  virtual = positions[:, :, None] * num_pseudo + jnp.arange(num_pseudo, dtype=jnp.int32)
  angles = virtual.astype(jnp.float32)[..., None] * rope_frequencies(d, theta)  # [B,N,P,d/2]
  cos, sin = (f(angles)[:, None] for f in (jnp.cos, jnp.sin))
  x1, x2 = jnp.split(x, 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _mix(x: jax.Array, alpha: jax.Array | None, positions, theta, scale: float = 1.0):
  """Source heads `[B, N, S, d]` -> virtual rows `[B, Ht, N * P, d]` in x.dtype: mixed
  by `alpha: [S, Ht, P]` (None: each head itself, P = 1), rotated, times `scale`."""
  b, n, _, d = x.shape
  if alpha is None:
    mixed = jnp.swapaxes(x.astype(jnp.float32), 1, 2)[:, :, :, None]  # [B, S, N, 1, d]
    p = 1
  else:
    p = alpha.shape[2]
    mixed = jnp.einsum(
      "bnmd,mhp->bhnpd", x, (alpha * scale).astype(x.dtype), preferred_element_type=jnp.float32
    )
    scale = 1.0
  mixed = _rotate_virtual(mixed, positions, p, theta) * scale
  return mixed.reshape(b, mixed.shape[1], n * p, d).astype(x.dtype)


def _segments(ids: jax.Array, num_pseudo: int, rows: int, padding: int) -> jax.Array:
  """Token ids `[B, N]` -> virtual ids `[B, rows]` (padded with `padding`)."""
  virtual = jnp.repeat(ids.astype(jnp.int32), num_pseudo, axis=1)
  return jnp.pad(virtual, ((0, 0), (0, rows - virtual.shape[1])), constant_values=padding)


def _pad_rows(x: jax.Array, rows: int) -> jax.Array:
  return jnp.pad(x, ((0, 0), (0, 0), (0, rows - x.shape[2]), (0, 0)))


def attend_virtual(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  alphas: tuple[jax.Array, jax.Array, jax.Array] | None,
  options: AttentionOptions,
) -> jax.Array:
  """Pseudo outputs `[B, Ht, N, P, dv]` (q.dtype) of mixing + flash attention.

  q `[B, N, H, d]`, k `[B, Nk, G, d]`, v `[B, Nk, G, dv]` source heads (Nk = N unless a
  sequence shard); `alphas = (alpha_q [H, Ht, P], alpha_k [G, Gt, P], alpha_v [G, Gt, P])`
  (Ht, Gt: the target heads computed here, all or a head shard) or None for MHA (P = 1).
  `options`: checked (window in virtual rows, causal, segment ids, positions, RoPE,
  block sizes in virtual rows, a shard's query offset and key-side ids / positions)."""
  b, n, h, d = q.shape
  nk = k.shape[1]
  sliced = options.sliced or nk != n
  p = 1 if alphas is None else alphas[0].shape[2]
  positions = default_positions(q, options.positions)
  key_positions = positions
  key_ids = options.segment_ids
  if sliced:
    key_ids, key_positions = options.key_segment_ids, options.key_positions
    if key_positions is None:
      key_positions = jnp.broadcast_to(jnp.arange(nk, dtype=jnp.int32), (b, nk))
  theta = options.rope_theta
  a_q, a_k, a_v = alphas if alphas is not None else (None, None, None)
  qv = _mix(q, a_q, positions, theta, scale=1 / math.sqrt(d))
  kv = _mix(k, a_k, key_positions, theta)
  vv = _mix(v, a_v, key_positions, None)
  blocks = options.block_sizes
  block_q, rows_q = _tile(n * p, blocks and blocks.block_q, DEFAULT_BLOCK_Q)
  block_k, rows_k = _tile(nk * p, blocks and blocks.block_k, DEFAULT_BLOCK_K)
  offset = options.query_offset if sliced else 0
  static = isinstance(offset, int)
  tiles = Tiles(
    block_q=block_q,
    block_k=block_k,
    num_q=rows_q // block_q,
    num_k=rows_k // block_k,
    keys=nk * p,
    causal=options.causal,
    window=options.window,
    offset=offset * p if static else None,
    max_offset=nk * p,
  )
  segments = options.segment_ids is not None or (sliced and key_ids is not None)
  seg = None
  if segments:
    query_ids = options.segment_ids
    if query_ids is None:
      query_ids = jnp.ones((b, n), jnp.int32)
    if key_ids is None:
      key_ids = jnp.ones((b, nk), jnp.int32)
    key_ids = jnp.where(key_ids == 0, -1, key_ids)  # padding keys: seen by no query
    seg = (
      _segments(query_ids, p, rows_q, 0)[..., None],
      _segments(key_ids, p, rows_k, -1)[:, None, :],
    )
  call = tpu_flash.Call(tiles, heads=qv.shape[1], kv_heads=kv.shape[1], segments=segments)
  offset_operand = None if static else (jnp.asarray(offset, jnp.int32) * p).reshape(1)
  o = _flash(call, _pad_rows(qv, rows_q), _pad_rows(kv, rows_k), _pad_rows(vv, rows_k), seg,
             offset_operand)
  return o[:, :, : n * p].reshape(b, o.shape[1], n, p, v.shape[-1])


def collapsed(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  alphas: tuple[jax.Array, jax.Array, jax.Array],
  collapse: jax.Array,
  options: AttentionOptions,
) -> jax.Array:
  """IHA on TPU -> `[B, N, H', d]` float32: H' = H for a full collapse `[H, Ht, P]` (a
  partial sum over the Ht local target heads), Ht for per_head `[Ht, P]`."""
  o = attend_virtual(q, k, v, alphas, options)
  spec = "bgnpd,hgp->bnhd" if collapse.ndim == 3 else "bhnpd,hp->bnhd"
  return jnp.einsum(spec, o, collapse.astype(o.dtype), preferred_element_type=jnp.float32)


def mha(q: jax.Array, k: jax.Array, v: jax.Array, options: AttentionOptions) -> jax.Array:
  """MHA on TPU: q `[B, N, H, d]`, k `[B, Nk, G, d]`, v `[B, Nk, G, dv]` -> `[B, N, H, dv]`."""
  o = attend_virtual(q, k, v, None, options)
  return jnp.swapaxes(o[:, :, :, 0], 1, 2)
