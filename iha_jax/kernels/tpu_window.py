"""Sliding-window IHA on TPU with the pseudo-heads made, attended and collapsed in VMEM.

The materialised pipeline (`iha_jax.kernels.virtual_attention`) writes pseudo q/k/v and
the pseudo output to HBM: four arrays P times the size of the layer's own activations.
A window layer attends a band of only ~W virtual keys per query, so at the paper's
P = H that traffic, not the MXU, bounds it. Here one grid step takes a tile of tokens
and does everything on chip, per target head: mixing, RoPE, the band's attention, and
the collapse, so only source-sized arrays cross HBM, forward and backward.

How the work maps to the MXU (every product a matmul; the vector units do the softmax
and RoPE only):
- *Mixing* contracts over the H source heads, a short axis. It is a matmul with a
  block-diagonal constant: for a group of `s` tokens, the source rows `(n, m)`
  `[s*H, d]` times `kron(I_s, alpha[:, h, :]^T)` `[s*P, s*H]` give the group's pseudo
  rows `(n, p)` `[s*P, d]`, already interleaved (token-major). With `s*H <= 128` each
  output row is one MXU pass, so the cost is the output's size: the same as an einsum
  in HBM, without the HBM. The collapse and every gradient of the mixing are the same
  kind of product.
- *RoPE* at virtual position `pos * P + p` is `R(p) R(pos * P)`: the source heads are
  rotated at `pos * P` outside (source-sized, in XLA), and each group's pseudo rows by
  `R(p)` here, from one constant `[s*P, 2d]` table (period P rows).
- *Attention*: a block of `cq` query rows sees at most `cq + W - 1` keys (`+ W - 1`
  more if bidirectional), so each block's whole band is one `[cq, kb]` score tile:
  plain softmax, no online rescaling, and in the backward no saved log-sum-exp (the
  probabilities are recomputed exactly). The mask is a constant `[cq, kb]` bias (the
  band is the same for every block) plus key ids per block (segments and padding).

Layouts: source rows token-major, `[B, tokens * heads, d]` (a free reshape of
`[B, N, H, d]`); the keys are padded in front so that tile i's own keys start a block,
and its band is its own block plus `halo` blocks before it (and after it when
bidirectional). The output y `[B, N, Ho, d]` is float32 (Ho = H, or the local target
heads of a per-head collapse; a full collapse over a head shard is a partial sum).

The backward kernel recomputes each block's probabilities and pseudo output, and writes
the source gradients (a tile's own keys and its halo separately, added in XLA), and each
tile's partial gradient of the mixing and collapse matrices (summed in XLA).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from iha_jax.core.masking import MASK_VALUE
from iha_jax.core.options import AttentionOptions, round_up
from iha_jax.core.rope import apply_rope, rope_frequencies
from iha_jax.core.validation import default_positions

LANES = 128
# Scoped VMEM the kernels may use (v5p has 64 MiB per core, v5e and v6e 128 MiB).
VMEM_LIMIT_BYTES = 56 * 2**20
# What the tiles' blocks and scratch may take of it (the rest: Mosaic's temporaries).
VMEM_BUDGET_BYTES = 44 * 2**20
# Default tile: about this many virtual rows per target head and grid step.
TILE_ROWS = 3200
BLOCK_UNROLL = 4
MIX_UNROLL = 8

# Additive masks: two of them still sum to a finite score (a row of padding stays finite).
HALF_MASK = MASK_VALUE / 2
_NT = (((1,), (1,)), ((), ()))  # a @ b.T
_NN = (((1,), (0,)), ((), ()))  # a @ b
_TN = (((0,), (0,)), ((), ()))  # a.T @ b


class UnsupportedShape(ValueError):
  """A call the on-chip window path cannot take (the materialised pipeline can): one line
  naming the limit and the implementation that takes the call."""

  def __init__(self, limit: str):
    super().__init__(
      f"implementation 'pallas_tpu_window' (IHA's on-chip window path): {limit}; use "
      "'pallas_tpu' (the materialised pipeline) or 'auto'"
    )


@dataclasses.dataclass(frozen=True)
class Plan:
  """The static tiling of one call (hashable: a custom_vjp argument). Units: tokens
  unless named rows (virtual rows, P per token)."""

  heads: int  # H: source query heads
  kv_heads: int  # G: source key/value heads
  out_heads: int  # Ho: collapsed heads the call outputs
  targets: int  # Ht: target query heads computed here
  kv_targets: int  # Gt: target key/value heads computed here
  num_pseudo: int  # P
  head_dim: int  # d
  window: int  # rows
  causal: bool
  per_head: bool  # collapse [Ht, P] (else [Ho, Ht, P])
  group: int  # s: tokens per mixing product of the query side (q, the collapse)
  kv_group: int  # tokens per mixing product of the key/value side
  tile: int  # bn: query tokens per grid step
  block_rows: int  # cq: query rows per score tile
  key_rows: int  # kb: key rows per score tile
  halo: int  # tokens per halo block (divides `tile`)
  halo_before: int  # halo blocks before the tile's own keys
  halo_after: int  # and after (bidirectional)
  num_tiles: int
  front: int  # key padding in front (tokens)
  first_block: int  # tile 0's own keys: block `first_block` of the padded keys
  key_tokens: int  # padded key tokens
  segments: bool
  rotary: bool
  low_precision: bool  # bf16 inputs (else float32: products at HIGHEST precision)

  @property
  def band_rows(self) -> int:
    return (self.halo * (self.halo_before + self.halo_after) + self.tile) * self.num_pseudo

  @property
  def lo_rows(self) -> int:  # key rows in the band before the tile's own
    return self.halo * self.halo_before * self.num_pseudo

  @property
  def blocks(self) -> int:  # score tiles per head and grid step
    return self.tile * self.num_pseudo // self.block_rows

  @property
  def base(self) -> int:
    """First band row of query block 0's keys (block qb's: `qb * cq + base`)."""
    if self.causal:
      return self.lo_rows + self.block_rows - self.key_rows
    return self.lo_rows - round_up(self.window - 1, self.align)

  @property
  def align(self) -> int:  # rows per sublane tile of the inputs' dtype
    return 16 if self.low_precision else 8

  @property
  def rows_per_group(self) -> int:
    return self.group * self.num_pseudo


def _aligned_group(heads: tuple[int, ...], p: int, align: int) -> int:
  for s in range(1, 129):
    if all((s * x) % align == 0 for x in (*heads, p)):
      return s
  raise UnsupportedShape(f"no group of up to 128 tokens aligns heads {heads} and P = {p}")


def plan(
  q_shape: tuple[int, ...],
  key_tokens: int,
  kv_heads: int,
  alphas_shape: tuple[tuple[int, ...], ...],
  collapse_shape: tuple[int, ...],
  options: AttentionOptions,
  offset: int,
  low_precision: bool,
  tile_rows: int | None = None,
  block_rows: int | None = None,
) -> Plan:
  """The tiling of a call, or `UnsupportedShape` naming the limit."""
  _, n, h, d = q_shape
  window = options.window
  if window is None:
    raise UnsupportedShape("it takes sliding windows only (window=None is a global layer)")
  if not isinstance(offset, int):
    raise UnsupportedShape("it needs a static query offset (a window layer's shard has one)")
  (_, ht, p), (_, gt, _) = alphas_shape[0], alphas_shape[1]
  per_head = len(collapse_shape) == 2
  ho = ht if per_head else collapse_shape[0]
  if d % 2 or d > LANES:
    raise UnsupportedShape(f"head_dim {d}: it takes an even head_dim <= {LANES}")
  align = 16 if low_precision else 8
  # Token groups whose source and pseudo rows fill whole sublane tiles, per side (a
  # product's contraction, s * heads, then stays one MXU pass wide: G = 5 takes 16 tokens
  # where H = 20 takes 4).
  s = _aligned_group((h, ho), p, align)
  s_kv = _aligned_group((kv_heads,), p, align)
  # Score tiles: cq query rows against kb keys (the whole band of the cq rows).
  reach = window - 1 if options.causal else 2 * round_up(window - 1, align)
  if block_rows is None:
    # MXU passes per query row of the two products (a weight tile is loaded per product,
    # which costs as much as streaming 128 rows through it); ties: the shortest tile unit.
    def cost(cq: int) -> tuple[float, int]:
      kb = round_up(cq + reach, LANES)
      return 2 * kb / LANES * max(cq, LANES) / cq, math.lcm(s, s_kv, cq // math.gcd(cq, p))

    block_rows = min(range(align, 512 + 1, align), key=cost)
  elif block_rows % align:
    raise UnsupportedShape(
      f"block_sizes.block_k={block_rows}: its score tiles are multiples of {align} query rows"
    )
  key_rows = round_up(block_rows + reach, LANES)
  # Key rows needed before a block's first query row and after its last.
  before = key_rows - block_rows if options.causal else round_up(window - 1, align)
  after = 0 if options.causal else key_rows - block_rows - before
  # Tiles of whole token groups (both sides) and whole score tiles.
  token_unit = math.lcm(s, s_kv, block_rows // math.gcd(block_rows, p))
  before_tokens, after_tokens = -(-before // p), -(-after // p)
  itemsize = 2 if low_precision else 4

  def layout(tile: int) -> tuple[int, int, int]:  # (halo, blocks before, blocks after)
    halo = _halo(max(before_tokens, after_tokens), tile, math.lcm(s, s_kv))
    return halo, -(-before_tokens // halo), -(-after_tokens // halo)

  def fits(tile: int) -> bool:
    halo, nb, na = layout(tile)
    band = tile + halo * (nb + na)
    sizes = dict(heads=h, kv_heads=kv_heads, out_heads=ho, targets=ht, kv_targets=gt, d=d, p=p)
    return _vmem_bytes(tile, band, block_rows, key_rows, s, s_kv, itemsize, **sizes) <= (
      VMEM_BUDGET_BYTES
    )

  if tile_rows is None:
    tile_rows = TILE_ROWS
  longest = round_up(max(n, 1), token_unit)
  tile = min(max(token_unit, round_up(-(-tile_rows // p), token_unit)), longest)
  while tile > token_unit and not fits(tile):
    tile -= token_unit
  if not fits(tile):
    raise UnsupportedShape(
      f"its smallest tile ({tile} tokens at H={h}, P={p}, d={d}) needs more than "
      f"{VMEM_BUDGET_BYTES // 2**20} MiB of VMEM"
    )
  halo, halo_before, halo_after = layout(tile)
  num_tiles = -(-n // tile)
  front = (-offset) % tile  # key padding that puts tile 0's own keys on a block boundary
  while offset + front < halo * halo_before:
    front += tile
  needed = front + offset + num_tiles * tile + halo * halo_after
  key_len = round_up(max(needed, front + key_tokens), tile)
  return Plan(
    heads=h,
    kv_heads=kv_heads,
    out_heads=ho,
    targets=ht,
    kv_targets=gt,
    num_pseudo=p,
    head_dim=d,
    window=window,
    causal=options.causal,
    per_head=per_head,
    group=s,
    kv_group=s_kv,
    tile=tile,
    block_rows=block_rows,
    key_rows=key_rows,
    halo=halo,
    halo_before=halo_before,
    halo_after=halo_after,
    num_tiles=num_tiles,
    front=front,
    first_block=(offset + front) // tile,
    key_tokens=key_len,
    segments=options.segment_ids is not None
    or options.kv_segment_ids is not None
    or options.key_segment_ids is not None,
    rotary=options.rope_theta is not None,
    low_precision=low_precision,
  )


def _vmem_bytes(
  tile, band, cq, kb, s, s_kv, itemsize, *, heads, kv_heads, out_heads, targets, kv_targets, d, p
) -> int:
  """VMEM of the backward kernel (the larger of the two) at a tile of `tile` tokens and a
  band of `band` key tokens: double-buffered blocks and matrices (with their transposes),
  scratch, and the score tiles' float32 temporaries. Rows take whole 128-lane vregs (a
  d = 64 row as much as a d = 128 one)."""
  lanes = lambda x: round_up(x, LANES)
  d = lanes(d)
  inputs = (tile * heads + 2 * band * kv_heads + tile * out_heads) * d * itemsize
  mixing = targets * s * p * lanes(s * heads) + 2 * kv_targets * s_kv * p * lanes(s_kv * kv_heads)
  mixing += targets * s * out_heads * lanes(s * p)
  outputs = (tile * heads + 2 * band * kv_heads) * d * 4
  partials = targets * s * p * lanes(s * heads) + 2 * kv_targets * s_kv * p * lanes(s_kv * kv_heads)
  partials += targets * s * out_heads * lanes(s * p)
  scratch = (3 * tile * p + 2 * band * p) * d * itemsize + (tile * p + 2 * band * p) * d * 4
  scores = 4 * cq * kb * 4
  segments = tile * p * LANES * 4
  return 2 * (inputs + 2 * mixing * itemsize + outputs + 4 * partials + segments) + scratch + scores


def _halo(tokens: int, tile: int, group: int) -> int:
  """Tokens per halo block: a divisor of the tile, whole token groups, covering `tokens`
  in one block when the tile is long enough (else whole tiles)."""
  if tokens <= 0:
    return tile
  if tokens >= tile:
    return tile
  for size in range(round_up(tokens, group), tile + 1, group):
    if tile % size == 0:
      return size
  return tile


# --- constants built outside the kernels (XLA, small) ------------------------------------


def _block_diagonal(weights: jax.Array, s: int) -> jax.Array:
  """`weights [S, T, P]` -> `[T, s*P, s*S]`: per target t, `kron(I_s, weights[:, t, :]^T)`
  (rows (n, p), columns (n', m): the products that map a group's source rows to its
  pseudo rows)."""
  eye = jnp.eye(s, dtype=weights.dtype)
  out = jnp.einsum("nN,mtp->tnpNm", eye, weights)
  t, _, p, _, m = out.shape
  return out.reshape(t, s * p, s * m)


def _collapse_blocks(collapse: jax.Array, plan: Plan) -> jax.Array:
  """`collapse` -> `[Ht, s*Ho, s*P]`: per target head h', rows (n, ho), columns (n', p),
  `delta(n, n') collapse[ho, h', p]` (per head: only ho = h')."""
  if plan.per_head:
    eye = jnp.eye(plan.targets, dtype=collapse.dtype)
    collapse = jnp.einsum("hp,hg->hgp", collapse, eye)  # [Ho = Ht, Ht, P]
  # [Ho, Ht, P] as weights [S=Ho, T=Ht, P]: kron gives rows (n, p), columns (n', ho); transpose.
  return jnp.swapaxes(_block_diagonal(collapse, plan.group), 1, 2)


def _group_table(plan: Plan, theta: float) -> jax.Array:
  """`[s*P, 2d]` float32 `cos | sin` of `R(p)` for the rows (n, p) of a token group, in
  the kernels' rotate-half form (`cos = [c, c]`, `sin = [-s, s]`)."""
  p, d = plan.num_pseudo, plan.head_dim
  angles = jnp.arange(p, dtype=jnp.float32)[:, None] * rope_frequencies(d, theta)
  cos, sin = jnp.cos(angles), jnp.sin(angles)
  table = jnp.concatenate([cos, cos, -sin, sin], axis=-1)  # [P, 2d]
  return jnp.tile(table, (max(plan.group, plan.kv_group), 1))


def _band_bias(plan: Plan) -> jax.Array:
  """`[cq, kb]` float32: 0 where a block's query row sees the key column by the window
  and causality, MASK_VALUE elsewhere (the same for every block)."""
  rows = np.arange(plan.block_rows)[:, None] + plan.lo_rows
  cols = np.arange(plan.key_rows)[None, :] + plan.base
  diff = rows - cols  # t - s
  ok = (diff < plan.window) & (diff >= 0 if plan.causal else diff > -plan.window)
  return jnp.asarray(np.where(ok, 0.0, HALF_MASK), jnp.float32)


# --- in-kernel helpers ------------------------------------------------------------------------


def _dot(a, b, dims, plan: Plan) -> jax.Array:
  precision = None if plan.low_precision else lax.Precision.HIGHEST
  return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32, precision=precision)


