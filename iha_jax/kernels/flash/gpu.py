"""Flash attention over a (virtual) sequence on GPU: the Pallas Triton calls of
`flash.gpu_kernel`'s bodies, the twin of `flash.tpu` in the same pipeline
(`flash.attention`: q, k, v mixed, scaled and rotated in HBM before).

Layouts as `flash.tpu`'s, but lse `[B, H, Tq]` float32, and the segment ids passed on as
rows `[B, Tq]`, `[B, Tk]`; d and dv are padded here to a power of two >= 16 lanes (Triton's
block shapes). Grids: forward and dQ `(query tiles, B, H)`, the longest causal
bands first; dK/dV `(key tiles, B, G)`, the r query heads of a group looped inside the
program, so no two programs write the same rows (no atomics). The bands are
`Tiles.key_band` / `query_band`'s; a traced query offset is a `[1]` int32 operand.
Launches (warps, pipeline stages) are `flash_launch()`'s, checked spill-free for H100 by
`tests/kernels/test_compile_targets.py`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from iha_jax.kernels.flash.gpu_kernel import dkv_kernel, dq_kernel, forward_kernel, query_tile
from iha_jax.kernels.flash.plan import Call
from iha_jax.kernels.gpu import Launch, block_pow2

DKV_BLOCK_Q = 64  # query rows per dK/dV step (`_dkv`)


def flash_launch(kernel: str, width: int, dtype) -> Launch:
  """The launch of `kernel` ("forward", "dq", "dkv") at lane width `width` (max of d,
  dv after padding): 8 warps hold a 128-row float32 accumulator of 128 lanes in
  registers; three stages of bf16 tiles of <= 128 lanes, two for float32 or wider ones
  (shared memory)."""
  wide = width > 64 or kernel == "dkv"
  stages = 3 if jnp.dtype(dtype).itemsize <= 2 and width <= 128 else 2
  return Launch(num_warps=8 if wide else 4, num_stages=stages)


def _pad_lanes(x: jax.Array) -> jax.Array:
  width = block_pow2(x.shape[-1])
  return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - x.shape[-1])])


def _segment_ids(seg) -> tuple[jax.Array, jax.Array]:
  seg_q, seg_k = seg
  return seg_q[..., 0], seg_k.reshape(seg_k.shape[0], -1)


def _pallas_call(kernel, call: Call, name: str, grid, launch: Launch, interpret: bool, **specs):
  return pl.pallas_call(
    functools.partial(kernel, call=call),
    grid=grid,
    compiler_params=launch.compiler_params(),
    interpret=interpret,
    name=name,
    **specs,
  )


def _offset_operand(call: Call, offset) -> tuple[list, list]:
  if call.tiles.offset is None:
    return [offset], [pl.BlockSpec(offset.shape, lambda *_: (0,))]
  return [], []


def _query_specs(call: Call, k):
  """BlockSpecs of the query-major grid: (per query tile, of trailing `block` dims; a
  head's whole key or value rows; segment ids, or [] without)."""
  bq, r = call.tiles.block_q, call.group
  home = functools.partial(query_tile, call)
  per_q = lambda *block: pl.BlockSpec(
    (None, None, bq, *block), lambda i, bb, hh: (bb, hh, home(i), *(0,) * len(block))
  )
  whole_kv = lambda x: pl.BlockSpec(
    (None, None, *x.shape[2:]), lambda i, bb, hh: (bb, hh // r, 0, 0)
  )
  seg_specs = [
    pl.BlockSpec((None, bq), lambda i, bb, hh: (bb, home(i))),
    pl.BlockSpec((None, k.shape[2]), lambda i, bb, hh: (bb, 0)),
  ]
  return per_q, whole_kv, seg_specs if call.segments else []


def forward(call: Call, q, k, v, rope, seg, offset, *, interpret: bool):
  """-> (o `[B, H, Tq, dv]` in q.dtype, lse `[B, H, Tq]` float32); arguments as
  `flash.tpu.forward`'s (`rope` must be None: RoPE is applied before, in HBM)."""
  if rope is not None:
    raise ValueError("the GPU flash kernels take q and k already rotated (rope=None)")
  b, h, tq, dv = *q.shape[:3], v.shape[-1]
  q, k, v = (_pad_lanes(x) for x in (q, k, v))
  width = max(q.shape[-1], v.shape[-1])
  lead, lead_specs = _offset_operand(call, offset)
  segs = list(_segment_ids(seg)) if call.segments else []
  per_q, whole_kv, seg_specs = _query_specs(call, k)
  o, lse = _pallas_call(
    forward_kernel,
    call,
    "iha_flash_forward",
    (call.tiles.num_q, b, h),
    flash_launch("forward", width, q.dtype),
    interpret,
    in_specs=[*lead_specs, per_q(q.shape[-1]), whole_kv(k), whole_kv(v), *seg_specs],
    out_specs=[per_q(v.shape[-1]), per_q()],
    out_shape=[
      jax.ShapeDtypeStruct((b, h, tq, v.shape[-1]), q.dtype),
      jax.ShapeDtypeStruct((b, h, tq), jnp.float32),
    ],
  )(*lead, q, k, v, *segs)
  return o[..., :dv], lse


def backward(call: Call, q, k, v, rope, seg, offset, do, lse, delta, *, interpret: bool):
  """-> (dq, dk, dv) in q's, k's and v's dtypes; `do` `[B, H, Tq, dv]`, `lse` and `delta`
  (`rowsum(o * do)`) `[B, H, Tq]` float32; the rest as `forward`'s."""
  if rope is not None:
    raise ValueError("the GPU flash kernels take q and k already rotated (rope=None)")
  d, dv = q.shape[-1], v.shape[-1]
  q, k, v, do = (_pad_lanes(x) for x in (q, k, v, do))
  segs = list(_segment_ids(seg)) if call.segments else []
  lead, lead_specs = _offset_operand(call, offset)
  operands = [*lead, q, k, v, do, lse, delta, *segs]
  dq = _dq(call, q, k, v, do, lead_specs, operands, interpret=interpret)
  dk, dv_ = _dkv(call, q, k, v, do, lse, delta, lead_specs, operands, interpret=interpret)
  return dq[..., :d], dk[..., :d], dv_[..., :dv]


def _dq(call: Call, q, k, v, do, lead_specs, operands, *, interpret: bool):
  """dQ over the forward's grid (key and value rows of a head whole)."""
  b, h = q.shape[:2]
  width = max(q.shape[-1], v.shape[-1])
  per_q, whole_kv, seg_specs = _query_specs(call, k)
  in_specs = [*lead_specs, per_q(q.shape[-1]), whole_kv(k), whole_kv(v), per_q(do.shape[-1])]
  return _pallas_call(
    dq_kernel,
    call,
    "iha_flash_dq",
    (call.tiles.num_q, b, h),
    flash_launch("dq", width, q.dtype),
    interpret,
    in_specs=[*in_specs, per_q(), per_q(), *seg_specs],
    out_specs=per_q(q.shape[-1]),
    out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
  )(*operands)


def _dkv(call: Call, q, k, v, do, lse, delta, lead_specs, operands, *, interpret: bool):
  """(dk, dv) over key tiles x batch x key/value heads; the group's r query heads whole.
  Query steps of at most 64 rows: two float32 accumulators and the transposed scores of
  128-row steps exceed the register file at d = 128."""
  b, g = q.shape[0], k.shape[1]
  tiles, r = call.tiles, call.group
  bq, bk = tiles.block_q, tiles.block_k
  width = max(q.shape[-1], v.shape[-1])
  step = min(DKV_BLOCK_Q, bq)
  call = dataclasses.replace(
    call, tiles=dataclasses.replace(tiles, block_q=step, num_q=tiles.num_q * bq // step)
  )
  group = lambda x: pl.BlockSpec(
    (None, r, *x.shape[2:]), lambda j, bb, gg: (bb, gg, 0, 0)[: x.ndim]
  )
  per_k = lambda x: pl.BlockSpec((None, None, bk, x.shape[-1]), lambda j, bb, gg: (bb, gg, j, 0))
  seg_specs = [
    pl.BlockSpec((None, q.shape[2]), lambda j, bb, gg: (bb, 0)),
    pl.BlockSpec((None, bk), lambda j, bb, gg: (bb, j)),
  ]
  return _pallas_call(
    dkv_kernel,
    call,
    "iha_flash_dkv",
    (tiles.num_k, b, g),
    flash_launch("dkv", width, q.dtype),
    interpret,
    in_specs=[
      *lead_specs,
      group(q),
      per_k(k),
      per_k(v),
      group(do),
      group(lse),
      group(delta),
      *(seg_specs if call.segments else []),
    ],
    out_specs=[per_k(k), per_k(v)],
    out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
  )(*operands)
