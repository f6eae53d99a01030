"""The on-chip mixing of IHA's GPU window kernels (`window.gpu_kernel`,
`window.gpu_backward_kernel`): pseudo rows made from a group's source rows by a
block-diagonal product and rotated by `R(p)`, and the transposes the backward takes
(un-mixing to source rows, `R(p)^T`, the collapse's dO, the weights' gradients folded to
their shapes), in Triton registers.

Register budget (H100: 255 per thread at eight warps; tests/kernels/test_compile_targets.py):
mixing products contract over `MIX_ROWS` source rows at a time; a constant is loaded at
a loop-varying zero offset (`varying_zero`), else the compiler hoists it into registers
for the whole loop; the weights' partials are added into the program's own output block
(`add_in_place`), not carried by loops.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from iha_jax.kernels.gpu import NN, NT, TN, barrier, dot
from iha_jax.kernels.window.gpu_plan import COLLAPSE_ROWS, Plan

# Source rows per mixing product (its contraction: a bounded source tile in registers) and
# per un-mixing product (its float32 result; 64: tall enough for wgmma), as compiled for
# H100 (tests/kernels/test_compile_targets.py).
MIX_ROWS = 32
UNMIX_ROWS = 64


def pseudo_rows(matrix, src1, src2, rope, dtype):
  """Pseudo rows of a token group in two halves: `R(p) (matrix @ src)`, rotated in float32
  on the halves (`(x1, x2) -> (x1 c - x2 s, x2 c + x1 s)`), so no lane concatenation.
  `rope`: the (cos, sin) table refs, or None."""
  x1, x2 = dot(matrix, src1, NN), dot(matrix, src2, NN)
  if rope is not None:
    # Loaded where used, not held across the loops: the tables would take a quarter of
    # the registers.
    cos, sin = rope[0][...], rope[1][...]
    x1, x2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
  return x1.astype(dtype), x2.astype(dtype)


def unrotate(g1, g2, rope, first=0):
  """`R(p)^T` of float32 pseudo-row gradients in halves (the transpose of `pseudo_rows`'s
  rotation); `first`: the tables' first row (`varying_zero`)."""
  if rope is None:
    return g1, g2
  rows = pl.ds(first, g1.shape[0])
  cos, sin = rope[0][rows, :], rope[1][rows, :]
  return g1 * cos + g2 * sin, g2 * cos - g1 * sin


def _token_rows(x: jax.Array, n, period: int, size: int) -> jax.Array:
  """Rows `(n, a)`, `a < period`, of a register tile `x [rows, w]` whose rows are `(token,
  a)` -> `[size, w]` (rows past `period` zero): a 0/1 product, exact in x's dtype."""
  a = lax.broadcasted_iota(jnp.int32, (size,), 0)[:, None]
  r = lax.broadcasted_iota(jnp.int32, (x.shape[0],), 0)[None, :]
  select = ((r == n * period + a) & (a < period)).astype(x.dtype)
  return dot(select, x, NN).astype(x.dtype)


def _first_rows(x: jax.Array, period: int) -> jax.Array:
  """x's first `period` rows, the others zero."""
  rows = lax.broadcasted_iota(jnp.int32, (x.shape[0],), 0)[:, None]
  return jnp.where(rows < period, x, jnp.zeros_like(x))


def _window(ref, row0, total: int, n, period: int, size: int) -> jax.Array:
  """The same of a group's `total` rows from `row0` in a ref: a `size`-row window inside
  the group (never past it: its start clamped), aligned by an exact 0/1 product."""
  start = jnp.minimum(n * period, total - size)
  x = ref[pl.ds(row0 + start, size), :]
  a = lax.broadcasted_iota(jnp.int32, (size,), 0)
  align = ((a[None, :] == a[:, None] + (n * period - start)) & (a[:, None] < period)).astype(
    x.dtype
  )
  return dot(align, x, NN).astype(x.dtype)


def folded_weights_grad(
  tiles, refs, row0, total: int, tokens: int, periods, sizes, refs_first: bool = False
) -> jax.Array:
  """`sum_n sum_lanes tile[(n, a)] src[(n, b)]` over a group's tokens and the pairs
  `(tile, src ref)` -> `[sizes[0], sizes[1]]` float32: the gradient of a block-diagonal
  `kron(I_s, w)` folded to w's shape (tiles: register rows `(n, a)`, period `periods[0]`;
  refs: a group's `total` rows `(n, b)` from `row0`, period `periods[1]`; `refs_first`:
  the refs' rows `(n, a)`, the tiles' `(n, b)`). Per token, small products on rows picked
  exactly: no float32 `[rows, total]` product to fold."""
  (pa, pb), (sa, sb) = periods, sizes
  if refs_first:
    refs, tiles, (pa, pb), (sa, sb) = tiles, refs, (pb, pa), (sb, sa)
  shape = (sb, sa) if refs_first else (sa, sb)
  if tokens == 1 and total == sb and all(x.shape[0] == sa for x in tiles):
    # One token (a key group at P = H = 20): its rows are the tile's and the group's own,
    # masked in place; the 0/1 products' tiles spilled beside the group's gradients.
    acc = jnp.zeros(shape, jnp.float32)
    for x, ref in zip(tiles, refs):
      pair = _first_rows(x, pa), _first_rows(ref[pl.ds(row0, total), :], pb)
      acc += dot(*(pair[::-1] if refs_first else pair), NT)
    return acc

  def token(n, acc):
    for x, ref in zip(tiles, refs):
      pair = _token_rows(x, n, pa, sa), _window(ref, row0, total, n, pb, sb)
      acc += dot(*(pair[::-1] if refs_first else pair), NT)
    return acc

  return lax.fori_loop(0, tokens, token, jnp.zeros(shape, jnp.float32))


