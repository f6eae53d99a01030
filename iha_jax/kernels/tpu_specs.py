"""How tiles reach the TPU kernels (`iha_jax.kernels.tpu`): BlockSpecs, band index maps,
the stacked token layouts, and the `pallas_call` of a sliced call.

Grid (B, outer tile, target head, band step): the outer axis walks query tiles (forward,
dQ) or key tiles (dK/dV); the band axis walks the other side's tiles that the outer tile
meets (`common.kv_range` / `q_range`), its index maps clamped past the band's end so the
block index repeats and no DMA is issued for skipped steps.

Sliced calls (`Config.sliced`: queries that are a slice of the keys' sequence) pass the
query offset as a scalar-prefetch operand (`[1]` int32 in SMEM): the index maps and the
kernels read it to shift the band, so one compiled kernel serves every offset. Unsliced
calls keep the plain grid (no prefetch operand, index maps unchanged).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from iha_jax.kernels import common
from iha_jax.kernels.common import Config


def offset_of(scalars) -> jax.Array | None:
  """The query offset from an index map's or kernel's scalar-prefetch refs (None: none)."""
  return scalars[0][0] if scalars else None


def split_offset(refs, cfg: Config) -> tuple[jax.Array | None, tuple]:
  """A kernel's refs -> (the query offset of a sliced call or None, the other refs)."""
  if cfg.sliced:
    return refs[0][0], refs[1:]
  return None, refs


def _clamp(lo, hi, step, cfg: Config):
  if not cfg.sliced:
    return jnp.minimum(lo + step, hi - 1)
  # An offset can leave a tile's band empty (hi <= lo, even hi = 0): stay on a real tile.
  return jnp.maximum(jnp.minimum(lo + step, hi - 1), 0)


class Specs:
  """BlockSpecs for grid (B, outer tile, target head, band step).

  `q_tile(x, o, *scalars)` / `k_tile(x, o, *scalars)` give the query / key tile index from
  the outer tile index x and band step o (and, sliced, the scalar-prefetch refs), clamped
  into the band.
  """

  def __init__(self, cfg: Config, q_tile, k_tile):
    self.cfg, self.q_tile, self.k_tile = cfg, q_tile, k_tile

  def source(self, rows: int, tile, lanes: int, kv: bool = False) -> pl.BlockSpec:
    """q/k/v, dq/dk/dv (`kv`: k, v, dk, dv): all source heads of the operand when mixing,
    else the one head query head h reads (h itself, or its key/value head `h // r`)."""
    cfg = self.cfg
    if cfg.mixing:
      heads, head = cfg.num_kv_heads if kv else cfg.num_heads, lambda h: 0
    else:
      heads, head = 1, cfg.kv_target if kv else (lambda h: h)
    return pl.BlockSpec(
      (None, heads, rows, lanes), lambda b, x, h, o, *s: (b, head(h), tile(x, o, *s), 0)
    )

  # Stacked token data (`token_layouts`): a tile's block spans the array's last two dims,
  # so any tile size obeys Mosaic's (sublane, lane) tiling.
  def column(self, rows: int, tile, batched: bool) -> pl.BlockSpec:  # [(B,) tiles, rows, 1]
    if batched:
      return pl.BlockSpec((None, None, rows, 1), lambda b, x, h, o, *s: (b, tile(x, o, *s), 0, 0))
    return pl.BlockSpec((None, rows, 1), lambda b, x, h, o, *s: (tile(x, o, *s), 0, 0))

  def row(self, rows: int, tile, batched: bool) -> pl.BlockSpec:  # [(B,) tiles, 1, rows]
    if batched:
      return pl.BlockSpec((None, None, 1, rows), lambda b, x, h, o, *s: (b, tile(x, o, *s), 0, 0))
    return pl.BlockSpec((None, 1, rows), lambda b, x, h, o, *s: (tile(x, o, *s), 0, 0))

  def per_pseudo(self, lanes: int) -> pl.BlockSpec:  # o, do, lse, delta at the query tile
    return pl.BlockSpec(
      (None, None, self.cfg.num_pseudo, self.cfg.block_q, lanes),
      lambda b, x, h, o, *s: (b, h, 0, self.q_tile(x, o, *s), 0),
    )

  def cotangents(self) -> list:  # do, lse, delta (backward inputs after `inputs`)
    return [self.per_pseudo(self.cfg.value_width), self.per_pseudo(1), self.per_pseudo(1)]

  def inputs(self, with_alpha: bool) -> list:
    cfg = self.cfg
    bq, bk = cfg.block_q, cfg.block_k
    rows_q, rows_k = cfg.num_pseudo * bq, cfg.num_pseudo * bk
    smem = [pl.BlockSpec(memory_space=pltpu.SMEM)] * (3 if with_alpha else 0)
    table = pl.BlockSpec((cfg.num_pseudo, cfg.half), lambda *_: (0, 0))
    return smem + [
      table,
      table,
      self.column(rows_q, self.q_tile, batched=False),
      self.column(rows_q, self.q_tile, batched=True),
      self.row(rows_k, self.k_tile, batched=False),
      self.row(rows_k, self.k_tile, batched=True),
      self.source(bq, self.q_tile, cfg.width),
      self.source(bk, self.k_tile, cfg.width, kv=True),
      self.source(bk, self.k_tile, cfg.value_width, kv=True),
    ]

  def dalpha(self, size: int) -> pl.BlockSpec:
    # [B, tiles, 1, size]: the last two block dims equal the array's (Mosaic tiling rule).
    return pl.BlockSpec(
      (None, None, 1, size), lambda b, x, h, o, *s: (b, x, 0, 0), memory_space=pltpu.SMEM
    )


