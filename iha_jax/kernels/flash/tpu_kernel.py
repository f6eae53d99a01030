"""The TPU flash kernels' bodies (Pallas Mosaic): what one grid step does in VMEM; their
calls are `flash.tpu`'s, the tile schedule `flash.plan`'s.

Each kernel body is four `pl.when`s, in this order: initialise, attend an entirely
visible pair (no mask work), attend a partly visible pair (masked), finalise;
`iha_jax.estimate.tpu` weights them by the steps that run them. A causal window's dK/dV
kernel also carries dQ (`ring` > 0: its key rows run in order, "arbitrary"; two more
`pl.when`s clear the ring and write a query tile). With RoPE tables (`Call.rotary`), each
q tile is rotated once into VMEM scratch, each k tile per step, and the float32 dq / dk
accumulators are rotated back (the transpose) before they are written.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from iha_jax.core.masking import MASK_VALUE
from iha_jax.kernels.flash.plan import Call
from iha_jax.kernels.tpu import (
  LANES,
  NN,
  NT,
  PACKED_SUBLANES,
  TN,
  dot,
  rotate,
  scalar_div,
  scalar_rem,
)

_ALL = slice(None)


def _broadcast_lanes(x: jax.Array, width: int) -> jax.Array:
  """`[rows, 128]` lane-replicated (or `[rows, 1]`) -> `[rows, width]`."""
  if x.shape[1] == LANES and width % LANES == 0:
    return jnp.tile(x, (1, width // LANES))
  return jnp.broadcast_to(x[:, :1], (x.shape[0], width))


def _cos_sin(table, rows: slice = _ALL) -> tuple[jax.Array, jax.Array]:
  """A RoPE table block `[rows, 2d]` (`cos | sin`; a ref, read at `rows`) -> (cos, sin)
  `[rows, d]` float32."""
  t = table[rows, :].astype(jnp.float32)
  d = t.shape[1] // 2
  return t[:, :d], t[:, d:]


def _rotated(ref, table, rows: slice = _ALL) -> jax.Array:
  """Rows of a q or k tile (a ref) rotated by their RoPE `table` (a ref, `[rows, 2d]`),
  in the tile's dtype (the MXU's input); the rows themselves without a table (None)."""
  x = ref[rows, :]
  if table is None:
    return x
  return rotate(x.astype(jnp.float32), *_cos_sin(table, rows)).astype(x.dtype)


def _visible(call: Call, t_first, s_first, shape, transposed: bool, seg_q=None, seg_k=None):
  """The mask of a block of one tile pair, `shape` `[queries, keys]` (`[keys, queries]`
  if `transposed`), its first query at row `t_first` of the key axis and its first key at
  `s_first`."""
  tiles = call.tiles
  row_axis, col_axis = (1, 0) if transposed else (0, 1)
  t = t_first + lax.broadcasted_iota(jnp.int32, shape, row_axis)
  s = s_first + lax.broadcasted_iota(jnp.int32, shape, col_axis)
  ok = tiles.visible(t, s)
  if call.segments:
    ok &= seg_q == seg_k
  return ok


def _row(column: jax.Array) -> jax.Array:
  """A lane-replicated column `[rows, 128]` -> the row `[1, rows]` (an XLU transpose)."""
  return jnp.transpose(column)[:1]


def _columns(*rows: jax.Array) -> tuple[jax.Array, ...]:
  """Rows `[1, n]` -> columns `[n, 1]`, by one transpose of whole 128-row blocks (the
  XLU's unit), cheaper than a transpose of 8 sublanes per row."""
  share = LANES // len(rows)
  stacked = jnp.concatenate([jnp.broadcast_to(r, (share, r.shape[1])) for r in rows], axis=0)
  t = jnp.transpose(stacked)
  return tuple(t[:, i * share : i * share + 1] for i in range(len(rows)))


def _refs(call: Call, refs, grads: int):
  """A kernel's refs: (query offset, q, k, v, RoPE tables (queries', keys'), the `grads`
  refs (do, lse, delta), segment ids (queries', keys'), the rest: outputs and scratch);
  tables and ids None where the call has none."""
  offset, refs = call.offset_and_refs(refs)
  tables, refs = (refs[3:5], refs[:3] + refs[5:]) if call.rotary else ((None, None), refs)
  front, refs = refs[: 3 + grads], refs[3 + grads :]
  segments, refs = (refs[:2], refs[2:]) if call.segments else ((None, None), refs)
  return offset, *front[:3], *tables, *front[3:], *segments, refs


def forward_kernel(*refs, call: Call, with_lse: bool = True):
  offset, q_ref, k_ref, v_ref, q_rope, k_rope, seg_q_ref, seg_k_ref, refs = _refs(call, refs, 0)
  exact = q_ref.dtype == jnp.float32  # float32 inputs: true float32 products
  if with_lse:
    o_ref, lse_ref, m_sc, l_sc, acc_sc, *q_sc = refs
  else:
    o_ref, m_sc, l_sc, acc_sc, *q_sc = refs
  step = call.tiles.query_step(pl.program_id(1), pl.program_id(2), offset)

  @pl.when(step.first)
  def _():
    m_sc[...] = jnp.full(m_sc.shape, MASK_VALUE, jnp.float32)
    l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
    acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)
    if q_rope is not None:  # the query tile rotated once, for all its steps
      q_sc[0][...] = _rotated(q_ref, q_rope)

  def attend(blocks, masked: bool):  # (query rows, key rows) blocks of the pair
    for rows, cols in blocks:
      q, k = (q_sc[0] if q_sc else q_ref)[rows, :], _rotated(k_ref, k_rope, cols)
      s = dot(q, k, NT, exact)
      if masked:
        segs = (seg_q_ref[rows, :], seg_k_ref[:, cols]) if call.segments else ()
        t_first, s_first = _firsts(call, step.home, step.tile, offset, rows, cols)
        s = jnp.where(_visible(call, t_first, s_first, s.shape, False, *segs), s, MASK_VALUE)
      m_prev = m_sc[rows, :]
      m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
      p = jnp.exp(s - _broadcast_lanes(m_next, s.shape[1]))
      rescale = jnp.exp(m_prev - m_next)
      l_sc[rows, :] = rescale * l_sc[rows, :] + jnp.sum(p, axis=1, keepdims=True)
      m_sc[rows, :] = m_next
      v = v_ref[cols, :]
      pv = dot(p.astype(v.dtype), v, NN, exact)
      acc_sc[rows, :] = _broadcast_lanes(rescale, pv.shape[1]) * acc_sc[rows, :] + pv

  _attend_pairs(step, call, attend, offset, split=False)

  @pl.when(step.last)
  def _():
    l = l_sc[...]
    out = acc_sc[...] / _broadcast_lanes(l, acc_sc.shape[1])
    if call.segments:  # padding queries (segment 0) output zeros
      keep = seg_q_ref[...] != 0
      out = jnp.where(keep, out, 0.0)
    o_ref[...] = out.astype(o_ref.dtype)
    if with_lse:
      lse_ref[...] = _row(m_sc[...] + jnp.log(l))


