"""Flash attention over a (virtual) sequence on TPU: the Pallas Mosaic calls.

The TPU hot path of IHA and MHA (`iha_jax.kernels.flash.attention` builds their inputs):
plain flash attention, every matmul on the MXU, over sequences already mixed and scaled
outside (IHA: the N*P virtual tokens of each target head), with RoPE either applied
outside or, given per-row tables (`Call.rotary`), by the kernels
(`iha_jax.kernels.flash.tpu_kernel`, whose bodies these calls run).

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

Grids (`iha_jax.kernels.flash.plan`): forward and dQ run `(B*H, rows, steps)` in the
query-major order, dK/dV `(B*G, rows, group * steps)` in the key-major order (the r query
heads of a group, innermost, add into one resident key/value block). The first two
dimensions are "parallel" (v5p's two TensorCores split the first one of size > 1);
steps "arbitrary" (accumulators in VMEM scratch). A causal window's dK/dV kernel also
carries dQ (`dq_ring`: its key rows run in order, "arbitrary").
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from iha_jax.kernels.flash.plan import Call
from iha_jax.kernels.flash.tpu_kernel import dkv_kernel, dq_kernel, forward_kernel
from iha_jax.kernels.tpu import LANES, scalar_div, scalar_rem

# dQ inside the dK/dV kernel (`dq_ring`) when its accumulators fit this much VMEM.
RING_BYTES = 4 * 2**20


def _params(*semantics: str) -> pltpu.CompilerParams:
  return pltpu.CompilerParams(dimension_semantics=semantics, disable_bounds_checks=True)


def _spec(block, index):
  return pl.BlockSpec(block, index)


def _specs(call: Call, d: int, dv: int):
  """BlockSpecs of the query-major grid (forward and dQ)."""
  tiles, h, r = call.tiles, call.heads, call.group
  bq, bk = tiles.block_q, tiles.block_k

  def step(row, s, offset):
    return tiles.query_step(row, s, offset[0][0] if tiles.offset is None else None)

  def q_index(bh, row, s, *offset):
    return scalar_div(bh, h), scalar_rem(bh, h), step(row, s, offset).home, 0

  def kv_index(bh, row, s, *offset):
    return scalar_div(bh, h), scalar_div(scalar_rem(bh, h), r), step(row, s, offset).tile, 0

  def seg_q_index(bh, row, s, *offset):
    return scalar_div(bh, h), step(row, s, offset).home, 0

  def seg_k_index(bh, row, s, *offset):  # key ids as rows, one per key tile
    return scalar_div(bh, h), step(row, s, offset).tile, 0, 0

  def k_table_index(bh, row, s, *offset):  # RoPE tables [B, T, 2d]
    return scalar_div(bh, h), step(row, s, offset).tile, 0

  def row_index(bh, row, s, *offset):  # lse, delta as rows [B, H, tiles, 1, bq]
    return scalar_div(bh, h), scalar_rem(bh, h), step(row, s, offset).home, 0, 0

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


def _pallas_call(
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
  `kernels.tpu.rotate`; q and k unrotated) or None (`call.rotary`); `seg`: (ids as columns
  `[B, Tq, 1]`, keys' ids as rows `[B, 1, Tk]`) or None; `offset`: `[1]` int32 (sliced
  calls) or None."""
  b, h, tq, d = q.shape
  dv = v.shape[-1]
  rows, steps = call.tiles.query_major()
  per_query, per_query_rows, inputs, segments = _specs(call, d, dv)
  bq = call.tiles.block_q
  outputs = _pallas_call(
    functools.partial(forward_kernel, with_lse=with_lse),
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


def dq_ring(call: Call, batch_groups: int, tq: int, tk: int, d: int) -> int:
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
  band (`dq_ring`), else a dQ kernel and a dK/dV kernel.

  `do` `[B, H, Tq, dv]` (q.dtype), `lse`, `delta` (`rowsum(o * do)`) `[B, H, Tq]` f32."""
  b, _, tq, d = q.shape
  g, tk = k.shape[1], k.shape[2]
  bq = call.tiles.block_q
  # Rows of one tile each, [B, H, tiles, 1, bq]: a (1, bq) block is then a whole trailing
  # pair of dimensions, legal for Mosaic at any tile size, and compact in HBM.
  rows_of = lambda x: x.reshape(*x.shape[:-1], x.shape[-1] // bq, 1, bq)
  segments = seg if call.segments else ()
  args = (q, k, v, rope or (), segments, offset, do, rows_of(lse), rows_of(delta))
  ring = dq_ring(call, b * g, tq, tk, d)
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
  (dq,) = _pallas_call(
    dq_kernel,
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


def _key_major_specs(call: Call, g: int, d: int, dv: int):
  """BlockSpecs of the key-major grid (dK/dV): (key-side spec of a lane width, inputs,
  segment ids: query ids as rows, key ids as columns, the dQ ring's output)."""
  tiles, r = call.tiles, call.group
  bq, bk = tiles.block_q, tiles.block_k

  def step(row, flat, offset):
    return tiles.key_step(row, scalar_div(flat, r), offset[0][0] if tiles.offset is None else None)

  def q_index(bg, row, flat, *offset):
    return (
      scalar_div(bg, g),
      scalar_rem(bg, g) * r + scalar_rem(flat, r),
      step(row, flat, offset).tile,
      0,
    )

  def row_index(bg, row, flat, *offset):  # lse, delta as rows [B, H, tiles, 1, bq]
    return (
      scalar_div(bg, g),
      scalar_rem(bg, g) * r + scalar_rem(flat, r),
      step(row, flat, offset).tile,
      0,
      0,
    )

  def kv_index(bg, row, flat, *offset):
    return scalar_div(bg, g), scalar_rem(bg, g), step(row, flat, offset).home, 0

  def seg_q_index(bg, row, flat, *offset):  # query ids as rows [B, tiles, 1, bq]
    return scalar_div(bg, g), step(row, flat, offset).tile, 0, 0

  def seg_k_index(bg, row, flat, *offset):  # key ids as columns [B, Tk, 1]
    return scalar_div(bg, g), step(row, flat, offset).home, 0

  def q_table_index(bg, row, flat, *offset):  # RoPE tables [B, T, 2d]
    return scalar_div(bg, g), step(row, flat, offset).tile, 0

  def dq_index(bg, row, flat, *offset):  # the group's r heads, query tile `row`
    return scalar_div(bg, g), scalar_rem(bg, g), row, 0

  per_key = lambda width: _spec((None, None, bk, width), kv_index)
  inputs = [_spec((None, None, bq, d), q_index), per_key(d), per_key(dv)]
  if call.rotary:  # the key tables follow the key ids' blocks
    inputs += [_spec((None, bq, 2 * d), q_table_index), _spec((None, bk, 2 * d), seg_k_index)]
  inputs += [
    _spec((None, None, bq, dv), q_index),
    _spec((None, None, None, 1, bq), row_index),
    _spec((None, None, None, 1, bq), row_index),
  ]
  segments = [_spec((None, None, 1, bq), seg_q_index), _spec((None, bk, 1), seg_k_index)]
  return per_key, inputs, segments, _spec((None, r, bq, d), dq_index)


def _dkv(call: Call, q, k, v, rope, segments, offset, do, lse, delta, *, ring: int, interpret):
  """(dk, dv) over the key-major grid, or (dq, dk, dv) with a dQ `ring` (`dq_ring`)."""
  b, _, tq, d = q.shape
  g, tk, dv = k.shape[1], k.shape[2], v.shape[-1]
  tiles, r = call.tiles, call.group
  bq, bk = tiles.block_q, tiles.block_k
  rows, steps = tiles.key_major()
  per_key, in_specs, seg_specs, dq_spec = _key_major_specs(call, g, d, dv)
  transposed_segments = ()
  if call.segments:
    seg_q_cols, seg_k_rows = segments
    query_rows = seg_q_cols.reshape(b, tq // bq, 1, bq)
    key_columns = seg_k_rows.reshape(b, tk, 1)
    transposed_segments = (query_rows, key_columns)
    in_specs += seg_specs
  out_specs = [per_key(d), per_key(dv)]
  out_shapes = [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)]
  scratch = [pltpu.VMEM((bk, d), jnp.float32), pltpu.VMEM((bk, dv), jnp.float32)]
  if ring:
    out_specs.append(dq_spec)
    out_shapes.append(jax.ShapeDtypeStruct(q.shape, q.dtype))
    scratch.append(pltpu.VMEM((ring * r, bq, d), jnp.float32))
  grads = _pallas_call(
    functools.partial(dkv_kernel, ring=ring),
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
