"""The GPU flash kernels' bodies (Pallas Triton): what one program does (forward, dQ,
dK/dV); their grids, block specs and calls are `iha_jax.kernels.flash.gpu`'s.

Each kernel's inner loop is one plain flash step over a key (or query) tile: two
tensor-core matmuls (`wgmma` on Hopper), the online softmax (`iha_jax.kernels.gpu`) and
the mask; no source-head loads or mixing (the pseudo q/k/v are made in HBM).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from iha_jax.kernels.flash.plan import Call
from iha_jax.kernels.gpu import (
  NN,
  NT,
  dot,
  probabilities,
  softmax_init,
  softmax_output,
  softmax_step,
)


def _mask(call: Call, q_tile, k_tile, offset, seg_q, seg_k, transposed: bool) -> jax.Array:
  """Visibility of one tile pair, `[bq, bk]` (`[bk, bq]` if `transposed`); seg_q, seg_k:
  the tiles' ids (`[bq]`, `[bk]`) or None."""
  tiles = call.tiles
  t = q_tile * tiles.block_q + offset + lax.broadcasted_iota(jnp.int32, (tiles.block_q,), 0)
  s = k_tile * tiles.block_k + lax.broadcasted_iota(jnp.int32, (tiles.block_k,), 0)
  if transposed:
    ok = tiles.visible(t[None, :], s[:, None])
    return ok & (seg_k[:, None] == seg_q[None, :]) if call.segments else ok
  ok = tiles.visible(t[:, None], s[None, :])
  return ok & (seg_q[:, None] == seg_k[None, :]) if call.segments else ok


def query_tile(call: Call, grid_index):
  """The query tile of grid index `grid_index` (forward and dQ): the last first, so the
  widest causal bands start first."""
  return call.tiles.num_q - 1 - grid_index


def _rows(ref, tile, block: int, head=None):
  """Rows `[tile * block, (tile + 1) * block)` of a ref (of head `head` of a group's)."""
  rows = pl.ds(tile * block, block)
  return ref[rows] if head is None else ref[head, rows]


def forward_kernel(*refs, call: Call):
  offset, refs = call.offset_and_refs(refs)
  q_ref, k_ref, v_ref, *refs = refs
  seg_q_ref, seg_k_ref, o_ref, lse_ref = refs if call.segments else (None, None, *refs)
  tiles = call.tiles
  i = query_tile(call, pl.program_id(0))
  seg_q = seg_q_ref[...] if call.segments else None
  q = q_ref[...]

  def body(j, carry):
    m, l, acc = carry
    k, v = _rows(k_ref, j, tiles.block_k), _rows(v_ref, j, tiles.block_k)
    seg_k = _rows(seg_k_ref, j, tiles.block_k) if call.segments else None
    visible = _mask(call, i, j, offset, seg_q, seg_k, transposed=False)
    m_next, l, p, rescale = softmax_step(dot(q, k, NT), visible, m, l)
    acc = rescale[:, None] * acc + dot(p.astype(v.dtype), v, NN)
    return m_next, l, acc

  init = softmax_init(tiles.block_q, o_ref.shape[-1])
  lo, hi = tiles.key_band(i, offset)
  m, l, acc = lax.fori_loop(lo, hi, body, init)
  out, l_safe = softmax_output(acc, l)  # rows that see no key (padding) output 0
  if call.segments:
    out = jnp.where((seg_q != 0)[:, None], out, 0.0)
  o_ref[...] = out.astype(o_ref.dtype)
  lse_ref[...] = m + jnp.log(l_safe)


def dq_kernel(*refs, call: Call):
  offset, refs = call.offset_and_refs(refs)
  q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs = refs
  seg_q_ref, seg_k_ref, dq_ref = refs if call.segments else (None, None, *refs)
  tiles = call.tiles
  i = query_tile(call, pl.program_id(0))
  seg_q = seg_q_ref[...] if call.segments else None
  q, do, lse, delta = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]

  def body(j, dq):
    k, v = _rows(k_ref, j, tiles.block_k), _rows(v_ref, j, tiles.block_k)
    seg_k = _rows(seg_k_ref, j, tiles.block_k) if call.segments else None
    visible = _mask(call, i, j, offset, seg_q, seg_k, transposed=False)
    p = probabilities(dot(q, k, NT), visible, lse)
    ds = p * (dot(do, v, NT) - delta[:, None])
    return dq + dot(ds.astype(k.dtype), k, NN)

  lo, hi = tiles.key_band(i, offset)
  dq = lax.fori_loop(lo, hi, body, jnp.zeros(q.shape, jnp.float32))
  dq_ref[...] = dq.astype(dq_ref.dtype)


def dkv_kernel(*refs, call: Call):
  offset, refs = call.offset_and_refs(refs)
  q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs = refs
  seg_q_ref, seg_k_ref, dk_ref, dv_ref = refs if call.segments else (None, None, *refs)
  tiles = call.tiles
  j = pl.program_id(0)
  seg_k = seg_k_ref[...] if call.segments else None
  k, v = k_ref[...], v_ref[...]
  bq = tiles.block_q

  def body(step, grads):
    dk, dv = grads
    head, i = lax.div(step, num_q_steps), lo + lax.rem(step, num_q_steps)
    q, do = _rows(q_ref, i, bq, head), _rows(do_ref, i, bq, head)
    lse, delta = _rows(lse_ref, i, bq, head), _rows(delta_ref, i, bq, head)
    seg_q = _rows(seg_q_ref, i, bq) if call.segments else None
    visible = _mask(call, i, j, offset, seg_q, seg_k, transposed=True)
    p_t = probabilities(dot(k, q, NT), visible, lse, transposed=True)  # [bk, bq]
    dv = dv + dot(p_t.astype(do.dtype), do, NN)
    ds_t = p_t * (dot(v, do, NT) - delta[None, :])
    return dk + dot(ds_t.astype(q.dtype), q, NN), dv

  lo, hi = tiles.query_band(j, offset)
  num_q_steps = jnp.maximum(hi - lo, 0)
  zeros = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
  # One loop over (query head of the group, query tile): the r heads add into one block.
  dk, dv = lax.fori_loop(0, call.group * num_q_steps, body, zeros)
  dk_ref[...] = dk.astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)
