"""The backward kernels of IHA's on-chip GPU window path (`gpu_window_backward` calls them).

Three Pallas-Triton kernels, each a grid `(programs, B)` whose program takes `span`
consecutive query tiles (key groups), read the forward's operands (`gpu_window.prepare`:
source rows, block-diagonal constants, RoPE tables, per-row ids; `gpu_window_kernel`'s
layouts) and the output's cotangent dy in the forward's output layout `[B, num_q *
out_rows, width]`, and remake every pseudo tile on chip:

- statistics (`query_kernel(stats=True)`, "iha_gpu_window_stats"): per target head and
  query tile, the forward's online softmax again -> the pseudo output O and the
  log-sum-exp `lse`; `delta = rowsum(dO * O)` with `dO = cm^T dy`, as the column sums of
  `cm * (dy O^T)`; and the collapse's partial, `dy O^T` folded to `[Ho', P']`.
- dQ (`query_kernel(stats=False)`, "iha_gpu_window_dq"): the band again with `lse` and
  `delta`: `dQ = sum_j dS_j K_j`, then `R(p)^T` and `aq^T` (source rows dq1, dq2, added
  over heads in the program's own output block) and the query mixing's partial, `dQ
  q^T` folded to `[P', H']`.
- dK/dV (`dkv_kernel`, "iha_gpu_window_dkv"): per key/value target head and key group,
  the pseudo keys and values; then the query tiles whose window reaches the group
  (`query_band`), for the group's r query heads, in 32-row sub-tiles whose pseudo
  queries and dO^T are remade: `dV = sum P^T dO`, `dK = sum dS^T Q`; `R(p)^T`, `ak^T`,
  `av^T` give dk1, dk2, dv and the partials `[P', G']`.

Register budget (H100: 255 per thread at eight warps; tests/test_compile_targets.py):
scores are transposed `[k_rows, q_rows]` in the query-side loops, so that what stays
fixed across a loop (pseudo queries, dy, cm) is a product's second operand, kept in
shared memory; a constant is loaded at a loop-varying zero offset (`_varying`), else the
compiler hoists it into registers for the whole loop; the weights' partials are added
into the program's own output block, not carried by loops; mixing products contract over
`MIX_ROWS` source rows at a time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from iha_jax.core.masking import MASK_VALUE
from iha_jax.kernels.gpu import MIN_BLOCK as MIN_LANES
from iha_jax.kernels.gpu import next_pow2
from iha_jax.kernels.gpu_window_kernel import _NN, _NT, COLLAPSE_ROWS, _dot, band, visible

if TYPE_CHECKING:
  from iha_jax.kernels.gpu_window import WindowPlan

# Source rows per mixing product (its contraction: a bounded source tile in registers) and
# per un-mixing product (its float32 result; 64: tall enough for wgmma), as compiled for
# H100 (tests/test_compile_targets.py).
MIX_ROWS = 32
UNMIX_ROWS = 64
# dQ's key mixing where a group has more source rows than `MIX_ROWS` (P = 4): smaller
# chunks, as compiled for H100 (32-row chunks spilled).
DQ_KEY_MIX_ROWS = 16
# Query rows per step of the dK/dV loop (a sub-tile: the pseudo queries and dO it remakes
# stay within the registers beside the key group's accumulators).
DKV_QUERY_ROWS = 32
_TN = (((0,), (0,)), ((), ()))  # a.T @ b


def pad2(x: int) -> int:
  return max(MIN_LANES, next_pow2(x))


def query_band(plan: WindowPlan, j):
  """Query tiles `[lo, hi)` whose window reaches key group `j` (the transpose of `band`)."""
  p, w = plan.num_pseudo, plan.window
  first = j * plan.k_tokens * p
  last = first + plan.k_tokens * p - 1
  low = first if plan.causal else jnp.maximum(first - (w - 1), 0)
  low_token = jnp.maximum(lax.div(low, p) - plan.offset, 0)
  high_token = lax.div(last + w - 1, p) - plan.offset
  lo = lax.div(low_token, plan.q_tokens)
  hi = jnp.minimum(lax.div(jnp.maximum(high_token, 0), plan.q_tokens) + 1, plan.num_q)
  hi = jnp.where(high_token < 0, lo, hi)
  return lo, jnp.maximum(hi, lo)


# --- in-kernel helpers ----------------------------------------------------------------------


def _unrotate(g1, g2, rope, first=0):
  """`R(p)^T` of float32 pseudo-row gradients in halves (the transpose of `_pseudo`'s
  rotation); `first`: the tables' first row (`_varying`)."""
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
  return _dot(select, x, _NN).astype(x.dtype)


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
  return _dot(align, x, _NN).astype(x.dtype)


