"""Sliding-window IHA on TPU with the pseudo-heads made, attended and collapsed in VMEM
(docs/design.md §8, the on-chip window path: why, and how the work maps to the MXU).

One grid step takes a tile of tokens and, per target head, mixes its pseudo rows by
products with block-diagonal constants, rotates them by `R(p)` (the source heads are
rotated at `pos * P` in XLA), attends each block of `cq` query rows to its whole band as
one `[cq, kb]` score tile (plain softmax; the mask a constant bias plus key ids per block)
and collapses the head's output: only source-sized arrays cross HBM, forward and backward.
Layouts: source rows token-major, `[B, tokens * heads, d]` (a free reshape of `[B, N, H,
d]`); the keys padded in front so that tile i's own keys start a block, its band its own
block and `halo` blocks before it (and after it, bidirectional); y `[B, N, Ho, d]` float32.
Here: the constants built in XLA, block specs, the calls and the custom VJP.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from iha_jax.core.options import AttentionOptions
from iha_jax.core.rope import apply_rope
from iha_jax.core.validation import default_positions
from iha_jax.kernels.tpu import on_tpu
from iha_jax.kernels.window import common
from iha_jax.kernels.window.common import block_diagonal, full_collapse, in_band, pseudo_angles
from iha_jax.kernels.window.tpu_kernel import HALF_MASK, backward_kernel, forward_kernel
from iha_jax.kernels.window.tpu_plan import VMEM_LIMIT_BYTES, Plan, gather_band, tiling


def _collapse_blocks(collapse: jax.Array, plan: Plan) -> jax.Array:
  """`collapse` -> `[Ht, s*Ho, s*P]`: per target head h', rows (n, ho), columns (n', p),
  `delta(n, n') collapse[ho, h', p]` (per head: only ho = h')."""
  collapse = full_collapse(collapse, plan)  # [Ho, Ht, P]
  # As weights [S=Ho, T=Ht, P]: kron gives rows (n, p), columns (n', ho); transpose.
  return jnp.swapaxes(block_diagonal(collapse, plan.group), 1, 2)


def _group_table(plan: Plan, theta: float) -> jax.Array:
  """`[s*P, 2d]` float32 `cos | sin` of `R(p)` for the rows (n, p) of a token group, in
  the kernels' rotate-half form (`cos = [c, c]`, `sin = [-s, s]`)."""
  angles = pseudo_angles(jnp.arange(plan.num_pseudo, dtype=jnp.float32), plan.head_dim, theta)
  cos, sin = jnp.cos(angles), jnp.sin(angles)
  table = jnp.concatenate([cos, cos, -sin, sin], axis=-1)  # [P, 2d]
  # As many token groups as the longest stacked mixing product's rows.
  return jnp.tile(table, (max(plan.group * plan.q_stack, plan.kv_group * plan.kv_stack), 1))


def _band_bias(plan: Plan) -> jax.Array:
  """`[cq, kb]` float32: 0 where a block's query row sees the key column by the window
  and causality (`in_band`), HALF_MASK elsewhere (the same for every block)."""
  rows = np.arange(plan.block_rows)[:, None] + plan.lo_rows
  cols = np.arange(plan.key_rows)[None, :] + plan.base
  ok = in_band(rows - cols, plan.window, plan.causal)
  return jnp.asarray(np.where(ok, 0.0, HALF_MASK), jnp.float32)


def _band_specs(plan: Plan, heads: int, d: int):
  """BlockSpecs of a key-side source array `[B, key_tokens * heads, d]`: halo blocks
  before the tile's own block, the block, halo blocks after."""
  per_tile = plan.tile // plan.halo
  first = plan.first_block

  def own(b, i):
    return b, i + first, 0

  def halo_at(shift):  # halo block `shift` (negative: before) relative to the own block
    return lambda b, i: (b, (i + first) * per_tile + shift + (per_tile - 1 if shift > 0 else 0), 0)

  before = [
    pl.BlockSpec((None, plan.halo * heads, d), halo_at(-j)) for j in range(plan.halo_before, 0, -1)
  ]
  after = [
    pl.BlockSpec((None, plan.halo * heads, d), halo_at(j)) for j in range(1, plan.halo_after + 1)
  ]
  return [*before, pl.BlockSpec((None, plan.tile * heads, d), own), *after]


def _whole(shape):
  return pl.BlockSpec(shape, lambda b, i: (0,) * len(shape))


class Constants(NamedTuple):
  """The kernels' small operands, built in XLA (`prepare`)."""

  aq: jax.Array  # [Ht, s*P, s*H]: `block_diagonal(alpha_q * scale)`
  ak: jax.Array  # [Gt, s*P, s*G]
  av: jax.Array  # [Gt, s*P, s*G]
  cm: jax.Array  # [Ht, s*Ho, s*P]: `_collapse_blocks(collapse)`
  bias: jax.Array  # [cq, kb] float32: `_band_bias`
  key_ids: jax.Array  # [B, tiles, blocks, kb] int32
  table: jax.Array | None  # [rows, 2d] float32 `cos | sin` of R(p) (`_group_table`), or None
  query_ids: jax.Array | None  # [B, rows, 1] int32, or None (no segments)

  def operands(self, plan: Plan, backward: bool) -> list[jax.Array]:
    """The kernels' constant operands: the mixing matrices stacked as the kernels' products
    take them (`q_stack` / `kv_stack` heads per product), per head where a gradient
    product takes them (the transposes)."""
    jq, jk = plan.q_stack, plan.kv_stack
    out = [_stacked(self.aq, jq), _stacked(self.ak, jk), _stacked(self.av, jk), self.cm]
    out += [self.bias, self.key_ids]
    if backward:  # the transposes, for the gradients' products (do's mixing stacked)
      aqt, akt, avt, cmt = (jnp.swapaxes(x, 1, 2) for x in (self.aq, self.ak, self.av, self.cm))
      out += [aqt, akt, avt, _stacked(cmt, jq)]
    return out + [x for x in (self.table, self.query_ids) if x is not None]


def _stacked(matrices: jax.Array, heads: int) -> jax.Array:
  """`[T, r, c]` per-head matrices -> `[T / heads, heads * r, c]`: consecutive heads' rows
  one after another (one product mixes them all)."""
  t, r, c = matrices.shape
  return matrices.reshape(t // heads, heads * r, c)


def _constant_specs(plan: Plan, operands: list[jax.Array]):
  """BlockSpecs of `Constants.operands`: each whole, except the per-tile key ids (6th)
  and query ids (last, with segments)."""
  specs = [_whole(x.shape) for x in operands]
  specs[5] = pl.BlockSpec((None, None, plan.blocks, plan.key_rows), lambda b, i: (b, i, 0, 0))
  if plan.segments:
    rows = plan.tile * plan.num_pseudo
    specs[-1] = pl.BlockSpec((None, rows, 1), lambda b, i: (b, i, 0))
  return specs


def _source_spec(plan: Plan, heads: int):
  return pl.BlockSpec((None, plan.tile * heads, plan.head_dim), lambda b, i: (b, i, 0))


def _call(plan: Plan, kernel, name: str, sources, constants: Constants, outs, scratch, interpret):
  """`kernel` over the grid `(B, tiles)` on `sources` (q, k, v, and dy in the backward; k
  and v once per block of the band) and the constants; `outs`: (BlockSpec,
  ShapeDtypeStruct) per output."""
  q, k, v, *dy = sources
  d, band = plan.head_dim, plan.halo_before + 1 + plan.halo_after
  fixed = constants.operands(plan, backward=bool(dy))
  in_specs = [
    _source_spec(plan, plan.heads),
    *_band_specs(plan, plan.kv_heads, d),
    *_band_specs(plan, plan.kv_heads, d),
    *[_source_spec(plan, plan.out_heads) for _ in dy],
    *_constant_specs(plan, fixed),
  ]
  return pl.pallas_call(
    functools.partial(kernel, plan=plan),
    grid=(q.shape[0], plan.num_tiles),
    in_specs=in_specs,
    out_specs=[spec for spec, _ in outs],
    out_shape=[shape for _, shape in outs],
    scratch_shapes=scratch,
    compiler_params=pltpu.CompilerParams(
      dimension_semantics=("parallel", "parallel"), vmem_limit_bytes=VMEM_LIMIT_BYTES
    ),
    interpret=interpret,
    name=name,
  )(q, *([k] * band), *([v] * band), *dy, *fixed)


def _forward_call(plan: Plan, q, k, v, constants: Constants, *, interpret: bool):
  b, d, rows = q.shape[0], plan.head_dim, plan.tile * plan.num_pseudo
  y = jax.ShapeDtypeStruct((b, plan.num_tiles * plan.tile * plan.out_heads, d), jnp.float32)
  scratch = [
    pltpu.VMEM((plan.q_stack, rows, d), q.dtype),  # pseudo q per stacked head
    pltpu.VMEM((plan.kv_stack, plan.band_rows, d), q.dtype),  # pseudo k, v
    pltpu.VMEM((plan.kv_stack, plan.band_rows, d), q.dtype),
    pltpu.VMEM((rows, d), q.dtype),  # one head's pseudo o
  ]
  outs = [(_source_spec(plan, plan.out_heads), y)]
  args = (plan, forward_kernel, "iha_window_forward", (q, k, v), constants, outs, scratch)
  return _call(*args, interpret)[0]


def _backward_call(plan: Plan, q, k, v, dy, constants: Constants, *, interpret: bool):
  b, d, rows = q.shape[0], plan.head_dim, plan.tile * plan.num_pseudo
  g, tiles = plan.kv_heads, plan.num_tiles
  per_tile = lambda shape: pl.BlockSpec(
    (None, None, *shape), lambda b, i: (b, i) + (0,) * len(shape)
  )
  halo_rows = lambda count: (max(count, 1) * plan.halo * g, d)
  f32 = lambda shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  key_side = [
    (per_tile(halo_rows(plan.halo_before)), f32((b, tiles, *halo_rows(plan.halo_before)))),
    (_source_spec(plan, g), f32((b, tiles * plan.tile * g, d))),
    (per_tile(halo_rows(plan.halo_after)), f32((b, tiles, *halo_rows(plan.halo_after)))),
  ]
  outs = [(_source_spec(plan, plan.heads), f32((b, tiles * plan.tile * plan.heads, d)))]
  outs += key_side + key_side
  s, s_kv, p = plan.group, plan.kv_group, plan.num_pseudo
  matrices = [  # aq, ak, av, cm (`Constants`)
    (plan.targets, s * p, s * plan.heads),
    (plan.kv_targets, s_kv * p, s_kv * plan.kv_heads),
    (plan.kv_targets, s_kv * p, s_kv * plan.kv_heads),
    (plan.targets, s * plan.out_heads, s * p),
  ]
  outs += [(per_tile(shape), f32((b, tiles, *shape))) for shape in matrices]
  dtype = q.dtype
  scratch = [
    pltpu.VMEM((plan.q_stack, rows, d), dtype),  # pseudo q per stacked head
    pltpu.VMEM((plan.q_stack, rows, d), dtype),  # pseudo do
    pltpu.VMEM((rows, d), jnp.float32),  # one head's pseudo dq
    pltpu.VMEM((rows, d), dtype),  # one head's pseudo o
    pltpu.VMEM((plan.kv_stack, plan.band_rows, d), dtype),  # pseudo k, v per stacked head
    pltpu.VMEM((plan.kv_stack, plan.band_rows, d), dtype),
    pltpu.VMEM((plan.band_rows, d), jnp.float32),  # one head's pseudo dk, dv
    pltpu.VMEM((plan.band_rows, d), jnp.float32),
  ]
  args = (plan, backward_kernel, "iha_window_backward", (q, k, v, dy), constants, outs, scratch)
  results = _call(*args, interpret)
  dq, dk_parts, dv_parts, dmats = results[0], results[1:4], results[4:7], results[7:]
  dk, dv = (gather_band(plan, parts, b, plan.key_tokens) for parts in (dk_parts, dv_parts))
  daq, dak, dav, dcm = (x.sum(axis=(0, 1)) for x in dmats)
  return dq, dk, dv, daq, dak, dav, dcm


def _ids(plan: Plan, b: int, n: int, nk: int, options: AttentionOptions):
  """(key ids per block `[B, tiles, blocks, kb]` int32: > 0 a visible key's segment, -1
  padding; query ids `[B, tiles * tile * P, 1]` or None without segments)."""
  p = plan.num_pseudo
  sliced = options.sliced or nk != n
  query_ids = options.segment_ids
  key_ids = options.key_segment_ids if sliced else options.segment_ids
  if key_ids is None:
    key_ids = jnp.ones((b, nk), jnp.int32)
  key_ids = jnp.where(key_ids == 0, -1, key_ids.astype(jnp.int32))
  tail = plan.key_tokens - plan.front - nk
  key_ids = jnp.pad(key_ids, ((0, 0), (plan.front, tail)), constant_values=-1)
  key_rows = jnp.repeat(key_ids, p, axis=1)  # [B, key_tokens * P]
  # Block j (over all tiles: they are contiguous) sees rows [start + j*cq, + kb): windows
  # at a stride of cq, made of `width` consecutive cq-row pieces (slices, not a gather).
  cq, blocks = plan.block_rows, plan.num_tiles * plan.blocks
  start = plan.first_block * plan.tile * p - plan.lo_rows + plan.base
  width = -(-plan.key_rows // cq)
  stop = start + (blocks + width - 1) * cq
  key_rows = jnp.pad(key_rows, ((0, 0), (0, max(0, stop - key_rows.shape[1]))), constant_values=-1)
  pieces = key_rows[:, start:stop].reshape(b, blocks + width - 1, cq)
  windows = jnp.concatenate([pieces[:, i : i + blocks] for i in range(width)], axis=-1)
  per_block = windows[..., : plan.key_rows].reshape(b, plan.num_tiles, plan.blocks, plan.key_rows)
  qid = None
  if plan.segments:
    if query_ids is None:
      query_ids = jnp.ones((b, n), jnp.int32)
    padded = jnp.pad(query_ids.astype(jnp.int32), ((0, 0), (0, plan.num_tiles * plan.tile - n)))
    qid = jnp.repeat(padded, p, axis=1)[..., None]
  return per_block, qid


def prepare(q, k, v, alphas, collapse, options: AttentionOptions, plan: Plan):
  """(q, k, v as the kernels' padded source rows, rotated by `R(pos * P)`; `Constants`)."""
  b, n, _, d = q.shape
  nk = k.shape[1]
  p = plan.num_pseudo
  positions = default_positions(q, options.positions)
  sliced = options.sliced or nk != n
  key_positions = options.key_positions if sliced else positions
  if key_positions is None:
    key_positions = jnp.broadcast_to(jnp.arange(nk, dtype=jnp.int32), (b, nk))
  if plan.rotary:  # R(pos * P) on the source heads; R(p) per pseudo row in the kernels
    q = apply_rope(q, positions * p, options.rope_theta)
    k = apply_rope(k, key_positions * p, options.rope_theta)
  pad_q = plan.num_tiles * plan.tile - n
  q = jnp.pad(q, ((0, 0), (0, pad_q), (0, 0), (0, 0))).reshape(b, -1, d)
  tail = plan.key_tokens - plan.front - nk
  k, v = (
    jnp.pad(x, ((0, 0), (plan.front, tail), (0, 0), (0, 0))).reshape(b, -1, d) for x in (k, v)
  )
  alpha_q, alpha_k, alpha_v = (a.astype(jnp.float32) for a in alphas)
  dtype = q.dtype
  key_ids, query_ids = _ids(plan, b, n, nk, options)
  constants = Constants(
    # The softmax scale, and log2(e): the kernels take powers of two (`_softmax`).
    aq=block_diagonal(alpha_q * (math.log2(math.e) / math.sqrt(d)), plan.group).astype(dtype),
    ak=block_diagonal(alpha_k, plan.kv_group).astype(dtype),
    av=block_diagonal(alpha_v, plan.kv_group).astype(dtype),
    cm=_collapse_blocks(collapse.astype(jnp.float32), plan).astype(dtype),
    bias=_band_bias(plan),
    key_ids=key_ids,
    table=_group_table(plan, options.rope_theta) if plan.rotary else None,
    query_ids=query_ids,
  )
  return q, k, v, constants


def _kernel_inputs(plan: Plan, options: AttentionOptions, q, k, v, alphas, collapse):
  """(the differentiable kernel operands: padded rotated q, k, padded v, and the mixing
  matrices; the other constants)."""
  q, k, v, c = prepare(q, k, v, alphas, collapse, options, plan)
  return (q, k, v, c.aq, c.ak, c.av, c.cm), (c.bias, c.key_ids, c.table, c.query_ids)


def _forward_rows(plan: Plan, options: AttentionOptions, q, k, v, alphas, collapse):
  """y rows `[B, tiles * tile * Ho, d]` float32 of the source heads: the forward kernel."""
  operands, fixed = _kernel_inputs(plan, options, q, k, v, alphas, collapse)

  def call(q, k, v, aq, ak, av, cm, fixed, *, interpret):
    return _forward_call(plan, q, k, v, Constants(aq, ak, av, cm, *fixed), interpret=interpret)

  return on_tpu(call, *operands, fixed)


def _backward_rows(plan: Plan, options: AttentionOptions, q, k, v, alphas, collapse, dy):
  """The cotangents of q, k, v, alphas, collapse: the backward kernel on the operands made
  again in XLA, then `prepare`'s transpose."""
  primals = (q, k, v, alphas, collapse)
  operands, prepare_vjp = jax.vjp(lambda *x: _kernel_inputs(plan, options, *x)[0], *primals)
  fixed = _kernel_inputs(plan, options, *primals)[1]

  def call(q, k, v, dy, aq, ak, av, cm, fixed, *, interpret):
    constants = Constants(aq, ak, av, cm, *fixed)
    return _backward_call(plan, q, k, v, dy, constants, interpret=interpret)

  q, k, v, aq, ak, av, cm = operands
  grads = on_tpu(call, q, k, v, dy.astype(q.dtype), aq, ak, av, cm, fixed)
  grads = tuple(g.astype(x.dtype) for g, x in zip(grads, operands))
  return prepare_vjp(grads)


_rows = common.saving_the_call(_forward_rows, _backward_rows)


def _output(plan: Plan, options: AttentionOptions, q, k, v, alphas, collapse):
  """y `[B, N, Ho, d]` float32 (the kernels' rows, past the call's tokens dropped)."""
  b, n, _, d = q.shape
  y = _rows(plan, options, q, k, v, alphas, collapse)
  return y.reshape(b, -1, plan.out_heads, d)[:, :n]


def window_iha(q, k, v, alphas, collapse, options: AttentionOptions) -> jax.Array:
  """Sliding-window IHA on TPU (`common.window_iha`'s arguments and result): `block_sizes`'
  `block_q` the virtual rows per target head of a grid step (rounded to whole tokens),
  `block_k` the query rows of a score tile; refuses with `TpuUnsupportedShape`."""
  return common.window_iha(_output, plan_for, q, k, v, alphas, collapse, options)


def plan_for(q, k, alphas, collapse, options: AttentionOptions) -> Plan:
  """The `Plan` of a call (arrays or ShapeDtypeStructs)."""
  low_precision = jnp.dtype(q.dtype).itemsize <= 2
  return common.plan_for(tiling, q, k, alphas, collapse, options, low_precision=low_precision)


def unsupported(q, v, num_pseudo: int, options: AttentionOptions) -> str | None:
  """`common.unsupported` of this path: why it cannot take a call, or None."""
  return common.unsupported(plan_for, q, v, num_pseudo, options)
