"""Flash attention over a (virtual) sequence on GPU: Pallas Triton kernels.

The GPU twin of `iha_jax.kernels.tpu_flash`, called by the same pipeline
(`iha_jax.kernels.virtual_attention`: IHA's pseudo q/k/v are mixed by einsums in HBM,
scaled and rotated there, so nothing here knows about pseudo-heads). Each kernel's inner
loop is one plain flash step over a key (or query) tile: two tensor-core matmuls
(`wgmma` on Hopper), the online softmax and the mask; no source-head loads or mixing.

Layouts (rows: the attended sequence, padded to whole tiles; the same as tpu_flash):
  q `[B, H, Tq, d]`, k `[B, G, Tk, d]`, v `[B, G, Tk, dv]` (G divides H: query head h
  reads key/value head `h // (H // G)`), o `[B, H, Tq, dv]`, lse `[B, H, Tq]` f32;
  segment ids (optional) as tpu_flash takes them (query ids `[B, Tq, 1]`, key ids
  `[B, tiles, 1, bk]`; padding keys -1, padding queries 0: zero outputs); d and dv are
  padded here to a power of two >= 16 lanes (Triton's block shapes).
Grids: forward and dQ `(query tiles, B, H)`, the longest causal bands first; dK/dV
`(key tiles, B, G)`, the r query heads of a group looped inside the program, so no two
programs write the same rows (no atomics). The bands come from `Tiles.key_band` /
`query_band` (a traced query offset of a sequence shard is a `[1]` int32 operand).
Launches (warps, pipeline stages) are `launch()`'s, checked spill-free for H100 by
`tests/test_compile_targets.py`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from iha_jax.core.masking import MASK_VALUE
from iha_jax.kernels.tile_schedule import Call

MIN_LANES = 16  # Triton dots need every dimension >= 16
DKV_BLOCK_Q = 64  # query rows per dK/dV step (`backward`)
_NT = (((1,), (1,)), ((), ()))  # a @ b.T
_NN = (((1,), (0,)), ((), ()))  # a @ b


def next_pow2(x: int) -> int:
  return 1 << max(0, x - 1).bit_length()


@dataclasses.dataclass(frozen=True)
class Launch:
  """Warps and software-pipeline stages of one kernel."""

  num_warps: int
  num_stages: int


def launch(kernel: str, width: int, dtype) -> Launch:
  """The launch of `kernel` ("forward", "dq", "dkv") at lane width `width` (max of d,
  dv after padding): 8 warps hold a 128-row float32 accumulator of 128 lanes in
  registers; three stages of bf16 tiles of <= 128 lanes, two for float32 or wider ones
  (shared memory)."""
  wide = width > 64 or kernel == "dkv"
  stages = 3 if jnp.dtype(dtype).itemsize <= 2 and width <= 128 else 2
  return Launch(num_warps=8 if wide else 4, num_stages=stages)


def _dot(a: jax.Array, b: jax.Array, dims) -> jax.Array:
  """A float32-accumulated matmul: tensor cores for 16-bit inputs; float32 inputs get true
  float32 products (on the CUDA cores)."""
  precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
  return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32, precision=precision)


def _offset(refs, call: Call):
  """(query offset in rows, remaining refs): a traced offset is the first operand."""
  if call.tiles.offset is None:
    return refs[0][0], refs[1:]
  return call.tiles.offset, refs


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


def _query_tile(call: Call, grid_index):
  """The query tile of grid index `grid_index` (forward and dQ): the last first, so the
  widest causal bands start first."""
  return call.tiles.num_q - 1 - grid_index


def _rows(ref, tile, block: int, head=None):
  """Rows `[tile * block, (tile + 1) * block)` of a ref (of head `head` of a group's)."""
  rows = pl.ds(tile * block, block)
  return ref[rows] if head is None else ref[head, rows]


# --- forward ------------------------------------------------------------------------------


def _forward_kernel(*refs, call: Call):
  offset, refs = _offset(refs, call)
  q_ref, k_ref, v_ref, *refs = refs
  seg_q_ref, seg_k_ref, o_ref, lse_ref = refs if call.segments else (None, None, *refs)
  tiles = call.tiles
  i = _query_tile(call, pl.program_id(0))
  seg_q = seg_q_ref[...] if call.segments else None
  q = q_ref[...]

  def body(j, carry):
    m, l, acc = carry
    k, v = _rows(k_ref, j, tiles.block_k), _rows(v_ref, j, tiles.block_k)
    seg_k = _rows(seg_k_ref, j, tiles.block_k) if call.segments else None
    visible = _mask(call, i, j, offset, seg_q, seg_k, transposed=False)
    s = jnp.where(visible, _dot(q, k, _NT), MASK_VALUE)
    m_next = jnp.maximum(m, jnp.max(s, axis=1))
    p = jnp.where(visible, jnp.exp(s - m_next[:, None]), 0.0)
    rescale = jnp.exp(m - m_next)
    l = rescale * l + jnp.sum(p, axis=1)
    acc = rescale[:, None] * acc + _dot(p.astype(v.dtype), v, _NN)
    return m_next, l, acc

  bq, dv = tiles.block_q, o_ref.shape[-1]
  init = (
    jnp.full((bq,), MASK_VALUE, jnp.float32),
    jnp.zeros((bq,), jnp.float32),
    jnp.zeros((bq, dv), jnp.float32),
  )
  lo, hi = tiles.key_band(i, offset)
  m, l, acc = lax.fori_loop(lo, hi, body, init)
  l_safe = jnp.where(l == 0.0, 1.0, l)  # rows that see no key (padding) output 0
  out = acc / l_safe[:, None]
  if call.segments:
    out = jnp.where((seg_q != 0)[:, None], out, 0.0)
  o_ref[...] = out.astype(o_ref.dtype)
  lse_ref[...] = m + jnp.log(l_safe)


# --- backward -----------------------------------------------------------------------------


def _dq_kernel(*refs, call: Call):
  offset, refs = _offset(refs, call)
  q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs = refs
  seg_q_ref, seg_k_ref, dq_ref = refs if call.segments else (None, None, *refs)
  tiles = call.tiles
  i = _query_tile(call, pl.program_id(0))
  seg_q = seg_q_ref[...] if call.segments else None
  q, do, lse, delta = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]

  def body(j, dq):
    k, v = _rows(k_ref, j, tiles.block_k), _rows(v_ref, j, tiles.block_k)
    seg_k = _rows(seg_k_ref, j, tiles.block_k) if call.segments else None
    visible = _mask(call, i, j, offset, seg_q, seg_k, transposed=False)
    p = jnp.where(visible, jnp.exp(_dot(q, k, _NT) - lse[:, None]), 0.0)
    ds = p * (_dot(do, v, _NT) - delta[:, None])
    return dq + _dot(ds.astype(k.dtype), k, _NN)

  lo, hi = tiles.key_band(i, offset)
  dq = lax.fori_loop(lo, hi, body, jnp.zeros(q.shape, jnp.float32))
  dq_ref[...] = dq.astype(dq_ref.dtype)