def _weights_grad(
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
      acc += _dot(*(pair[::-1] if refs_first else pair), _NT)
    return acc

  def token(n, acc):
    for x, ref in zip(tiles, refs):
      pair = _token_rows(x, n, pa, sa), _window(ref, row0, total, n, pb, sb)
      acc += _dot(*(pair[::-1] if refs_first else pair), _NT)
    return acc

  return lax.fori_loop(0, tokens, token, jnp.zeros(shape, jnp.float32))


def _chunks(total: int, size: int) -> list[int]:
  """Starts of the `size`-row chunks of a group's `total` source rows."""
  return list(range(0, total, min(size, total)))


def _mixed(matrix_ref, index, src_refs, row0, rope, dtype, first=0, rows=None, chunk=MIX_ROWS):
  """`_pseudo` with the contraction over source rows in chunks of `chunk` rows (a bounded
  source tile in registers): `R(p) (matrix[index] @ src)` of a group's source rows from
  `row0`, in halves; its pseudo rows `[first, first + rows)` (default all)."""
  total = matrix_ref.shape[-1]
  size = min(chunk, total)
  pseudo = pl.ds(first, rows or matrix_ref.shape[1])
  outs = [0.0] * len(src_refs)
  for c in _chunks(total, size):
    matrix = matrix_ref[index, pseudo, pl.ds(c, size)]
    for n, ref in enumerate(src_refs):
      outs[n] += _dot(matrix, ref[pl.ds(row0 + c, size), :], _NN)
  if rope is not None:
    cos, sin = rope[0][pseudo, :], rope[1][pseudo, :]
    outs = [outs[0] * cos - outs[1] * sin, outs[1] * cos + outs[0] * sin]
  return [x.astype(dtype) for x in outs]


def _unmix(matrix_ref, index, grads, dst_refs, row0, interpret: bool) -> None:
  """The gradient of `_mixed` (without the rotation) for a group's source rows from
  `row0`, in chunks: `dst[chunk] += matrix[index][:, chunk]^T grad` per (grad, dst)."""
  total = matrix_ref.shape[-1]
  size = min(UNMIX_ROWS, total)
  for c in _chunks(total, size):
    matrix = matrix_ref[index, :, pl.ds(c, size)]
    for grad, dst_ref in zip(grads, dst_refs):
      _accumulate(dst_ref, pl.ds(row0 + c, size), _dot(matrix, grad, _TN), interpret)


def _virtual(plan: WindowPlan, rows: int, first_token, first_row=0):
  """Virtual indices (on the keys' axis) of a group's pseudo rows `(n, p)` from token
  `first_token`, rows `[first_row, first_row + rows)`: row `(n, p)` is at `(first_token +
  n) * P + p`, i.e. `first_token * P + row` (padding rows get indices past the group's;
  their ids mask them)."""
  r = lax.broadcasted_iota(jnp.int32, (rows,), 0)
  return first_token * plan.num_pseudo + first_row + r


def _d_output(
  plan: WindowPlan, cm_ref, dy_ref, h, row0, dtype, first=0, rows=None, *, t=False, chunk=None
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
    d_o += _dot(dy, cm, _TN) if t else _dot(cm, dy, _TN)
  return d_o.astype(dtype)


def _varying(j):
  """0, to the compiler a value of loop index j (>= 0, which it cannot know): a load at an
  offset plus it stays in the loop. Hoisted out as loop-invariant, a constant's tile would
  hold registers across the whole loop."""
  return jnp.minimum(j, 0)


def _barrier(interpret: bool) -> None:
  """Stores of an output block by other threads visible (read-modify-write by heads)."""
  if not interpret:
    plgpu.debug_barrier()


def _add(ref, index, value, interpret: bool) -> None:
  """`ref[index] += value` (a partial of the weights, the program's own block): not a
  loop's carry, which would hold registers across the loops inside."""
  _barrier(interpret)
  ref[index] += value
  _barrier(interpret)


def _accumulate(ref, rows, value, interpret: bool) -> None:
  _barrier(interpret)
  ref[rows, :] += value
  _barrier(interpret)


# --- dQ -------------------------------------------------------------------------------------


def query_kernel(*refs, plan: WindowPlan, span: int, interpret: bool, stats: bool):
  """The query side, in two kernels (`stats`: the first; apart, each fits the registers).
  Stats: per target head and tile, the forward's online softmax again (O, lse), delta and
  the collapse's partial. dQ: the band again with lse and delta, `dQ = sum dS K`, un-mixed
  to source rows, and the query mixing's partial."""
  q1_ref, q2_ref, k1_ref, k2_ref, v_ref, dy_ref, *refs = refs
  if not stats:
    lse_ref, delta_ref, *refs = refs
  aq_ref, ak_ref, av_ref, cm_ref, *refs = refs
  rope_q = rope_k = None
  if plan.rotary:
    cos_q, sin_q, cos_k, sin_k, *refs = refs
    rope_q, rope_k = (cos_q, sin_q), (cos_k, sin_k)
  if stats:
    qid_ref, kid_ref, lse_ref, delta_ref, part_ref = refs
  else:
    qid_ref, kid_ref, dq1_ref, dq2_ref, part_ref = refs
  program = pl.program_id(0)
  dtype = q1_ref.dtype
  rq, rk, qs, ks = plan.q_rows, plan.k_rows, plan.q_src, plan.k_src
  p, heads, out_heads = plan.num_pseudo, plan.heads, plan.out_heads
  r = plan.targets // plan.kv_targets
  p_pad = pad2(p)
  other = pad2(out_heads if stats else heads)
  # Where a tile's output rows are no more than its pseudo rows (P = H = 20): dQ's loop
  # never makes dO (`cm^T ((dy v^T) av^T)` per step; dO beside dQ's accumulators spilled),
  # and delta's products take 32 output rows at a time (64 spilled; with more output
  # rows, 64 keeps wgmma), as compiled for H100.
  few_outputs = plan.out_rows <= plan.q_rows
  dy_late = not stats and few_outputs and plan.mix_values_late
  key_chunk = DQ_KEY_MIX_ROWS if not stats and ks > MIX_ROWS else MIX_ROWS

  if not stats:

    def zero(t, carry):
      rows = pl.ds(t * qs, qs)
      dq1_ref[rows, :] = jnp.zeros((qs, plan.half), jnp.float32)
      dq2_ref[rows, :] = jnp.zeros((qs, plan.half), jnp.float32)
      return carry

    lax.fori_loop(0, span, zero, 0)

  def head(h, carry):
    g = lax.div(h, r)
    part_ref[h] = jnp.zeros(part_ref.shape[1:], jnp.float32)

    def tile(t, carry):
      i = program * span + t
      z = _varying(t)  # the tile's constants loaded in the tile loop, not held across it
      qx1, qx2 = _mixed(aq_ref, h, (q1_ref, q2_ref), t * qs, rope_q, dtype, z)
      qid = qid_ref[pl.ds(t * rq, rq)]
      tq = _virtual(plan, rq, plan.offset + i * plan.q_tokens)
      lo, hi = band(plan, i)
      d_o = None
      if not (stats or dy_late):
        # In 32-row chunks: fewer registers beside the loop's operands (H100, P = 4).
        d_o = _d_output(plan, cm_ref, dy_ref, h + z, t * plan.out_rows, dtype, chunk=32)
      stat = pl.ds(t * rq, rq)

      def keys(j):  # transposed scores `[k_rows, q_rows]` of key group j, and its mask
        y = _varying(j)
        kx1, kx2 = _mixed(ak_ref, g, (k1_ref, k2_ref), j * ks, rope_k, dtype, y, chunk=key_chunk)
        kid = kid_ref[pl.ds(j * rk, rk)]
        u = _virtual(plan, rk, j * plan.k_tokens)
        ok = visible(plan, tq, u, qid, lambda: kid, transposed=True)
        return kx1, kx2, ok, _dot(kx1, qx1, _NT) + _dot(kx2, qx2, _NT), y

      if stats:

        def forward(j, carry):  # the forward's online softmax (transposed): O, lse
          m, l, acc = carry
          _, _, ok, s, y = keys(j)
          s = jnp.where(ok, s, MASK_VALUE)
          m_next = jnp.maximum(m, jnp.max(s, axis=0))
          probs = jnp.where(ok, jnp.exp(s - m_next[None, :]), 0.0)
          rescale = jnp.exp(m - m_next)
          l = rescale * l + jnp.sum(probs, axis=0)
          probs = probs.astype(dtype)
          v = v_ref[pl.ds(j * ks, ks)]
          if plan.mix_values_late:  # (probs @ av) @ v: no [k_rows, width] temporary
            values = _dot(_dot(probs, av_ref[g + y], _TN).astype(dtype), v, _NN)
          else:
            values = _dot(probs, _dot(av_ref[g + y], v, _NN).astype(dtype), _TN)
          return m_next, l, rescale[:, None] * acc + values

        init = (
          jnp.full((rq,), MASK_VALUE, jnp.float32),
          jnp.zeros((rq,), jnp.float32),
          jnp.zeros((rq, plan.width), jnp.float32),
        )
        m, l, acc = lax.fori_loop(lo, hi, forward, init)
        l = jnp.where(l == 0.0, 1.0, l)  # no key seen: O = 0
        o = (acc / l[:, None]).astype(dtype)
        lse_ref[h, stat] = m + jnp.log(l)
        # delta = rowsum(dO * O) with dO = cm^T dy: the column sums of cm * (dy O^T), in
        # chunks of output rows (dO never made; tall products).
        chunk = min(32 if few_outputs else COLLAPSE_ROWS, plan.out_rows)
        delta = jnp.zeros((rq,), jnp.float32)
        for c in range(plan.out_rows // chunk):
          dy = dy_ref[pl.ds(t * plan.out_rows + c * chunk, chunk), :]
          cm = cm_ref[h + z, pl.ds(c * chunk, chunk), :].astype(jnp.float32)
          delta += jnp.sum(cm * _dot(dy, o, _NT), axis=0)
        delta_ref[h, stat] = delta
        # dcm[h] += dy O^T folded to the collapse's shape, per token
        args = (t * plan.out_rows, plan.out_rows, plan.q_tokens, (out_heads, p), (other, p_pad))
        d_cm = _weights_grad([dy_ref], [o], *args, refs_first=True)
        _add(part_ref, h, d_cm, interpret)
        return carry

      lse, delta = lse_ref[h, stat], delta_ref[h, stat]

      # Transposed, `[k_rows, q_rows]`: the tile's pseudo queries, dO (or dy and cm) are
      # the products' second operands, which stay in shared memory across the loop.
      if dy_late:
        dy = dy_ref[pl.ds(t * plan.out_rows, plan.out_rows), :]
        cm = cm_ref[h + z]

      def backward(j, carry):
        dq1, dq2 = carry
        kx1, kx2, ok, s, y = keys(j)
        probs = jnp.where(ok, jnp.exp(s - lse[None, :]), 0.0)
        v = v_ref[pl.ds(j * ks, ks)]
        if dy_late:
          mixed = _dot(_dot(v, dy, _NT).astype(dtype), cm, _NN).astype(dtype)
          d_probs = _dot(av_ref[g + y], mixed, _NN)
        elif plan.mix_values_late:
          d_probs = _dot(av_ref[g + y], _dot(v, d_o, _NT).astype(dtype), _NN)
        else:
          d_probs = _dot(_dot(av_ref[g + y], v, _NN).astype(dtype), d_o, _NT)
        ds = (probs * (d_probs - delta[None, :])).astype(dtype)
        return dq1 + _dot(ds, kx1, _TN), dq2 + _dot(ds, kx2, _TN)

      zeros = jnp.zeros((rq, plan.half), jnp.float32)
      dq1, dq2 = lax.fori_loop(lo, hi, backward, (zeros, zeros))
      grads = [x.astype(dtype) for x in _unrotate(dq1, dq2, rope_q, z)]
      args = (t * qs, qs, plan.q_tokens, (p, heads), (p_pad, other))
      partial = lambda: _add(part_ref, h, _weights_grad(grads, (q1_ref, q2_ref), *args), interpret)
      # The weights' partial first where the output rows are many (P = 4), after the
      # un-mixing where they are few (P = H = 20): either order spilled on H100 in the other.
      if not few_outputs:
        partial()
      _unmix(aq_ref, h + z, grads, (dq1_ref, dq2_ref), t * qs, interpret)
      if few_outputs:
        partial()
      return carry

    lax.fori_loop(0, span, tile, 0)
    return carry

  lax.fori_loop(0, plan.targets, head, 0)


# --- dK/dV ----------------------------------------------------------------------------------


def dkv_kernel(*refs, plan: WindowPlan, span: int, interpret: bool):
  q1_ref, q2_ref, k1_ref, k2_ref, v_ref, dy_ref, lse_ref, delta_ref, *refs = refs
  aq_ref, ak_ref, av_ref, cm_ref, *refs = refs
  rope_q = rope_k = None
  if plan.rotary:
    cos_q, sin_q, cos_k, sin_k, *refs = refs
    rope_q, rope_k = (cos_q, sin_q), (cos_k, sin_k)
  qid_ref, kid_ref, dk1_ref, dk2_ref, dv_ref, dak_ref, dav_ref = refs
  program = pl.program_id(0)
  dtype = q1_ref.dtype
  rq, rk, ks = plan.q_rows, plan.k_rows, plan.k_src
  p, kv_heads = plan.num_pseudo, plan.kv_heads
  r = plan.targets // plan.kv_targets
  p_pad, g_pad = pad2(p), pad2(kv_heads)
  sub_rows = min(DKV_QUERY_ROWS, rq)
  subs = rq // sub_rows
  refs_q = (q1_ref, q2_ref, aq_ref, cm_ref, dy_ref, lse_ref, delta_ref, qid_ref)

  def zero(t, carry):
    rows = pl.ds(t * ks, ks)
    dk1_ref[rows, :] = jnp.zeros((ks, plan.half), jnp.float32)
    dk2_ref[rows, :] = jnp.zeros((ks, plan.half), jnp.float32)
    dv_ref[rows, :] = jnp.zeros((ks, plan.width), jnp.float32)
    return carry

  lax.fori_loop(0, span, zero, 0)

  def kv_head(g, carry):
    dak_ref[g] = jnp.zeros((p_pad, g_pad), jnp.float32)
    dav_ref[g] = jnp.zeros((p_pad, g_pad), jnp.float32)

    def group(t, carry):
      j = program * span + t
      z = _varying(t)  # the group's constants loaded in the group loop, not held across it
      kx = _mixed(ak_ref, g, (k1_ref, k2_ref), t * ks, rope_k, dtype, z)
      (vx,) = _mixed(av_ref, g, (v_ref,), t * ks, None, dtype, z)
      kid = kid_ref[pl.ds(t * rk, rk)]
      u = _virtual(plan, rk, j * plan.k_tokens)
      lo, hi = query_band(plan, j)
      tiles = hi - lo

      def step(n, carry):  # (query head of the group, query tile, sub-tile)
        n, sub = lax.div(n, subs), lax.rem(n, subs)
        h, i = g * r + lax.div(n, tiles), lo + lax.rem(n, tiles)
        args = (kx, vx, u, kid, h, i, sub * sub_rows, sub_rows, carry)
        return _dkv_step(plan, refs_q, rope_q, *args)

      zeros = jnp.zeros((rk, plan.half), jnp.float32)
      init = (zeros, zeros, jnp.zeros((plan.width, rk), jnp.float32))
      dk1, dk2, dv = lax.fori_loop(0, r * tiles * subs, step, init)
      dv = dv.T
      grads = [x.astype(dtype) for x in _unrotate(dk1, dk2, rope_k, z)]
      dv = dv.astype(dtype)
      row0 = t * ks
      _unmix(ak_ref, g + z, grads, (dk1_ref, dk2_ref), row0, interpret)
      _unmix(av_ref, g + z, [dv], (dv_ref,), row0, interpret)
      periods, sizes = (p, kv_heads), (p_pad, g_pad)
      fold = lambda x, refs: _weights_grad(x, refs, row0, ks, plan.k_tokens, periods, sizes)
      _add(dak_ref, g, fold(grads, (k1_ref, k2_ref)), interpret)
      _add(dav_ref, g, fold([dv], [v_ref]), interpret)
      return carry

    lax.fori_loop(0, span, group, 0)
    return carry

  lax.fori_loop(0, plan.kv_targets, kv_head, 0)


def _dkv_step(plan: WindowPlan, refs_q, rope_q, kx, vx, u, kid, h, i, row0, rows, carry):
  """One step of the dK/dV loop: query rows `[row0, row0 + rows)` of tile i, head h
  (pseudo queries and dO remade), against the key group's pseudo rows."""
  q1_ref, q2_ref, aq_ref, cm_ref, dy_ref, lse_ref, delta_ref, qid_ref = refs_q
  dk1, dk2, dv = carry
  dtype = vx.dtype
  qx1, qx2 = _mixed(aq_ref, h, (q1_ref, q2_ref), i * plan.q_src, rope_q, dtype, row0, rows)
  # dO^T `[width, rows]`: both its products take it as the second operand (and its own
  # product is tall: tensor cores' wgmma where the key group's rows are few).
  d_o = _d_output(plan, cm_ref, dy_ref, h, i * plan.out_rows, dtype, row0, rows, t=True)
  at = pl.ds(i * plan.q_rows + row0, rows)
  lse, delta = lse_ref[h, at], delta_ref[h, at]
  tq = _virtual(plan, rows, plan.offset + i * plan.q_tokens, row0)
  ok = visible(plan, tq, u, qid_ref[at], lambda: kid, transposed=True)
  s = _dot(kx[0], qx1, _NT) + _dot(kx[1], qx2, _NT)
  probs = jnp.where(ok, jnp.exp(s - lse[None, :]), 0.0)
  dv += _dot(d_o, probs.astype(dtype), _NT)  # dV^T `[width, k_rows]`: a tall product
  ds = (probs * (_dot(vx, d_o, _NN) - delta[None, :])).astype(dtype)
  return dk1 + _dot(ds, qx1, _NN), dk2 + _dot(ds, qx2, _NN), dv
