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
  order (`tpu_specs.token_layouts`), whole-array blocks of their last two dims.
- Sliced calls (a sequence shard: queries `Np` tokens at a query offset into `Nkp` key
  tokens): the offset is a scalar-prefetch operand that the kernels and index maps read
  to shift the band (`tpu_specs`); the grid's band axis covers the widest band any offset
  gives (the whole key axis for global layers, where skipped steps cost no DMA).
- forward: the pseudo-q pieces are built once per (tile, head) into scratch.
- dQ / dK-dV: the target-head axis is "arbitrary" and the float32 source-gradient
  block stays resident in VMEM across it, so every target head adds its
  alpha-contracted pseudo gradient into the same block (no atomics, no
  P-sized gradient). Partial dalpha goes to an SMEM block per (batch, tile).
- Grouped-query (G key/value heads for H query heads): the key/value blocks hold the G
  source heads (mixing) or key/value head `h // r` alone (MHA: its BlockSpec index), never
  a copy per query head. dK/dV's output block of a key/value head stays resident over the
  r consecutive query heads of its group (the head axis is then "arbitrary"), which add
  into it in turn.
Mosaic tiling: token tiles are multiples of 8 (16 for 2-byte types). Default tiles fit
`VMEM_BUDGET_BYTES` of the default 16 MiB scoped VMEM (`tiled`, `vmem_estimate`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from iha_jax.core.masking import MASK_VALUE, visible
from iha_jax.kernels import common, tpu_specs, tpu_tiles
from iha_jax.kernels.common import Config

# Tiles and their scoped-VMEM estimate live in `tpu_tiles`; `fused` calls `tpu.tiled`.
tiled = tpu_tiles.tiled
vmem_estimate = tpu_tiles.vmem_estimate


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


def dalpha_flat(x: jax.Array, cfg: Config, kv: bool = False) -> jax.Array:
  """Partials `[B, tiles, 1, Ht * S * P]` (S = H; `kv`: S = G) -> the flat (target, source,
  pseudo) layout; key/value partials, one slot per query target, summed over each group."""
  if not kv or cfg.group == 1:
    return x.reshape(-1, cfg.flat_alpha if not kv else cfg.flat_alpha_kv).sum(axis=0)
  slots = x.reshape(-1, cfg.kv_targets, cfg.group, cfg.num_kv_heads * cfg.num_pseudo)
  return slots.sum(axis=(0, 2)).reshape(-1)


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
  offset, refs = tpu_specs.split_offset(refs, cfg)
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
  query, key = cfg.query_side(h), cfg.key_side(h)
  lo, hi = common.kv_range(i, cfg, offset)

  @pl.when(j == 0)
  def _():
    _store_pieces(
      q_sc, common.rotated_pieces(_halves(q_ref, cfg), aq, query, rotation, cfg, q_sc.dtype), cfg
    )
    m_sc[...] = jnp.full(m_sc.shape, MASK_VALUE, jnp.float32)
    l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
    acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

  @pl.when(lo + j < hi)
  def _():
    _store_pieces(
      k_sc, common.rotated_pieces(_halves(k_ref, cfg), ak, key, rotation, cfg, k_sc.dtype), cfg
    )
    _store_pieces(v_sc, common.plain_pieces(_whole(v_ref, cfg), av, key, cfg, v_sc.dtype), cfg)
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
  offset, refs = tpu_specs.split_offset(refs, cfg)
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
  query, key = cfg.query_side(h), cfg.key_side(h)
  lo, hi = common.kv_range(i, cfg, offset)
  first_head = (h == 0) if cfg.mixing else True  # MHA: one output block per head

  @pl.when((j == 0) & first_head)
  def _():
    dq_ref[...] = jnp.zeros(dq_ref.shape, dq_ref.dtype)

  @pl.when(j == 0)
  def _():
    _store_pieces(
      q_sc, common.rotated_pieces(_halves(q_ref, cfg), aq, query, rotation, cfg, q_sc.dtype), cfg
    )
    dq_sc[...] = jnp.zeros(dq_sc.shape, jnp.float32)

  @pl.when(lo + j < hi)
  def _():
    _store_pieces(
      k_sc, common.rotated_pieces(_halves(k_ref, cfg), ak, key, rotation, cfg, k_sc.dtype), cfg
    )
    _store_pieces(v_sc, common.plain_pieces(_whole(v_ref, cfg), av, key, cfg, v_sc.dtype), cfg)
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
      query,
      cfg,
    )