def _chunks(total: int, size: int) -> list[int]:
  """Starts of the `size`-row chunks of a group's `total` source rows."""
  return list(range(0, total, min(size, total)))


def pseudo_rows_in_chunks(
  matrix_ref, index, src_refs, row0, rope, dtype, first=0, rows=None, chunk=MIX_ROWS
):
  """`pseudo_rows` with the contraction over source rows in chunks of `chunk` rows (a bounded
  source tile in registers): `R(p) (matrix[index] @ src)` of a group's source rows from
  `row0`, in halves; its pseudo rows `[first, first + rows)` (default all)."""
  total = matrix_ref.shape[-1]
  size = min(chunk, total)
  pseudo = pl.ds(first, rows or matrix_ref.shape[1])
  outs = [0.0] * len(src_refs)
  for c in _chunks(total, size):
    matrix = matrix_ref[index, pseudo, pl.ds(c, size)]
    for n, ref in enumerate(src_refs):
      outs[n] += dot(matrix, ref[pl.ds(row0 + c, size), :], NN)
  if rope is not None:
    cos, sin = rope[0][pseudo, :], rope[1][pseudo, :]
    outs = [outs[0] * cos - outs[1] * sin, outs[1] * cos + outs[0] * sin]
  return [x.astype(dtype) for x in outs]


def unmix(matrix_ref, index, grads, dst_refs, row0, interpret: bool) -> None:
  """The gradient of `pseudo_rows_in_chunks` (without the rotation) for a group's source rows from
  `row0`, in chunks: `dst[chunk] += matrix[index][:, chunk]^T grad` per (grad, dst)."""
  total = matrix_ref.shape[-1]
  size = min(UNMIX_ROWS, total)
  for c in _chunks(total, size):
    matrix = matrix_ref[index, :, pl.ds(c, size)]
    for grad, dst_ref in zip(grads, dst_refs):
      rows = (pl.ds(row0 + c, size), slice(None))
      add_in_place(dst_ref, rows, dot(matrix, grad, TN), interpret)


def virtual_rows(plan: Plan, rows: int, first_token, first_row=0):
  """Virtual indices (on the keys' axis) of a group's pseudo rows `(n, p)` from token
  `first_token`, rows `[first_row, first_row + rows)`: row `(n, p)` is at `(first_token +
  n) * P + p`, i.e. `first_token * P + row` (padding rows get indices past the group's;
  their ids mask them)."""
  r = lax.broadcasted_iota(jnp.int32, (rows,), 0)
  return first_token * plan.num_pseudo + first_row + r


def output_grad(
  plan: Plan, cm_ref, dy_ref, h, row0, dtype, first=0, rows=None, *, t=False, chunk=None
):
  """dO `[rows, width]` of target head h (`t`: its transpose, `[width, rows]`): `cm[h]^T
  dy` over the tile's output rows from `row0`, in chunks of `chunk` (`COLLAPSE_ROWS`) rows
  (a bounded dy tile in registers); its pseudo rows `[first, first + rows)` (default all)."""
  chunk = min(chunk or COLLAPSE_ROWS, plan.out_rows)
  rows = rows or plan.q_rows
  d_o = jnp.zeros((plan.width, rows) if t else (rows, plan.width), jnp.float32)
  for c in range(plan.out_rows // chunk):
    dy = dy_ref[pl.ds(row0 + c * chunk, chunk), :]
    cm = cm_ref[h, pl.ds(c * chunk, chunk), pl.ds(first, rows)]
    d_o += dot(dy, cm, TN) if t else dot(cm, dy, TN)
  return d_o.astype(dtype)


def varying_zero(j):
  """0, to the compiler a value of loop index j (>= 0, which it cannot know): a load at an
  offset plus it stays in the loop. Hoisted out as loop-invariant, a constant's tile would
  hold registers across the whole loop."""
  return jnp.minimum(j, 0)


def add_in_place(ref, index, value, interpret: bool) -> None:
  """`ref[index] += value` in the program's own block (a partial of the weights: not a
  loop's carry, which would hold registers across the loops inside)."""
  barrier(interpret)
  ref[index] += value
  barrier(interpret)