def _dkv_kernel(*refs, call: Call):
  offset, refs = _offset(refs, call)
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
    p_t = jnp.where(visible, jnp.exp(_dot(k, q, _NT) - lse[None, :]), 0.0)  # [bk, bq]
    dv = dv + _dot(p_t.astype(do.dtype), do, _NN)
    ds_t = p_t * (_dot(v, do, _NT) - delta[None, :])
    return dk + _dot(ds_t.astype(q.dtype), q, _NN), dv

  lo, hi = tiles.query_band(j, offset)
  num_q_steps = jnp.maximum(hi - lo, 0)
  zeros = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
  # One loop over (query head of the group, query tile): the r heads add into one block.
  dk, dv = lax.fori_loop(0, call.group * num_q_steps, body, zeros)
  dk_ref[...] = dk.astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


# --- pallas_call wrappers -------------------------------------------------------------------


def _pad_lanes(x: jax.Array) -> jax.Array:
  width = max(MIN_LANES, next_pow2(x.shape[-1]))
  return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - x.shape[-1])])


def _segment_ids(seg) -> tuple[jax.Array, jax.Array]:
  seg_q, seg_k = seg
  return seg_q[..., 0], seg_k.reshape(seg_k.shape[0], -1)


def _pallas(kernel, call: Call, name: str, grid, launch_: Launch, interpret: bool, **specs):
  return pl.pallas_call(
    functools.partial(kernel, call=call),
    grid=grid,
    compiler_params=plgpu.CompilerParams(
      num_warps=launch_.num_warps, num_stages=launch_.num_stages
    ),
    interpret=interpret,
    name=name,
    **specs,
  )


def _offset_operand(call: Call, offset) -> tuple[list, list]:
  if call.tiles.offset is None:
    return [offset], [pl.BlockSpec(offset.shape, lambda *_: (0,))]
  return [], []


