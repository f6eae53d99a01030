"""Flash attention over a (virtual) sequence on TPU: Pallas Mosaic kernels.

The TPU hot path of IHA and MHA (`iha_jax.kernels.virtual_attention` builds their inputs):
plain flash attention, every matmul on the MXU, over sequences already mixed and scaled
outside (IHA: the N*P virtual tokens of each target head), with RoPE either applied
outside or, given per-row tables (`Call.rotary`), here: each q tile rotated once into
VMEM scratch, each k tile per step, and the float32 dq / dk accumulators rotated back
(the transpose) before they are written.

Layouts (rows: the attended sequence, padded to whole tiles):
  q `[B, H, Tq, d]`, k `[B, G, Tk, d]`, v `[B, G, Tk, dv]` (G divides H: query head h
  reads key/value head `h // (H // G)`), o `[B, H, Tq, dv]`; the per-row float32 lse and
  delta cross HBM as rows of one tile each, `[B, H, tiles, 1, bq]` (compact: a column
  `[B, H, Tq, 1]` is padded to 128 lanes there, 128 times its size; docs/design.md §8),
  and the kernels that need columns transpose them in VMEM;
  segment ids (optional) as columns `[B, T, 1]` and rows `[B, 1, T]` int32, padding keys
  marked -1 (never equal to a query's id), padding queries 0 (zeroed outputs); RoPE
  tables (optional) `[B, T, 2d]` float32 (`cos | sin`) per query / key row, blocked
  like the ids.
The query offset of a sequence shard (rows; `Tiles.offset is None`) is a `[1]` int32
scalar-prefetch operand.

Grids (`iha_jax.kernels.tile_schedule`): forward and dQ run `(B*H, rows, steps)` in the
query-major order, dK/dV `(B*G, rows, group * steps)` in the key-major order (the r query
heads of a group, innermost, add into one resident key/value block). The first two
dimensions are "parallel" (v5p's two TensorCores split the first one of size > 1);
steps "arbitrary" (accumulators in VMEM scratch). Each kernel body is four `pl.when`s, in
this order: initialise, attend an entirely visible pair (no mask work), attend a partly
visible pair (masked), finalise; `iha_jax.estimate.tpu` weights them by the steps
that run them. A causal window's dK/dV kernel also carries dQ (`_dq_ring`: its key rows
run in order, "arbitrary"; two more `pl.when`s clear the ring and write a query tile).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from iha_jax.core.masking import MASK_VALUE
from iha_jax.kernels.tile_schedule import Call

LANES = 128
_NT = (((1,), (1,)), ((), ()))  # a @ b.T
_NN = (((1,), (0,)), ((), ()))  # a @ b
_TN = (((0,), (0,)), ((), ()))  # a.T @ b
_ALL = slice(None)
# dQ inside the dK/dV kernel (`_dq_ring`) when its accumulators fit this much VMEM.
RING_BYTES = 4 * 2**20


def _div(a, b: int):
  """Division of non-negative int32 scalars (grid indices) by a constant; Mosaic lowers
  `lax.div`, not jnp's floor division."""
  return a if b == 1 else lax.div(a, jnp.int32(b))


def _rem(a, b: int):
  return jnp.zeros_like(a) if b == 1 else lax.rem(a, jnp.int32(b))


def _dot(a: jax.Array, b: jax.Array, dims, like) -> jax.Array:
  """A float32-accumulated matmul on the MXU; float32 inputs (`like`'s dtype) get true
  float32 products (the MXU's default precision rounds them to bf16)."""
  precision = lax.Precision.HIGHEST if like.dtype == jnp.float32 else None
  return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32, precision=precision)


def _params(*semantics: str) -> pltpu.CompilerParams:
  return pltpu.CompilerParams(dimension_semantics=semantics, disable_bounds_checks=True)


