"""Flash attention over a (virtual) sequence on TPU: the Pallas Mosaic calls of
`flash.tpu_kernel`'s bodies, over sequences already mixed and scaled (`flash.attention`).

Layouts (rows: the attended sequence, padded to whole tiles):
  q `[B, H, Tq, d]`, k `[B, G, Tk, d]`, v `[B, G, Tk, dv]` (G divides H: query head h
  reads key/value head `h // (H // G)`), o `[B, H, Tq, dv]`; the per-row float32 lse and
  delta cross HBM as rows of one tile each, `[B, H, tiles, 1, bq]` (a column `[B, H, Tq,
  1]` is padded to 128 lanes there; docs/design.md §8), and the kernels that need columns
  transpose them in VMEM; segment ids (optional) as columns `[B, T, 1]` and rows `[B, 1,
  T]` int32, padding keys -1 (never equal to a query's id), padding queries 0 (zeroed
  outputs); RoPE tables (optional) `[B, T, 2d]` float32 (`cos | sin`), blocked like the
  ids. A sequence shard's query offset (rows; `Tiles.offset is None`) is a `[1]` int32
  scalar-prefetch operand.

Grids (`flash.plan`): forward and dQ `(B*H, rows, steps)` query-major, dK/dV `(B*G, rows,
group * steps)` key-major (the r query heads of a group, innermost, add into one resident
key/value block). The first two dimensions are "parallel" (v5p's two TensorCores split the
first one of size > 1), steps "arbitrary" (accumulators in VMEM scratch).
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
_PARALLEL = ("parallel", "parallel", "arbitrary")


def _specs(call: Call, d: int, dv: int):
  """BlockSpecs of the query-major grid (forward and dQ): (per-query spec of a lane width,
  lse / delta rows, inputs q, k, v and tables, segment ids)."""
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

  def k_table_index(bh, row, s, *offset):  # RoPE tables [B, T, 2d]
    return scalar_div(bh, h), step(row, s, offset).tile, 0

  seg_k_index = lambda *index: (*k_table_index(*index), 0)  # key ids as rows, one per tile
  row_index = lambda *index: (*q_index(*index), 0)  # lse, delta as rows [B, H, tiles, 1, bq]
  per_query = lambda width: pl.BlockSpec((None, None, bq, width), q_index)
  per_key = lambda width: pl.BlockSpec((None, None, bk, width), kv_index)
  inputs = [per_query(d), per_key(d), per_key(dv)]
  if call.rotary:  # the query tables follow the query ids' blocks
    inputs += [
      pl.BlockSpec((None, bq, 2 * d), seg_q_index),
      pl.BlockSpec((None, bk, 2 * d), k_table_index),
    ]
  segments = [
    pl.BlockSpec((None, bq, 1), seg_q_index),
    pl.BlockSpec((None, None, 1, bk), seg_k_index),
  ]
  rows = pl.BlockSpec((None, None, None, 1, bq), row_index)
  return per_query, rows, inputs, segments if call.segments else []


def _pallas_call(kernel, call: Call, name: str, grid, semantics, in_specs, outs, scratch):
  """`kernel(call=call)` over `grid` as a function of (the query offset of a sliced call,
  the scalar-prefetch operand, or None; the other operands; `interpret`); `outs`:
  (BlockSpec, ShapeDtypeStruct) per output."""

  def run(offset, *args, interpret: bool):
    prefetch = () if offset is None else (offset,)
    spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=len(prefetch),
      grid=grid,
      in_specs=in_specs,
      out_specs=[spec for spec, _ in outs],
      scratch_shapes=scratch,
    )
    return pl.pallas_call(
      functools.partial(kernel, call=call),
      grid_spec=spec,
      out_shape=[shape for _, shape in outs],
      compiler_params=pltpu.CompilerParams(
        dimension_semantics=semantics, disable_bounds_checks=True
      ),
      interpret=interpret,
      name=name,
    )(*prefetch, *args)

  return run


def forward(call: Call, q, k, v, rope, seg, offset, *, interpret: bool, with_lse: bool = True):
  """-> (o `[B, H, Tq, dv]` in q.dtype, lse `[B, H, Tq]` float32, or None without
  `with_lse`: a call nothing differentiates writes no lse). `rope`: RoPE tables of the
  query and key rows, `[B, Tq, 2d]` / `[B, Tk, 2d]` float32 (q and k unrotated) or None
  (`call.rotary`); `seg`: (ids as columns `[B, Tq, 1]`, keys' ids as rows `[B, 1, Tk]`)
  or None; `offset`: `[1]` int32 (sliced calls) or None."""
  b, h, tq, d = q.shape
  dv, bq = v.shape[-1], call.tiles.block_q
  grid = (b * h, *call.tiles.query_major())
  per_query, rows, inputs, segments = _specs(call, d, dv)
  outs = [
    (per_query(dv), jax.ShapeDtypeStruct((b, h, tq, dv), q.dtype)),
    (rows, jax.ShapeDtypeStruct((b, h, tq // bq, 1, bq), jnp.float32)),
  ][: 1 + with_lse]
  scratch = [
    pltpu.VMEM((bq, LANES), jnp.float32),
    pltpu.VMEM((bq, LANES), jnp.float32),
    pltpu.VMEM((bq, dv), jnp.float32),
    *([pltpu.VMEM((bq, d), q.dtype)] if call.rotary else []),
  ]
  kernel = functools.partial(forward_kernel, with_lse=with_lse)
  outputs = _pallas_call(
    kernel, call, "iha_flash_forward", grid, _PARALLEL, inputs + segments, outs, scratch
  )(offset, q, k, v, *(rope or ()), *(seg or ()), interpret=interpret)
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
  (accumulated in float32 VMEM, written once); with `rope` (as in `forward`), the gradients
  of the unrotated q and k. One kernel for a causal window's band (`dq_ring`), else a dQ
  kernel and a dK/dV kernel. `do` `[B, H, Tq, dv]` (q.dtype), `lse`, `delta`
  (`rowsum(o * do)`) `[B, H, Tq]` float32."""
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
  grid = (b * h, *call.tiles.query_major())
  per_query, rows, inputs, seg_specs = _specs(call, d, dv)
  in_specs = inputs + [per_query(dv), rows, rows] + seg_specs
  scratch = [
    pltpu.VMEM((bq, d), jnp.float32),
    pltpu.VMEM((bq, 1), jnp.float32),  # lse, delta as columns
    pltpu.VMEM((bq, 1), jnp.float32),
    *([pltpu.VMEM((bq, d), q.dtype)] if call.rotary else []),
  ]
  outs = [(per_query(d), jax.ShapeDtypeStruct(q.shape, q.dtype))]
  run = _pallas_call(dq_kernel, call, "iha_flash_dq", grid, _PARALLEL, in_specs, outs, scratch)
  return run(offset, q, k, v, *rope, do, lse, delta, *segments, interpret=interpret)[0]


def _key_major_specs(call: Call, g: int, d: int, dv: int):
  """BlockSpecs of the key-major grid (dK/dV): (key-side spec of a lane width, inputs,
  segment ids: query ids as rows, key ids as columns, the dQ ring's output)."""
  tiles, r = call.tiles, call.group
  bq, bk = tiles.block_q, tiles.block_k

  def step(row, flat, offset):
    return tiles.key_step(row, scalar_div(flat, r), offset[0][0] if tiles.offset is None else None)

  def q_index(bg, row, flat, *offset):  # query head: the group's, then the innermost index's
    b = scalar_div(bg, g)
    return b, scalar_rem(bg, g) * r + scalar_rem(flat, r), step(row, flat, offset).tile, 0

  row_index = lambda *index: (*q_index(*index), 0)  # lse, delta as rows [B, H, tiles, 1, bq]

  def kv_index(bg, row, flat, *offset):
    return scalar_div(bg, g), scalar_rem(bg, g), step(row, flat, offset).home, 0

  def seg_k_index(bg, row, flat, *offset):  # key ids as columns [B, Tk, 1]
    return scalar_div(bg, g), step(row, flat, offset).home, 0

  def q_table_index(bg, row, flat, *offset):  # RoPE tables [B, T, 2d]
    return scalar_div(bg, g), step(row, flat, offset).tile, 0

  seg_q_index = lambda *index: (*q_table_index(*index), 0)  # query ids as rows [B, tiles, 1, bq]

  def dq_index(bg, row, flat, *offset):  # the group's r heads, query tile `row`
    return scalar_div(bg, g), scalar_rem(bg, g), row, 0

  per_key = lambda width: pl.BlockSpec((None, None, bk, width), kv_index)
  inputs = [pl.BlockSpec((None, None, bq, d), q_index), per_key(d), per_key(dv)]
  if call.rotary:  # the key tables follow the key ids' blocks
    inputs += [
      pl.BlockSpec((None, bq, 2 * d), q_table_index),
      pl.BlockSpec((None, bk, 2 * d), seg_k_index),
    ]
  rows = pl.BlockSpec((None, None, None, 1, bq), row_index)
  inputs += [pl.BlockSpec((None, None, bq, dv), q_index), rows, rows]
  if call.segments:
    inputs += [
      pl.BlockSpec((None, None, 1, bq), seg_q_index),
      pl.BlockSpec((None, bk, 1), seg_k_index),
    ]
  return per_key, inputs, pl.BlockSpec((None, r, bq, d), dq_index)


def _dkv(call: Call, q, k, v, rope, segments, offset, do, lse, delta, *, ring: int, interpret):
  """(dk, dv) over the key-major grid, or (dq, dk, dv) with a dQ `ring` (`dq_ring`)."""
  b, _, tq, d = q.shape
  g, tk, dv = k.shape[1], k.shape[2], v.shape[-1]
  tiles, r = call.tiles, call.group
  bq, bk = tiles.block_q, tiles.block_k
  per_key, in_specs, dq_spec = _key_major_specs(call, g, d, dv)
  if call.segments:  # query ids as rows, key ids as columns
    segments = (segments[0].reshape(b, tq // bq, 1, bq), segments[1].reshape(b, tk, 1))
  outs = [(per_key(d), jax.ShapeDtypeStruct(k.shape, k.dtype))]
  outs += [(per_key(dv), jax.ShapeDtypeStruct(v.shape, v.dtype))]
  scratch = [pltpu.VMEM((bk, d), jnp.float32), pltpu.VMEM((bk, dv), jnp.float32)]
  if ring:
    outs.append((dq_spec, jax.ShapeDtypeStruct(q.shape, q.dtype)))
    scratch.append(pltpu.VMEM((ring * r, bq, d), jnp.float32))
  scratch += [pltpu.VMEM((bk, d), k.dtype)] if call.rotary else []
  rows, steps = tiles.key_major()
  # With a ring the key tiles of a (batch, group) run in order on one core.
  semantics = ("parallel", "arbitrary" if ring else "parallel", "arbitrary")
  kernel = functools.partial(dkv_kernel, ring=ring)
  grid = (b * g, rows, r * steps)
  grads = _pallas_call(kernel, call, "iha_flash_dkv", grid, semantics, in_specs, outs, scratch)(
    offset, q, k, v, *rope, do, lse, delta, *segments, interpret=interpret
  )
  if ring:
    dk, dv_, dq = grads
    return dq, dk, dv_
  return tuple(grads)
