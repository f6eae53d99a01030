"""Fused IHA attention for GPU: Pallas Triton kernels (forward, dQ, dK/dV).

Layouts are those of `iha_jax.kernels.common`. Triton blocks are pointer
offsets, not copies, so every kernel sees whole `[H, Np, W]` source rows of its
batch element and loads `[block, half]` (q/k) and `[block, Wv]` (v) tiles at
dynamic offsets inside its own loops (the pattern of FlashAttention-2 on GPU):
- forward, grid (query tiles, B, target heads): builds the pseudo-q pieces once,
  then walks exactly the key tiles of its band (causal or bidirectional, global or
  window: `common.kv_range`), rebuilding pseudo k/v pieces per tile (mixing + RoPE
  on chip) with an online softmax.
- dQ, grid (query tiles, B): loops over target heads (they all add into the same
  source-head dq rows, so one program owns them: no atomics) and over the key
  band; contracts d(pseudo q) with alpha on chip into float32 dq and a per-tile
  partial dalpha_q.
- dK/dV, grid (key tiles, B): the same over the query band for dk, dv, dalpha_k/v.
`interpret=True` runs the same kernels through Pallas' HLO interpreter (CPU).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from iha_jax.kernels import common
from iha_jax.kernels.common import Config
from iha_jax.ops.options import round_up


def default_block(num_pseudo: int) -> int:
  """Token tile: ~128 virtual rows per tile, >= 16 (Triton's smallest dot edge)."""
  return max(16, 1 << ((128 // num_pseudo).bit_length() - 1))


def half_width(head_dim: int) -> int:
  """Lanes per RoPE half: a power of two >= 16 (Triton dot and arange constraints)."""
  return max(16, common.next_pow2(-(-head_dim // 2)))


def tiles(
  n: int, num_pseudo: int, dtype, block_q: int | None, block_k: int | None
) -> tuple[int, int, int]:
  """(block_q, block_k, padded tokens) in tokens; tiles never exceed the padded sequence."""
  del dtype  # Triton tiles depend on the element type only through tuning.
  cap = max(16, common.next_pow2(n))
  block_q = min(block_q or default_block(num_pseudo), cap)
  block_k = min(block_k or default_block(num_pseudo), cap)
  return block_q, block_k, round_up(n, max(block_q, block_k))


def check_blocks(cfg: Config) -> None:
  """Triton tiles must be powers of two (and >= 16 for tensor-core dots when compiled)."""
  for name, block in (
    ("block_q", cfg.block_q),
    ("block_k", cfg.block_k),
    ("half", cfg.half),
    ("value_half", cfg.value_half),
  ):
    if block & (block - 1):
      raise ValueError(
        f"GPU kernels need power-of-two tiles; {name} is {block} tokens "
        f"(virtual block = tokens * P)."
      )


def _params(cfg: Config) -> plgpu.CompilerParams:
  width = max(cfg.width, cfg.value_width)
  return plgpu.CompilerParams(num_warps=4 if width <= 64 else 8, num_stages=2)


def _halves(ref, rows, cfg: Config):
  """Loader of source head m's `[rows, half]` lane halves (for q and k)."""
  return lambda m: (ref[m, rows, pl.ds(0, cfg.half)], ref[m, rows, pl.ds(cfg.half, cfg.half)])


def _whole(ref, rows):
  """Loader of source head m's full-width `[rows, Wv]` tile (for v)."""
  return lambda m: (ref[m, rows, :],)


def _adder(ref, rows, cfg: Config, halves: bool):
  """`add(m, parts)`: read-modify-write of source head m's float32 gradient rows."""

  def add(m, parts):
    if halves:
      for c, part in enumerate(parts):
        ref[m, rows, pl.ds(c * cfg.half, cfg.half)] += part
    else:
      ref[m, rows, :] += parts[0]

  return add


def _column(ref, rows):
  return ref[rows][:, None]


def _row(ref, rows):
  return ref[rows][None, :]


def _key_tile(j, h, k_ref, v_ref, seg_ref, pos_ref, ak, av, inv_freq, cfg: Config):
  """Key tile j of target head h: (rotated pseudo k pieces, pseudo v pieces,
  key segment ids `[1, bk]`, key token indices `[1, bk]`)."""
  bk = cfg.block_k
  k_rows = pl.ds(j * bk, bk)
  k = common.rotated_pieces(
    _halves(k_ref, k_rows, cfg), ak, h, _column(pos_ref, k_rows), inv_freq, cfg, k_ref.dtype
  )
  v = common.plain_pieces(_whole(v_ref, k_rows), av, h, cfg, v_ref.dtype)
  return k, v, _row(seg_ref, k_rows), common.token_index(j * bk, bk, 1)


def _forward_kernel(*refs, cfg: Config):
  (aq, ak, av), (freq_ref, seg_ref, pos_ref, q_ref, k_ref, v_ref, o_ref, lse_ref) = (
    common.split_alpha(refs, cfg)
  )
  i, h = pl.program_id(0), pl.program_id(2)
  bq = cfg.block_q
  q_rows = pl.ds(i * bq, bq)
  inv_freq = freq_ref[...]
  seg_q, q_tok = _column(seg_ref, q_rows), common.token_index(i * bq, bq, 0)
  q = common.rotated_pieces(
    _halves(q_ref, q_rows, cfg), aq, h, _column(pos_ref, q_rows), inv_freq, cfg, q_ref.dtype
  )

  def body(j, state):
    k, v, seg_k, k_tok = _key_tile(j, h, k_ref, v_ref, seg_ref, pos_ref, ak, av, inv_freq, cfg)
    mask = lambda pq, pk: common.tile_mask(q_tok, k_tok, pq, pk, seg_q, seg_k, cfg)
    return common.forward_tile(state, q, k, v, mask, cfg)

  lo, hi = common.kv_range(i, cfg)
  state = lax.fori_loop(lo, hi, body, common.init_state(cfg))
  for p, (out, lse) in enumerate(common.finalize(state, seg_q)):
    o_ref[p, q_rows, :] = out.astype(o_ref.dtype)
    lse_ref[p, q_rows, :] = lse


def _zero_rows(refs, rows, cfg: Config) -> None:
  for ref in refs:
    for m in range(cfg.num_heads):
      ref[m, rows, :] = jnp.zeros((rows.size, ref.shape[-1]), ref.dtype)


def _dq_kernel(*refs, cfg: Config):
  (
    (aq, ak, av),
    (freq_ref, seg_ref, pos_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, *dalpha),
  ) = common.split_alpha(refs, cfg)
  i = pl.program_id(0)
  bq = cfg.block_q
  q_rows = pl.ds(i * bq, bq)
  inv_freq = freq_ref[...]
  seg_q, pos_q = _column(seg_ref, q_rows), _column(pos_ref, q_rows)
  q_tok = common.token_index(i * bq, bq, 0)
  load_q = _halves(q_ref, q_rows, cfg)
  _zero_rows([dq_ref], q_rows, cfg)
  lo, hi = common.kv_range(i, cfg)

  def head(h, carry):
    q = common.rotated_pieces(load_q, aq, h, pos_q, inv_freq, cfg, q_ref.dtype)
    do = [do_ref[h, p, q_rows, :] for p in range(cfg.num_pseudo)]
    lse = [lse_ref[h, p, q_rows, :] for p in range(cfg.num_pseudo)]
    delta = [delta_ref[h, p, q_rows, :] for p in range(cfg.num_pseudo)]

    def body(j, dq):
      k, v, seg_k, k_tok = _key_tile(j, h, k_ref, v_ref, seg_ref, pos_ref, ak, av, inv_freq, cfg)
      dq = [list(piece) for piece in dq]
      for pq in range(cfg.num_pseudo):
        for pk in range(cfg.num_pseudo):
          mask = common.tile_mask(q_tok, k_tok, pq, pk, seg_q, seg_k, cfg)
          _, ds = common.probs_and_grads(q[pq], k[pk], v[pk], do[pq], lse[pq], delta[pq], mask, cfg)
          for c, part in enumerate(k[pk]):
            dq[pq][c] += common.dot(ds.astype(part.dtype), part, (1, 0))
      return [tuple(piece) for piece in dq]

    zeros = [
      tuple(jnp.zeros((bq, cfg.half), jnp.float32) for _ in range(2)) for _ in range(cfg.num_pseudo)
    ]
    dq = lax.fori_loop(lo, hi, body, zeros)
    if cfg.rope:
      dq = [
        common.rope(g, common.virtual_position(pos_q, p, cfg), inv_freq, transpose=True)
        for p, g in enumerate(dq)
      ]
    common.scatter_to_sources(
      dq,
      load_q,
      _adder(dq_ref, q_rows, cfg, halves=True),
      aq,
      dalpha[0] if dalpha else None,
      h,
      cfg,
    )
    return carry

  lax.fori_loop(0, cfg.num_targets, head, 0)


def _dkv_kernel(*refs, cfg: Config):
  (
    (aq, ak, av),
    (
      freq_ref,
      seg_ref,
      pos_ref,
      q_ref,
      k_ref,
      v_ref,
      do_ref,
      lse_ref,
      delta_ref,
      dk_ref,
      dv_ref,
      *dalpha,
    ),
  ) = common.split_alpha(refs, cfg)
  j = pl.program_id(0)
  bq, bk = cfg.block_q, cfg.block_k
  k_rows = pl.ds(j * bk, bk)
  inv_freq = freq_ref[...]
  seg_k, pos_k = _row(seg_ref, k_rows), _column(pos_ref, k_rows)
  k_tok = common.token_index(j * bk, bk, 1)
  load_k, load_v = _halves(k_ref, k_rows, cfg), _whole(v_ref, k_rows)
  _zero_rows([dk_ref, dv_ref], k_rows, cfg)
  lo, hi = common.q_range(j, cfg)

  def head(h, carry):
    k = common.rotated_pieces(load_k, ak, h, pos_k, inv_freq, cfg, k_ref.dtype)
    v = common.plain_pieces(load_v, av, h, cfg, v_ref.dtype)

    def body(i, grads):
      dk, dv = [list(piece) for piece in grads[0]], list(grads[1])
      q_rows = pl.ds(i * bq, bq)
      q = common.rotated_pieces(
        _halves(q_ref, q_rows, cfg), aq, h, _column(pos_ref, q_rows), inv_freq, cfg, q_ref.dtype
      )
      seg_q, q_tok = _column(seg_ref, q_rows), common.token_index(i * bq, bq, 0)
      for pq in range(cfg.num_pseudo):
        do = do_ref[h, pq, q_rows, :]
        lse, delta = lse_ref[h, pq, q_rows, :], delta_ref[h, pq, q_rows, :]
        for pk in range(cfg.num_pseudo):
          mask = common.tile_mask(q_tok, k_tok, pq, pk, seg_q, seg_k, cfg)
          p, ds = common.probs_and_grads(q[pq], k[pk], v[pk], do, lse, delta, mask, cfg)
          dv[pk] += common.dot(p.astype(do.dtype), do, (0, 0))
          for c, part in enumerate(q[pq]):
            dk[pk][c] += common.dot(ds.astype(part.dtype), part, (0, 0))
      return [tuple(piece) for piece in dk], dv

    zeros = (
      [
        tuple(jnp.zeros((bk, cfg.half), jnp.float32) for _ in range(2))
        for _ in range(cfg.num_pseudo)
      ],
      [jnp.zeros((bk, cfg.value_width), jnp.float32) for _ in range(cfg.num_pseudo)],
    )
    dk, dv = lax.fori_loop(lo, hi, body, zeros)
    if cfg.rope:
      dk = [
        common.rope(g, common.virtual_position(pos_k, p, cfg), inv_freq, transpose=True)
        for p, g in enumerate(dk)
      ]
    common.scatter_to_sources(
      dk,
      load_k,
      _adder(dk_ref, k_rows, cfg, halves=True),
      ak,
      dalpha[0] if dalpha else None,
      h,
      cfg,
    )
    common.scatter_to_sources(
      [(g,) for g in dv],
      load_v,
      _adder(dv_ref, k_rows, cfg, False),
      av,
      dalpha[1] if dalpha else None,
      h,
      cfg,
    )
    return carry

  lax.fori_loop(0, cfg.num_targets, head, 0)


def _whole_spec(x: jax.Array) -> pl.BlockSpec:
  """All of a small array (alpha, inv_freq) for every program."""
  return pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)


def _batch_spec(x: jax.Array, batch_axis: int) -> pl.BlockSpec:
  """Batch element b of x (all other axes whole); b is grid axis `batch_axis`."""
  return pl.BlockSpec((None, *x.shape[1:]), lambda *g: (g[batch_axis],) + (0,) * (x.ndim - 1))


def _dalpha_shape(cfg: Config, batch: int, tiles: int) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct((batch, tiles, cfg.flat_alpha), jnp.float32)


def forward(cfg: Config, alphas, inv_freq, seg, pos, q, k, v, *, interpret: bool):
  """-> (o `[B, H, P, Np, Wv]` in q.dtype, lse `[B, H, P, Np, 1]` float32)."""
  check_blocks(cfg)
  b = q.shape[0]
  small = [*alphas, inv_freq]
  batch = [seg, pos, q, k, v]
  out_shape = (
    jax.ShapeDtypeStruct(
      (b, cfg.num_targets, cfg.num_pseudo, cfg.seq_len, cfg.value_width), q.dtype
    ),
    jax.ShapeDtypeStruct((b, cfg.num_targets, cfg.num_pseudo, cfg.seq_len, 1), jnp.float32),
  )
  per_head = lambda s: pl.BlockSpec((None, None, *s.shape[2:]), lambda i, bb, h: (bb, h, 0, 0, 0))
  return pl.pallas_call(
    functools.partial(_forward_kernel, cfg=cfg),
    grid=(cfg.num_q_blocks, b, cfg.num_targets),
    in_specs=[_whole_spec(x) for x in small] + [_batch_spec(x, 1) for x in batch],
    out_specs=tuple(per_head(s) for s in out_shape),
    out_shape=out_shape,
    compiler_params=_params(cfg),
    interpret=interpret,
    name="iha_forward",
  )(*small, *batch)


def backward(cfg: Config, alphas, inv_freq, seg, pos, q, k, v, do, lse, delta, *, interpret: bool):
  """-> (dq, dk `[B, H, Np, W]`, dv `[B, H, Np, Wv]` float32, dalpha partials
  `[B, tiles, H*H*P]` x3 or None)."""
  check_blocks(cfg)
  b = q.shape[0]
  small = [*alphas, inv_freq]
  batch = [seg, pos, q, k, v, do, lse, delta]
  in_specs = [_whole_spec(x) for x in small] + [_batch_spec(x, 1) for x in batch]
  grad = jax.ShapeDtypeStruct(q.shape, jnp.float32)
  dq_out = [grad] + ([_dalpha_shape(cfg, b, cfg.num_q_blocks)] if cfg.mixing else [])
  dkv_out = [grad, jax.ShapeDtypeStruct(v.shape, jnp.float32)] + (
    [_dalpha_shape(cfg, b, cfg.num_k_blocks)] * 2 if cfg.mixing else []
  )
  tile_spec = lambda s: pl.BlockSpec((None, None, s.shape[2]), lambda t, bb: (bb, t, 0))
  out_spec = lambda s: tile_spec(s) if s.ndim == 3 else _batch_spec(s, 1)
  dq, *dalpha_q = pl.pallas_call(
    functools.partial(_dq_kernel, cfg=cfg),
    grid=(cfg.num_q_blocks, b),
    in_specs=in_specs,
    out_specs=[out_spec(s) for s in dq_out],
    out_shape=dq_out,
    compiler_params=_params(cfg),
    interpret=interpret,
    name="iha_backward_dq",
  )(*small, *batch)
  dk, dv, *dalpha_kv = pl.pallas_call(
    functools.partial(_dkv_kernel, cfg=cfg),
    grid=(cfg.num_k_blocks, b),
    in_specs=in_specs,
    out_specs=[out_spec(s) for s in dkv_out],
    out_shape=dkv_out,
    compiler_params=_params(cfg),
    interpret=interpret,
    name="iha_backward_dkv",
  )(*small, *batch)
  dalpha = (dalpha_q[0], *dalpha_kv) if cfg.mixing else None
  return dq, dk, dv, dalpha