def _attend_pairs(
  step, call: Call, attend, offset, transposed: bool = False, split: bool = True
) -> None:
  """Runs `attend(blocks, masked)` (`blocks`: (rows, columns) pairs of static slices of
  the home tile's rows and of the other tile's) on the steps that attend a pair: whole
  and without mask work where the pair is entirely visible, else masked, in halves
  (`_masked_blocks`) if `split`. Packed segments need the mask on every pair. The
  forward does not split: its masked steps cost the same either way by v5p estimate,
  the backward's fewer (docs/performance.md §14)."""
  masked = functools.partial(_masked_blocks, step, call, attend, offset, transposed)
  if not split:
    masked = lambda: attend([(_ALL, _ALL)], True)
  if call.segments:
    pl.when(step.compute)(masked)
    return
  pl.when(step.compute & ~step.masked)(lambda: attend([(_ALL, _ALL)], False))
  pl.when(step.compute & step.masked)(masked)


# Block patterns of a partly visible pair with code of their own: per half of the home
# tile's rows, the run of the other tile's halves it sees any of, `[first, stop)`. They
# are the causal diagonal and the window's edge, in either orientation (query-major
# forward and dQ, key-major dK/dV).
_PATTERNS = (((0, 1), (0, 2)), ((0, 2), (1, 2)))