def _rotate(x: jax.Array, table: jax.Array, inverse: bool = False) -> jax.Array:
  """Rotate-half RoPE of float32 rows `x [r, d]` by a `cos | sin` table `[r, 2d]`."""
  d = x.shape[1]
  cos, sin = table[:, :d], table[:, d:]
  swapped = pltpu.roll(x, d // 2, 1) * sin
  return x * cos - swapped if inverse else x * cos + swapped


def _unroll(count: int, most: int) -> int:
  """The largest unroll factor up to `most` that divides `count` (independent products
  in flight hide the MXU's and the reductions' latency)."""
  return next(u for u in range(min(most, count), 0, -1) if count % u == 0)


def _mix(
  plan: Plan, src_ref, src_heads: int, tokens: int, matrix, dst_ref, dst_row: int, table, s: int
):
  """Pseudo rows of `tokens` source tokens: `dst[dst_row + (n, p)] = R(p) sum_m
  matrix[(n, p), (n, m)] src[(n, m)]`, one MXU product per group of `s` tokens."""
  rows = s * plan.num_pseudo
  table = None if table is None else table[:rows]
  width = s * src_heads
  groups = tokens // s

  def body(i, carry):
    src = src_ref[pl.ds(pl.multiple_of(i * width, plan.align), width), :]
    out = _dot(matrix, src, _NN, plan)
    if table is not None:
      out = _rotate(out, table)
    dst_ref[pl.ds(pl.multiple_of(dst_row + i * rows, plan.align), rows), :] = out.astype(
      dst_ref.dtype
    )
    return carry

  lax.fori_loop(0, groups, body, 0, unroll=_unroll(groups, MIX_UNROLL))


def _mix_band(plan: Plan, refs, matrix, dst_ref, table):
  """The band's pseudo rows: halo blocks before, the tile's own, halo blocks after."""
  sizes = [plan.halo] * plan.halo_before + [plan.tile] + [plan.halo] * plan.halo_after
  row = 0
  for ref, tokens in zip(refs, sizes):
    _mix(plan, ref, plan.kv_heads, tokens, matrix, dst_ref, row, table, plan.kv_group)
    row += tokens * plan.num_pseudo


def _scores(plan: Plan, q, k, bias_ref, kid_ref, qid_ref, block, t0):
  """Masked scores `[cq, kb]` float32 of one block, in log2 units (the queries carry
  log2(e): `_softmax` takes powers of two). Without segments the masks are additive (the
  band's bias and the keys' validity row: no compare per score)."""
  s = _dot(q, k, _NT, plan) + bias_ref[...]
  key_ids = kid_ref[pl.ds(block, 1), :]  # [1, kb]
  if plan.segments:
    ok = qid_ref[pl.ds(t0, plan.block_rows), :] == key_ids
    return jnp.where(ok, s, MASK_VALUE)
  return s + jnp.where(key_ids > 0, 0.0, HALF_MASK)


def _softmax(s):
  """(unnormalised probabilities, their row sums) of log2-unit scores."""
  m = jnp.max(s, axis=1, keepdims=True)
  p = jnp.exp2(s - m)
  return p, jnp.sum(p, axis=1, keepdims=True)


def _reciprocal(x):
  """1 / x of row sums `[cq, 1]` (>= 1: each row's largest term is 1): the approximate
  reciprocal and two Newton steps, float32-accurate from an estimate of 8 good bits (an
  exact division expands to a dozen vector operations per vreg, for cases that never
  arise here)."""
  r = pl.reciprocal(x, approx=True)
  r = r * (2.0 - x * r)
  return r * (2.0 - x * r)


# --- forward ----------------------------------------------------------------------------------


def _split_inputs(plan: Plan, refs):
  """(q, k band refs, v band refs, rest) of the kernels' leading inputs."""
  band = plan.halo_before + 1 + plan.halo_after
  q_ref, refs = refs[0], refs[1:]
  k_refs, v_refs, refs = refs[:band], refs[band : 2 * band], refs[2 * band :]
  return q_ref, k_refs, v_refs, refs


def _forward_kernel(*refs, plan: Plan):
  q_ref, k_refs, v_refs, refs = _split_inputs(plan, refs)
  aq_ref, ak_ref, av_ref, cm_ref, bias_ref, kid_ref, *refs = refs
  table_ref = refs.pop(0) if plan.rotary else None
  qid_ref = refs.pop(0) if plan.segments else None
  y_ref, qx, kx, vx, ox = refs
  cq = plan.block_rows
  r = plan.targets // plan.kv_targets
  y_ref[...] = jnp.zeros(y_ref.shape, y_ref.dtype)
  table = None if table_ref is None else table_ref[...]

  def kv_head(g, carry):
    _mix_band(plan, k_refs, ak_ref[g], kx, table)
    _mix_band(plan, v_refs, av_ref[g], vx, None)

    def query_head(j, carry):
      h = g * r + j
      _mix(plan, q_ref, plan.heads, plan.tile, aq_ref[h], qx, 0, table, plan.group)

      def block(qb, carry):
        t0 = pl.multiple_of(qb * cq, plan.align)
        k0 = pl.multiple_of(t0 + plan.base, plan.align)
        s = _scores(
          plan,
          qx[pl.ds(t0, cq), :],
          kx[pl.ds(k0, plan.key_rows), :],
          bias_ref,
          kid_ref,
          qid_ref,
          qb,
          t0,
        )
        probs, total = _softmax(s)
        o = _dot(probs.astype(vx.dtype), vx[pl.ds(k0, plan.key_rows), :], _NN, plan)
        ox[pl.ds(t0, cq), :] = (o * _reciprocal(total)).astype(ox.dtype)
        return carry

      lax.fori_loop(0, plan.blocks, block, 0, unroll=_unroll(plan.blocks, BLOCK_UNROLL))
      _collapse(plan, cm_ref[h], ox, y_ref)
      return carry

    lax.fori_loop(0, r, query_head, 0)
    return carry

  lax.fori_loop(0, plan.kv_targets, kv_head, 0)


def _collapse(plan: Plan, matrix, o_ref, y_ref):
  """`y[(n, ho)] += sum_p matrix[(n, ho), (n, p)] o[(n, p)]` over the tile's token groups
  (one target head's share of the collapse)."""
  rows, out_rows = plan.rows_per_group, plan.group * plan.out_heads
  groups = plan.tile // plan.group

  def body(i, carry):
    o = o_ref[pl.ds(pl.multiple_of(i * rows, plan.align), rows), :]
    y_rows = pl.ds(pl.multiple_of(i * out_rows, 8), out_rows)
    y_ref[y_rows, :] += _dot(matrix, o, _NN, plan)
    return carry

  lax.fori_loop(0, groups, body, 0, unroll=_unroll(groups, MIX_UNROLL))


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

  aq: jax.Array  # [Ht, s*P, s*H]: `_block_diagonal(alpha_q * scale)`
  ak: jax.Array  # [Gt, s*P, s*G]
  av: jax.Array  # [Gt, s*P, s*G]
  cm: jax.Array  # [Ht, s*Ho, s*P]: `_collapse_blocks(collapse)`
  bias: jax.Array  # [cq, kb] float32: `_band_bias`
  key_ids: jax.Array  # [B, tiles, blocks, kb] int32
  table: jax.Array | None  # [s*P, 2d] float32 `cos | sin` of R(p), or None (no RoPE)
  query_ids: jax.Array | None  # [B, rows, 1] int32, or None (no segments)

  def operands(self, backward: bool) -> list[jax.Array]:
    out = [self.aq, self.ak, self.av, self.cm, self.bias, self.key_ids]
    if backward:  # the transposes, for the gradients' products
      out += [jnp.swapaxes(x, 1, 2) for x in (self.aq, self.ak, self.av, self.cm)]
    return out + [x for x in (self.table, self.query_ids) if x is not None]


def _matrix_shapes(plan: Plan) -> list[tuple[int, int, int]]:
  """Shapes of the mixing products' matrices: aq, ak, av, cm (`Constants`)."""
  s, s_kv, p = plan.group, plan.kv_group, plan.num_pseudo
  return [
    (plan.targets, s * p, s * plan.heads),
    (plan.kv_targets, s_kv * p, s_kv * plan.kv_heads),
    (plan.kv_targets, s_kv * p, s_kv * plan.kv_heads),
    (plan.targets, s * plan.out_heads, s * p),
  ]


def _constant_specs(plan: Plan, d: int, *, backward: bool):
  p = plan.num_pseudo
  matrices = _matrix_shapes(plan)
  specs = [_whole(shape) for shape in matrices]
  specs += [
    _whole((plan.block_rows, plan.key_rows)),
    pl.BlockSpec((None, None, plan.blocks, plan.key_rows), lambda b, i: (b, i, 0, 0)),
  ]
  if backward:
    specs += [_whole((t, c, r)) for t, r, c in matrices]
  if plan.rotary:
    specs.append(_whole((max(plan.group, plan.kv_group) * p, 2 * d)))
  if plan.segments:
    specs.append(pl.BlockSpec((None, plan.tile * p, 1), lambda b, i: (b, i, 0)))
  return specs


def _on_tpu(call, *args):
  """`call(*args, interpret=...)`: compiled by Mosaic when lowering for TPU, Pallas' TPU
  interpreter anywhere else (CPU tests, under `pltpu.force_tpu_interpret_mode()`)."""
  compiled = functools.partial(call, interpret=False)
  return lax.platform_dependent(
    *args, default=functools.partial(call, interpret=True), tpu=compiled
  )


def _compiler_params() -> pltpu.CompilerParams:
  return pltpu.CompilerParams(
    dimension_semantics=("parallel", "parallel"), vmem_limit_bytes=VMEM_LIMIT_BYTES
  )


def _source_spec(plan: Plan, heads: int):
  return pl.BlockSpec((None, plan.tile * heads, plan.head_dim), lambda b, i: (b, i, 0))


def _band_count(plan: Plan) -> int:
  return plan.halo_before + 1 + plan.halo_after


def _forward_call(plan: Plan, q, k, v, constants: Constants, *, interpret: bool):
  b, d, p = q.shape[0], plan.head_dim, plan.num_pseudo
  in_specs = [
    _source_spec(plan, plan.heads),
    *_band_specs(plan, plan.kv_heads, d),
    *_band_specs(plan, plan.kv_heads, d),
    *_constant_specs(plan, d, backward=False),
  ]
  band = _band_count(plan)
  return pl.pallas_call(
    functools.partial(_forward_kernel, plan=plan),
    grid=(b, plan.num_tiles),
    in_specs=in_specs,
    out_specs=_source_spec(plan, plan.out_heads),
    out_shape=jax.ShapeDtypeStruct(
      (b, plan.num_tiles * plan.tile * plan.out_heads, d), jnp.float32
    ),
    scratch_shapes=[
      pltpu.VMEM((plan.tile * p, d), q.dtype),
      pltpu.VMEM((plan.band_rows, d), q.dtype),
      pltpu.VMEM((plan.band_rows, d), q.dtype),
      pltpu.VMEM((plan.tile * p, d), q.dtype),
    ],
    compiler_params=_compiler_params(),
    interpret=interpret,
    name="iha_window_forward",
  )(q, *([k] * band), *([v] * band), *constants.operands(backward=False))


# --- backward ---------------------------------------------------------------------------------


def _backward_kernel(*refs, plan: Plan):
  q_ref, k_refs, v_refs, refs = _split_inputs(plan, refs)
  dy_ref, aq_ref, ak_ref, av_ref, cm_ref, bias_ref, kid_ref, *refs = refs
  aqt_ref, akt_ref, avt_ref, cmt_ref, *refs = refs
  table_ref = refs.pop(0) if plan.rotary else None
  qid_ref = refs.pop(0) if plan.segments else None
  dq_ref, dk_refs, dv_refs, refs = refs[0], refs[1:4], refs[4:7], refs[7:]
  daq_ref, dak_ref, dav_ref, dcm_ref, qx, dox, dqx, ox, kx, vx, dkx, dvx = refs
  cq, kb = plan.block_rows, plan.key_rows
  r = plan.targets // plan.kv_targets
  for ref in (dq_ref, *dk_refs, *dv_refs, daq_ref, dak_ref, dav_ref, dcm_ref):
    ref[...] = jnp.zeros(ref.shape, ref.dtype)
  table = None if table_ref is None else table_ref[...]
  dtype = qx.dtype

  def kv_head(g, carry):
    _mix_band(plan, k_refs, ak_ref[g], kx, table)
    _mix_band(plan, v_refs, av_ref[g], vx, None)
    dkx[...] = jnp.zeros(dkx.shape, dkx.dtype)
    dvx[...] = jnp.zeros(dvx.shape, dvx.dtype)

    def query_head(j, carry):
      h = g * r + j
      _mix(plan, q_ref, plan.heads, plan.tile, aq_ref[h], qx, 0, table, plan.group)
      _mix(plan, dy_ref, plan.out_heads, plan.tile, cmt_ref[h], dox, 0, None, plan.group)

      def block(qb, carry):
        t0 = pl.multiple_of(qb * cq, plan.align)
        k0 = pl.multiple_of(t0 + plan.base, plan.align)
        q, k, v = qx[pl.ds(t0, cq), :], kx[pl.ds(k0, kb), :], vx[pl.ds(k0, kb), :]
        do = dox[pl.ds(t0, cq), :]
        probs, total = _softmax(_scores(plan, q, k, bias_ref, kid_ref, qid_ref, qb, t0))
        probs = probs * _reciprocal(total)
        o = _dot(probs.astype(dtype), v, _NN, plan).astype(dtype)
        ox[pl.ds(t0, cq), :] = o
        dp = _dot(do, v, _NT, plan)
        delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=1, keepdims=True)
        # The scores' gradient, times ln 2: the queries carry log2(e) (`prepare`).
        ds = (probs * (dp - delta) * math.log(2)).astype(dtype)
        dvx[pl.ds(k0, kb), :] += _dot(probs.astype(dtype), do, _TN, plan)
        dkx[pl.ds(k0, kb), :] += _dot(ds, q, _TN, plan)
        dqx[pl.ds(t0, cq), :] = _dot(ds, k, _NN, plan)
        return carry

      lax.fori_loop(0, plan.blocks, block, 0, unroll=_unroll(plan.blocks, BLOCK_UNROLL))
      _collapse_grad(plan, dy_ref, ox, dcm_ref, h)
      _unmix(
        plan,
        dqx,
        0,
        plan.tile,
        aqt_ref[h],
        q_ref,
        dq_ref,
        plan.heads,
        daq_ref,
        h,
        table,
        plan.group,
      )
      return carry

    lax.fori_loop(0, r, query_head, 0)
    _unmix_band(plan, dkx, akt_ref[g], k_refs, dk_refs, dak_ref, g, table)
    _unmix_band(plan, dvx, avt_ref[g], v_refs, dv_refs, dav_ref, g, None)
    return carry

  lax.fori_loop(0, plan.kv_targets, kv_head, 0)


