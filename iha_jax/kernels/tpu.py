"""Fused IHA attention for TPU: Pallas Mosaic kernels (forward, dQ, dK/dV).

Layouts are those of `iha_jax.kernels.common`. Mosaic copies BlockSpec tiles
HBM -> VMEM, so the band loop is a grid axis: grid (B, tiles, target heads,
band), where the band axis walks only the key (or query) tiles the band (causal
or bidirectional, global or window: `common.kv_range` / `q_range`) touches; its
size is the widest band. Its index maps clamp past the band's end, so the block
index repeats and no new DMA is issued for the skipped steps, which `pl.when`
turns into no-ops: blocks outside the band are never loaded nor computed.
Accumulators live in VMEM scratch across the band axis.
- A tile of `block` tokens is built as P pieces `[block, W]` (piece p: pseudo-head p of
  every token) into a `[P, block, W]` VMEM scratch and read back as ONE pseudo-major
  `[P * block, W]` matrix (`_stacked`), so each tile pair is one matmul. The tile's
  virtual indices `t = n * P + p` and segment ids arrive precomputed in the same stacked
  order (`_token_layouts`), whole-array blocks of their last two dims.
- forward: the pseudo-q pieces are built once per (tile, head) into scratch.
- dQ / dK-dV: the target-head axis is "arbitrary" and the float32 source-gradient
  block stays resident in VMEM across it, so every target head adds its
  alpha-contracted pseudo gradient into the same block (no atomics, no
  P-sized gradient). Partial dalpha goes to an SMEM block per (batch, tile).
Mosaic tiling: token tiles are multiples of 8 (16 for 2-byte types). Default tiles fit
`VMEM_BUDGET_BYTES` of the default 16 MiB scoped VMEM (`tiled`, `vmem_estimate`).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from iha_jax.kernels import common
from iha_jax.kernels.common import Config
from iha_jax.ops.masking import MASK_VALUE, visible
from iha_jax.ops.options import round_up

_LANES = 128


def half_width(head_dim: int) -> int:
  """Lanes per RoPE half: exactly ceil(d / 2) (a full-width block needs no padding)."""
  return -(-head_dim // 2)


# The pseudo output's axes in einsum letters: [B, Ht, P, Np, W].
OUTPUT_SPEC = "bhpnd"


def pseudo_rows(num_pseudo: int) -> int:
  """Pieces per tile: one per pseudo index."""
  return num_pseudo


def pseudo_view(o: jax.Array, cfg: Config) -> jax.Array:
  del cfg
  return o


kernel_view = pseudo_view


def collapse_weights(collapse: jax.Array, cfg: Config) -> jax.Array:
  del cfg
  return collapse


def dalpha_flat(x: jax.Array, cfg: Config) -> jax.Array:
  """Partials `[B, tiles, 1, Ht * H * P]` -> the flat (target, source, pseudo) layout."""
  return x.reshape(-1, cfg.flat_alpha).sum(axis=0)


def _tokens(name: str, value: int | None, num_pseudo: int) -> int | None:
  """A tile of `value` virtual tokens in tokens (the kernels tile whole tokens)."""
  if value is None:
    return None
  if value % num_pseudo:
    raise ValueError(
      f"{name} = {value} virtual tokens must be a multiple of P = {num_pseudo} for the "
      "TPU kernels (a tile holds whole tokens)."
    )
  return value // num_pseudo


# Mosaic's default scoped-VMEM limit on v4, v5e, v5p and v6e; tiles are chosen to fit
# it with room for the compiler's own temporaries, so no kernel needs a larger limit.
SCOPED_VMEM_BYTES = 16 * 2**20
VMEM_BUDGET_BYTES = 12 * 2**20


def _tile_bytes(shape: tuple[int, ...], itemsize: int) -> int:
  """VMEM bytes of an array padded to Mosaic's (sublane, 128-lane) tiles."""
  *lead, rows, lanes = shape
  sublanes = 8 * max(1, 4 // itemsize)
  return math.prod(lead) * round_up(rows, sublanes) * round_up(lanes, _LANES) * itemsize


def vmem_estimate(cfg: Config, itemsize: int) -> int:
  """Estimate (calibrated against XLA:TPU, docs/compile_checks.md) of the scoped VMEM of
  the largest of the three kernels: double-buffered blocks, scratch, the float32 pseudo
  pieces built while mixing and the stacked `[P*bq, P*bk]` score temporaries."""
  p, bq, bk = cfg.num_pseudo, cfg.block_q, cfg.block_k
  heads = cfg.num_heads if cfg.mixing else 1
  w, wv = cfg.width, cfg.value_width
  f32 = lambda *shape: _tile_bytes(shape, 4)
  x = lambda *shape: _tile_bytes(shape, itemsize)
  tokens = 2 * (2 * f32(p, cfg.half) + 2 * f32(p * bq, 1) + 2 * f32(1, p * bk))
  sources = 2 * (x(heads, bq, w) + x(heads, bk, w) + x(heads, bk, wv))
  pseudo = x(p, bq, w) + x(p, bk, w) + x(p, bk, wv)  # scratch
  mixing = p * (f32(max(bq, bk), w) + f32(bk, wv))  # float32 pieces of one tile
  scores = 5 * f32(p * bq, p * bk)
  per_query = 2 * (x(p, bq, wv) + 2 * f32(p, bq, 1))  # do, lse, delta (o, lse forward)
  forward = sources + pseudo + per_query + 2 * f32(p * bq, 1) + f32(p * bq, wv)
  dq = sources + pseudo + per_query + 2 * f32(heads, bq, w) + f32(p, bq, w)
  dkv = sources + pseudo + per_query + 2 * (f32(heads, bk, w) + f32(heads, bk, wv))
  dkv += f32(p, bk, w) + f32(p, bk, wv)
  return tokens + mixing + scores + max(forward, dq, dkv)


def tiled(cfg: Config, n: int, dtype, block_q: int | None, block_k: int | None) -> Config:
  """cfg with its tiles: block_q, block_k and padded tokens `seq_len` (tokens).

  `block_q`, `block_k`: virtual tokens (multiples of P) or None. Token tiles are multiples
  of 8 (16 for 2-byte types) sublanes. Defaults: about 256 virtual query rows and 512
  virtual key rows, halved (keys first) until `vmem_estimate` fits `VMEM_BUDGET_BYTES`; tiles a
  caller gives are kept (the compiler then says whether they fit).
  """
  p = cfg.num_pseudo
  itemsize = jnp.dtype(dtype).itemsize
  user_q, user_k = _tokens("block_q", block_q, p), _tokens("block_k", block_k, p)
  sublanes = 8 * max(1, 4 // itemsize)
  for name, value in (("block_q", user_q), ("block_k", user_k)):
    if value is not None and value % sublanes:
      raise ValueError(
        f"TPU tiles must be multiples of {sublanes} tokens ({sublanes * p} virtual tokens at "
        f"P = {p}), got {name} = {value * p} virtual tokens."
      )
  n_min = round_up(n, sublanes)
  bq = min(user_q or max(sublanes, 256 // p // sublanes * sublanes), n_min)
  bk = min(user_k or max(sublanes, 512 // p // sublanes * sublanes), round_up(n_min, bq))
  fixed = dict(block_q=user_q is not None, block_k=user_k is not None)
  while True:
    cfg = dataclasses.replace(cfg, block_q=bq, block_k=bk, seq_len=round_up(n, math.lcm(bq, bk)))
    if vmem_estimate(cfg, itemsize) <= VMEM_BUDGET_BYTES:
      return cfg
    if not fixed["block_k"] and bk >= bq and bk // 2 % sublanes == 0:
      bk //= 2
    elif not fixed["block_q"] and bq // 2 % sublanes == 0 and bq > sublanes:
      bq //= 2
    else:
      return cfg


def _head(m, cfg: Config):
  """Index of source head m inside a source block (MHA blocks hold only head h)."""
  return m if cfg.mixing else 0


def _halves(ref, cfg: Config):
  return lambda m: (ref[_head(m, cfg), :, : cfg.half], ref[_head(m, cfg), :, cfg.half :])


def _whole(ref, cfg: Config):
  return lambda m: (ref[_head(m, cfg)],)


def _adder(ref, cfg: Config, halves: bool):
  def add(m, parts):
    if halves:
      ref[_head(m, cfg), :, : cfg.half] += parts[0]
      ref[_head(m, cfg), :, cfg.half :] += parts[1]
    else:
      ref[_head(m, cfg)] += parts[0]

  return add


def _rotation(cos_ref, sin_ref):
  """`rotation(p)`: the `[1, half]` cos and sin of pseudo index p (static)."""
  return lambda p: (cos_ref[pl.ds(p, 1), :], sin_ref[pl.ds(p, 1), :])


def _store_pieces(scratch, pieces, cfg: Config) -> None:
  for p, parts in enumerate(pieces):
    if len(parts) == 2:
      scratch[p, :, : cfg.half] = parts[0]
      scratch[p, :, cfg.half :] = parts[1]
    else:
      scratch[p] = parts[0]


def _stacked(scratch) -> jax.Array:
  """A `[P, rows, W]` scratch of pieces as one `[P * rows, W]` tile (pseudo-major rows)."""
  p, rows, w = scratch.shape
  return scratch[...].reshape(p * rows, w)


def _pieces(stacked: jax.Array, cfg: Config, halves: bool) -> list:
  """`[P * rows, W]` -> P pieces of lane parts (the inverse of `_stacked`)."""
  rows = stacked.shape[0] // cfg.num_pseudo
  tiles = [stacked[p * rows : (p + 1) * rows] for p in range(cfg.num_pseudo)]
  if halves:
    return [(x[:, : cfg.half], x[:, cfg.half :]) for x in tiles]
  return [(x,) for x in tiles]


def _mask(t_q, seg_q, t_k, seg_k, cfg: Config) -> jax.Array:
  """`ops.masking.visible` on a stacked tile pair (virtual indices precomputed outside)."""
  return visible(t_q[...], t_k[...], seg_q[...], seg_k[...], cfg.window, cfg.causal)


def _forward_kernel(*refs, cfg: Config):
  (
    (aq, ak, av),
    (
      cos,
      sin,
      t_q,
      seg_q,
      t_k,
      seg_k,
      q_ref,
      k_ref,
      v_ref,
      o_ref,
      lse_ref,
      q_sc,
      k_sc,
      v_sc,
      m_sc,
      l_sc,
      acc_sc,
    ),
  ) = common.split_alpha(refs, cfg)
  rotation = _rotation(cos, sin)
  i, h, j = pl.program_id(1), pl.program_id(2), pl.program_id(3)
  lo, hi = common.kv_range(i, cfg)

  @pl.when(j == 0)
  def _():
    _store_pieces(
      q_sc, common.rotated_pieces(_halves(q_ref, cfg), aq, h, rotation, cfg, q_sc.dtype), cfg
    )
    m_sc[...] = jnp.full(m_sc.shape, MASK_VALUE, jnp.float32)
    l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
    acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

  @pl.when(lo + j < hi)
  def _():
    _store_pieces(
      k_sc, common.rotated_pieces(_halves(k_ref, cfg), ak, h, rotation, cfg, k_sc.dtype), cfg
    )
    _store_pieces(v_sc, common.plain_pieces(_whole(v_ref, cfg), av, h, cfg, v_sc.dtype), cfg)
    mask = _mask(t_q, seg_q, t_k, seg_k, cfg)
    [(m, l, acc)] = common.forward_tile(
      [(m_sc[...], l_sc[...], acc_sc[...])],
      [(_stacked(q_sc),)],
      [(_stacked(k_sc),)],
      [(_stacked(v_sc),)],
      lambda *_: mask,
      cfg,
    )
    m_sc[...], l_sc[...], acc_sc[...] = m, l, acc

  @pl.when(j == pl.num_programs(3) - 1)
  def _():
    [(out, lse)] = common.finalize([(m_sc[...], l_sc[...], acc_sc[...])], seg_q[...])
    shape = (cfg.num_pseudo, cfg.block_q)
    o_ref[...] = out.reshape(*shape, cfg.value_width).astype(o_ref.dtype)
    lse_ref[...] = lse.reshape(*shape, 1)


def _cotangents(do_ref, lse_ref, delta_ref):
  """The query tile's do, lse, delta, stacked `[P * block_q, ·]`."""
  return _stacked(do_ref), _stacked(lse_ref), _stacked(delta_ref)


def _dq_kernel(*refs, cfg: Config):
  (
    (aq, ak, av),
    (
      cos,
      sin,
      t_q,
      seg_q,
      t_k,
      seg_k,
      q_ref,
      k_ref,
      v_ref,
      do_ref,
      lse_ref,
      delta_ref,
      dq_ref,
      *rest,
    ),
  ) = common.split_alpha(refs, cfg)
  *dalpha, q_sc, k_sc, v_sc, dq_sc = rest
  rotation = _rotation(cos, sin)
  i, h, j = pl.program_id(1), pl.program_id(2), pl.program_id(3)
  lo, hi = common.kv_range(i, cfg)
  first_head = (h == 0) if cfg.mixing else True  # MHA: one output block per head

  @pl.when((j == 0) & first_head)
  def _():
    dq_ref[...] = jnp.zeros(dq_ref.shape, dq_ref.dtype)

  @pl.when(j == 0)
  def _():
    _store_pieces(
      q_sc, common.rotated_pieces(_halves(q_ref, cfg), aq, h, rotation, cfg, q_sc.dtype), cfg
    )
    dq_sc[...] = jnp.zeros(dq_sc.shape, jnp.float32)

  @pl.when(lo + j < hi)
  def _():
    _store_pieces(
      k_sc, common.rotated_pieces(_halves(k_ref, cfg), ak, h, rotation, cfg, k_sc.dtype), cfg
    )
    _store_pieces(v_sc, common.plain_pieces(_whole(v_ref, cfg), av, h, cfg, v_sc.dtype), cfg)
    do, lse, delta = _cotangents(do_ref, lse_ref, delta_ref)
    k = _stacked(k_sc)
    mask = _mask(t_q, seg_q, t_k, seg_k, cfg)
    _, ds = common.probs_and_grads(
      (_stacked(q_sc),), (k,), (_stacked(v_sc),), do, lse, delta, mask, cfg
    )
    dq = common.dot(ds.astype(k.dtype), k, (1, 0))
    dq_sc[...] += dq.reshape(dq_sc.shape)

  @pl.when(j == pl.num_programs(3) - 1)
  def _():
    grads = _pieces(_stacked(dq_sc), cfg, True)
    if cfg.rope:
      grads = [common.rotate(g, *rotation(p), transpose=True) for p, g in enumerate(grads)]
    common.scatter_to_sources(
      grads,
      _halves(q_ref, cfg),
      _adder(dq_ref, cfg, True),
      aq,
      dalpha[0].at[0] if dalpha else None,
      h,
      cfg,
    )


def _dkv_kernel(*refs, cfg: Config):
  (
    (aq, ak, av),
    (
      cos,
      sin,
      t_q,
      seg_q,
      t_k,
      seg_k,
      q_ref,
      k_ref,
      v_ref,
      do_ref,
      lse_ref,
      delta_ref,
      dk_ref,
      dv_ref,
      *rest,
    ),
  ) = common.split_alpha(refs, cfg)
  *dalpha, q_sc, k_sc, v_sc, dk_sc, dv_sc = rest
  rotation = _rotation(cos, sin)
  j, h, t = pl.program_id(1), pl.program_id(2), pl.program_id(3)
  lo, hi = common.q_range(j, cfg)
  first_head = (h == 0) if cfg.mixing else True

  @pl.when((t == 0) & first_head)
  def _():
    dk_ref[...] = jnp.zeros(dk_ref.shape, dk_ref.dtype)
    dv_ref[...] = jnp.zeros(dv_ref.shape, dv_ref.dtype)

  @pl.when(t == 0)
  def _():
    _store_pieces(
      k_sc, common.rotated_pieces(_halves(k_ref, cfg), ak, h, rotation, cfg, k_sc.dtype), cfg
    )
    _store_pieces(v_sc, common.plain_pieces(_whole(v_ref, cfg), av, h, cfg, v_sc.dtype), cfg)
    dk_sc[...] = jnp.zeros(dk_sc.shape, jnp.float32)
    dv_sc[...] = jnp.zeros(dv_sc.shape, jnp.float32)

  @pl.when(lo + t < hi)
  def _():
    _store_pieces(
      q_sc, common.rotated_pieces(_halves(q_ref, cfg), aq, h, rotation, cfg, q_sc.dtype), cfg
    )
    q = _stacked(q_sc)
    do, lse, delta = _cotangents(do_ref, lse_ref, delta_ref)
    mask = _mask(t_q, seg_q, t_k, seg_k, cfg)
    p, ds = common.probs_and_grads(
      (q,), (_stacked(k_sc),), (_stacked(v_sc),), do, lse, delta, mask, cfg
    )
    dv_sc[...] += common.dot(p.astype(do.dtype), do, (0, 0)).reshape(dv_sc.shape)
    dk_sc[...] += common.dot(ds.astype(q.dtype), q, (0, 0)).reshape(dk_sc.shape)

  @pl.when(t == pl.num_programs(3) - 1)
  def _():
    grads = _pieces(_stacked(dk_sc), cfg, True)
    if cfg.rope:
      grads = [common.rotate(g, *rotation(p), transpose=True) for p, g in enumerate(grads)]
    common.scatter_to_sources(
      grads,
      _halves(k_ref, cfg),
      _adder(dk_ref, cfg, True),
      ak,
      dalpha[0].at[0] if dalpha else None,
      h,
      cfg,
    )
    common.scatter_to_sources(
      _pieces(_stacked(dv_sc), cfg, False),
      _whole(v_ref, cfg),
      _adder(dv_ref, cfg, False),
      av,
      dalpha[1].at[0] if dalpha else None,
      h,
      cfg,
    )


class _Specs:
  """BlockSpecs for grid (B, outer tile, target head, band step).

  `q_tile(x, o)` / `k_tile(x, o)` give the query / key tile index from the outer
  tile index x and band step o, clamped into the band.
  """

  def __init__(self, cfg: Config, q_tile, k_tile):
    self.cfg, self.q_tile, self.k_tile = cfg, q_tile, k_tile

  def source(self, rows: int, tile, lanes: int) -> pl.BlockSpec:  # q/k/v, dq/dk/dv
    heads = self.cfg.num_heads if self.cfg.mixing else 1
    head = (lambda h: 0) if self.cfg.mixing else (lambda h: h)
    return pl.BlockSpec((None, heads, rows, lanes), lambda b, x, h, o: (b, head(h), tile(x, o), 0))

  # Stacked token data (`_token_layouts`): a tile's block spans the array's last two dims,
  # so any tile size obeys Mosaic's (sublane, lane) tiling.
  def column(self, rows: int, tile, batched: bool) -> pl.BlockSpec:  # [(B,) tiles, rows, 1]
    if batched:
      return pl.BlockSpec((None, None, rows, 1), lambda b, x, h, o: (b, tile(x, o), 0, 0))
    return pl.BlockSpec((None, rows, 1), lambda b, x, h, o: (tile(x, o), 0, 0))

  def row(self, rows: int, tile, batched: bool) -> pl.BlockSpec:  # [(B,) tiles, 1, rows]
    if batched:
      return pl.BlockSpec((None, None, 1, rows), lambda b, x, h, o: (b, tile(x, o), 0, 0))
    return pl.BlockSpec((None, 1, rows), lambda b, x, h, o: (tile(x, o), 0, 0))

  def per_pseudo(self, lanes: int) -> pl.BlockSpec:  # o, do, lse, delta at the query tile
    return pl.BlockSpec(
      (None, None, self.cfg.num_pseudo, self.cfg.block_q, lanes),
      lambda b, x, h, o: (b, h, 0, self.q_tile(x, o), 0),
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
      self.source(bk, self.k_tile, cfg.width),
      self.source(bk, self.k_tile, cfg.value_width),
    ]

  def dalpha(self) -> pl.BlockSpec:
    # [B, tiles, 1, H*H*P]: the last two block dims equal the array's (Mosaic tiling rule).
    return pl.BlockSpec(
      (None, None, 1, self.cfg.flat_alpha), lambda b, x, h, o: (b, x, 0, 0), memory_space=pltpu.SMEM
    )


def _stack(x: jax.Array, block: int, p: int) -> jax.Array:
  """`[..., Np]` token data -> `[..., tiles, P * block]`: each tile's tokens repeated per
  pseudo index, pseudo-major (the row order of `_stacked` tiles)."""
  *lead, n = x.shape
  tiles = x.reshape(*lead, n // block, 1, block)
  return jnp.broadcast_to(tiles, (*lead, n // block, p, block)).reshape(*lead, n // block, -1)


def _token_layouts(seg: jax.Array, cfg: Config) -> tuple[jax.Array, ...]:
  """Stacked virtual indices `t = n * P + p` and segment ids: query-tile columns
  `[nq, P*bq, 1]`, `[B, nq, P*bq, 1]`; key-tile rows `[nk, 1, P*bk]`, `[B, nk, 1, P*bk]`."""
  p = cfg.num_pseudo
  tokens = jnp.arange(cfg.seq_len, dtype=jnp.int32)

  def virtual(block):
    pseudo = jnp.repeat(jnp.arange(p, dtype=jnp.int32), block)
    return _stack(tokens, block, p) * p + pseudo

  return (
    virtual(cfg.block_q)[..., None],
    _stack(seg, cfg.block_q, p)[..., None],
    virtual(cfg.block_k)[:, None, :],
    _stack(seg, cfg.block_k, p)[:, :, None, :],
  )


def _clamp(lo, hi, step):
  return jnp.minimum(lo + step, hi - 1)


def _forward_specs(cfg: Config) -> _Specs:
  return _Specs(cfg, lambda i, j: i, lambda i, j: _clamp(*common.kv_range(i, cfg), j))


def _params(*semantics: str) -> pltpu.CompilerParams:
  return pltpu.CompilerParams(dimension_semantics=semantics)


def forward(cfg: Config, alphas, rotation, seg, q, k, v, *, interpret):
  """-> (o `[B, H, P, Np, Wv]` in q.dtype, lse `[B, H, P, Np, 1]` float32)."""
  b = q.shape[0]
  specs = _forward_specs(cfg)
  out_shape = (
    jax.ShapeDtypeStruct(
      (b, cfg.num_targets, cfg.num_pseudo, cfg.seq_len, cfg.value_width), q.dtype
    ),
    jax.ShapeDtypeStruct((b, cfg.num_targets, cfg.num_pseudo, cfg.seq_len, 1), jnp.float32),
  )
  pieces_q, pieces_k = (cfg.num_pseudo, cfg.block_q), (cfg.num_pseudo, cfg.block_k)
  rows_q = cfg.num_pseudo * cfg.block_q
  return pl.pallas_call(
    functools.partial(_forward_kernel, cfg=cfg),
    grid=(b, cfg.num_q_blocks, cfg.num_targets, common.max_kv_band(cfg)),
    in_specs=specs.inputs(cfg.mixing),
    out_specs=(specs.per_pseudo(cfg.value_width), specs.per_pseudo(1)),
    out_shape=out_shape,
    scratch_shapes=[
      pltpu.VMEM((*pieces_q, cfg.width), q.dtype),
      pltpu.VMEM((*pieces_k, cfg.width), q.dtype),
      pltpu.VMEM((*pieces_k, cfg.value_width), q.dtype),
      pltpu.VMEM((rows_q, 1), jnp.float32),
      pltpu.VMEM((rows_q, 1), jnp.float32),
      pltpu.VMEM((rows_q, cfg.value_width), jnp.float32),
    ],
    compiler_params=_params("parallel", "parallel", "parallel", "arbitrary"),
    interpret=interpret,
    name="iha_forward",
  )(*alphas, *rotation, *_token_layouts(seg, cfg), q, k, v)


def backward(cfg: Config, alphas, rotation, seg, q, k, v, do, lse, delta, *, interpret):
  """-> (dq, dk `[B, H, Np, W]`, dv `[B, H, Np, Wv]` f32, dalpha partials
  `[B, tiles, 1, H*H*P]` x3 or None)."""
  b = q.shape[0]
  args = (*alphas, *rotation, *_token_layouts(seg, cfg), q, k, v, do, lse, delta)
  pieces_q, pieces_k = (cfg.num_pseudo, cfg.block_q), (cfg.num_pseudo, cfg.block_k)
  # pseudo q, k, v pieces (rebuilt per step or held across the band)
  pseudo = [
    pltpu.VMEM((*pieces_q, cfg.width), q.dtype),
    pltpu.VMEM((*pieces_k, cfg.width), q.dtype),
    pltpu.VMEM((*pieces_k, cfg.value_width), q.dtype),
  ]
  grad, dv_out = (jax.ShapeDtypeStruct(x.shape, jnp.float32) for x in (q, v))
  flat = cfg.flat_alpha
  # Source-gradient blocks stay resident across the (arbitrary) target-head axis.
  head_semantics = "arbitrary" if cfg.mixing else "parallel"
  semantics = _params("parallel", "parallel", head_semantics, "arbitrary")

  specs = _forward_specs(cfg)
  dq_out = [grad] + (
    [jax.ShapeDtypeStruct((b, cfg.num_q_blocks, 1, flat), jnp.float32)] if cfg.mixing else []
  )
  dq, *dalpha_q = pl.pallas_call(
    functools.partial(_dq_kernel, cfg=cfg),
    grid=(b, cfg.num_q_blocks, cfg.num_targets, common.max_kv_band(cfg)),
    in_specs=specs.inputs(cfg.mixing) + specs.cotangents(),
    out_specs=[specs.source(cfg.block_q, specs.q_tile, cfg.width)] + [specs.dalpha()] * cfg.mixing,
    out_shape=dq_out,
    scratch_shapes=[*pseudo, pltpu.VMEM((*pieces_q, cfg.width), jnp.float32)],
    compiler_params=semantics,
    interpret=interpret,
    name="iha_backward_dq",
  )(*args)

  specs = _Specs(cfg, lambda j, t: _clamp(*common.q_range(j, cfg), t), lambda j, t: j)
  dalpha_shapes = [jax.ShapeDtypeStruct((b, cfg.num_k_blocks, 1, flat), jnp.float32)] * 2
  dkv_out = [grad, dv_out] + (dalpha_shapes if cfg.mixing else [])
  dk, dv, *dalpha_kv = pl.pallas_call(
    functools.partial(_dkv_kernel, cfg=cfg),
    grid=(b, cfg.num_k_blocks, cfg.num_targets, common.max_q_band(cfg)),
    in_specs=specs.inputs(cfg.mixing) + specs.cotangents(),
    out_specs=[
      specs.source(cfg.block_k, specs.k_tile, cfg.width),
      specs.source(cfg.block_k, specs.k_tile, cfg.value_width),
    ]
    + [specs.dalpha()] * 2 * cfg.mixing,
    out_shape=dkv_out,
    scratch_shapes=[
      *pseudo,
      pltpu.VMEM((*pieces_k, cfg.width), jnp.float32),
      pltpu.VMEM((*pieces_k, cfg.value_width), jnp.float32),
    ],
    compiler_params=semantics,
    interpret=interpret,
    name="iha_backward_dkv",
  )(*args)
  dalpha = (dalpha_q[0], *dalpha_kv) if cfg.mixing else None
  return dq, dk, dv, dalpha
