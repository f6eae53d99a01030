"""Which (query tile, key tile) pair a flash-attention grid step works on.

The TPU flash kernels (`flash.tpu`) run a grid `(batch x heads, rows, steps)`: every step
attends one query tile to one key tile, and a row walks the key tiles one query tile sees
(or, for the key/value gradients, the query tiles that see one key tile). Grid steps cost
time even when a kernel skips them, so the schedule visits only the visible tile pairs:
- causal, global, unsliced: *folded* rows. Query tile i sees key tiles `[0, hi(i))`,
  a band that grows with i; row r runs tile r's band, then tile `Q-1-r`'s, so every row
  does the same work (both TensorCores of a megacore chip get equal halves, and no step
  is skipped but the middle row's tail when Q is odd);
- otherwise (windows, bidirectional attention, sequence shards): one row per tile, its
  band from `lo(i)` to `hi(i)`, as many steps as the widest band (the steps past a
  narrower band are skipped; with a traced query offset, as wide as any offset needs).
Each step also says whether it starts or ends its tile's band (init / finalize) and
whether the pair needs a mask (partly visible: the diagonal, a window's edge, padded
keys) or is entirely visible (no mask work at all).

Units: rows of the virtual sequence the kernel attends over (virtual tokens for IHA).
Query row t sits at `t + offset` on the key axis: key s is visible iff `s <= t + offset`
(causal), `|t + offset - s| < window` (with a window; one-sided if causal) and `s < keys`
(the unpadded key count). All functions take and return int32 scalars (jnp) and run in
index maps and kernel bodies alike.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
from jax import lax

from iha_jax.core.masking import ranges_meet


class Step(NamedTuple):
  """One grid step: the tile it attends (`tile`) and the tile its row accumulates into
  (`home`: the query tile in the forward / dQ order, the key tile in the dK/dV order)."""

  home: jnp.ndarray
  tile: jnp.ndarray
  compute: jnp.ndarray  # the pair is in `home`'s band (False: a step past it, no work)
  first: jnp.ndarray  # first step of `home`'s band: initialise accumulators
  last: jnp.ndarray  # last step of `home`'s band (or its only step if the band is empty)
  masked: jnp.ndarray  # the pair is only partly visible


_BIAS = 1 << 24  # |rows| bound for floor division through truncation


def _xp(*values):
  """NumPy for static values (Python or NumPy ints: sizes fixed while tracing), jax.numpy
  for traced ones (grid indices, a shard's offset)."""
  static = all(isinstance(v, (int, np.integer, np.ndarray)) for v in values)
  return np if static else jnp


def _floor_div(a, b: int):
  """Floor division by a positive constant, also of negative int32 scalars, through
  truncating division of a shifted value (Mosaic has no floor division of scalars)."""
  if _xp(a) is np:
    return np.floor_divide(a, b)
  shift = -(-_BIAS // b)
  return lax.div(a + shift * b, jnp.int32(b)) - shift


@dataclasses.dataclass(frozen=True)
class Tiles:
  """The static tiling of one attention call (rows)."""

  block_q: int  # tile edges
  block_k: int
  num_q: int  # tiles of the padded query and key axes
  num_k: int
  keys: int  # unpadded key rows (keys at or past it are padding: never visible)
  causal: bool
  window: int | None  # None: global
  offset: int | None = 0  # the first query's row on the key axis (None: traced, an operand)
  max_offset: int = 0  # a bound on |offset| for a traced offset

  def _rows(self, i, offset):
    """First and last query row of query tile i on the key axis."""
    first = i * self.block_q + offset
    return first, first + self.block_q - 1

  def key_band(self, i, offset=0):
    """Key tiles `[lo, hi)` that query tile i sees any key of (hi <= lo: none)."""
    first, last = self._rows(i, offset)
    key_tiles = -(-self.keys // self.block_k)
    xp = _xp(i, offset)
    if self.causal:
      hi = _floor_div(last, self.block_k) + 1
    elif self.window is None:
      hi = key_tiles + 0 * i
    else:
      hi = _floor_div(last + self.window - 1, self.block_k) + 1
    lo = 0 * i
    if self.window is not None:
      lo = xp.maximum(_floor_div(first - self.window + 1, self.block_k), 0)
    return lo, xp.clip(hi, 0, key_tiles)

  def query_band(self, j, offset=0):
    """Query tiles `[lo, hi)` that see any key of key tile j."""
    first = j * self.block_k - offset  # key rows in query-row units
    last = first + self.block_k - 1
    xp = _xp(j, offset)
    if self.causal:
      lo = _floor_div(first, self.block_q)
    elif self.window is None:
      lo = 0 * j
    else:
      lo = _floor_div(first - self.window + 1, self.block_q)
    hi = self.num_q + 0 * j
    if self.window is not None:
      hi = _floor_div(last + self.window - 1, self.block_q) + 1
    valid = j * self.block_k < self.keys  # a tile of padding keys only: seen by none
    lo = xp.clip(lo, 0, self.num_q)
    return lo, xp.where(valid, xp.clip(hi, 0, self.num_q), lo)

  def visible(self, t, s):
    """Whether query rows `t` see key rows `s` (any array module; the kernels' mask)."""
    return (s < self.keys) & ranges_meet(t, t, s, s, self.window, self.causal)

  def any_visible(self, t_first, t_last, s_first, s_last):
    """Whether some query row in `[t_first, t_last]` (on the key axis) sees some key row
    in `[s_first, s_last]` (`ranges_meet`). Conservative at the padded keys' edge (a key
    bound inside the rectangle is not narrowed)."""
    return (s_first < self.keys) & ranges_meet(
      t_first, t_last, s_first, s_last, self.window, self.causal
    )

  def fully_visible(self, i, j, offset=0):
    """Whether every row of query tile i sees every key of key tile j: the visible set
    is a band in t - s below a key bound, so the corner (first row, last key) decides,
    and for a window also how far the last row reaches back."""
    first, last = self._rows(i, offset)
    key_first = j * self.block_k
    ok = self.visible(first, key_first + self.block_k - 1)
    if self.window is not None:
      ok &= last - key_first < self.window
    return ok

  @property
  def folded(self) -> bool:
    """Causal global bands with a static offset: fold rows i and Q-1-i."""
    return self.causal and self.window is None and self.offset is not None and self.num_q > 1

  def query_major(self) -> tuple[int, int]:
    """(rows, steps) of the forward / dQ grid."""
    return self._grid(self.key_band, self.num_q, self.block_q, self.block_k, self.num_k)

  def key_major(self) -> tuple[int, int]:
    """(rows, steps) of the dK/dV grid (per query head of a group)."""
    return self._grid(self.query_band, self.num_k, self.block_k, self.block_q, self.num_q)

  def _grid(self, band, count: int, home_block: int, other_block: int, other_count: int):
    if self.folded:
      width = lambda i: max(1, int(band(i)[1] - band(i)[0]))
      rows = (count + 1) // 2
      pairs = [width(r) + (width(count - 1 - r) if count - 1 - r != r else 0) for r in range(rows)]
      return rows, max(1, max(pairs))
    if self.offset is not None:  # the widest band
      widths = [int(band(i, self.offset)[1] - band(i, self.offset)[0]) for i in range(count)]
      return count, max(1, *widths)
    if self.window is None:  # any offset: the whole other axis, or a window's reach
      return count, other_count
    reach = home_block + self.window - 1 + (0 if self.causal else self.window - 1)
    return count, min(other_count, -(-reach // other_block) + 1)

  def query_step(self, row, step, offset=None) -> Step:
    """Forward / dQ order: `home` a query tile, `tile` a key tile."""
    offset = self.offset if offset is None else offset
    return self._step(row, step, offset, self.key_band, self.num_q, query_home=True)

  def key_step(self, row, step, offset=None) -> Step:
    """dK/dV order: `home` a key tile, `tile` a query tile."""
    offset = self.offset if offset is None else offset
    return self._step(row, step, offset, self.query_band, self.num_k, query_home=False)

  def _step(self, row, step, offset, band, count: int, query_home: bool) -> Step:
    # Plain scalar arithmetic: cheaper per step on v5p than reading a per-row table from
    # SMEM (every index map and the kernel body evaluate it; loads add latency).
    xp = _xp(row, step, offset)
    width = lambda lo, hi: xp.maximum(hi - lo, 1)  # an empty band still gets a step
    if self.folded:
      partner = count - 1 - row
      lo_a, hi_a = band(row, offset)
      lo_b, hi_b = band(partner, offset)
      in_a = step < width(lo_a, hi_a)
      home = xp.where(in_a, row, partner)
      lo = xp.where(in_a, lo_a, lo_b)
      hi = xp.where(in_a, hi_a, hi_b)
      local = xp.where(in_a, step, step - width(lo_a, hi_a))
      exists = in_a | (partner != row)  # the middle row of an odd count has no partner
    else:
      home = row + 0 * step
      lo, hi = band(row, offset)
      local = step + 0 * row
      exists = local == local
    tile = lo + local
    compute = exists & (tile < hi)
    # Past the band, repeat its last tile: the block stays in VMEM (no copy is issued).
    tile = xp.maximum(xp.minimum(tile, hi - 1), 0)
    i, j = (home, tile) if query_home else (tile, home)
    return Step(
      home=home,
      tile=tile,
      compute=compute,
      first=exists & (local == 0),
      last=exists & xp.where(hi <= lo, local == 0, compute & (tile == hi - 1)),
      masked=~self.fully_visible(i, j, offset),
    )


@dataclasses.dataclass(frozen=True)
class Call:
  """Static shape of one flash-attention call (hashable: a custom_vjp nondiff argument);
  the TPU and GPU flash kernels take it alike."""

  tiles: Tiles
  heads: int  # H query heads
  kv_heads: int  # G key/value heads
  segments: bool  # segment ids given
  rotary: bool = False  # RoPE tables given: q and k rotated per tile, in VMEM

  @property
  def group(self) -> int:
    return self.heads // self.kv_heads

  def offset_and_refs(self, refs):
    """(the query offset in rows, a kernel's other refs): a traced offset (a sequence
    shard's) is the kernel's first operand, read here; a static one is the tiles'."""
    if self.tiles.offset is None:
      return refs[0][0], refs[1:]
    return self.tiles.offset, refs