def _collapse_grad(plan: Plan, dy_ref, o_ref, dcm_ref, h):
  """`dcm[h] += dy[(n, ho)] o[(n, p)]^T` over the tile's token groups."""
  rows, out_rows = plan.rows_per_group, plan.group * plan.out_heads
  groups = plan.tile // plan.group

  def body(i, acc):
    o = o_ref[pl.ds(pl.multiple_of(i * rows, plan.align), rows), :]
    dy = dy_ref[pl.ds(pl.multiple_of(i * out_rows, plan.align), out_rows), :]
    return acc + _dot(dy, o, _NT, plan)

  zero = jnp.zeros((out_rows, rows), jnp.float32)
  dcm_ref[h] += lax.fori_loop(0, groups, body, zero, unroll=_unroll(groups, MIX_UNROLL))


def _unmix(
  plan: Plan,
  grad_ref,
  row0,
  tokens,
  transposed,
  src_ref,
  dst_ref,
  heads,
  dmat_ref,
  index,
  table,
  s: int,
  dst_row0: int = 0,
):
  """The gradient of `_mix` (groups of `s` tokens): pseudo-row gradients
  `grad[row0 + (n, p)]` (float32, of the rotated rows) -> source rows
  `dst[(n, m)] += transposed[(n, m), (n, p)] g[(n, p)]`, and the matrix's
  `dmat[index] += g[(n, p)] src[(n, m)]^T`, with `g = R(p)^T grad`."""
  rows = s * plan.num_pseudo
  table = None if table is None else table[:rows]
  width = s * heads
  groups = tokens // s

  def body(i, acc):
    grad = grad_ref[pl.ds(pl.multiple_of(row0 + i * rows, plan.align), rows), :]
    if table is not None:
      grad = _rotate(grad, table, inverse=True)
    grad = grad.astype(src_ref.dtype)
    src_rows = pl.ds(pl.multiple_of(i * width, plan.align), width)
    dst_rows = pl.ds(pl.multiple_of(dst_row0 + i * width, 8), width)
    dst_ref[dst_rows, :] += _dot(transposed, grad, _NN, plan)
    return acc + _dot(grad, src_ref[src_rows, :], _NT, plan)

  zero = jnp.zeros((rows, width), jnp.float32)
  dmat_ref[index] += lax.fori_loop(0, groups, body, zero, unroll=_unroll(groups, MIX_UNROLL))


