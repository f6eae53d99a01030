"""The backward kernels of IHA's on-chip GPU window path (`window.gpu` calls them).

Three Pallas-Triton kernels, each a grid `(programs, B)` whose program takes `span`
consecutive query tiles (key groups), read the forward's operands (`window.gpu_kernel`'s
layouts) and dy in the forward's output layout, and remake every pseudo tile on chip
(`window.gpu_mixing`):
- statistics (`query_kernel(stats=True)`): per target head and query tile, the forward's
  online softmax again -> O and `lse`; `delta = rowsum(dO * O)` with `dO = cm^T dy`; the
  collapse's partial `dy O^T`, folded to `[Ho', P']`;
- dQ (`query_kernel(stats=False)`): the band again with `lse` and `delta`, `dQ = sum dS
  K`, then `R(p)^T` and `aq^T` (source rows dq1, dq2) and the query mixing's partial;
- dK/dV (`dkv_kernel`): per key/value target head and key group, the query tiles whose
  window reaches it (`query_tiles`), for the group's r query heads, in sub-tiles whose
  pseudo queries and dO^T are remade: `dV = sum P^T dO`, `dK = sum dS^T Q`, un-mixed to
  dk1, dk2, dv, and the partials `[P', G']`.
Register budget (H100; tests/kernels/test_compile_targets.py): the query-side loops transpose the
scores, `[k_rows, q_rows]`, so that what stays fixed across a loop (pseudo queries, dy,
cm) is a product's second operand, kept in shared memory.
"""

from __future__ import annotations

import collections
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from iha_jax.kernels.gpu import (
  NN,
  NT,
  TN,
  block_pow2,
  dot,
  probabilities,
  softmax_init,
  softmax_output,
  softmax_step,
)
from iha_jax.kernels.window.gpu_mixing import (
  MIX_ROWS,
  add_in_place,
  folded_weights_grad,
  output_grad,
  pseudo_rows_in_chunks,
  unmix,
  unrotate,
  varying_zero,
  virtual_rows,
)
from iha_jax.kernels.window.gpu_plan import COLLAPSE_ROWS, Plan, key_groups, query_tiles, visible

# dQ's key mixing where a group has more source rows than `MIX_ROWS` (P = 4): smaller
# chunks, as compiled for H100 (32-row chunks spilled).
DQ_KEY_MIX_ROWS = 16
# Query rows per step of the dK/dV loop (a sub-tile: the pseudo queries and dO it remakes
# stay within the registers beside the key group's accumulators).
DKV_QUERY_ROWS = 32


# A backward kernel's operand refs by `window.gpu.prepare`'s names (rope_q, rope_k: the
# (cos, sin) refs, or None without RoPE); lse and delta are the statistics kernel's
# outputs, the other two kernels' inputs.
_Operands = collections.namedtuple(
  "_Operands", "q1 q2 k1 k2 v dy lse delta aq ak av cm rope_q rope_k qid kid"
)


def _operands(refs, plan: Plan, stats: bool) -> tuple[_Operands, list]:
  """(the operands, the other outputs' refs) of a backward kernel's refs."""
  q1, q2, k1, k2, v, dy, *refs = refs
  lse = delta = None
  if not stats:
    lse, delta, *refs = refs
  aq, ak, av, cm, *refs = refs
  rope_q = rope_k = None
  if plan.rotary:
    cos_q, sin_q, cos_k, sin_k, *refs = refs
    rope_q, rope_k = (cos_q, sin_q), (cos_k, sin_k)
  qid, kid, *outputs = refs
  if stats:
    lse, delta, *outputs = outputs
  operands = (q1, q2, k1, k2, v, dy, lse, delta, aq, ak, av, cm, rope_q, rope_k, qid, kid)
  return _Operands(*operands), outputs


class _QuerySide(NamedTuple):
  """What the query side's tiles share: the static call, the refs, the program index."""

  plan: Plan
  span: int
  interpret: bool
  program: jax.Array
  ops: _Operands
  part: Any  # the weights' partials: collapse (statistics) or query mixing (dQ)
  dq: tuple | None  # (dq1, dq2) refs (dQ)