def _broadcast_lanes(x: jax.Array, width: int) -> jax.Array:
  """`[rows, 128]` lane-replicated (or `[rows, 1]`) -> `[rows, width]`."""
  if x.shape[1] == LANES and width % LANES == 0:
    return jnp.tile(x, (1, width // LANES))
  return jnp.broadcast_to(x[:, :1], (x.shape[0], width))


def _rotate(x: jax.Array, cos: jax.Array, sin: jax.Array, inverse: bool = False) -> jax.Array:
  """RoPE of the rows of `x: [rows, d]` (float32): `x cos + swap(x) sin` with the tables'
  `cos = [c, c]`, `sin = [-s, s]` and `swap([x1, x2]) = [x2, x1]` (a lane rotation by
  d/2); `inverse`: the transpose, `x cos - swap(x) sin` (gradients back to unrotated)."""
  swapped = pltpu.roll(x, x.shape[1] // 2, 1) * sin
  return x * cos - swapped if inverse else x * cos + swapped


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
  return _rotate(x.astype(jnp.float32), *_cos_sin(table, rows)).astype(x.dtype)


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
  XLU's unit: ~270 bundles per 512-row tile on v5p; two transposes of 8 sublanes each
  cost ~150 more)."""
  share = LANES // len(rows)
  stacked = jnp.concatenate([jnp.broadcast_to(r, (share, r.shape[1])) for r in rows], axis=0)
  t = jnp.transpose(stacked)
  return tuple(t[:, i * share : i * share + 1] for i in range(len(rows)))


def _offset(refs, call: Call):
  """Splits the scalar-prefetch offset (rows; sliced calls) off the refs."""
  if call.tiles.offset is None:
    return refs[0][0], refs[1:]
  return call.tiles.offset, refs


def _tables(refs, call: Call):
  """Splits the RoPE tables' refs `(queries', keys', rest)` off the refs (None, None
  without RoPE)."""
  if not call.rotary:
    return None, None, refs
  return refs[0], refs[1], refs[2:]


# --- forward ------------------------------------------------------------------------------


def _forward_kernel(*refs, call: Call, with_lse: bool = True):
  offset, refs = _offset(refs, call)
  q_ref, k_ref, v_ref, *refs = refs
  q_rope, k_rope, refs = _tables(refs, call)
  if call.segments:
    seg_q_ref, seg_k_ref, *refs = refs
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
      s = _dot(q, k, _NT, q_ref)
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
      pv = _dot(p.astype(v.dtype), v, _NN, q_ref)
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
  if rows % (2 * 16) or cols % (2 * LANES):
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


def _spec(block, index):
  return pl.BlockSpec(block, index)


def _specs(call: Call, d: int, dv: int):
  """BlockSpecs of the query-major grid (forward and dQ)."""
  tiles, h, r = call.tiles, call.heads, call.group
  bq, bk = tiles.block_q, tiles.block_k

  def step(row, s, offset):
    return tiles.query_step(row, s, offset[0][0] if tiles.offset is None else None)

  def q_index(bh, row, s, *offset):
    return _div(bh, h), _rem(bh, h), step(row, s, offset).home, 0

  def kv_index(bh, row, s, *offset):
    return _div(bh, h), _div(_rem(bh, h), r), step(row, s, offset).tile, 0

  def seg_q_index(bh, row, s, *offset):
    return _div(bh, h), step(row, s, offset).home, 0

  def seg_k_index(bh, row, s, *offset):  # key ids as rows, one per key tile
    return _div(bh, h), step(row, s, offset).tile, 0, 0

  def k_table_index(bh, row, s, *offset):  # RoPE tables [B, T, 2d]
    return _div(bh, h), step(row, s, offset).tile, 0

  def row_index(bh, row, s, *offset):  # lse, delta as rows [B, H, tiles, 1, bq]
    return _div(bh, h), _rem(bh, h), step(row, s, offset).home, 0, 0

  per_query = lambda width: _spec((None, None, bq, width), q_index)
  inputs = [
    per_query(d),
    _spec((None, None, bk, d), kv_index),
    _spec((None, None, bk, dv), kv_index),
  ]
  if call.rotary:  # the query tables follow the query ids' blocks
    inputs += [_spec((None, bq, 2 * d), seg_q_index), _spec((None, bk, 2 * d), k_table_index)]
  segments = [_spec((None, bq, 1), seg_q_index), _spec((None, None, 1, bk), seg_k_index)]
  rows = _spec((None, None, None, 1, bq), row_index)
  return per_query, rows, inputs, segments


def _call(
  kernel,
  call: Call,
  grid,
  in_specs,
  out_specs,
  out_shape,
  scratch,
  semantics,
  name,
  interpret,
  prefetch,
  *args,
):
  """`prefetch`: the scalar-prefetch operands (a sliced call's query offset, or none)."""
  spec = pltpu.PrefetchScalarGridSpec(
    num_scalar_prefetch=len(prefetch),
    grid=grid,
    in_specs=in_specs,
    out_specs=out_specs,
    scratch_shapes=scratch,
  )
  fn = pl.pallas_call(
    functools.partial(kernel, call=call),
    grid_spec=spec,
    out_shape=out_shape,
    compiler_params=_params(*semantics),
    interpret=interpret,
    name=name,
  )
  return fn(*prefetch, *args)


def forward(call: Call, q, k, v, rope, seg, offset, *, interpret: bool, with_lse: bool = True):
  """-> (o `[B, H, Tq, dv]` in q.dtype, lse `[B, H, Tq]` float32, or None without
  `with_lse`: a call nothing differentiates writes no lse). `rope`: RoPE tables
  of the query and key rows, `[B, Tq, 2d]` / `[B, Tk, 2d]` float32 (`cos | sin` per row,
  `_rotate`; q and k unrotated) or None (`call.rotary`); `seg`: (ids as columns
  `[B, Tq, 1]`, keys' ids as rows `[B, 1, Tk]`) or None; `offset`: `[1]` int32 (sliced
  calls) or None."""
  b, h, tq, d = q.shape
  dv = v.shape[-1]
  rows, steps = call.tiles.query_major()
  per_query, per_query_rows, inputs, segments = _specs(call, d, dv)
  bq = call.tiles.block_q
  outputs = _call(
    functools.partial(_forward_kernel, with_lse=with_lse),
    call,
    (b * h, rows, steps),
    inputs + (segments if call.segments else []),
    [per_query(dv), per_query_rows][: 1 + with_lse],
    [
      jax.ShapeDtypeStruct((b, h, tq, dv), q.dtype),
      jax.ShapeDtypeStruct((b, h, tq // bq, 1, bq), jnp.float32),
    ][: 1 + with_lse],
    [
      pltpu.VMEM((bq, LANES), jnp.float32),
      pltpu.VMEM((bq, LANES), jnp.float32),
      pltpu.VMEM((bq, dv), jnp.float32),
      *([pltpu.VMEM((bq, d), q.dtype)] if call.rotary else []),
    ],
    ("parallel", "parallel", "arbitrary"),
    "iha_flash_forward",
    interpret,
    () if offset is None else (offset,),
    q,
    k,
    v,
    *(rope or ()),
    *(seg or ()),
  )
  if not with_lse:
    return outputs[0], None
  o, lse = outputs
  return o, lse.reshape(b, h, tq)


# --- backward: dQ ---------------------------------------------------------------------------


def _dq_kernel(*refs, call: Call):
  offset, refs = _offset(refs, call)
  q_ref, k_ref, v_ref, *refs = refs
  q_rope, k_rope, refs = _tables(refs, call)
  do_ref, lse_ref, delta_ref, *refs = refs
  if call.segments:
    seg_q_ref, seg_k_ref, *refs = refs
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
      s = _dot(q, k, _NT, q_ref)
      p = jnp.exp(s - lse_sc[rows, :])
      if masked:
        segs = (seg_q_ref[rows, :], seg_k_ref[:, cols]) if call.segments else ()
        t_first, s_first = _firsts(call, step.home, step.tile, offset, rows, cols)
        p = jnp.where(_visible(call, t_first, s_first, s.shape, False, *segs), p, 0.0)
      do = do_ref[rows, :]
      dp = _dot(do, v, _NT, q_ref)
      ds = p * (dp - delta_sc[rows, :])
      dq_sc[rows, :] += _dot(ds.astype(k.dtype), k, _NN, q_ref)

  _attend_pairs(step, call, attend, offset)

  @pl.when(step.last)
  def _():
    dq = dq_sc[...]  # the rotated queries' gradient: rotated back
    if q_rope is not None:
      dq = _rotate(dq, *_cos_sin(q_rope), inverse=True)
    dq_ref[...] = dq.astype(dq_ref.dtype)


# --- backward: dK, dV -----------------------------------------------------------------------


def _dkv_kernel(*refs, call: Call, ring: int = 0):
  """dK, dV; with `ring` > 0 (`_dq_ring`) also dQ, from the same score tiles: query tile
  i's float32 accumulator sits in slot `i % ring` of a VMEM ring (per query head of the
  group) from its first key tile to key tile i, its last (causal, equal tiles), whose
  first step writes it out and clears the slot."""
  offset, refs = _offset(refs, call)
  q_ref, k_ref, v_ref, *refs = refs
  q_rope, k_rope, refs = _tables(refs, call)
  do_ref, lse_ref, delta_ref, *refs = refs
  if call.segments:
    seg_q_ref, seg_k_ref, *refs = refs
  if ring:
    dk_ref, dv_ref, dq_ref, dk_sc, dv_sc, dq_sc, *k_sc = refs
  else:
    dk_ref, dv_ref, dk_sc, dv_sc, *k_sc = refs
  r = call.group
  flat = pl.program_id(2)
  step = call.tiles.key_step(pl.program_id(1), _div(flat, r), offset)
  head = _rem(flat, r)  # the query head of the group, innermost

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
      s_t = _dot(k, q, _NT, q_ref)  # [keys, queries]
      p_t = jnp.exp(s_t - lse_ref[:, cols])
      if masked:
        segs = (seg_q_ref[:, cols], seg_k_ref[rows, :]) if call.segments else ()
        t_first, s_first = _firsts(call, step.tile, step.home, offset, cols, rows)
        p_t = jnp.where(_visible(call, t_first, s_first, s_t.shape, True, *segs), p_t, 0.0)
      dv_sc[rows, :] += _dot(p_t.astype(do.dtype), do, _NN, q_ref)
      dp_t = _dot(v, do, _NT, q_ref)
      ds_t = p_t * (dp_t - delta_ref[:, cols])
      dk_sc[rows, :] += _dot(ds_t.astype(q.dtype), q, _NN, q_ref)
      if ring:
        slot = _rem(step.tile, ring) * r + head
        dq_sc[slot, cols, :] += _dot(ds_t.astype(k.dtype), k, _TN, q_ref)

  _attend_pairs(step, call, attend, offset, transposed=True)

  if ring:  # query tile `home` got its last contribution: out, and its slot cleared

    @pl.when(step.first)
    def _():
      slot = _rem(step.home, ring) * r + head
      dq = dq_sc[slot]
      if q_rope is not None:  # (the table of tile `home`: the first step's query tile)
        dq = _rotate(dq, *_cos_sin(q_rope), inverse=True)
      dq_ref[head] = dq.astype(dq_ref.dtype)
      dq_sc[slot] = jnp.zeros(dq.shape, jnp.float32)

  @pl.when(step.last & (head == r - 1))
  def _():
    dk = dk_sc[...]  # the rotated keys' gradient: rotated back
    if k_rope is not None:
      dk = _rotate(dk, *_cos_sin(k_rope), inverse=True)
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dv_ref[...] = dv_sc[...].astype(dv_ref.dtype)


def _dq_ring(call: Call, batch_groups: int, tq: int, tk: int, d: int) -> int:
  """Slots of the dQ ring when dQ can ride in the dK/dV kernel, else 0.

  Needs the key tiles of one (batch, group) in order on one core, and query tile i's last
  contribution at key tile i's first step: a causal window (a band: a few query tiles in
  flight), equal tiles over equal query and key rows, unsliced. Saves the separate dQ
  kernel's second pass over every score tile (its S, P and dP), for one more matmul per
  step. Not for a single (batch, group): rows in order would leave a v5p core idle."""
  tiles = call.tiles
  if not (
    tiles.causal
    and tiles.window is not None
    and tiles.offset == 0
    and tiles.block_q == tiles.block_k
    and tq == tk
    and batch_groups > 1
  ):
    return 0
  ring = tiles.key_major()[1]  # query tiles one key tile reaches
  return ring if ring * call.group * tiles.block_q * d * 4 <= RING_BYTES else 0


def backward(call: Call, q, k, v, rope, seg, offset, do, lse, delta, *, interpret: bool):
  """-> (dq `[B, H, Tq, d]`, dk `[B, G, Tk, d]`, dv `[B, G, Tk, dv]`) in q/k/v's dtypes
  (accumulated in float32 VMEM; written once, not cast afterwards); with `rope` (as in
  `forward`), the gradients of the unrotated q and k. One kernel for a causal window's
  band (`_dq_ring`), else a dQ kernel and a dK/dV kernel.

  `do` `[B, H, Tq, dv]` (q.dtype), `lse`, `delta` (`rowsum(o * do)`) `[B, H, Tq]` f32."""
  b, _, tq, d = q.shape
  g, tk = k.shape[1], k.shape[2]
  bq = call.tiles.block_q
  # Rows of one tile each, [B, H, tiles, 1, bq]: a (1, bq) block is then a whole trailing
  # pair of dimensions, legal for Mosaic at any tile size, and compact in HBM.
  rows_of = lambda x: x.reshape(*x.shape[:-1], x.shape[-1] // bq, 1, bq)
  segments = seg if call.segments else ()
  args = (q, k, v, rope or (), segments, offset, do, rows_of(lse), rows_of(delta))
  ring = _dq_ring(call, b * g, tq, tk, d)
  if ring:
    return _dkv(call, *args, ring=ring, interpret=interpret)
  dq = _dq(call, *args, interpret=interpret)
  return (dq, *_dkv(call, *args, ring=0, interpret=interpret))


def _dq(call: Call, q, k, v, rope, segments, offset, do, lse, delta, *, interpret: bool):
  """dQ over the query-major grid (lse, delta as rows)."""
  b, h, _, d = q.shape
  dv, bq = v.shape[-1], call.tiles.block_q
  rows, steps = call.tiles.query_major()
  per_query, per_query_rows, inputs, seg_specs = _specs(call, d, dv)
  (dq,) = _call(
    _dq_kernel,
    call,
    (b * h, rows, steps),
    inputs + [per_query(dv), per_query_rows, per_query_rows] + (seg_specs if call.segments else []),
    [per_query(d)],
    [jax.ShapeDtypeStruct(q.shape, q.dtype)],
    [
      pltpu.VMEM((bq, d), jnp.float32),
      pltpu.VMEM((bq, 1), jnp.float32),  # lse, delta as columns
      pltpu.VMEM((bq, 1), jnp.float32),
      *([pltpu.VMEM((bq, d), q.dtype)] if call.rotary else []),
    ],
    ("parallel", "parallel", "arbitrary"),
    "iha_flash_dq",
    interpret,
    () if offset is None else (offset,),
    q,
    k,
    v,
    *rope,
    do,
    lse,
    delta,
    *segments,
  )
  return dq


def _dkv(call: Call, q, k, v, rope, segments, offset, do, lse, delta, *, ring: int, interpret):
  """(dk, dv) over the key-major grid, or (dq, dk, dv) with a dQ `ring` (`_dq_ring`)."""
  b, _, tq, d = q.shape
  g, tk, dv = k.shape[1], k.shape[2], v.shape[-1]
  tiles, r = call.tiles, call.group
  bq, bk = tiles.block_q, tiles.block_k
  rows, steps = tiles.key_major()

  def step(row, flat, offset):
    return tiles.key_step(row, _div(flat, r), offset[0][0] if tiles.offset is None else None)

  def q_index(bg, row, flat, *offset):
    return _div(bg, g), _rem(bg, g) * r + _rem(flat, r), step(row, flat, offset).tile, 0

  def row_index(bg, row, flat, *offset):  # lse, delta as rows [B, H, tiles, 1, bq]
    return _div(bg, g), _rem(bg, g) * r + _rem(flat, r), step(row, flat, offset).tile, 0, 0

  def kv_index(bg, row, flat, *offset):
    return _div(bg, g), _rem(bg, g), step(row, flat, offset).home, 0

  def seg_q_index(bg, row, flat, *offset):  # query ids as rows [B, tiles, 1, bq]
    return _div(bg, g), step(row, flat, offset).tile, 0, 0

  def seg_k_index(bg, row, flat, *offset):  # key ids as columns [B, Tk, 1]
    return _div(bg, g), step(row, flat, offset).home, 0

  def q_table_index(bg, row, flat, *offset):  # RoPE tables [B, T, 2d]
    return _div(bg, g), step(row, flat, offset).tile, 0

  def dq_index(bg, row, flat, *offset):  # the group's r heads, query tile `row`
    return _div(bg, g), _rem(bg, g), row, 0

  per_key = lambda width: _spec((None, None, bk, width), kv_index)
  in_specs = [_spec((None, None, bq, d), q_index), per_key(d), per_key(dv)]
  if call.rotary:  # the key tables follow the key ids' blocks
    in_specs += [_spec((None, bq, 2 * d), q_table_index), _spec((None, bk, 2 * d), seg_k_index)]
  in_specs += [
    _spec((None, None, bq, dv), q_index),
    _spec((None, None, None, 1, bq), row_index),
    _spec((None, None, None, 1, bq), row_index),
  ]
  transposed_segments = ()
  if call.segments:
    seg_q_cols, seg_k_rows = segments
    query_rows = seg_q_cols.reshape(b, tq // bq, 1, bq)
    key_columns = seg_k_rows.reshape(b, tk, 1)
    transposed_segments = (query_rows, key_columns)
    in_specs += [_spec((None, None, 1, bq), seg_q_index), _spec((None, bk, 1), seg_k_index)]
  out_specs = [per_key(d), per_key(dv)]
  out_shapes = [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)]
  scratch = [pltpu.VMEM((bk, d), jnp.float32), pltpu.VMEM((bk, dv), jnp.float32)]
  if ring:
    out_specs.append(_spec((None, r, bq, d), dq_index))
    out_shapes.append(jax.ShapeDtypeStruct(q.shape, q.dtype))
    scratch.append(pltpu.VMEM((ring * r, bq, d), jnp.float32))
  grads = _call(
    functools.partial(_dkv_kernel, ring=ring),
    call,
    (b * g, rows, r * steps),
    in_specs,
    out_specs,
    out_shapes,
    scratch + ([pltpu.VMEM((bk, d), k.dtype)] if call.rotary else []),
    # With a ring the key tiles of a (batch, group) run in order on one core.
    ("parallel", "arbitrary" if ring else "parallel", "arbitrary"),
    "iha_flash_dkv",
    interpret,
    () if offset is None else (offset,),
    q,
    k,
    v,
    *rope,
    do,
    lse,
    delta,
    *transposed_segments,
  )
  if ring:
    dk, dv_, dq = grads
    return dq, dk, dv_
  return tuple(grads)