def _dkv_kernel(*refs, cfg: Config):
  offset, refs = tpu_specs.split_offset(refs, cfg)
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
  query, key = cfg.query_side(h), cfg.key_side(h)
  lo, hi = common.q_range(j, cfg, offset)
  # The first query head to add into the resident dk/dv block: of all heads (mixing: every
  # head feeds every source) or of the key/value head's group (MHA).
  if cfg.mixing:
    first_head = h == 0
  else:
    first_head = True if cfg.group == 1 else jax.lax.rem(h, cfg.group) == 0

  @pl.when((t == 0) & first_head)
  def _():
    dk_ref[...] = jnp.zeros(dk_ref.shape, dk_ref.dtype)
    dv_ref[...] = jnp.zeros(dv_ref.shape, dv_ref.dtype)

  @pl.when(t == 0)
  def _():
    _store_pieces(
      k_sc, common.rotated_pieces(_halves(k_ref, cfg), ak, key, rotation, cfg, k_sc.dtype), cfg
    )
    _store_pieces(v_sc, common.plain_pieces(_whole(v_ref, cfg), av, key, cfg, v_sc.dtype), cfg)
    dk_sc[...] = jnp.zeros(dk_sc.shape, jnp.float32)
    dv_sc[...] = jnp.zeros(dv_sc.shape, jnp.float32)

  @pl.when(lo + t < hi)
  def _():
    _store_pieces(
      q_sc, common.rotated_pieces(_halves(q_ref, cfg), aq, query, rotation, cfg, q_sc.dtype), cfg
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
      key,
      cfg,
    )
    common.scatter_to_sources(
      _pieces(_stacked(dv_sc), cfg, False),
      _whole(v_ref, cfg),
      _adder(dv_ref, cfg, False),
      av,
      dalpha[1].at[0] if dalpha else None,
      key,
      cfg,
    )


def _params(*semantics: str) -> pltpu.CompilerParams:
  return pltpu.CompilerParams(dimension_semantics=semantics)


def forward(cfg: Config, alphas, rotation, seg, q, k, v, *, interpret):
  """q `[B, H, Np, W]`, k `[B, G, Nkp, W]`, v `[B, G, Nkp, Wv]` -> (o `[B, Ht, P, Np, Wv]`
  in q.dtype, lse `[B, Ht, P, Np, 1]` float32). `seg`: `tpu_specs.token_layouts`'."""
  b = q.shape[0]
  specs = tpu_specs.forward_specs(cfg)
  out_shape = (
    jax.ShapeDtypeStruct(
      (b, cfg.num_targets, cfg.num_pseudo, cfg.seq_len, cfg.value_width), q.dtype
    ),
    jax.ShapeDtypeStruct((b, cfg.num_targets, cfg.num_pseudo, cfg.seq_len, 1), jnp.float32),
  )
  pieces_q, pieces_k = (cfg.num_pseudo, cfg.block_q), (cfg.num_pseudo, cfg.block_k)
  rows_q = cfg.num_pseudo * cfg.block_q
  return tpu_specs.call(
    functools.partial(_forward_kernel, cfg=cfg),
    cfg,
    seg,
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
  )(*alphas, *rotation, *tpu_specs.token_layouts(seg, cfg), q, k, v)


