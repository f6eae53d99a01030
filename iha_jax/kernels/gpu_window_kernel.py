"""The forward kernel of IHA's on-chip GPU window path (`iha_jax.kernels.gpu_window`).

One program per (query tile, batch row): for each target head it mixes the tile's pseudo
queries from the source rows, loops over the key groups of the tile's band mixing each
group's pseudo keys and values, runs the online softmax over them, and adds the head's
collapsed output into the tile's output rows. Every product is a tensor-core matmul;
layouts and constants are built by `gpu_window.prepare` (`WindowPlan` names the sizes).

Operands (per batch row; rows of a token group are padded with zeros to a power of two):
  q1, q2 `[num_q * q_src, half]`: the source queries' two RoPE halves, rotated at
    `pos * P`, a query tile's `q_tokens * H` source rows padded to `q_src`;
  k1, k2 `[num_k * k_src, half]`, v `[num_k * k_src, width]`: the key groups' sources;
  aq `[Ht, q_rows, q_src]`, ak, av `[Gt, k_rows, k_src]`: block-diagonal mixing
    constants `kron(I_s, alpha^T)` (aq carries the softmax scale);
  cm `[Ht, out_rows, q_rows]`: block-diagonal collapse constants;
  cos/sin `[q_rows, half]`, `[k_rows, half]`: `R(p)` per pseudo row (RoPE only);
  qid `[num_q * q_rows]`, kid `[num_k * k_rows]` int32: per pseudo row, a segment id
    (queries: 0 for padding rows; keys: -1), so one comparison masks documents, padding
    rows and padding tokens.
Output: y `[num_q * out_rows, width]` float32, the tile's rows `(n, ho)`.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from iha_jax.core.masking import MASK_VALUE

if TYPE_CHECKING:
  from iha_jax.kernels.gpu_window import WindowPlan

_NT = (((1,), (1,)), ((), ()))  # a @ b.T
_NN = (((1,), (0,)), ((), ()))  # a @ b
# Output rows per collapse product: bounds the float32 result the registers hold.
COLLAPSE_ROWS = 64


def _dot(a: jax.Array, b: jax.Array, dims) -> jax.Array:
  """Float32-accumulated matmul: tensor cores for 16-bit inputs, true float32 products
  for float32 inputs (as `gpu_flash._dot`)."""
  precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
  return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32, precision=precision)


def _pseudo(matrix, src1, src2, rope, dtype):
  """Pseudo rows of a token group in two halves: `R(p) (matrix @ src)`, rotated in float32
  on the halves (`(x1, x2) -> (x1 c - x2 s, x2 c + x1 s)`), so no lane concatenation.
  `rope`: the (cos, sin) table refs, or None."""
  x1, x2 = _dot(matrix, src1, _NN), _dot(matrix, src2, _NN)
  if rope is not None:
    # Loaded where used, not held across the loops: the tables would take a quarter of
    # the registers.
    cos, sin = rope[0][...], rope[1][...]
    x1, x2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
  return x1.astype(dtype), x2.astype(dtype)


def band(plan: WindowPlan, i):
  """Key groups `[lo, hi)` that query tile `i`'s window reaches."""
  p, w = plan.num_pseudo, plan.window
  first = (plan.offset + i * plan.q_tokens) * p
  last = first + plan.q_tokens * p - 1
  low = jnp.maximum(first - (w - 1), 0)
  high = last if plan.causal else last + w - 1
  lo = lax.div(lax.div(low, p), plan.k_tokens)
  hi = jnp.minimum(lax.div(lax.div(high, p), plan.k_tokens) + 1, plan.num_k)
  return lo, jnp.maximum(hi, lo)