def forward_specs(cfg: Config) -> Specs:
  """Outer axis: query tiles; band: the key tiles each one sees (forward and dQ)."""
  return Specs(
    cfg, lambda i, j, *s: i, lambda i, j, *s: _clamp(*common.kv_range(i, cfg, offset_of(s)), j, cfg)
  )


def dkv_specs(cfg: Config) -> Specs:
  """Outer axis: key tiles; band: the query tiles that see each one (dK/dV)."""
  return Specs(
    cfg, lambda j, t, *s: _clamp(*common.q_range(j, cfg, offset_of(s)), t, cfg), lambda j, t, *s: j
  )


def _stack(x: jax.Array, block: int, p: int) -> jax.Array:
  """`[..., Np]` token data -> `[..., tiles, P * block]`: each tile's tokens repeated per
  pseudo index, pseudo-major (the row order of `tpu._stacked` tiles)."""
  *lead, n = x.shape
  tiles = x.reshape(*lead, n // block, 1, block)
  return jnp.broadcast_to(tiles, (*lead, n // block, p, block)).reshape(*lead, n // block, -1)


def token_layouts(seg, cfg: Config) -> tuple[jax.Array, ...]:
  """Stacked virtual indices `t = n * P + p` and segment ids: query-tile columns
  `[nq, P*bq, 1]`, `[B, nq, P*bq, 1]`; key-tile rows `[nk, 1, P*bk]`, `[B, nk, 1, P*bk]`.

  `seg`: `[B, Np]` segment ids of queries and keys alike, or, sliced, `(offset [1],
  query ids [B, Np], key ids [B, Nkp])`: query token n then has virtual index
  `(offset + n) * P + p` on the keys' axis."""
  p = cfg.num_pseudo
  offset, seg_q, seg_k = seg if cfg.sliced else (None, seg, seg)
  tokens = jnp.arange(cfg.seq_len, dtype=jnp.int32)
  key_tokens = tokens if cfg.key_len == cfg.seq_len else jnp.arange(cfg.key_len, dtype=jnp.int32)

  def virtual(block, tokens):
    pseudo = jnp.repeat(jnp.arange(p, dtype=jnp.int32), block)
    return _stack(tokens, block, p) * p + pseudo

  t_q = virtual(cfg.block_q, tokens)
  if offset is not None:
    t_q = t_q + offset[0] * p
  return (
    t_q[..., None],
    _stack(seg_q, cfg.block_q, p)[..., None],
    virtual(cfg.block_k, key_tokens)[:, None, :],
    _stack(seg_k, cfg.block_k, p)[:, :, None, :],
  )


def call(kernel, cfg: Config, seg, *, grid, in_specs, out_specs, scratch_shapes, **kwargs):
  """`pl.pallas_call` over `grid`; a sliced call's query offset (from `seg`) goes first,
  as a scalar-prefetch operand the index maps and the kernel read."""
  if not cfg.sliced:
    return pl.pallas_call(
      kernel,
      grid=grid,
      in_specs=in_specs,
      out_specs=out_specs,
      scratch_shapes=scratch_shapes,
      **kwargs,
    )
  spec = pltpu.PrefetchScalarGridSpec(
    num_scalar_prefetch=1,
    grid=grid,
    in_specs=in_specs,
    out_specs=out_specs,
    scratch_shapes=scratch_shapes,
  )
  return functools.partial(pl.pallas_call(kernel, grid_spec=spec, **kwargs), seg[0])
