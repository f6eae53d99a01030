"""The static tiling of IHA's on-chip TPU window path (`iha_jax.kernels.window.tpu`).

`tiling` turns a call's shapes and options into a `Plan`: token groups whose mixing
products fill whole sublane tiles, the score tile `[cq, kb]` that holds a block's whole
band, the query tile per grid step (the longest within the scoped VMEM budget, counted by
`_vmem_bytes`), and the halo blocks of keys around it; or `TpuUnsupportedShape`, naming
the limit, for a call the path cannot take. `gather_band` puts the key gradients the
tiles write (own keys, halo blocks) back at their key positions (XLA, after the backward).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from iha_jax.core.options import AttentionOptions, round_up
from iha_jax.kernels.tpu import LANES, PACKED_SUBLANES, SUBLANES
from iha_jax.kernels.window.common import UnsupportedShape, WindowShape, window_shape

# Scoped VMEM the kernels may use (v5p has 64 MiB per core, v5e and v6e 128 MiB).
VMEM_LIMIT_BYTES = 56 * 2**20
# What the tiles' blocks and scratch may take of it as `_vmem_bytes` counts them (the
# rest: Mosaic's temporaries; the count runs above Mosaic's own: docs/performance.md §14).
VMEM_BUDGET_BYTES = 46 * 2**20
# Default tile: about this many virtual rows per target head and grid step.
TILE_ROWS = 3200


class TpuUnsupportedShape(UnsupportedShape):
  """A call the on-chip TPU window path cannot take."""

  implementation = "pallas_tpu_window"
  path = "IHA's on-chip window path"
  fallback = "pallas_tpu"


@dataclasses.dataclass(frozen=True)
class Plan(WindowShape):
  """The static tiling of one call (hashable: a custom_vjp argument). Units: tokens
  unless named rows (virtual rows, P per token)."""

  group: int  # s: tokens per mixing product of the query side (q, the collapse)
  kv_group: int  # tokens per mixing product of the key/value side
  q_stack: int  # consecutive target heads whose query-side mixing is one product
  kv_stack: int  # consecutive key/value target heads mixed by one product
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
    return _align(self.low_precision)

  @property
  def exact(self) -> bool:  # float32 inputs: true float32 products (HIGHEST precision)
    return not self.low_precision

  @property
  def rows_per_group(self) -> int:
    return self.group * self.num_pseudo


def _align(low_precision: bool) -> int:
  return PACKED_SUBLANES if low_precision else SUBLANES


def _aligned_group(heads: tuple[int, ...], p: int, align: int) -> int:
  for s in range(1, 129):
    if all((s * x) % align == 0 for x in (*heads, p)):
      return s
  raise TpuUnsupportedShape(f"no group of up to 128 tokens aligns heads {heads} and P = {p}")


def tiling(
  q_shape: tuple[int, ...],
  key_tokens: int,
  kv_heads: int,
  alphas_shape: tuple[tuple[int, ...], ...],
  collapse_shape: tuple[int, ...],
  options: AttentionOptions,
  offset: int,
  tile_rows: int | None = None,
  block_rows: int | None = None,
  *,
  low_precision: bool,
) -> Plan:
  """The tiling of a call, or `TpuUnsupportedShape` naming the limit."""
  shape = window_shape(
    q_shape, kv_heads, alphas_shape, collapse_shape, options, offset, LANES, TpuUnsupportedShape
  )
  n, p = q_shape[1], shape.num_pseudo
  align = _align(low_precision)
  # Token groups whose source and pseudo rows fill whole sublane tiles, per side (a
  # product's contraction, s * heads, then stays one MXU pass wide: G = 5 takes 16 tokens
  # where H = 20 takes 4).
  s = _aligned_group((shape.heads, shape.out_heads), p, align)
  s_kv = _aligned_group((kv_heads,), p, align)
  kv_stack = _stack(shape.kv_targets, s_kv * p)
  q_stack = _stack(kv_stack * (shape.targets // shape.kv_targets), s * p)
  block_rows, key_rows, before, after = _score_tile(shape, block_rows, s, s_kv, align)
  # Tiles of whole token groups (both sides) and whole score tiles.
  token_unit = math.lcm(s, s_kv, block_rows // math.gcd(block_rows, p))
  before_tokens, after_tokens = -(-before // p), -(-after // p)

  def layout(tile: int) -> tuple[int, int, int]:  # (halo, blocks before, blocks after)
    halo = _halo(max(before_tokens, after_tokens), tile, math.lcm(s, s_kv))
    return halo, -(-before_tokens // halo), -(-after_tokens // halo)

  def vmem(tile: int) -> int:
    halo, nb, na = layout(tile)
    sizes = (block_rows, key_rows, s, s_kv, 2 if low_precision else 4, q_stack, kv_stack)
    return _vmem_bytes(shape, tile, tile + halo * (nb + na), *sizes)

  tile = _fitting_tile(shape, n, tile_rows, token_unit, vmem)
  halo, halo_before, halo_after = layout(tile)
  num_tiles = -(-n // tile)
  front = (-offset) % tile  # key padding that puts tile 0's own keys on a block boundary
  while offset + front < halo * halo_before:
    front += tile
  needed = front + offset + num_tiles * tile + halo * halo_after
  return Plan(
    **dataclasses.asdict(shape),
    group=s,
    kv_group=s_kv,
    q_stack=q_stack,
    kv_stack=kv_stack,
    tile=tile,
    block_rows=block_rows,
    key_rows=key_rows,
    halo=halo,
    halo_before=halo_before,
    halo_after=halo_after,
    num_tiles=num_tiles,
    front=front,
    first_block=(offset + front) // tile,
    key_tokens=round_up(max(needed, front + key_tokens), tile),
    segments=options.segment_ids is not None
    or options.kv_segment_ids is not None
    or options.key_segment_ids is not None,
    low_precision=low_precision,
  )


def _score_tile(
  shape: WindowShape, block_rows: int | None, s: int, s_kv: int, align: int
) -> tuple[int, int, int, int]:
  """(cq, kb, before, after): score tiles of cq query rows against the kb keys of their
  whole band, which starts `before` rows before a block's first query row and ends `after`
  rows after its last (`in_band`: W - 1 back, and W - 1 ahead when bidirectional, in
  whole sublane tiles); cq the requested, else the fewest MXU passes per query row."""
  window, p = shape.window, shape.num_pseudo
  reach = window - 1 if shape.causal else 2 * round_up(window - 1, align)
  if block_rows is None:
    # MXU passes per query row of the two products (a weight tile is loaded per product,
    # which costs as much as streaming 128 rows through it); ties: the shortest tile unit.
    def cost(cq: int) -> tuple[float, int]:
      kb = round_up(cq + reach, LANES)
      return 2 * kb / LANES * max(cq, LANES) / cq, math.lcm(s, s_kv, cq // math.gcd(cq, p))

    block_rows = min(range(align, 512 + 1, align), key=cost)
  elif block_rows % align:
    raise TpuUnsupportedShape(
      f"block_sizes.block_k={block_rows}: its score tiles are multiples of {align} query rows"
    )
  key_rows = round_up(block_rows + reach, LANES)
  before = key_rows - block_rows if shape.causal else round_up(window - 1, align)
  after = 0 if shape.causal else key_rows - block_rows - before
  return block_rows, key_rows, before, after


def _fitting_tile(
  shape: WindowShape, n: int, tile_rows: int | None, token_unit: int, vmem: Callable
) -> int:
  """Query tokens per grid step: about `tile_rows` virtual rows (`TILE_ROWS` by default)
  per target head in whole `token_unit`s, at most the sequence, shortened until `vmem` of
  the tile is within `VMEM_BUDGET_BYTES`."""
  p = shape.num_pseudo
  if tile_rows is None:
    tile_rows = TILE_ROWS
  longest = round_up(max(n, 1), token_unit)
  tile = min(max(token_unit, round_up(-(-tile_rows // p), token_unit)), longest)
  while tile > token_unit and vmem(tile) > VMEM_BUDGET_BYTES:
    tile -= token_unit
  if vmem(tile) > VMEM_BUDGET_BYTES:
    raise TpuUnsupportedShape(
      f"its smallest tile ({tile} tokens at H={shape.heads}, P={p}, d={shape.head_dim}) "
      f"needs more than {VMEM_BUDGET_BYTES // 2**20} MiB of VMEM"
    )
  return tile


def _stack(heads: int, rows: int) -> int:
  """Consecutive target heads whose mixing is one product (a divisor of `heads`): they
  share the product's weights (the source rows), so stacking them halves the weight
  pushes and the products' fixed latency per head (P = 20: two heads' 160 rows per
  product; docs/design.md §8). The fewest heads reaching 128 rows, at most 256 rows
  (VMEM)."""
  fits = [j for j in range(1, heads + 1) if heads % j == 0 and j * rows <= max(rows, 2 * LANES)]
  return next((j for j in fits if j * rows >= LANES), fits[-1])


def _vmem_bytes(shape: WindowShape, tile, band, cq, kb, s, s_kv, itemsize, q_stack, kv_stack):
  """VMEM of the backward kernel (the larger of the two) at a tile of `tile` tokens and a
  band of `band` key tokens: double-buffered blocks and matrices (with their transposes),
  scratch, and the score tiles' float32 temporaries. Rows take whole 128-lane vregs (a
  d = 64 row as much as a d = 128 one)."""
  heads, kv_heads, out_heads = shape.heads, shape.kv_heads, shape.out_heads
  targets, kv_targets, p = shape.targets, shape.kv_targets, shape.num_pseudo
  lanes = lambda x: round_up(x, LANES)
  d = lanes(shape.head_dim)
  inputs = (tile * heads + 2 * band * kv_heads + tile * out_heads) * d * itemsize
  mixing = targets * s * p * lanes(s * heads) + 2 * kv_targets * s_kv * p * lanes(s_kv * kv_heads)
  mixing += targets * s * out_heads * lanes(s * p)
  outputs = (tile * heads + 2 * band * kv_heads) * d * 4
  partials = targets * s * p * lanes(s * heads) + 2 * kv_targets * s_kv * p * lanes(s_kv * kv_heads)
  partials += targets * s * out_heads * lanes(s * p)
  # Pseudo q and do per stacked query head, o, k and v per stacked key/value head; one
  # head's dq, dk and dv.
  stacked = (2 * q_stack + 1) * tile * p + 2 * kv_stack * band * p
  scratch = stacked * d * itemsize + (tile * p + 2 * band * p) * d * 4
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


def gather_band(plan: Plan, parts, b: int, key_tokens: int) -> jax.Array:
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