def _masked_blocks(step, call: Call, attend, offset, transposed: bool) -> None:
  """A partly visible pair, skipping the quarter a causal diagonal or a window's edge
  hides (`_PATTERNS`): each half of the home tile's rows attends only the halves of the
  other tile it sees, in one straight-line body per pattern (a branch per half left each
  half's MXU latency exposed and cost more than it saved). Any other pattern, or halves
  that would not be whole vregs (rows: 16 sublanes of bf16; columns: 128 lanes), is
  attended whole."""
  tiles = call.tiles
  rows, cols = (tiles.block_k, tiles.block_q) if transposed else (tiles.block_q, tiles.block_k)
  if rows % (2 * PACKED_SUBLANES) or cols % (2 * LANES):
    attend([(_ALL, _ALL)], True)
    return
  half_r, half_c = rows // 2, cols // 2
  q_tile, k_tile = (step.tile, step.home) if transposed else (step.home, step.tile)
  t_first, s_first = _firsts(call, q_tile, k_tile, offset, _ALL, _ALL)

  def seen(r: int, c: int):  # whether half r of the rows sees any of half c of the columns
    if transposed:  # rows: keys; columns: queries
      t0, s0, t_rows, s_rows = t_first + c * half_c, s_first + r * half_r, half_c, half_r
    else:
      t0, s0, t_rows, s_rows = t_first + r * half_r, s_first + c * half_c, half_r, half_c
    return tiles.any_visible(t0, t0 + t_rows - 1, s0, s0 + s_rows - 1)

  halves = [[seen(r, c) for c in range(2)] for r in range(2)]

  def blocks(pattern) -> None:
    rows = [slice(r * half_r, (r + 1) * half_r) for r in range(2)]
    attend([(rows[r], slice(a * half_c, b * half_c)) for r, (a, b) in enumerate(pattern)], True)

  matched = False
  for pattern in _PATTERNS:
    fits = True
    for r, (first, stop) in enumerate(pattern):
      for c in range(2):
        fits &= halves[r][c] if first <= c < stop else ~halves[r][c]
    pl.when(fits)(functools.partial(blocks, pattern))
    matched |= fits
  pl.when(~matched)(lambda: attend([(_ALL, _ALL)], True))


def _firsts(call: Call, q_tile, k_tile, offset, q_rows: slice, k_rows: slice):
  """(first query row on the key axis, first key row) of a block of a tile pair."""
  tiles = call.tiles
  t_first = q_tile * tiles.block_q + offset + (q_rows.start or 0)
  return t_first, k_tile * tiles.block_k + (k_rows.start or 0)


def dq_kernel(*refs, call: Call):
  offset, q_ref, k_ref, v_ref, q_rope, k_rope, *refs = _refs(call, refs, 3)
  do_ref, lse_ref, delta_ref, seg_q_ref, seg_k_ref, refs = refs
  exact = q_ref.dtype == jnp.float32
  dq_ref, dq_sc, lse_sc, delta_sc, *q_sc = refs
  step = call.tiles.query_step(pl.program_id(1), pl.program_id(2), offset)

  @pl.when(step.first)
  def _():
    dq_sc[...] = jnp.zeros(dq_sc.shape, jnp.float32)
    # the tile's rows as columns, once
    lse_sc[...], delta_sc[...] = _columns(lse_ref[...], delta_ref[...])
    if q_rope is not None:
      q_sc[0][...] = _rotated(q_ref, q_rope)

  def attend(blocks, masked: bool):  # (query rows, key rows) blocks of the pair
    for rows, cols in blocks:
      q = (q_sc[0] if q_sc else q_ref)[rows, :]
      k, v = _rotated(k_ref, k_rope, cols), v_ref[cols, :]
      s = dot(q, k, NT, exact)
      p = jnp.exp(s - lse_sc[rows, :])
      if masked:
        segs = (seg_q_ref[rows, :], seg_k_ref[:, cols]) if call.segments else ()
        t_first, s_first = _firsts(call, step.home, step.tile, offset, rows, cols)
        p = jnp.where(_visible(call, t_first, s_first, s.shape, False, *segs), p, 0.0)
      do = do_ref[rows, :]
      dp = dot(do, v, NT, exact)
      ds = p * (dp - delta_sc[rows, :])
      dq_sc[rows, :] += dot(ds.astype(k.dtype), k, NN, exact)

  _attend_pairs(step, call, attend, offset)

  @pl.when(step.last)
  def _():
    dq = dq_sc[...]  # the rotated queries' gradient: rotated back
    if q_rope is not None:
      dq = rotate(dq, *_cos_sin(q_rope), inverse=True)
    dq_ref[...] = dq.astype(dq_ref.dtype)


