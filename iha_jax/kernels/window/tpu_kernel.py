"""The kernel bodies of IHA's on-chip TPU window path: what one grid step does in VMEM,
forward and backward; their layouts and calls are `window.tpu`'s, the tiling
`window.tpu_plan`'s.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from iha_jax.core.masking import MASK_VALUE
from iha_jax.kernels.tpu import NN, NT, TN, dot, rotate
from iha_jax.kernels.window.tpu_plan import Plan

BLOCK_UNROLL = 4
MIX_UNROLL = 8

# Additive masks: two of them still sum to a finite score (a row of padding stays finite).
HALF_MASK = MASK_VALUE / 2


def _rotate(x: jax.Array, table: jax.Array, inverse: bool = False) -> jax.Array:
  """Rotate-half RoPE of float32 rows `x [r, d]` by a `cos | sin` table `[r, 2d]`."""
  d = x.shape[1]
  return rotate(x, table[:, :d], table[:, d:], inverse)


def _unroll(count: int, most: int) -> int:
  """The largest unroll factor up to `most` that divides `count` (independent products
  in flight hide the MXU's and the reductions' latency)."""
  return next(u for u in range(min(most, count), 0, -1) if count % u == 0)


def _mix(
  plan: Plan, src_ref, src_heads: int, tokens: int, matrix, dst_ref, dst_row: int, table, s: int
):
  """Pseudo rows of `tokens` source tokens for a stack of target heads: `dst[i, dst_row +
  (n, p)] = R(p) sum_m matrix[(i, n, p), (n, m)] src[(n, m)]`, one MXU product per group
  of `s` tokens (its rows: the stacked heads' blocks, one after another)."""
  rows = s * plan.num_pseudo
  stack = matrix.shape[0] // rows
  table = None if table is None else table[: stack * rows]
  width = s * src_heads
  groups = tokens // s

  def body(i, carry):
    src = src_ref[pl.ds(pl.multiple_of(i * width, plan.align), width), :]
    out = dot(matrix, src, NN, plan.exact)
    if table is not None:
      out = _rotate(out, table)
    out = out.astype(dst_ref.dtype)
    dst = pl.ds(pl.multiple_of(dst_row + i * rows, plan.align), rows)
    for j in range(stack):
      dst_ref[j, dst, :] = out[j * rows : (j + 1) * rows]
    return carry

  lax.fori_loop(0, groups, body, 0, unroll=_unroll(groups, MIX_UNROLL))


def _mix_band(plan: Plan, refs, matrix, dst_ref, table):
  """The band's pseudo rows: halo blocks before, the tile's own, halo blocks after."""
  sizes = [plan.halo] * plan.halo_before + [plan.tile] + [plan.halo] * plan.halo_after
  row = 0
  for ref, tokens in zip(refs, sizes):
    _mix(plan, ref, plan.kv_heads, tokens, matrix, dst_ref, row, table, plan.kv_group)
    row += tokens * plan.num_pseudo


def _heads(plan: Plan, mix_kv, mix_q, head):
  """Loop over the target heads as the stacked mixing products take them: per chunk `c`
  of `kv_stack` key/value heads `mix_kv(c)`; per chunk of `q_stack` of their query heads
  `mix_q(stacked)` (the chunk's index into the stacked matrices); `head(h, qi, slot)` per
  query head `h`, `qi` its place in its query stack, `slot` its key/value head's in the
  key/value stack (the heads in order)."""
  r = plan.targets // plan.kv_targets
  jq, jk = plan.q_stack, plan.kv_stack
  chunks = jk * r // jq  # query chunks per key/value chunk

  def kv_body(c, carry):
    mix_kv(c)

    def q_body(qc, carry):
      mix_q(c * chunks + qc)

      def head_body(qi, carry):
        head(c * jk * r + qc * jq + qi, qi, lax.div(qc * jq + qi, r))
        return carry

      return lax.fori_loop(0, jq, head_body, carry)

    return lax.fori_loop(0, chunks, q_body, carry)

  lax.fori_loop(0, plan.kv_targets // jk, kv_body, 0)


def _scores(plan: Plan, q, k, bias_ref, kid_ref, qid_ref, block, t0):
  """Masked scores `[cq, kb]` float32 of one block, in log2 units (the queries carry
  log2(e): `unnormalised_softmax` takes powers of two). Without segments the masks are
  additive (the band's bias and the keys' validity row: no compare per score)."""
  s = dot(q, k, NT, plan.exact) + bias_ref[...]
  key_ids = kid_ref[pl.ds(block, 1), :]  # [1, kb]
  if plan.segments:
    ok = qid_ref[pl.ds(t0, plan.block_rows), :] == key_ids
    return jnp.where(ok, s, MASK_VALUE)
  return s + jnp.where(key_ids > 0, 0.0, HALF_MASK)


def unnormalised_softmax(s):
  """(unnormalised probabilities, their row sums) of log2-unit scores."""
  m = jnp.max(s, axis=1, keepdims=True)
  p = jnp.exp2(s - m)
  return p, jnp.sum(p, axis=1, keepdims=True)


def reciprocal(x):
  """1 / x of row sums `[cq, 1]` (>= 1: each row's largest term is 1): the approximate
  reciprocal and two Newton steps, float32-accurate from an estimate of 8 good bits (an
  exact division expands to a dozen vector operations per vreg, for cases that never
  arise here)."""
  r = pl.reciprocal(x, approx=True)
  r = r * (2.0 - x * r)
  return r * (2.0 - x * r)


def _split_inputs(plan: Plan, refs):
  """(q, k band refs, v band refs, rest) of the kernels' leading inputs."""
  band = plan.halo_before + 1 + plan.halo_after
  q_ref, refs = refs[0], refs[1:]
  k_refs, v_refs, refs = refs[:band], refs[band : 2 * band], refs[2 * band :]
  return q_ref, k_refs, v_refs, refs


def forward_kernel(*refs, plan: Plan):
  q_ref, k_refs, v_refs, refs = _split_inputs(plan, refs)
  aq_ref, ak_ref, av_ref, cm_ref, bias_ref, kid_ref, *refs = refs
  table_ref = refs.pop(0) if plan.rotary else None
  qid_ref = refs.pop(0) if plan.segments else None
  y_ref, qx, kx, vx, ox = refs
  cq = plan.block_rows
  y_ref[...] = jnp.zeros(y_ref.shape, y_ref.dtype)
  table = None if table_ref is None else table_ref[...]

  def mix_kv(c):
    _mix_band(plan, k_refs, ak_ref[c], kx, table)
    _mix_band(plan, v_refs, av_ref[c], vx, None)

  def mix_q(stacked):
    _mix(plan, q_ref, plan.heads, plan.tile, aq_ref[stacked], qx, 0, table, plan.group)

  def head(h, qi, slot):
    def block(qb, carry):
      t0 = pl.multiple_of(qb * cq, plan.align)
      k0 = pl.multiple_of(t0 + plan.base, plan.align)
      s = _scores(
        plan,
        qx[qi, pl.ds(t0, cq), :],
        kx[slot, pl.ds(k0, plan.key_rows), :],
        bias_ref,
        kid_ref,
        qid_ref,
        qb,
        t0,
      )
      probs, total = unnormalised_softmax(s)
      o = dot(probs.astype(vx.dtype), vx[slot, pl.ds(k0, plan.key_rows), :], NN, plan.exact)
      ox[pl.ds(t0, cq), :] = (o * reciprocal(total)).astype(ox.dtype)
      return carry

    lax.fori_loop(0, plan.blocks, block, 0, unroll=_unroll(plan.blocks, BLOCK_UNROLL))
    _collapse(plan, cm_ref[h], ox, y_ref)

  _heads(plan, mix_kv, mix_q, head)


def _collapse(plan: Plan, matrix, o_ref, y_ref):
  """`y[(n, ho)] += sum_p matrix[(n, ho), (n, p)] o[(n, p)]` over the tile's token groups
  (one target head's share of the collapse)."""
  rows, out_rows = plan.rows_per_group, plan.group * plan.out_heads
  groups = plan.tile // plan.group

  def body(i, carry):
    o = o_ref[pl.ds(pl.multiple_of(i * rows, plan.align), rows), :]
    y_rows = pl.ds(pl.multiple_of(i * out_rows, 8), out_rows)
    y_ref[y_rows, :] += dot(matrix, o, NN, plan.exact)
    return carry

  lax.fori_loop(0, groups, body, 0, unroll=_unroll(groups, MIX_UNROLL))


def backward_kernel(*refs, plan: Plan):
  q_ref, k_refs, v_refs, refs = _split_inputs(plan, refs)
  dy_ref, aq_ref, ak_ref, av_ref, cm_ref, bias_ref, kid_ref, *refs = refs
  aqt_ref, akt_ref, avt_ref, cmt_ref, *refs = refs
  table_ref = refs.pop(0) if plan.rotary else None
  qid_ref = refs.pop(0) if plan.segments else None
  dq_ref, dk_refs, dv_refs, refs = refs[0], refs[1:4], refs[4:7], refs[7:]
  daq_ref, dak_ref, dav_ref, dcm_ref, qx, dox, dqx, ox, kx, vx, dkx, dvx = refs
  cq, kb = plan.block_rows, plan.key_rows
  for ref in (dq_ref, *dk_refs, *dv_refs, daq_ref, dak_ref, dav_ref, dcm_ref):
    ref[...] = jnp.zeros(ref.shape, ref.dtype)
  table = None if table_ref is None else table_ref[...]
  dtype = qx.dtype

  def mix_kv(c):
    _mix_band(plan, k_refs, ak_ref[c], kx, table)
    _mix_band(plan, v_refs, av_ref[c], vx, None)

  def mix_q(stacked):
    _mix(plan, q_ref, plan.heads, plan.tile, aq_ref[stacked], qx, 0, table, plan.group)
    _mix(plan, dy_ref, plan.out_heads, plan.tile, cmt_ref[stacked], dox, 0, None, plan.group)

  def head(h, qi, slot):
    def block(qb, carry):
      t0 = pl.multiple_of(qb * cq, plan.align)
      k0 = pl.multiple_of(t0 + plan.base, plan.align)
      q, do = qx[qi, pl.ds(t0, cq), :], dox[qi, pl.ds(t0, cq), :]
      k, v = kx[slot, pl.ds(k0, kb), :], vx[slot, pl.ds(k0, kb), :]
      probs, total = unnormalised_softmax(_scores(plan, q, k, bias_ref, kid_ref, qid_ref, qb, t0))
      # The probabilities stay unnormalised: 1 / total scales the [cq, d] rows of o and
      # do and the dS factor instead of the [cq, kb] tile (fewer vector operations).
      scale = reciprocal(total)
      unnormalised = probs.astype(dtype)
      o = (dot(unnormalised, v, NN, plan.exact) * scale).astype(dtype)
      ox[pl.ds(t0, cq), :] = o
      dp = dot(do, v, NT, plan.exact)
      delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=1, keepdims=True)
      # The scores' gradient, times ln 2: the queries carry log2(e) (`prepare`).
      ds = (probs * ((dp - delta) * (scale * math.log(2)))).astype(dtype)
      scaled_do = (do.astype(jnp.float32) * scale).astype(dtype)
      _add_keys(plan, dvx, k0, dot(unnormalised, scaled_do, TN, plan.exact))
      _add_keys(plan, dkx, k0, dot(ds, q, TN, plan.exact))
      dqx[pl.ds(t0, cq), :] = dot(ds, k, NN, plan.exact)
      return carry

    if _one_query_head(plan) and kb > cq:
      # Block 0 adds to its window's first kb - cq rows; every other row of the head's
      # windows is written by a block before any block adds to it (`_add_keys`).
      for ref in (dkx, dvx):
        ref[pl.ds(plan.base, plan.key_rows - cq), :] = jnp.zeros(
          (plan.key_rows - cq, ref.shape[1]), ref.dtype
        )
    lax.fori_loop(0, plan.blocks, block, 0, unroll=_unroll(plan.blocks, BLOCK_UNROLL))
    _collapse_grad(plan, dy_ref, ox, dcm_ref, h)
    _unmix(plan, dqx, 0, plan.tile, aqt_ref[h], q_ref, (dq_ref, 0), (daq_ref, h), table, False)
    # A key/value head's query heads run one after another: after its last one, its
    # gradients are complete (one dk/dv scratch serves every head).
    r = plan.targets // plan.kv_targets
    last = lax.rem(h, r) == r - 1

    @pl.when(last)
    def _():
      g = lax.div(h, r)
      _unmix_band(plan, dkx, akt_ref[g], k_refs, dk_refs, dak_ref, g, table)
      _unmix_band(plan, dvx, avt_ref[g], v_refs, dv_refs, dav_ref, g, None)
      if not _one_query_head(plan):
        dkx[...] = jnp.zeros(dkx.shape, dkx.dtype)
        dvx[...] = jnp.zeros(dvx.shape, dvx.dtype)

  dkx[...] = jnp.zeros(dkx.shape, dkx.dtype)
  dvx[...] = jnp.zeros(dvx.shape, dvx.dtype)
  _heads(plan, mix_kv, mix_q, head)


def _one_query_head(plan: Plan) -> bool:
  """Whether each key/value head has one query head (H = G): its key gradients then come
  from that head's blocks alone, in order."""
  return plan.targets == plan.kv_targets


def _add_keys(plan: Plan, ref, k0, grad):
  """`ref[k0 : k0 + kb] += grad` (`[kb, d]` float32, a block's key-side gradient). With
  one query head per key/value head, the window's last cq rows are rows no earlier block
  saw (blocks run in order, a stride of cq apart): those are written, not added, so the
  head needs no zeroed scratch (only block 0's first kb - cq rows, zeroed before it)."""
  kb, cq = plan.key_rows, plan.block_rows
  if not _one_query_head(plan):
    ref[pl.ds(k0, kb), :] += grad
    return
  shared = kb - cq
  if shared:
    ref[pl.ds(k0, shared), :] += grad[:shared]
  ref[pl.ds(pl.multiple_of(k0 + shared, 8), cq), :] = grad[shared:]


def _collapse_grad(plan: Plan, dy_ref, o_ref, dcm_ref, h):
  """`dcm[h] += dy[(n, ho)] o[(n, p)]^T` over the tile's token groups."""
  rows, out_rows = plan.rows_per_group, plan.group * plan.out_heads
  groups = plan.tile // plan.group

  def body(i, acc):
    o = o_ref[pl.ds(pl.multiple_of(i * rows, plan.align), rows), :]
    dy = dy_ref[pl.ds(pl.multiple_of(i * out_rows, plan.align), out_rows), :]
    return acc + dot(dy, o, NT, plan.exact)

  zero = jnp.zeros((out_rows, rows), jnp.float32)
  dcm_ref[h] += lax.fori_loop(0, groups, body, zero, unroll=_unroll(groups, MIX_UNROLL))


def _unmix(plan: Plan, grad_ref, row0, tokens, transposed, src_ref, dst, dmat, table, kv: bool):
  """The gradient of `_mix` (groups of the query or, `kv`, key/value side's tokens):
  pseudo-row gradients `grad[row0 + (n, p)]` (float32, of the rotated rows) -> source rows
  `dst_ref[dst_row0 + (n, m)] += transposed[(n, m), (n, p)] g[(n, p)]`, and the matrix's
  `dmat_ref[index] += g[(n, p)] src[(n, m)]^T`, with `g = R(p)^T grad`; `dst`: (dst_ref,
  dst_row0), `dmat`: (dmat_ref, index)."""
  (dst_ref, dst_row0), (dmat_ref, index) = dst, dmat
  heads, s = (plan.kv_heads, plan.kv_group) if kv else (plan.heads, plan.group)
  rows = s * plan.num_pseudo
  table = None if table is None else table[:rows]
  width = s * heads
  groups = tokens // s

  def body(i, acc):
    grad = grad_ref[pl.ds(pl.multiple_of(row0 + i * rows, plan.align), rows), :]
    if table is not None:
      grad = _rotate(grad, table, inverse=True)
    grad = grad.astype(src_ref.dtype)
    src_rows = pl.ds(pl.multiple_of(i * width, plan.align), width)
    dst_rows = pl.ds(pl.multiple_of(dst_row0 + i * width, 8), width)
    dst_ref[dst_rows, :] += dot(transposed, grad, NN, plan.exact)
    return acc + dot(grad, src_ref[src_rows, :], NT, plan.exact)

  zero = jnp.zeros((rows, width), jnp.float32)
  dmat_ref[index] += lax.fori_loop(0, groups, body, zero, unroll=_unroll(groups, MIX_UNROLL))


def _unmix_band(plan: Plan, grad_ref, transposed, src_refs, dst_refs, dmat_ref, index, table):
  """`_unmix` over the band: halo blocks before (into `dst_refs[0]`, stacked), the tile's
  own keys (`dst_refs[1]`), halo blocks after (`dst_refs[2]`)."""
  p, g = plan.num_pseudo, plan.kv_heads
  row = 0
  regions = [(0, j) for j in range(plan.halo_before)] + [(1, 0)]
  regions += [(2, j) for j in range(plan.halo_after)]
  for src_ref, (region, j) in zip(src_refs, regions):
    tokens = plan.tile if region == 1 else plan.halo
    dst = (dst_refs[region], j * plan.halo * g)
    _unmix(plan, grad_ref, row, tokens, transposed, src_ref, dst, (dmat_ref, index), table, True)
    row += tokens * p