def _forward_kernel(*refs, plan: WindowPlan, interpret: bool):
  q1_ref, q2_ref, k1_ref, k2_ref, v_ref, aq_ref, ak_ref, av_ref, cm_ref, *refs = refs
  if plan.rotary:
    cos_q_ref, sin_q_ref, cos_k_ref, sin_k_ref, *refs = refs
  qid_ref, kid_ref, y_ref = refs
  i = pl.program_id(0)
  dtype = q1_ref.dtype
  rq, rk, ks = plan.q_rows, plan.k_rows, plan.k_src
  r = plan.targets // plan.kv_targets
  rope_q = (cos_q_ref, sin_q_ref) if plan.rotary else None
  rope_k = (cos_k_ref, sin_k_ref) if plan.rotary else None
  # Virtual indices (on the keys' axis) of the tile's pseudo rows. Padding rows of a
  # group get indices past it; their ids keep them out of every mask.
  r_q = lax.broadcasted_iota(jnp.int32, (rq,), 0)
  tok_q = lax.div(r_q, plan.num_pseudo)
  t = (plan.offset + i * plan.q_tokens + tok_q) * plan.num_pseudo + (r_q - tok_q * plan.num_pseudo)
  r_k = lax.broadcasted_iota(jnp.int32, (rk,), 0)
  tok_k = lax.div(r_k, plan.num_pseudo)
  lo, hi = band(plan, i)
  chunk = min(COLLAPSE_ROWS, plan.out_rows)
  chunks = plan.out_rows // chunk
  for c in range(chunks):
    y_ref[pl.ds(c * chunk, chunk), :] = jnp.zeros((chunk, plan.width), jnp.float32)

  def head(h, carry):
    g = lax.div(h, r)
    qx1, qx2 = _pseudo(aq_ref[h], q1_ref[...], q2_ref[...], rope_q, dtype)
    qid = qid_ref[...]

    def step(j, carry):
      # Every operand loaded where it is used (the mixing constants and tables hit the
      # caches): values held across the loop would spill.
      m, l, acc = carry
      rows = pl.ds(j * ks, ks)
      kx1, kx2 = _pseudo(ak_ref[g], k1_ref[rows], k2_ref[rows], rope_k, dtype)
      s = _dot(qx1, kx1, _NT) + _dot(qx2, kx2, _NT)
      u = (j * plan.k_tokens + tok_k) * plan.num_pseudo + (r_k - tok_k * plan.num_pseudo)
      ok = visible(plan, t, u, qid, lambda: kid_ref[pl.ds(j * rk, rk)])
      s = jnp.where(ok, s, MASK_VALUE)
      m_next = jnp.maximum(m, jnp.max(s, axis=1))
      probs = jnp.where(ok, jnp.exp(s - m_next[:, None]), 0.0)
      rescale = jnp.exp(m - m_next)
      l = rescale * l + jnp.sum(probs, axis=1)
      probs = probs.astype(dtype)
      if plan.mix_values_late:  # (probs @ av) @ v: no [k_rows, width] float32 temporary
        mixed = _dot(probs, av_ref[g], _NN).astype(dtype)
        acc = rescale[:, None] * acc + _dot(mixed, v_ref[rows], _NN)
      else:  # probs @ (av @ v), made after the scores (shorter-lived)
        vx = _dot(av_ref[g], v_ref[rows], _NN).astype(dtype)
        acc = rescale[:, None] * acc + _dot(probs, vx, _NN)
      return m_next, l, acc

    init = (
      jnp.full((rq,), MASK_VALUE, jnp.float32),
      jnp.zeros((rq,), jnp.float32),
      jnp.zeros((rq, plan.width), jnp.float32),
    )
    _, l, acc = lax.fori_loop(lo, hi, step, init)
    o = (acc / jnp.where(l == 0.0, 1.0, l)[:, None]).astype(dtype)  # no key seen: 0
    if not interpret:
      # The previous head's stores of these rows, made by other threads, are visible.
      plgpu.debug_barrier()
    for c in range(chunks):
      rows = pl.ds(c * chunk, chunk)
      y_ref[rows, :] += _dot(cm_ref[h, rows, :], o, _NN)
    if not interpret:
      plgpu.debug_barrier()
    return carry

  lax.fori_loop(0, plan.targets, head, 0)


def visible(plan: WindowPlan, t, u, qid, kid, *, transposed: bool = False):
  """`[len(t), len(u)]` (`[len(u), len(t)]` if transposed): query rows t see key rows u
  (window, causality, then segments: `kid()` loads the key ids where they are used)."""
  delta = t[None, :] - u[:, None] if transposed else t[:, None] - u[None, :]
  ok = delta < plan.window
  ok &= delta >= 0 if plan.causal else delta > -plan.window
  return ok & (qid[None, :] == kid()[:, None] if transposed else qid[:, None] == kid()[None, :])


def launch(plan: WindowPlan) -> plgpu.CompilerParams:
  """Eight warps (two warpgroups share the 64-row tiles' products and hold the float32
  accumulators); two pipeline stages only for 16-row key groups, whose prefetched source
  rows are few: with 32- or 64-row groups a second stage spilled registers on H100
  (tests/test_compile_targets.py)."""
  return plgpu.CompilerParams(num_warps=8, num_stages=2 if plan.k_rows < 32 else 1)


def forward_call(plan: WindowPlan, operands: dict[str, jax.Array], *, interpret: bool):
  """The forward `pallas_call` over grid `(num_q, B)` -> y `[B, num_q * out_rows, width]`
  float32."""
  b = operands["q1"].shape[0]
  per_tile = lambda rows, cols: pl.BlockSpec((None, rows, cols), lambda i, bb: (bb, i, 0))
  whole_row = lambda x: pl.BlockSpec((None, *x.shape[1:]), lambda i, bb: (bb, 0, 0))
  whole = lambda x: pl.BlockSpec(x.shape, lambda i, bb: (0,) * x.ndim)
  names = ["q1", "q2", "k1", "k2", "v", "aq", "ak", "av", "cm"]
  if plan.rotary:
    names += ["cos_q", "sin_q", "cos_k", "sin_k"]
  names += ["qid", "kid"]
  specs = {
    "q1": per_tile(plan.q_src, plan.half),
    "q2": per_tile(plan.q_src, plan.half),
    "qid": pl.BlockSpec((None, plan.q_rows), lambda i, bb: (bb, i)),
    "kid": pl.BlockSpec((None, operands["kid"].shape[1]), lambda i, bb: (bb, 0)),
  }
  for name in ("k1", "k2", "v"):
    specs[name] = whole_row(operands[name])
  for name in ("aq", "ak", "av", "cm", "cos_q", "sin_q", "cos_k", "sin_k"):
    if name in operands:
      specs[name] = whole(operands[name])
  return pl.pallas_call(
    functools.partial(_forward_kernel, plan=plan, interpret=interpret),
    grid=(plan.num_q, b),
    in_specs=[specs[n] for n in names],
    out_specs=per_tile(plan.out_rows, plan.width),
    out_shape=jax.ShapeDtypeStruct((b, plan.num_q * plan.out_rows, plan.width), jnp.float32),
    compiler_params=launch(plan),
    interpret=interpret,
    name="iha_gpu_window_forward",
  )(*[operands[n] for n in names])