def forward(call: Call, q, k, v, rope, seg, offset, *, interpret: bool):
  """-> (o `[B, H, Tq, dv]` in q.dtype, lse `[B, H, Tq]` float32); arguments as
  `tpu_flash.forward`'s (`rope` must be None: RoPE is applied before, in HBM)."""
  if rope is not None:
    raise ValueError("gpu_flash takes q and k already rotated (rope=None)")
  b, h, tq, dv = *q.shape[:3], v.shape[-1]
  q, k, v = (_pad_lanes(x) for x in (q, k, v))
  tiles, r = call.tiles, call.group
  bq, width = tiles.block_q, max(q.shape[-1], v.shape[-1])
  operands, in_specs = _offset_operand(call, offset)
  home = functools.partial(_query_tile, call)
  operands += [q, k, v]
  in_specs += [
    pl.BlockSpec((None, None, bq, q.shape[-1]), lambda i, bb, hh: (bb, hh, home(i), 0)),
    pl.BlockSpec((None, None, *k.shape[2:]), lambda i, bb, hh: (bb, hh // r, 0, 0)),
    pl.BlockSpec((None, None, *v.shape[2:]), lambda i, bb, hh: (bb, hh // r, 0, 0)),
  ]
  if call.segments:
    seg_q, seg_k = _segment_ids(seg)
    operands += [seg_q, seg_k]
    in_specs += [
      pl.BlockSpec((None, bq), lambda i, bb, hh: (bb, home(i))),
      pl.BlockSpec((None, seg_k.shape[1]), lambda i, bb, hh: (bb, 0)),
    ]
  o, lse = _pallas(
    _forward_kernel,
    call,
    "iha_flash_forward",
    (tiles.num_q, b, h),
    launch("forward", width, q.dtype),
    interpret,
    in_specs=in_specs,
    out_specs=[
      pl.BlockSpec((None, None, bq, v.shape[-1]), lambda i, bb, hh: (bb, hh, home(i), 0)),
      pl.BlockSpec((None, None, bq), lambda i, bb, hh: (bb, hh, home(i))),
    ],
    out_shape=[
      jax.ShapeDtypeStruct((b, h, tq, v.shape[-1]), q.dtype),
      jax.ShapeDtypeStruct((b, h, tq), jnp.float32),
    ],
  )(*operands)
  return o[..., :dv], lse


def backward(call: Call, q, k, v, rope, seg, offset, do, lse, delta, *, interpret: bool):
  """-> (dq, dk, dv) in q's, k's and v's dtypes; `do` `[B, H, Tq, dv]`, `lse` and `delta`
  (`rowsum(o * do)`) `[B, H, Tq]` float32; the rest as `forward`'s."""
  if rope is not None:
    raise ValueError("gpu_flash takes q and k already rotated (rope=None)")
  b, h, tq, d = q.shape
  g, dv = k.shape[1], v.shape[-1]
  q, k, v, do = (_pad_lanes(x) for x in (q, k, v, do))
  tiles, r = call.tiles, call.group
  bq, bk = tiles.block_q, tiles.block_k
  width = max(q.shape[-1], v.shape[-1])
  segs = list(_segment_ids(seg)) if call.segments else []
  lead, lead_specs = _offset_operand(call, offset)
  operands = [*lead, q, k, v, do, lse, delta, *segs]

  # dQ: the forward's grid.
  home = functools.partial(_query_tile, call)
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
  dq = _pallas(
    _dq_kernel,
    call,
    "iha_flash_dq",
    (tiles.num_q, b, h),
    launch("dq", width, q.dtype),
    interpret,
    in_specs=[
      *lead_specs,
      per_q(q.shape[-1]),
      whole_kv(k),
      whole_kv(v),
      per_q(do.shape[-1]),
      per_q(),
      per_q(),
      *(seg_specs if call.segments else []),
    ],
    out_specs=per_q(q.shape[-1]),
    out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
  )(*operands)

  # dK/dV: key tiles x batch x key/value heads; the group's r query heads whole. Query
  # steps of at most 64 rows: two float32 accumulators and the transposed scores of
  # 128-row steps exceed the register file at d = 128.
  step = min(DKV_BLOCK_Q, bq)
  call = dataclasses.replace(
    call, tiles=dataclasses.replace(tiles, block_q=step, num_q=tiles.num_q * bq // step)
  )
  group = lambda x: pl.BlockSpec(
    (None, r, *x.shape[2:]), lambda j, bb, gg: (bb, gg, 0, 0)[: x.ndim]
  )
  per_k = lambda x: pl.BlockSpec((None, None, bk, x.shape[-1]), lambda j, bb, gg: (bb, gg, j, 0))
  dk, dv_ = _pallas(
    _dkv_kernel,
    call,
    "iha_flash_dkv",
    (tiles.num_k, b, g),
    launch("dkv", width, q.dtype),
    interpret,
    in_specs=[
      *lead_specs,
      group(q),
      per_k(k),
      per_k(v),
      group(do),
      group(lse),
      group(delta),
      *(
        [
          pl.BlockSpec((None, q.shape[2]), lambda j, bb, gg: (bb, 0)),
          pl.BlockSpec((None, bk), lambda j, bb, gg: (bb, j)),
        ]
        if call.segments
        else []
      ),
    ],
    out_specs=[per_k(k), per_k(v)],
    out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
  )(*operands)
  return dq[..., :d], dk[..., :d], dv_[..., :dv]