def _unmix_band(plan: Plan, grad_ref, transposed, src_refs, dst_refs, dmat_ref, index, table):
  """`_unmix` over the band: halo blocks before (into `dst_refs[0]`, stacked), the tile's
  own keys (`dst_refs[1]`), halo blocks after (`dst_refs[2]`)."""
  p, g = plan.num_pseudo, plan.kv_heads
  row = 0
  regions = [(0, j) for j in range(plan.halo_before)] + [(1, 0)]
  regions += [(2, j) for j in range(plan.halo_after)]
  for src_ref, (region, j) in zip(src_refs, regions):
    tokens = plan.tile if region == 1 else plan.halo
    _unmix(
      plan,
      grad_ref,
      row,
      tokens,
      transposed,
      src_ref,
      dst_refs[region],
      g,
      dmat_ref,
      index,
      table,
      plan.kv_group,
      dst_row0=j * plan.halo * g,
    )
    row += tokens * p


def _backward_call(plan: Plan, q, k, v, dy, constants: Constants, *, interpret: bool):
  b, d, p = q.shape[0], plan.head_dim, plan.num_pseudo
  g, tiles = plan.kv_heads, plan.num_tiles
  band = _band_count(plan)
  in_specs = [
    _source_spec(plan, plan.heads),
    *_band_specs(plan, g, d),
    *_band_specs(plan, g, d),
    _source_spec(plan, plan.out_heads),
    *_constant_specs(plan, d, backward=True),
  ]
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
  matrices = _matrix_shapes(plan)
  outs = [(_source_spec(plan, plan.heads), f32((b, tiles * plan.tile * plan.heads, d)))]
  outs += key_side + key_side
  outs += [(per_tile(shape), f32((b, tiles, *shape))) for shape in matrices]
  dtype = q.dtype
  results = pl.pallas_call(
    functools.partial(_backward_kernel, plan=plan),
    grid=(b, tiles),
    in_specs=in_specs,
    out_specs=[spec for spec, _ in outs],
    out_shape=[shape for _, shape in outs],
    scratch_shapes=[
      pltpu.VMEM((plan.tile * p, d), dtype),  # pseudo q
      pltpu.VMEM((plan.tile * p, d), dtype),  # pseudo do
      pltpu.VMEM((plan.tile * p, d), jnp.float32),  # pseudo dq
      pltpu.VMEM((plan.tile * p, d), dtype),  # pseudo o
      pltpu.VMEM((plan.band_rows, d), dtype),  # pseudo k, v
      pltpu.VMEM((plan.band_rows, d), dtype),
      pltpu.VMEM((plan.band_rows, d), jnp.float32),  # pseudo dk, dv
      pltpu.VMEM((plan.band_rows, d), jnp.float32),
    ],
    compiler_params=_compiler_params(),
    interpret=interpret,
    name="iha_window_backward",
  )(q, *([k] * band), *([v] * band), dy, *constants.operands(backward=True))
  dq, dk_parts, dv_parts, dmats = results[0], results[1:4], results[4:7], results[7:]
  key_tokens = plan.key_tokens
  dk, dv = (_gather_band(plan, parts, b, key_tokens) for parts in (dk_parts, dv_parts))
  daq, dak, dav, dcm = (x.sum(axis=(0, 1)) for x in dmats)
  return dq, dk, dv, daq, dak, dav, dcm


