"""The forward kernel of IHA's on-chip GPU window path (`window.gpu`): one program per
(query tile, batch row), every product a tensor-core matmul.

Operands (per batch row, built by `window.gpu.prepare`, sizes named by
`window.gpu_plan.Plan`; a token group's rows padded with zeros to a power of two):
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

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from iha_jax.kernels.gpu import NN, NT, barrier, dot, softmax_init, softmax_output, softmax_step
from iha_jax.kernels.window.gpu_mixing import pseudo_rows
from iha_jax.kernels.window.gpu_plan import COLLAPSE_ROWS, Plan, key_groups, visible


def forward_kernel(*refs, plan: Plan, interpret: bool):
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
  lo, hi = key_groups(plan, i)
  chunk = min(COLLAPSE_ROWS, plan.out_rows)
  chunks = plan.out_rows // chunk
  for c in range(chunks):
    y_ref[pl.ds(c * chunk, chunk), :] = jnp.zeros((chunk, plan.width), jnp.float32)

  def head(h, carry):
    g = lax.div(h, r)
    qx1, qx2 = pseudo_rows(aq_ref[h], q1_ref[...], q2_ref[...], rope_q, dtype)
    qid = qid_ref[...]

    def step(j, carry):
      # Every operand loaded where it is used (the mixing constants and tables hit the
      # caches): values held across the loop would spill.
      m, l, acc = carry
      rows = pl.ds(j * ks, ks)
      kx1, kx2 = pseudo_rows(ak_ref[g], k1_ref[rows], k2_ref[rows], rope_k, dtype)
      s = dot(qx1, kx1, NT) + dot(qx2, kx2, NT)
      u = (j * plan.k_tokens + tok_k) * plan.num_pseudo + (r_k - tok_k * plan.num_pseudo)
      ok = visible(plan, t, u, qid, lambda: kid_ref[pl.ds(j * rk, rk)])
      m_next, l, probs, rescale = softmax_step(s, ok, m, l)
      probs = probs.astype(dtype)
      if plan.mix_values_late:  # (probs @ av) @ v: no [k_rows, width] float32 temporary
        mixed = dot(probs, av_ref[g], NN).astype(dtype)
        acc = rescale[:, None] * acc + dot(mixed, v_ref[rows], NN)
      else:  # probs @ (av @ v), made after the scores (shorter-lived)
        vx = dot(av_ref[g], v_ref[rows], NN).astype(dtype)
        acc = rescale[:, None] * acc + dot(probs, vx, NN)
      return m_next, l, acc

    _, l, acc = lax.fori_loop(lo, hi, step, softmax_init(rq, plan.width))
    o, _ = softmax_output(acc, l)  # no key seen: 0
    o = o.astype(dtype)
    barrier(interpret)  # the previous head's stores of these rows, by other threads
    for c in range(chunks):
      rows = pl.ds(c * chunk, chunk)
      y_ref[rows, :] += dot(cm_ref[h, rows, :], o, NN)
    barrier(interpret)
    return carry

  lax.fori_loop(0, plan.targets, head, 0)