def query_kernel(*refs, plan: Plan, span: int, interpret: bool, stats: bool):
  """The query side, in two kernels (`stats`: the first; apart, each fits the registers).
  Stats: per target head and tile, the forward's online softmax again (O, lse), delta and
  the collapse's partial (`_stats_tile`). dQ: the band again with lse and delta, `dQ =
  sum dS K`, un-mixed to source rows, and the query mixing's partial (`_dq_tile`)."""
  ops, outputs = _operands(refs, plan, stats)
  dq = None if stats else tuple(outputs[:2])
  side = _QuerySide(plan, span, interpret, pl.program_id(0), ops, outputs[-1], dq)
  qs = plan.q_src
  r = plan.targets // plan.kv_targets
  if not stats:

    def zero(t, carry):
      rows = pl.ds(t * qs, qs)
      dq[0][rows, :] = jnp.zeros((qs, plan.half), jnp.float32)
      dq[1][rows, :] = jnp.zeros((qs, plan.half), jnp.float32)
      return carry

    lax.fori_loop(0, span, zero, 0)
  tile = _stats_tile if stats else _dq_tile

  def head(h, carry):
    g = lax.div(h, r)
    side.part[h] = jnp.zeros(side.part.shape[1:], jnp.float32)
    lax.fori_loop(0, span, lambda t, carry: tile(side, h, g, t, carry), 0)
    return carry

  lax.fori_loop(0, plan.targets, head, 0)


def _tile_queries(side: _QuerySide, h, t):
  """Query tile `t` of the program, target head h: (its index i, `varying_zero(t)` (the
  tile's constants loaded in the tile loop, not held across it), pseudo queries qx1, qx2,
  their ids and virtual rows, the key groups `[lo, hi)` of its band)."""
  plan, ops = side.plan, side.ops
  i = side.program * side.span + t
  z = varying_zero(t)
  dtype = ops.q1.dtype
  qx1, qx2 = pseudo_rows_in_chunks(
    ops.aq, h, (ops.q1, ops.q2), t * plan.q_src, ops.rope_q, dtype, z
  )
  qid = ops.qid[pl.ds(t * plan.q_rows, plan.q_rows)]
  tq = virtual_rows(plan, plan.q_rows, plan.offset + i * plan.q_tokens)
  lo, hi = key_groups(plan, i)
  return i, z, qx1, qx2, qid, tq, lo, hi


def _key_scores(side: _QuerySide, g, tq, qid, qx1, qx2, chunk: int, j):
  """Key group j's pseudo keys (mixed in chunks of `chunk` source rows), the mask and the
  transposed scores `[k_rows, q_rows]` against the tile's queries, `varying_zero(j)`."""
  plan, ops = side.plan, side.ops
  y = varying_zero(j)
  rope_k, dtype = ops.rope_k, ops.q1.dtype
  rows = j * plan.k_src
  kx1, kx2 = pseudo_rows_in_chunks(ops.ak, g, (ops.k1, ops.k2), rows, rope_k, dtype, y, chunk=chunk)
  kid = ops.kid[pl.ds(j * plan.k_rows, plan.k_rows)]
  u = virtual_rows(plan, plan.k_rows, j * plan.k_tokens)
  ok = visible(plan, tq, u, qid, lambda: kid, transposed=True)
  return kx1, kx2, ok, dot(kx1, qx1, NT) + dot(kx2, qx2, NT), y