def backward(cfg: Config, alphas, rotation, seg, q, k, v, do, lse, delta, *, interpret):
  """-> (dq `[B, H, Np, W]`, dk `[B, G, Nkp, W]`, dv `[B, G, Nkp, Wv]` f32, dalpha partials
  `[B, tiles, 1, Ht*H*P]` (q), `[B, tiles, 1, Ht*G*P]` (k, v; `dalpha_flat`) or None)."""
  b = q.shape[0]
  args = (*alphas, *rotation, *tpu_specs.token_layouts(seg, cfg), q, k, v, do, lse, delta)
  pieces_q, pieces_k = (cfg.num_pseudo, cfg.block_q), (cfg.num_pseudo, cfg.block_k)
  # pseudo q, k, v pieces (rebuilt per step or held across the band)
  pseudo = [
    pltpu.VMEM((*pieces_q, cfg.width), q.dtype),
    pltpu.VMEM((*pieces_k, cfg.width), q.dtype),
    pltpu.VMEM((*pieces_k, cfg.value_width), q.dtype),
  ]
  dq_shape, dk_shape, dv_shape = (jax.ShapeDtypeStruct(x.shape, jnp.float32) for x in (q, k, v))
  partials = lambda tiles, size: jax.ShapeDtypeStruct((b, tiles, 1, size), jnp.float32)
  # Source-gradient blocks stay resident across the (arbitrary) target-head axis: every
  # head's with mixing, a key/value head's over its group with grouped-query MHA.
  semantics = lambda resident: _params(
    "parallel", "parallel", "arbitrary" if resident else "parallel", "arbitrary"
  )

  specs = tpu_specs.forward_specs(cfg)
  dq_out = [dq_shape] + ([partials(cfg.num_q_blocks, cfg.flat_alpha)] if cfg.mixing else [])
  dq, *dalpha_q = tpu_specs.call(
    functools.partial(_dq_kernel, cfg=cfg),
    cfg,
    seg,
    grid=(b, cfg.num_q_blocks, cfg.num_targets, common.max_kv_band(cfg)),
    in_specs=specs.inputs(cfg.mixing) + specs.cotangents(),
    out_specs=[specs.source(cfg.block_q, specs.q_tile, cfg.width)]
    + [specs.dalpha(cfg.flat_alpha)] * cfg.mixing,
    out_shape=dq_out,
    scratch_shapes=[*pseudo, pltpu.VMEM((*pieces_q, cfg.width), jnp.float32)],
    compiler_params=semantics(cfg.mixing),
    interpret=interpret,
    name="iha_backward_dq",
  )(*args)

  specs = tpu_specs.dkv_specs(cfg)
  dkv_out = [dk_shape, dv_shape] + [partials(cfg.num_k_blocks, cfg.dalpha_kv_slots)] * 2 * (
    cfg.mixing
  )
  dk, dv, *dalpha_kv = tpu_specs.call(
    functools.partial(_dkv_kernel, cfg=cfg),
    cfg,
    seg,
    grid=(b, cfg.num_k_blocks, cfg.num_targets, common.max_q_band(cfg)),
    in_specs=specs.inputs(cfg.mixing) + specs.cotangents(),
    out_specs=[
      specs.source(cfg.block_k, specs.k_tile, cfg.width, kv=True),
      specs.source(cfg.block_k, specs.k_tile, cfg.value_width, kv=True),
    ]
    + [specs.dalpha(cfg.dalpha_kv_slots)] * 2 * cfg.mixing,
    out_shape=dkv_out,
    scratch_shapes=[
      *pseudo,
      pltpu.VMEM((*pieces_k, cfg.width), jnp.float32),
      pltpu.VMEM((*pieces_k, cfg.value_width), jnp.float32),
    ],
    compiler_params=semantics(cfg.mixing or cfg.group > 1),
    interpret=interpret,
    name="iha_backward_dkv",
  )(*args)
  dalpha = (dalpha_q[0], *dalpha_kv) if cfg.mixing else None
  return dq, dk, dv, dalpha