def _gather_band(plan: Plan, parts, b: int, key_tokens: int) -> jax.Array:
  """The key-side gradients the tiles wrote (halo blocks before, own keys, halo blocks
  after, each `[B, tiles, ...]`) added up at their key positions -> `[B, key_tokens * G,
  d]` float32 (rows of padding keys included)."""
  before, own, after = parts
  g, tile = plan.kv_heads, plan.tile
  first = plan.first_block * tile  # tile 0's own first key token

  def place(x, start_token):  # x [B, T, d] rows of keys at tokens [start, start + T/g)
    tokens = x.shape[1] // g
    return jnp.pad(x, ((0, 0), (start_token * g, (key_tokens - start_token - tokens) * g), (0, 0)))

  total = place(own, first)
  for j in range(plan.halo_before):  # block j of `before`: halo_before - j blocks back
    piece = before[:, :, j * plan.halo * g : (j + 1) * plan.halo * g]
    shift = (plan.halo_before - j) * plan.halo
    total = total + place(
      _tiles_to_rows(piece, tile, g, at_end=True), first - shift - (tile - plan.halo)
    )
  for j in range(plan.halo_after):
    piece = after[:, :, j * plan.halo * g : (j + 1) * plan.halo * g]
    shift = tile + j * plan.halo
    total = total + place(_tiles_to_rows(piece, tile, g, at_end=False), first + shift)
  return total