def _stats_tile(side: _QuerySide, h, g, t, carry):
  """The statistics of query tile t, head h: O and lse by the online softmax, delta, and
  the collapse's partial `dy O^T` folded to `[Ho', P']`."""
  plan, ops = side.plan, side.ops
  dtype, rq, ks = ops.q1.dtype, plan.q_rows, plan.k_src
  few_outputs = plan.out_rows <= plan.q_rows
  i, z, qx1, qx2, qid, tq, lo, hi = _tile_queries(side, h, t)
  stat = pl.ds(t * rq, rq)

  def forward(j, carry):  # the forward's online softmax (transposed): O, lse
    m, l, acc = carry
    _, _, ok, s, y = _key_scores(side, g, tq, qid, qx1, qx2, MIX_ROWS, j)
    m_next, l, probs, rescale = softmax_step(s, ok, m, l, transposed=True)
    probs = probs.astype(dtype)
    v = ops.v[pl.ds(j * ks, ks)]
    if plan.mix_values_late:  # (probs @ av) @ v: no [k_rows, width] temporary
      values = dot(dot(probs, ops.av[g + y], TN).astype(dtype), v, NN)
    else:
      values = dot(probs, dot(ops.av[g + y], v, NN).astype(dtype), TN)
    return m_next, l, rescale[:, None] * acc + values

  m, l, acc = lax.fori_loop(lo, hi, forward, softmax_init(rq, plan.width))
  o, l = softmax_output(acc, l)  # no key seen: O = 0
  o = o.astype(dtype)
  ops.lse[h, stat] = m + jnp.log(l)
  # delta = rowsum(dO * O) with dO = cm^T dy: the column sums of cm * (dy O^T), in
  # chunks of output rows (dO never made; tall products). Where the output rows are no
  # more than the pseudo rows (P = H = 20), 32 at a time (64 spilled; with more output
  # rows, 64 keeps wgmma), as compiled for H100.
  chunk = min(32 if few_outputs else COLLAPSE_ROWS, plan.out_rows)
  delta = jnp.zeros((rq,), jnp.float32)
  for c in range(plan.out_rows // chunk):
    dy = ops.dy[pl.ds(t * plan.out_rows + c * chunk, chunk), :]
    cm = ops.cm[h + z, pl.ds(c * chunk, chunk), :].astype(jnp.float32)
    delta += jnp.sum(cm * dot(dy, o, NT), axis=0)
  ops.delta[h, stat] = delta
  # dcm[h] += dy O^T folded to the collapse's shape, per token
  periods = (plan.out_heads, plan.num_pseudo)
  sizes = (block_pow2(plan.out_heads), block_pow2(plan.num_pseudo))
  args = (t * plan.out_rows, plan.out_rows, plan.q_tokens, periods, sizes)
  d_cm = folded_weights_grad([ops.dy], [o], *args, refs_first=True)
  add_in_place(side.part, h, d_cm, side.interpret)
  return carry


def _dq_tile(side: _QuerySide, h, g, t, carry):
  """dQ of query tile t, head h: the band again with lse and delta, `dQ = sum dS K`,
  `R(p)^T`, un-mixed to the source rows dq1, dq2, and the query mixing's partial `dQ
  q^T` folded to `[P', H']`."""
  plan, ops = side.plan, side.ops
  dtype, rq, qs, ks = ops.q1.dtype, plan.q_rows, plan.q_src, plan.k_src
  # Where a tile's output rows are no more than its pseudo rows (P = H = 20): the loop
  # never makes dO (`cm^T ((dy v^T) av^T)` per step; dO beside dQ's accumulators spilled
  # on H100).
  few_outputs = plan.out_rows <= plan.q_rows
  dy_late = few_outputs and plan.mix_values_late
  key_chunk = DQ_KEY_MIX_ROWS if ks > MIX_ROWS else MIX_ROWS
  i, z, qx1, qx2, qid, tq, lo, hi = _tile_queries(side, h, t)
  d_o = None
  if not dy_late:
    # In 32-row chunks: fewer registers beside the loop's operands (H100, P = 4).
    d_o = output_grad(plan, ops.cm, ops.dy, h + z, t * plan.out_rows, dtype, chunk=32)
  stat = pl.ds(t * rq, rq)
  lse, delta = ops.lse[h, stat], ops.delta[h, stat]
  # Transposed, `[k_rows, q_rows]`: the tile's pseudo queries, dO (or dy and cm) are
  # the products' second operands, which stay in shared memory across the loop.
  if dy_late:
    dy = ops.dy[pl.ds(t * plan.out_rows, plan.out_rows), :]
    cm = ops.cm[h + z]

  def backward(j, carry):
    dq1, dq2 = carry
    kx1, kx2, ok, s, y = _key_scores(side, g, tq, qid, qx1, qx2, key_chunk, j)
    probs = probabilities(s, ok, lse, transposed=True)
    v = ops.v[pl.ds(j * ks, ks)]
    if dy_late:
      mixed = dot(dot(v, dy, NT).astype(dtype), cm, NN).astype(dtype)
      d_probs = dot(ops.av[g + y], mixed, NN)
    elif plan.mix_values_late:
      d_probs = dot(ops.av[g + y], dot(v, d_o, NT).astype(dtype), NN)
    else:
      d_probs = dot(dot(ops.av[g + y], v, NN).astype(dtype), d_o, NT)
    ds = (probs * (d_probs - delta[None, :])).astype(dtype)
    return dq1 + dot(ds, kx1, TN), dq2 + dot(ds, kx2, TN)

  zeros = jnp.zeros((rq, plan.half), jnp.float32)
  dq1, dq2 = lax.fori_loop(lo, hi, backward, (zeros, zeros))
  grads = [x.astype(dtype) for x in unrotate(dq1, dq2, ops.rope_q, z)]
  periods = (plan.num_pseudo, plan.heads)
  sizes = (block_pow2(plan.num_pseudo), block_pow2(plan.heads))
  args = (t * qs, qs, plan.q_tokens, periods, sizes)
  fold = lambda: folded_weights_grad(grads, (ops.q1, ops.q2), *args)
  partial = lambda: add_in_place(side.part, h, fold(), side.interpret)
  # The weights' partial first where the output rows are many (P = 4), after the
  # un-mixing where they are few (P = H = 20): either order spilled on H100 in the other.
  if not few_outputs:
    partial()
  unmix(ops.aq, h + z, grads, side.dq, t * qs, side.interpret)
  if few_outputs:
    partial()
  return carry


def dkv_kernel(*refs, plan: Plan, span: int, interpret: bool):
  ops, (dk1_ref, dk2_ref, dv_ref, dak_ref, dav_ref) = _operands(refs, plan, stats=False)
  program = pl.program_id(0)
  dtype = ops.q1.dtype
  rq, rk, ks = plan.q_rows, plan.k_rows, plan.k_src
  p, kv_heads = plan.num_pseudo, plan.kv_heads
  r = plan.targets // plan.kv_targets
  p_pad, g_pad = block_pow2(p), block_pow2(kv_heads)
  sub_rows = min(DKV_QUERY_ROWS, rq)
  subs = rq // sub_rows

  def zero(t, carry):
    rows = pl.ds(t * ks, ks)
    dk1_ref[rows, :] = jnp.zeros((ks, plan.half), jnp.float32)
    dk2_ref[rows, :] = jnp.zeros((ks, plan.half), jnp.float32)
    dv_ref[rows, :] = jnp.zeros((ks, plan.width), jnp.float32)
    return carry

  lax.fori_loop(0, span, zero, 0)

  def kv_head(g, carry):
    dak_ref[g] = jnp.zeros((p_pad, g_pad), jnp.float32)
    dav_ref[g] = jnp.zeros((p_pad, g_pad), jnp.float32)

    def group(t, carry):
      j = program * span + t
      z = varying_zero(t)  # the group's constants loaded in the group loop, not held across it
      kx = pseudo_rows_in_chunks(ops.ak, g, (ops.k1, ops.k2), t * ks, ops.rope_k, dtype, z)
      (vx,) = pseudo_rows_in_chunks(ops.av, g, (ops.v,), t * ks, None, dtype, z)
      kid = ops.kid[pl.ds(t * rk, rk)]
      u = virtual_rows(plan, rk, j * plan.k_tokens)
      lo, hi = query_tiles(plan, j)
      tiles = hi - lo

      def step(n, carry):  # (query head of the group, query tile, sub-tile)
        n, sub = lax.div(n, subs), lax.rem(n, subs)
        h, i = g * r + lax.div(n, tiles), lo + lax.rem(n, tiles)
        return _dkv_step(plan, ops, kx, vx, u, kid, h, i, sub * sub_rows, sub_rows, carry)

      zeros = jnp.zeros((rk, plan.half), jnp.float32)
      init = (zeros, zeros, jnp.zeros((plan.width, rk), jnp.float32))
      dk1, dk2, dv = lax.fori_loop(0, r * tiles * subs, step, init)
      dv = dv.T
      grads = [x.astype(dtype) for x in unrotate(dk1, dk2, ops.rope_k, z)]
      dv = dv.astype(dtype)
      row0 = t * ks
      unmix(ops.ak, g + z, grads, (dk1_ref, dk2_ref), row0, interpret)
      unmix(ops.av, g + z, [dv], (dv_ref,), row0, interpret)
      periods, sizes = (p, kv_heads), (p_pad, g_pad)
      fold = lambda x, refs: folded_weights_grad(x, refs, row0, ks, plan.k_tokens, periods, sizes)
      add_in_place(dak_ref, g, fold(grads, (ops.k1, ops.k2)), interpret)
      add_in_place(dav_ref, g, fold([dv], [ops.v]), interpret)
      return carry

    lax.fori_loop(0, span, group, 0)
    return carry

  lax.fori_loop(0, plan.kv_targets, kv_head, 0)


def _dkv_step(plan: Plan, ops: _Operands, kx, vx, u, kid, h, i, row0, rows, carry):
  """One step of the dK/dV loop: query rows `[row0, row0 + rows)` of tile i, head h
  (pseudo queries and dO remade), against the key group's pseudo rows."""
  dk1, dk2, dv = carry
  dtype = vx.dtype
  q_rows = (ops.q1, ops.q2)
  qx1, qx2 = pseudo_rows_in_chunks(ops.aq, h, q_rows, i * plan.q_src, ops.rope_q, dtype, row0, rows)
  # dO^T `[width, rows]`: both its products take it as the second operand (and its own
  # product is tall: tensor cores' wgmma where the key group's rows are few).
  d_o = output_grad(plan, ops.cm, ops.dy, h, i * plan.out_rows, dtype, row0, rows, t=True)
  at = pl.ds(i * plan.q_rows + row0, rows)
  lse, delta = ops.lse[h, at], ops.delta[h, at]
  tq = virtual_rows(plan, rows, plan.offset + i * plan.q_tokens, row0)
  ok = visible(plan, tq, u, ops.qid[at], lambda: kid, transposed=True)
  s = dot(kx[0], qx1, NT) + dot(kx[1], qx2, NT)
  probs = probabilities(s, ok, lse, transposed=True)
  dv += dot(d_o, probs.astype(dtype), NT)  # dV^T `[width, k_rows]`: a tall product
  ds = (probs * (dot(vx, d_o, NN) - delta[None, :])).astype(dtype)
  return dk1 + dot(ds, qx1, NN), dk2 + dot(ds, qx2, NN), dv
