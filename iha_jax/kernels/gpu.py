"""Fused IHA attention for GPU: Pallas Triton kernels (forward, dQ, dK/dV) on virtual-row tiles.

A tile is `R` consecutive rows of one target head's virtual sequence, in the interleaved
order of docs/design.md §1.3: each token owns `Pr = next_pow2(P)` rows, row `r` of tile i
is pseudo-head `p = r % Pr` of token `i * b + r // Pr` (`b = R / Pr` tokens per tile), and
rows with `p >= P` are dead (segment 0: never seen, output zero; only when P is not a power
of two). So every dot is one `[Rq, W] x [W, Rk]` tensor-core matmul (Hopper `wgmma` from
64 rows), the mask is `ops.masking.visible` on virtual indices `t = n * P + p`, and the
kernels never unroll over P. Tiles are built on chip: a source head's `[R, W]` rows are a
gather of its token rows (each token read Pr times, from L1), mixed with the coefficient
column `alpha[m, h, p(r)]`, then rotated by R(p) (the caller rotated the source heads by
R(pos * P): RoPE at virtual position `pos * P + p`, see `iha_jax.kernels.common`).

Layouts (besides `iha_jax.kernels.common`'s source layouts): the pseudo output, its
cotangent, lse and delta are `[B, Ht, Np, Pr, ·]` (a tile's rows are `[b, Pr]` of it);
dalpha partials `[B, tiles, Ht * H, Pr]` (q) and `[B, tiles, Ht * G, Pr]` (k, v: one slot
per query target, summed over each group by `dalpha_flat`).

- forward, grid (query tiles, B, target heads): walks the key tiles of its band
  (`common.kv_range`) with an online softmax.
- dQ, grid (query tiles, B): loops over target heads (they all add into the same source
  rows of dq, so one program owns them: no atomics) and over the key band; the pseudo
  gradient goes back to the source heads on chip (`_scatter`).
- dK/dV, grid (key tiles, B): the same over the query band for dk, dv. With grouped-query
  attention (G key/value heads) the r query heads of a group read, and add into, key/value
  head `h // r` in turn inside the program: keys and values are never copied per query
  head, and no two programs write the same rows.
- Sliced calls (a sequence shard): the query offset arrives as a `[1]` int32 operand and
  the keys bring their own segment ids (`[B, Nkp]`); query rows take virtual index
  `(offset + n) * P + p` and the band loops shift by the offset (`common.kv_range`,
  `q_range`), so one compiled kernel serves every shard.

Tiles, warps and pipeline stages per kernel come from `iha_jax.kernels.gpu_tiles`, chosen
by compiling candidates for H100 (`benchmarks/tune_gpu_tiles.py`). `interpret=True` runs
the same kernels through Pallas' HLO interpreter (CPU).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from iha_jax.core.masking import visible
from iha_jax.kernels import common, gpu_tiles
from iha_jax.kernels.common import Config, Side
from iha_jax.kernels.gpu_tiles import Launch

# The pseudo output's axes in einsum letters: [B, Ht, Np, Pr, W] (see `pseudo_view`).
OUTPUT_SPEC = "bhnpd"


def half_width(head_dim: int) -> int:
  """Lanes per RoPE half: a power of two >= 16 (Triton dot and arange constraints)."""
  return max(16, common.next_pow2(-(-head_dim // 2)))


def pseudo_rows(num_pseudo: int) -> int:
  """Rows per token inside a tile: P rounded up to a power of two."""
  return common.next_pow2(num_pseudo)


# Tiles per kernel live in `gpu_tiles`; `fused` calls `gpu.tiled`.
tiled = gpu_tiles.tiled


def _params(launch: Launch) -> plgpu.CompilerParams:
  return plgpu.CompilerParams(num_warps=launch.num_warps, num_stages=launch.num_stages)


# --- Rows of a tile. --------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Rows:
  """Tile `index` of `block` tokens: per row (`[R]` int32 / bool) its token, pseudo index,
  virtual index `t = token * P + p` and whether it is live (`p < P`)."""

  index: jax.Array
  block: int
  token: jax.Array
  pseudo: jax.Array
  virtual: jax.Array
  live: jax.Array

  @property
  def size(self) -> int:
    return self.token.shape[0]

  @property
  def tokens(self) -> pl.Slice:
    """This tile's tokens in the `[.., Np, ..]` layouts."""
    return pl.ds(self.index * self.block, self.block)

  def load(self, ref, head) -> jax.Array:
    """This tile's rows of head `head` of a pseudo-layout ref `[Ht, Np, Pr, w]`, `[R, w]`."""
    x = ref[head, self.tokens, :, :]
    return x.reshape(self.size, x.shape[-1])

  def store(self, ref, x: jax.Array) -> None:
    """Writes `[R, w]` rows into this tile's part of a per-head block `[Np, Pr, w]`."""
    ref[self.tokens, :, :] = x.reshape(self.block, self.size // self.block, x.shape[-1])


def _rows(index, block: int, cfg: Config, offset=None) -> _Rows:
  """Tile `index`'s rows; `offset` (queries of a sliced call): the query offset in tokens,
  added to the virtual index only (loads use the local token)."""
  pr = pseudo_rows(cfg.num_pseudo)
  r = lax.broadcasted_iota(jnp.int32, (block * pr,), 0)
  token = index * block + lax.div(r, jnp.int32(pr))
  pseudo = lax.rem(r, jnp.int32(pr))
  live = pseudo < cfg.num_pseudo
  on_keys = token if offset is None else token + offset
  return _Rows(index, block, token, pseudo, on_keys * cfg.num_pseudo + pseudo, live)


def _token_refs(refs, cfg: Config):
  """(query offset or None, query segment ids ref, key segment ids ref, the other refs):
  a sliced call's kernels take the offset (`[1]` int32) and both ids, else one ids ref."""
  if cfg.sliced:
    offset_ref, seg_q, seg_k, *rest = refs
    return offset_ref[0], seg_q, seg_k, rest
  seg, *rest = refs
  return None, seg, seg, rest


def _segments(seg_ref, rows: _Rows) -> jax.Array:
  """`[R]` segment ids, 0 on dead rows."""
  return jnp.where(rows.live, seg_ref[rows.token], 0)


def _lanes(start: int, width: int) -> jax.Array:
  return start + lax.broadcasted_iota(jnp.int32, (1, width), 1)


def _loader(ref, rows: _Rows, widths: tuple[int, ...]):
  """`load(m)`: source head m's rows of the tile as lane parts (`[R, w]` each, a gather)."""
  starts = [sum(widths[:c]) for c in range(len(widths))]
  return lambda m: tuple(ref[m, rows.token[:, None], _lanes(s, w)] for s, w in zip(starts, widths))


def _coefficients(alpha_ref, side: Side, m, rows: _Rows, cfg: Config) -> jax.Array:
  """`[R, 1]` column alpha[m, t, p(r)] of target t = `side.target` (the last pseudo index
  on dead rows)."""
  p = jnp.minimum(rows.pseudo, cfg.num_pseudo - 1)
  return alpha_ref[(side.target * side.sources + m) * cfg.num_pseudo + p][:, None]


def _pseudo(load, alpha_ref, side: Side, rows: _Rows, cfg: Config) -> tuple[jax.Array, ...]:
  """Target t's pseudo rows `sum_m alpha[m, t, p(r)] * source[m]`, float32 parts."""
  if not cfg.mixing:  # MHA: head t itself
    return tuple(x.astype(jnp.float32) for x in load(side.target))

  def add_source(m, acc):
    c = _coefficients(alpha_ref, side, m, rows, cfg)
    return tuple(a + c * x.astype(jnp.float32) for a, x in zip(acc, load(m)))

  first = _coefficients(alpha_ref, side, 0, rows, cfg)
  init = tuple(first * x.astype(jnp.float32) for x in load(0))
  return lax.fori_loop(1, side.sources, add_source, init)


def _rotation(cos_ref, sin_ref, rows: _Rows, cfg: Config) -> tuple[jax.Array, jax.Array]:
  """`[R, half]` cos and sin of each row's pseudo index (a gather from the `[Pr, half]`
  tables)."""
  index = (rows.pseudo[:, None], _lanes(0, cfg.half))
  return cos_ref[index], sin_ref[index]


def _qk_tile(ref, alpha_ref, side: Side, rows, rotation, cfg: Config, dtype):
  """Pseudo q or k rows of `side`'s target, rotated by R(p), as lane halves in `dtype`."""
  parts = _pseudo(_loader(ref, rows, (cfg.half, cfg.half)), alpha_ref, side, rows, cfg)
  if cfg.rope:
    parts = common.rotate(parts, *_rotation(*rotation, rows, cfg))
  return tuple(x.astype(dtype) for x in parts)


def _v_tile(ref, alpha_ref, side: Side, rows, cfg: Config, dtype):
  (v,) = _pseudo(_loader(ref, rows, (cfg.value_width,)), alpha_ref, side, rows, cfg)
  return v.astype(dtype)


def _mask(q_rows: _Rows, seg_q, k_rows: _Rows, seg_k, cfg: Config) -> jax.Array:
  return visible(
    q_rows.virtual[:, None], k_rows.virtual[None, :], seg_q, seg_k, cfg.window, cfg.causal
  )


# --- Scatter of pseudo gradients back to the source heads. ---------------------------


def _token_sum(x: jax.Array, rows: _Rows) -> jax.Array:
  """`[R, ...]` -> `[b, ...]`: sum over each token's Pr rows."""
  return jnp.sum(x.reshape(rows.block, x.shape[0] // rows.block, *x.shape[1:]), axis=1)


def _scatter(grads, load, ref, alpha_ref, dalpha_ref, side: Side, rows: _Rows, cfg: Config, widths):
  """Adds target t's pseudo gradient (float32 lane parts, `[R, w]`, before RoPE) into
  the source rows of `ref` (`[S, Np, W]` float32, S = `side.sources`): `sum_p alpha[m, t,
  p] * grad[p]` for every source head m, and writes this tile's partial `dalpha[m, t, p]`
  into row `side.slot * S + m`."""
  starts = [sum(widths[:c]) for c in range(len(widths))]

  def add(m, parts):
    for s, w, part in zip(starts, widths, parts):
      ref[m, rows.tokens, pl.ds(s, w)] += part

  if not cfg.mixing:
    add(side.target, grads)
    return

  def body(m, carry):
    c = _coefficients(alpha_ref, side, m, rows, cfg)
    add(m, tuple(_token_sum(c * g, rows) for g in grads))
    src = load(m)
    dot = sum(jnp.sum(x.astype(jnp.float32) * g, axis=1) for x, g in zip(src, grads))
    dalpha_ref[side.slot * side.sources + m, :] = jnp.sum(dot.reshape(rows.block, -1), axis=0)
    return carry

  lax.fori_loop(0, side.sources, body, 0)


# --- Kernels. ------------------------------------------------------------------------


def _forward_kernel(*refs, cfg: Config):
  (aq, ak, av), (cos_ref, sin_ref, *refs) = common.split_alpha(refs, cfg)
  offset, seg_q_ref, seg_k_ref, (q_ref, k_ref, v_ref, o_ref, lse_ref) = _token_refs(refs, cfg)
  i, h = pl.program_id(0), pl.program_id(2)
  key = cfg.key_side(h)
  rotation = (cos_ref, sin_ref)
  q_rows = _rows(i, cfg.block_q, cfg, offset)
  seg_q = _segments(seg_q_ref, q_rows)[:, None]
  q = _qk_tile(q_ref, aq, cfg.query_side(h), q_rows, rotation, cfg, q_ref.dtype)

  def body(j, state):
    k_rows = _rows(j, cfg.block_k, cfg)
    k = _qk_tile(k_ref, ak, key, k_rows, rotation, cfg, k_ref.dtype)
    v = _v_tile(v_ref, av, key, k_rows, cfg, v_ref.dtype)
    mask = _mask(q_rows, seg_q, k_rows, _segments(seg_k_ref, k_rows)[None, :], cfg)
    [state] = common.forward_tile([state], [q], [k], [(v,)], lambda *_: mask, cfg)
    return state

  lo, hi = common.kv_range(i, cfg, offset)
  [state] = common.init_state(1, q_rows.size, cfg.value_width)
  [(out, lse)] = common.finalize([lax.fori_loop(lo, hi, body, state)], seg_q)
  q_rows.store(o_ref, out.astype(o_ref.dtype))
  q_rows.store(lse_ref, lse)


def _zero_rows(refs, rows: _Rows) -> None:
  for ref in refs:
    for m in range(ref.shape[0]):  # every source head of the block
      ref[m, rows.tokens, :] = jnp.zeros((rows.block, ref.shape[-1]), ref.dtype)


def _cotangents(do_ref, lse_ref, delta_ref, h, rows: _Rows):
  return tuple(rows.load(ref, h) for ref in (do_ref, lse_ref, delta_ref))


def _dq_kernel(*refs, cfg: Config):
  (aq, ak, av), (cos_ref, sin_ref, *refs) = common.split_alpha(refs, cfg)
  offset, seg_q_ref, seg_k_ref, refs = _token_refs(refs, cfg)
  q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, *dalpha = refs
  rotation = (cos_ref, sin_ref)
  q_rows = _rows(pl.program_id(0), cfg.block_q, cfg, offset)
  seg_q = _segments(seg_q_ref, q_rows)[:, None]
  load_q = _loader(q_ref, q_rows, (cfg.half, cfg.half))
  _zero_rows([dq_ref], q_rows)
  lo, hi = common.kv_range(q_rows.index, cfg, offset)

  def head(h, carry):
    query, key = cfg.query_side(h), cfg.key_side(h)
    q = _qk_tile(q_ref, aq, query, q_rows, rotation, cfg, q_ref.dtype)
    do, lse, delta = _cotangents(do_ref, lse_ref, delta_ref, h, q_rows)

    def body(j, dq):
      k_rows = _rows(j, cfg.block_k, cfg)
      k = _qk_tile(k_ref, ak, key, k_rows, rotation, cfg, k_ref.dtype)
      v = _v_tile(v_ref, av, key, k_rows, cfg, v_ref.dtype)
      mask = _mask(q_rows, seg_q, k_rows, _segments(seg_k_ref, k_rows)[None, :], cfg)
      _, ds = common.probs_and_grads(q, k, (v,), do, lse, delta, mask, cfg)
      return tuple(acc + common.dot(ds.astype(x.dtype), x, (1, 0)) for acc, x in zip(dq, k))

    zeros = tuple(jnp.zeros((q_rows.size, cfg.half), jnp.float32) for _ in range(2))
    dq = lax.fori_loop(lo, hi, body, zeros)
    if cfg.rope:
      dq = common.rotate(dq, *_rotation(*rotation, q_rows, cfg), transpose=True)
    halves = (cfg.half,) * 2
    _scatter(dq, load_q, dq_ref, aq, dalpha[0] if dalpha else None, query, q_rows, cfg, halves)
    return carry

  lax.fori_loop(0, cfg.num_targets, head, 0)


def _dkv_kernel(*refs, cfg: Config):
  (aq, ak, av), (cos_ref, sin_ref, *refs) = common.split_alpha(refs, cfg)
  offset, seg_q_ref, seg_k_ref, refs = _token_refs(refs, cfg)
  q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, *dalpha = refs
  rotation = (cos_ref, sin_ref)
  k_rows = _rows(pl.program_id(0), cfg.block_k, cfg)
  seg_k = _segments(seg_k_ref, k_rows)[None, :]
  load_k = _loader(k_ref, k_rows, (cfg.half, cfg.half))
  load_v = _loader(v_ref, k_rows, (cfg.value_width,))
  _zero_rows([dk_ref, dv_ref], k_rows)
  lo, hi = common.q_range(k_rows.index, cfg, offset)

  def head(h, carry):
    query, key = cfg.query_side(h), cfg.key_side(h)
    k = _qk_tile(k_ref, ak, key, k_rows, rotation, cfg, k_ref.dtype)
    v = _v_tile(v_ref, av, key, k_rows, cfg, v_ref.dtype)

    def body(i, grads):
      dk, dv = grads
      q_rows = _rows(i, cfg.block_q, cfg, offset)
      q = _qk_tile(q_ref, aq, query, q_rows, rotation, cfg, q_ref.dtype)
      do, lse, delta = _cotangents(do_ref, lse_ref, delta_ref, h, q_rows)
      mask = _mask(q_rows, _segments(seg_q_ref, q_rows)[:, None], k_rows, seg_k, cfg)
      p, ds = common.probs_and_grads(q, k, (v,), do, lse, delta, mask, cfg)
      dv = dv + common.dot(p.astype(do.dtype), do, (0, 0))
      dk = tuple(acc + common.dot(ds.astype(x.dtype), x, (0, 0)) for acc, x in zip(dk, q))
      return dk, dv

    zeros = (
      tuple(jnp.zeros((k_rows.size, cfg.half), jnp.float32) for _ in range(2)),
      jnp.zeros((k_rows.size, cfg.value_width), jnp.float32),
    )
    dk, dv = lax.fori_loop(lo, hi, body, zeros)
    if cfg.rope:
      dk = common.rotate(dk, *_rotation(*rotation, k_rows, cfg), transpose=True)
    halves, whole = (cfg.half,) * 2, (cfg.value_width,)
    _scatter(dk, load_k, dk_ref, ak, dalpha[0] if dalpha else None, key, k_rows, cfg, halves)
    _scatter((dv,), load_v, dv_ref, av, dalpha[1] if dalpha else None, key, k_rows, cfg, whole)
    return carry

  lax.fori_loop(0, cfg.num_targets, head, 0)


# --- pallas_call wrappers. -----------------------------------------------------------


def _whole_spec(x: jax.Array) -> pl.BlockSpec:
  """All of a small array (alpha, rotation tables) for every program."""
  return pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)


def _batch_spec(x: jax.Array, batch_axis: int) -> pl.BlockSpec:
  """Batch element b of x (all other axes whole); b is grid axis `batch_axis`."""
  return pl.BlockSpec((None, *x.shape[1:]), lambda *g: (g[batch_axis],) + (0,) * (x.ndim - 1))


def pseudo_view(o: jax.Array, cfg: Config) -> jax.Array:
  """The pseudo outputs in `OUTPUT_SPEC` order (the kernel layout already is)."""
  del cfg
  return o


kernel_view = pseudo_view


def collapse_weights(collapse: jax.Array, cfg: Config) -> jax.Array:
  """Collapse padded with zeros along P to the tile's Pr rows per token."""
  pad = pseudo_rows(cfg.num_pseudo) - cfg.num_pseudo
  return jnp.pad(collapse, [(0, 0)] * (collapse.ndim - 1) + [(0, pad)])


def _operands(cfg: Config, alphas, rotation, seg) -> tuple[list, list]:
  """(whole small operands, per-batch token operands): a sliced call's `seg` is (offset
  `[1]`, query ids `[B, Np]`, key ids `[B, Nkp]`), else `[B, Np]` ids of both."""
  if cfg.sliced:
    offset, seg_q, seg_k = seg
    return [*alphas, *rotation, offset], [seg_q, seg_k]
  return [*alphas, *rotation], [seg]


def forward(cfg: Config, alphas, rotation, seg, q, k, v, *, interpret: bool):
  """-> (o `[B, Ht, Np, Pr, Wv]` in q.dtype, lse `[B, Ht, Np, Pr, 1]` float32)."""
  launch = cfg.launch[0]
  kcfg = gpu_tiles.kernel_config(cfg, launch)
  b = q.shape[0]
  small, tokens = _operands(cfg, alphas, rotation, seg)
  batch = [*tokens, q, k, v]
  rows = (cfg.seq_len, pseudo_rows(cfg.num_pseudo))
  out_shape = (
    jax.ShapeDtypeStruct((b, cfg.num_targets, *rows, cfg.value_width), q.dtype),
    jax.ShapeDtypeStruct((b, cfg.num_targets, *rows, 1), jnp.float32),
  )
  per_head = lambda s: pl.BlockSpec((None, None, *s.shape[2:]), lambda i, bb, h: (bb, h, 0, 0, 0))
  return pl.pallas_call(
    functools.partial(_forward_kernel, cfg=kcfg),
    grid=(kcfg.num_q_blocks, b, cfg.num_targets),
    in_specs=[_whole_spec(x) for x in small] + [_batch_spec(x, 1) for x in batch],
    out_specs=tuple(per_head(s) for s in out_shape),
    out_shape=out_shape,
    compiler_params=_params(launch),
    interpret=interpret,
    name="iha_forward",
  )(*small, *batch)


def _dalpha_shape(cfg: Config, batch: int, tiles: int, sources: int) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(
    (batch, tiles, cfg.num_targets * sources, pseudo_rows(cfg.num_pseudo)), jnp.float32
  )


def dalpha_flat(x: jax.Array, cfg: Config, kv: bool = False) -> jax.Array:
  """Partials `[B, tiles, Ht * S, Pr]` (S = H; `kv`: S = G) -> the flat (target, source,
  pseudo) layout; key/value partials, one slot per query target, summed over each group."""
  flat = x[..., : cfg.num_pseudo].sum(axis=(0, 1))
  if kv and cfg.group > 1:
    flat = flat.reshape(cfg.kv_targets, cfg.group, -1).sum(axis=1)
  return flat.reshape(-1)


def backward(cfg: Config, alphas, rotation, seg, q, k, v, do, lse, delta, *, interpret: bool):
  """-> (dq `[B, H, Np, W]`, dk `[B, G, Nkp, W]`, dv `[B, G, Nkp, Wv]` float32, dalpha
  partials `[B, tiles, Ht * H, Pr]` (q), `[B, tiles, Ht * G, Pr]` (k, v) or None)."""
  b = q.shape[0]
  small, tokens = _operands(cfg, alphas, rotation, seg)
  batch = [*tokens, q, k, v, do, lse, delta]
  in_specs = [_whole_spec(x) for x in small] + [_batch_spec(x, 1) for x in batch]
  dq_shape, dk_shape, dv_shape = (jax.ShapeDtypeStruct(x.shape, jnp.float32) for x in (q, k, v))

  dq_launch, dkv_launch = cfg.launch[1], cfg.launch[2]
  dq_cfg, dkv_cfg = (gpu_tiles.kernel_config(cfg, x) for x in (dq_launch, dkv_launch))
  dq_out = [dq_shape] + (
    [_dalpha_shape(cfg, b, dq_cfg.num_q_blocks, cfg.num_heads)] if cfg.mixing else []
  )
  dkv_out = [dk_shape, dv_shape] + (
    [_dalpha_shape(cfg, b, dkv_cfg.num_k_blocks, cfg.num_kv_heads)] * 2 if cfg.mixing else []
  )
  tile_spec = lambda s: pl.BlockSpec((None, None, *s.shape[2:]), lambda t, bb: (bb, t, 0, 0))
  dq, *dalpha_q = pl.pallas_call(
    functools.partial(_dq_kernel, cfg=dq_cfg),
    grid=(dq_cfg.num_q_blocks, b),
    in_specs=in_specs,
    out_specs=[_batch_spec(dq_out[0], 1)] + [tile_spec(s) for s in dq_out[1:]],
    out_shape=dq_out,
    compiler_params=_params(dq_launch),
    interpret=interpret,
    name="iha_backward_dq",
  )(*small, *batch)
  dk, dv, *dalpha_kv = pl.pallas_call(
    functools.partial(_dkv_kernel, cfg=dkv_cfg),
    grid=(dkv_cfg.num_k_blocks, b),
    in_specs=in_specs,
    out_specs=[_batch_spec(s, 1) for s in dkv_out[:2]] + [tile_spec(s) for s in dkv_out[2:]],
    out_shape=dkv_out,
    compiler_params=_params(dkv_launch),
    interpret=interpret,
    name="iha_backward_dkv",
  )(*small, *batch)
  dalpha = (dalpha_q[0], *dalpha_kv) if cfg.mixing else None
  return dq, dk, dv, dalpha