def _tiles_to_rows(piece, tile: int, g: int, *, at_end: bool) -> jax.Array:
  """`[B, tiles, w*G, d]` pieces, one per tile at a stride of `tile` tokens -> contiguous
  rows `[B, tiles * tile * G, d]` (each piece padded to a whole tile, at its end or its
  start)."""
  b, tiles, rows, d = piece.shape
  pad = tile * g - rows
  piece = jnp.pad(piece, ((0, 0), (0, 0), (pad, 0) if at_end else (0, pad), (0, 0)))
  return piece.reshape(b, tiles * tile * g, d)


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
    aq=_block_diagonal(alpha_q * (math.log2(math.e) / math.sqrt(d)), plan.group).astype(dtype),
    ak=_block_diagonal(alpha_k, plan.kv_group).astype(dtype),
    av=_block_diagonal(alpha_v, plan.kv_group).astype(dtype),
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


def _forward(plan: Plan, operands, fixed):
  def call(q, k, v, aq, ak, av, cm, fixed, *, interpret):
    return _forward_call(plan, q, k, v, Constants(aq, ak, av, cm, *fixed), interpret=interpret)

  return _on_tpu(call, *operands, fixed)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attend(plan: Plan, options: AttentionOptions, q, k, v, alphas, collapse):
  """y rows `[B, tiles * tile * Ho, d]` float32 of the source heads."""
  return _forward(plan, *_kernel_inputs(plan, options, q, k, v, alphas, collapse))


