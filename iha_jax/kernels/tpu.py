"""Fused IHA attention for TPU: Pallas Mosaic kernels (forward, dQ, dK/dV).

Layouts are those of `iha_jax.kernels.common`. Mosaic copies BlockSpec tiles
HBM -> VMEM, so the band loop is a grid axis: grid (B, tiles, target heads,
band), where the band axis walks only the key (or query) tiles the band (causal
or bidirectional, global or window: `common.kv_range` / `q_range`) touches; its
size is the widest band. Its index maps clamp past the band's end, so the block
index repeats and no new DMA is issued for the skipped steps, which `pl.when`
turns into no-ops: blocks outside the band are never loaded nor computed.
Accumulators live in VMEM scratch across the band axis.
- forward: the pseudo-q pieces are built once per (tile, head) into scratch.
- dQ / dK-dV: the target-head axis is "arbitrary" and the float32 source-gradient
  block stays resident in VMEM across it, so every target head adds its
  alpha-contracted pseudo gradient into the same block (no atomics, no
  P-sized gradient). Partial dalpha goes to an SMEM block per (batch, tile).
Mosaic tiling: token tiles are multiples of 8 (16 for 2-byte types); key tiles
are multiples of 128 tokens, since key segment ids sit on lanes, unless one
key tile covers the whole padded sequence.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from iha_jax.kernels import common
from iha_jax.kernels.common import Config
from iha_jax.ops.masking import MASK_VALUE
from iha_jax.ops.options import round_up

_LANES = 128


def half_width(head_dim: int) -> int:
  """Lanes per RoPE half: exactly ceil(d / 2) (a full-width block needs no padding)."""
  return -(-head_dim // 2)


def tiles(
  n: int, num_pseudo: int, dtype, block_q: int | None, block_k: int | None
) -> tuple[int, int, int]:
  """(block_q, block_k, padded tokens) in tokens, obeying Mosaic's (sublane, lane) tiling."""
  sublanes = 8 * (4 // min(4, dtype.itemsize))
  n_min = round_up(n, sublanes)
  block_q = min(block_q or max(sublanes, 256 // num_pseudo // sublanes * sublanes), n_min)
  block_k = block_k or _LANES
  if block_q % sublanes:
    raise ValueError(f"TPU query tiles must be multiples of {sublanes} tokens, got {block_q}.")
  if block_k >= n_min:  # one key tile holds the whole (padded) sequence
    seq_len = round_up(n_min, block_q)
    return block_q, seq_len, seq_len
  if block_k % _LANES:
    raise ValueError(
      f"TPU key tiles must be multiples of {_LANES} tokens (or cover the sequence), got {block_k}."
    )
  return block_q, block_k, round_up(n, math.lcm(block_q, block_k))


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


def _store_pieces(scratch, pieces, cfg: Config) -> None:
  for p, parts in enumerate(pieces):
    if len(parts) == 2:
      scratch[p, :, : cfg.half] = parts[0]
      scratch[p, :, cfg.half :] = parts[1]
    else:
      scratch[p] = parts[0]


def _pieces(scratch, cfg: Config, halves: bool):
  if halves:
    return [(scratch[p, :, : cfg.half], scratch[p, :, cfg.half :]) for p in range(cfg.num_pseudo)]
  return [(scratch[p],) for p in range(cfg.num_pseudo)]


def _masker(q_start, k_start, seg_q, seg_k, cfg: Config):
  q_tok = common.token_index(q_start, cfg.block_q, 0)
  k_tok = common.token_index(k_start, cfg.block_k, 1)
  return lambda pq, pk: common.tile_mask(q_tok, k_tok, pq, pk, seg_q, seg_k, cfg)


def _forward_kernel(*refs, cfg: Config):
  (
    (aq, ak, av),
    (
      freq,
      seg_q,
      pos_q,
      seg_k,
      pos_k,
      q_ref,
      k_ref,
      v_ref,
      o_ref,
      lse_ref,
      q_sc,
      m_sc,
      l_sc,
      acc_sc,
    ),
  ) = common.split_alpha(refs, cfg)
  i, h, j = pl.program_id(1), pl.program_id(2), pl.program_id(3)
  lo, hi = common.kv_range(i, cfg)
  kv = lo + j

  @pl.when(j == 0)
  def _():
    q = common.rotated_pieces(_halves(q_ref, cfg), aq, h, pos_q[...], freq[...], cfg, q_sc.dtype)
    _store_pieces(q_sc, q, cfg)
    m_sc[...] = jnp.full(m_sc.shape, MASK_VALUE, jnp.float32)
    l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
    acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

  @pl.when(kv < hi)
  def _():
    k = common.rotated_pieces(_halves(k_ref, cfg), ak, h, pos_k[...], freq[...], cfg, k_ref.dtype)
    v = common.plain_pieces(_whole(v_ref, cfg), av, h, cfg, v_ref.dtype)
    state = [(m_sc[p], l_sc[p], acc_sc[p]) for p in range(cfg.num_pseudo)]
    mask = _masker(i * cfg.block_q, kv * cfg.block_k, seg_q[...], seg_k[...], cfg)
    state = common.forward_tile(state, _pieces(q_sc, cfg, True), k, v, mask, cfg)
    for p, (m, l, acc) in enumerate(state):
      m_sc[p], l_sc[p], acc_sc[p] = m, l, acc

  @pl.when(j == pl.num_programs(3) - 1)
  def _():
    state = [(m_sc[p], l_sc[p], acc_sc[p]) for p in range(cfg.num_pseudo)]
    for p, (out, lse) in enumerate(common.finalize(state, seg_q[...])):
      o_ref[p] = out.astype(o_ref.dtype)
      lse_ref[p] = lse


def _dq_kernel(*refs, cfg: Config):
  (
    (aq, ak, av),
    (
      freq,
      seg_q,
      pos_q,
      seg_k,
      pos_k,
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
  *dalpha, q_sc, dq_sc = rest
  i, h, j = pl.program_id(1), pl.program_id(2), pl.program_id(3)
  lo, hi = common.kv_range(i, cfg)
  kv = lo + j
  first_head = (h == 0) if cfg.mixing else True  # MHA: one output block per head

  @pl.when((j == 0) & first_head)
  def _():
    dq_ref[...] = jnp.zeros(dq_ref.shape, dq_ref.dtype)

  @pl.when(j == 0)
  def _():
    q = common.rotated_pieces(_halves(q_ref, cfg), aq, h, pos_q[...], freq[...], cfg, q_sc.dtype)
    _store_pieces(q_sc, q, cfg)
    dq_sc[...] = jnp.zeros(dq_sc.shape, jnp.float32)

  @pl.when(kv < hi)
  def _():
    k = common.rotated_pieces(_halves(k_ref, cfg), ak, h, pos_k[...], freq[...], cfg, k_ref.dtype)
    v = common.plain_pieces(_whole(v_ref, cfg), av, h, cfg, v_ref.dtype)
    q = _pieces(q_sc, cfg, True)
    mask = _masker(i * cfg.block_q, kv * cfg.block_k, seg_q[...], seg_k[...], cfg)
    for pq in range(cfg.num_pseudo):
      for pk in range(cfg.num_pseudo):
        _, ds = common.probs_and_grads(
          q[pq], k[pk], v[pk], do_ref[pq], lse_ref[pq], delta_ref[pq], mask(pq, pk), cfg
        )
        ds = ds.astype(k_ref.dtype)
        dq_sc[pq, :, : cfg.half] += common.dot(ds, k[pk][0], (1, 0))
        dq_sc[pq, :, cfg.half :] += common.dot(ds, k[pk][1], (1, 0))

  @pl.when(j == pl.num_programs(3) - 1)
  def _():
    grads = _pieces(dq_sc, cfg, True)
    if cfg.rope:
      grads = [
        common.rope(g, common.virtual_position(pos_q[...], p, cfg), freq[...], transpose=True)
        for p, g in enumerate(grads)
      ]
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
      freq,
      seg_q,
      pos_q,
      seg_k,
      pos_k,
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
  *dalpha, k_sc, v_sc, dk_sc, dv_sc = rest
  j, h, t = pl.program_id(1), pl.program_id(2), pl.program_id(3)
  lo, hi = common.q_range(j, cfg)
  qi = lo + t
  first_head = (h == 0) if cfg.mixing else True

  @pl.when((t == 0) & first_head)
  def _():
    dk_ref[...] = jnp.zeros(dk_ref.shape, dk_ref.dtype)
    dv_ref[...] = jnp.zeros(dv_ref.shape, dv_ref.dtype)

  @pl.when(t == 0)
  def _():
    _store_pieces(
      k_sc,
      common.rotated_pieces(_halves(k_ref, cfg), ak, h, pos_k[...], freq[...], cfg, k_sc.dtype),
      cfg,
    )
    _store_pieces(v_sc, common.plain_pieces(_whole(v_ref, cfg), av, h, cfg, v_sc.dtype), cfg)
    dk_sc[...] = jnp.zeros(dk_sc.shape, jnp.float32)
    dv_sc[...] = jnp.zeros(dv_sc.shape, jnp.float32)

  @pl.when(qi < hi)
  def _():
    q = common.rotated_pieces(_halves(q_ref, cfg), aq, h, pos_q[...], freq[...], cfg, q_ref.dtype)
    k, v = _pieces(k_sc, cfg, True), _pieces(v_sc, cfg, False)
    mask = _masker(qi * cfg.block_q, j * cfg.block_k, seg_q[...], seg_k[...], cfg)
    for pq in range(cfg.num_pseudo):
      do = do_ref[pq]
      for pk in range(cfg.num_pseudo):
        p, ds = common.probs_and_grads(
          q[pq], k[pk], v[pk], do, lse_ref[pq], delta_ref[pq], mask(pq, pk), cfg
        )
        dv_sc[pk] += common.dot(p.astype(do.dtype), do, (0, 0))
        ds = ds.astype(q_ref.dtype)
        dk_sc[pk, :, : cfg.half] += common.dot(ds, q[pq][0], (0, 0))
        dk_sc[pk, :, cfg.half :] += common.dot(ds, q[pq][1], (0, 0))

  @pl.when(t == pl.num_programs(3) - 1)
  def _():
    grads = _pieces(dk_sc, cfg, True)
    if cfg.rope:
      grads = [
        common.rope(g, common.virtual_position(pos_k[...], p, cfg), freq[...], transpose=True)
        for p, g in enumerate(grads)
      ]
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
      _pieces(dv_sc, cfg, False),
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

  def column(self, rows: int, tile) -> pl.BlockSpec:  # [B, Np, 1] token data as a column
    return pl.BlockSpec((None, rows, 1), lambda b, x, h, o: (b, tile(x, o), 0))

  def row(self, rows: int, tile) -> pl.BlockSpec:  # [B, 1, Np] token data as a row
    return pl.BlockSpec((None, 1, rows), lambda b, x, h, o: (b, 0, tile(x, o)))

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
    smem = [pl.BlockSpec(memory_space=pltpu.SMEM)] * (3 if with_alpha else 0)
    return smem + [
      pl.BlockSpec((1, cfg.half), lambda *_: (0, 0)),
      self.column(bq, self.q_tile),
      self.column(bq, self.q_tile),
      self.row(bk, self.k_tile),
      self.column(bk, self.k_tile),
      self.source(bq, self.q_tile, cfg.width),
      self.source(bk, self.k_tile, cfg.width),
      self.source(bk, self.k_tile, cfg.value_width),
    ]

  def dalpha(self) -> pl.BlockSpec:
    # [B, tiles, 1, H*H*P]: the last two block dims equal the array's (Mosaic tiling rule).
    return pl.BlockSpec(
      (None, None, 1, self.cfg.flat_alpha), lambda b, x, h, o: (b, x, 0, 0), memory_space=pltpu.SMEM
    )


def _token_layouts(seg, pos):
  """`[B, Np]` -> (seg column, pos column, seg row) for the (sublane, lane) tiling."""
  return seg[:, :, None], pos[:, :, None], seg[:, None, :]


def _clamp(lo, hi, step):
  return jnp.minimum(lo + step, hi - 1)


def _forward_specs(cfg: Config) -> _Specs:
  return _Specs(cfg, lambda i, j: i, lambda i, j: _clamp(*common.kv_range(i, cfg), j))


def _params(*semantics: str) -> pltpu.CompilerParams:
  return pltpu.CompilerParams(dimension_semantics=semantics)


def forward(cfg: Config, alphas, inv_freq, seg, pos, q, k, v, *, interpret):
  """-> (o `[B, H, P, Np, Wv]` in q.dtype, lse `[B, H, P, Np, 1]` float32)."""
  b = q.shape[0]
  seg_col, pos_col, seg_row = _token_layouts(seg, pos)
  specs = _forward_specs(cfg)
  out_shape = (
    jax.ShapeDtypeStruct(
      (b, cfg.num_targets, cfg.num_pseudo, cfg.seq_len, cfg.value_width), q.dtype
    ),
    jax.ShapeDtypeStruct((b, cfg.num_targets, cfg.num_pseudo, cfg.seq_len, 1), jnp.float32),
  )
  pieces = (cfg.num_pseudo, cfg.block_q)
  return pl.pallas_call(
    functools.partial(_forward_kernel, cfg=cfg),
    grid=(b, cfg.num_q_blocks, cfg.num_targets, common.max_kv_band(cfg)),
    in_specs=specs.inputs(cfg.mixing),
    out_specs=(specs.per_pseudo(cfg.value_width), specs.per_pseudo(1)),
    out_shape=out_shape,
    scratch_shapes=[
      pltpu.VMEM((*pieces, cfg.width), q.dtype),
      pltpu.VMEM((*pieces, 1), jnp.float32),
      pltpu.VMEM((*pieces, 1), jnp.float32),
      pltpu.VMEM((*pieces, cfg.value_width), jnp.float32),
    ],
    compiler_params=_params("parallel", "parallel", "parallel", "arbitrary"),
    interpret=interpret,
    name="iha_forward",
  )(*alphas, inv_freq, seg_col, pos_col, seg_row, pos_col, q, k, v)


def backward(cfg: Config, alphas, inv_freq, seg, pos, q, k, v, do, lse, delta, *, interpret):
  """-> (dq, dk `[B, H, Np, W]`, dv `[B, H, Np, Wv]` f32, dalpha partials
  `[B, tiles, 1, H*H*P]` x3 or None)."""
  b = q.shape[0]
  seg_col, pos_col, seg_row = _token_layouts(seg, pos)
  args = (*alphas, inv_freq, seg_col, pos_col, seg_row, pos_col, q, k, v, do, lse, delta)
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
    scratch_shapes=[
      pltpu.VMEM((cfg.num_pseudo, cfg.block_q, cfg.width), q.dtype),
      pltpu.VMEM((cfg.num_pseudo, cfg.block_q, cfg.width), jnp.float32),
    ],
    compiler_params=semantics,
    interpret=interpret,
    name="iha_backward_dq",
  )(*args)

  specs = _Specs(cfg, lambda j, t: _clamp(*common.q_range(j, cfg), t), lambda j, t: j)
  dalpha_shapes = [jax.ShapeDtypeStruct((b, cfg.num_k_blocks, 1, flat), jnp.float32)] * 2
  dkv_out = [grad, dv_out] + (dalpha_shapes if cfg.mixing else [])
  pieces = (cfg.num_pseudo, cfg.block_k)
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
    # pseudo k, pseudo v, dk, dv pieces
    scratch_shapes=[
      pltpu.VMEM((*pieces, cfg.width), q.dtype),
      pltpu.VMEM((*pieces, cfg.value_width), q.dtype),
      pltpu.VMEM((*pieces, cfg.width), jnp.float32),
      pltpu.VMEM((*pieces, cfg.value_width), jnp.float32),
    ],
    compiler_params=semantics,
    interpret=interpret,
    name="iha_backward_dkv",
  )(*args)
  dalpha = (dalpha_q[0], *dalpha_kv) if cfg.mixing else None
  return dq, dk, dv, dalpha