def dkv_kernel(*refs, call: Call, ring: int = 0):
  """dK, dV; with `ring` > 0 (`flash.tpu.dq_ring`) also dQ, from the same score tiles: query tile
  i's float32 accumulator sits in slot `i % ring` of a VMEM ring (per query head of the
  group) from its first key tile to key tile i, its last (causal, equal tiles), whose
  first step writes it out and clears the slot."""
  offset, q_ref, k_ref, v_ref, q_rope, k_rope, *refs = _refs(call, refs, 3)
  do_ref, lse_ref, delta_ref, seg_q_ref, seg_k_ref, refs = refs
  exact = q_ref.dtype == jnp.float32
  if ring:
    dk_ref, dv_ref, dq_ref, dk_sc, dv_sc, dq_sc, *k_sc = refs
  else:
    dk_ref, dv_ref, dk_sc, dv_sc, *k_sc = refs
  r = call.group
  flat = pl.program_id(2)
  step = call.tiles.key_step(pl.program_id(1), scalar_div(flat, r), offset)
  head = scalar_rem(flat, r)  # the query head of the group, innermost

  if ring:  # key tiles run in order per (batch, group): clear the ring at the first

    @pl.when((pl.program_id(1) == 0) & step.first & (head == 0))
    def _():
      dq_sc[...] = jnp.zeros(dq_sc.shape, jnp.float32)

  @pl.when(step.first & (head == 0))
  def _():
    dk_sc[...] = jnp.zeros(dk_sc.shape, jnp.float32)
    dv_sc[...] = jnp.zeros(dv_sc.shape, jnp.float32)
    if k_rope is not None:  # the key tile rotated once, for all its steps
      k_sc[0][...] = _rotated(k_ref, k_rope)

  def attend(blocks, masked: bool):  # (key rows, query rows) blocks of the pair
    for rows, cols in blocks:
      q, k = _rotated(q_ref, q_rope, cols), (k_sc[0] if k_sc else k_ref)[rows, :]
      v, do = v_ref[rows, :], do_ref[cols, :]
      s_t = dot(k, q, NT, exact)  # [keys, queries]
      p_t = jnp.exp(s_t - lse_ref[:, cols])
      if masked:
        segs = (seg_q_ref[:, cols], seg_k_ref[rows, :]) if call.segments else ()
        t_first, s_first = _firsts(call, step.tile, step.home, offset, cols, rows)
        p_t = jnp.where(_visible(call, t_first, s_first, s_t.shape, True, *segs), p_t, 0.0)
      dv_sc[rows, :] += dot(p_t.astype(do.dtype), do, NN, exact)
      dp_t = dot(v, do, NT, exact)
      ds_t = p_t * (dp_t - delta_ref[:, cols])
      dk_sc[rows, :] += dot(ds_t.astype(q.dtype), q, NN, exact)
      if ring:
        slot = scalar_rem(step.tile, ring) * r + head
        dq_sc[slot, cols, :] += dot(ds_t.astype(k.dtype), k, TN, exact)

  _attend_pairs(step, call, attend, offset, transposed=True)

  if ring:  # query tile `home` got its last contribution: out, and its slot cleared

    @pl.when(step.first)
    def _():
      slot = scalar_rem(step.home, ring) * r + head
      dq = dq_sc[slot]
      if q_rope is not None:  # (the table of tile `home`: the first step's query tile)
        dq = rotate(dq, *_cos_sin(q_rope), inverse=True)
      dq_ref[head] = dq.astype(dq_ref.dtype)
      dq_sc[slot] = jnp.zeros(dq.shape, jnp.float32)

  @pl.when(step.last & (head == r - 1))
  def _():
    dk = dk_sc[...]  # the rotated keys' gradient: rotated back
    if k_rope is not None:
      dk = rotate(dk, *_cos_sin(k_rope), inverse=True)
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dv_ref[...] = dv_sc[...].astype(dv_ref.dtype)