def _attend_fwd(plan, options, q, k, v, alphas, collapse):
  y = _forward(plan, *_kernel_inputs(plan, options, q, k, v, alphas, collapse))
  # The layer's own arrays: nothing P-sized, nor the padded and rotated copies (remade in
  # the backward: source-sized XLA work).
  return y, (options, q, k, v, alphas, collapse)


def _attend_bwd(plan, residuals, dy):
  options, *primals = residuals
  operands, prepare_vjp = jax.vjp(lambda *x: _kernel_inputs(plan, options, *x)[0], *primals)
  fixed = _kernel_inputs(plan, options, *primals)[1]

  def call(q, k, v, dy, aq, ak, av, cm, fixed, *, interpret):
    constants = Constants(aq, ak, av, cm, *fixed)
    return _backward_call(plan, q, k, v, dy, constants, interpret=interpret)

  q, k, v, aq, ak, av, cm = operands
  grads = _on_tpu(call, q, k, v, dy.astype(q.dtype), aq, ak, av, cm, fixed)
  grads = tuple(g.astype(x.dtype) for g, x in zip(grads, operands))
  return (jax.tree.map(lambda _: None, options), *prepare_vjp(grads))


_attend.defvjp(_attend_fwd, _attend_bwd)


def window_iha(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  alphas: tuple[jax.Array, jax.Array, jax.Array],
  collapse: jax.Array,
  options: AttentionOptions,
) -> jax.Array:
  """Sliding-window IHA (docs/design.md §8, the on-chip window path) -> `[B, N, Ho, d]`
  float32: Ho = H for a full collapse `[H, Ht, P]` (a partial sum over the Ht local target
  heads), Ht for per_head `[Ht, P]`.

  q `[B, N, H, d]`, k and v `[B, Nk, G, d]` source heads (Nk = N unless a sequence shard,
  whose query offset must be static); `alphas = (alpha_q [H, Ht, P], alpha_k [G, Gt, P],
  alpha_v [G, Gt, P])`; `options`: a window (virtual rows), causal or not, segment ids,
  positions, RoPE, and `block_sizes`: `block_q` the virtual rows per target head of a grid
  step (rounded to whole tokens), `block_k` the query rows of a score tile. Raises
  `UnsupportedShape` (one line, naming the limit) for calls this path cannot take. The
  backward saves the call's own arrays only (nothing P-sized, no padded or rotated copy)."""
  b, n, _, d = q.shape
  the_plan = plan_for(q, k, alphas, collapse, options)
  y = _attend(the_plan, options, q, k, v, tuple(alphas), collapse)
  y = y.reshape(b, -1, the_plan.out_heads, d)[:, :n]
  if options.segment_ids is not None:  # padding queries output zeros
    y = jnp.where((options.segment_ids != 0)[:, :, None, None], y, 0.0)
  return y


def plan_for(q, k, alphas, collapse, options: AttentionOptions) -> Plan:
  """The `Plan` of a call (arrays or ShapeDtypeStructs)."""
  n = q.shape[1]
  offset = options.query_offset if (options.sliced or k.shape[1] != n) else 0
  blocks = options.block_sizes
  return plan(
    q.shape,
    k.shape[1],
    k.shape[2],
    tuple(a.shape for a in alphas),
    collapse.shape,
    options,
    offset,
    jnp.dtype(q.dtype).itemsize <= 2,
    blocks and blocks.block_q,
    blocks and blocks.block_k,
  )


def unsupported(q, v, num_pseudo: int, options: AttentionOptions) -> str | None:
  """Why the on-chip window path cannot take a call of q `[B, N, H, d]` and v `[B, Nk, G,
  d]` at P pseudo-heads (full mixing and collapse), or None."""
  h, g = q.shape[2], v.shape[2]
  alphas = ((h, h, num_pseudo), (g, g, num_pseudo), (g, g, num_pseudo))
  shape = lambda s: jax.ShapeDtypeStruct(s, jnp.float32)
  try:
    plan_for(q, v, tuple(shape(a) for a in alphas), shape((h, h, num_pseudo)), options)
  except UnsupportedShape as error:
    return str(error)
  return None
