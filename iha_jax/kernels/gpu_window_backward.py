"""The on-chip backward of IHA's GPU window path (`iha_jax.kernels.gpu_window`'s VJP).

Three Pallas-Triton kernels (`gpu_window_backward_kernel`: statistics, dQ, dK/dV) read
the forward's source-sized operands (`gpu_window.prepare`) and the cotangent dy in the
forward's output layout, remake every pseudo tile on chip (nothing is saved by the
forward: its softmax is run again), and write source-sized gradients. What crosses HBM:
- source rows: dq1, dq2 `[B, num_q * q_src, half]`, dk1, dk2 `[B, num_k * k_src, half]`,
  dv `[B, num_k * k_src, width]` float32 (the operands' row layouts; `gpu_window` maps
  them back to `[B, N, H, d]`, `[B, Nk, G, d]` through the transpose of `sources`, RoPE's
  `R(pos * P)^T` included);
- two float32 numbers per pseudo query row and target head, `lse` and `delta` `[B, Ht,
  num_q * q_rows]` (2/d of a P-sized array), written by the statistics kernel for the
  other two within the backward: the only arrays with P-sized rows, nothing P x d;
- the weights' partials, one per program, matrix and target head, folded to the weights'
  shapes padded to powers of two >= 16 (`[P', H']`, `[P', G']`, `[Ho', P']`): with
  `PROGRAMS` programs per batch row they are `B * PROGRAMS * Ht * P' * H' * 4` bytes,
  independent of N (docs/compile_checks.md); XLA sums them (`weight_grads`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from iha_jax.core.options import round_up
from iha_jax.kernels.gpu_window_backward_kernel import dkv_kernel, pad2, query_kernel

if TYPE_CHECKING:
  from iha_jax.kernels.gpu_window import WindowPlan

# Programs per batch row of each kernel (one per H100 SM): each takes `span` consecutive
# tiles, so the weights' partials are this many per batch row. (Two waves spilled in dQ
# at the 2.4B layer's shape under jax 0.10.2: docs/compile_checks.md.)
PROGRAMS = 132


def backward_plan(plan: WindowPlan) -> tuple[WindowPlan, int, int]:
  """(the plan with query tiles and key groups padded to whole spans, query tiles per dQ
  program, key groups per dK/dV program). The padding tiles hold padding rows only."""
  q_span, k_span = -(-plan.num_q // PROGRAMS), -(-plan.num_k // PROGRAMS)
  padded = dataclasses.replace(
    plan, num_q=round_up(plan.num_q, q_span), num_k=round_up(plan.num_k, k_span)
  )
  return padded, q_span, k_span


# --- the calls ------------------------------------------------------------------------------


def launch(plan: WindowPlan) -> plgpu.CompilerParams:
  """Eight warps (two warpgroups share the 64-row products), one pipeline stage: a second
  one, or four or sixteen warps, spilled more registers on H100
  (tests/test_compile_targets.py checks the spills)."""
  del plan
  return plgpu.CompilerParams(num_warps=8, num_stages=1)


def _rope_names(plan: WindowPlan) -> list[str]:
  return ["cos_q", "sin_q", "cos_k", "sin_k"] if plan.rotary else []


def _call(kernel, name, plan, span, operands, names, specs, outs, interpret):
  b = operands["q1"].shape[0]
  whole = lambda x: pl.BlockSpec(x.shape, lambda i, bb: (0,) * x.ndim)
  for n in ("aq", "ak", "av", "cm", *_rope_names(plan)):
    specs[n] = whole(operands[n])
  return pl.pallas_call(
    functools.partial(kernel, plan=plan, span=span, interpret=interpret),
    grid=((plan.num_k if kernel is dkv_kernel else plan.num_q) // span, b),
    in_specs=[specs[n] for n in names],
    out_specs=[spec for spec, _ in outs],
    out_shape=[shape for _, shape in outs],
    compiler_params=launch(plan),
    interpret=interpret,
    name=name,
  )(*[operands[n] for n in names])


def _per_program(rows: int, cols: int):
  return pl.BlockSpec((None, rows, cols), lambda i, bb: (bb, i, 0))


def _whole_row(x: jax.Array):
  return pl.BlockSpec((None, *x.shape[1:]), lambda i, bb: (bb,) + (0,) * (x.ndim - 1))


def _partials(programs: int, b: int, heads: int, rows: int, cols: int):
  spec = pl.BlockSpec((None, None, heads, rows, cols), lambda i, bb: (bb, i, 0, 0, 0))
  return spec, jax.ShapeDtypeStruct((b, programs, heads, rows, cols), jnp.float32)


def query_calls(plan: WindowPlan, span: int, operands: dict, *, interpret: bool):
  """The stats kernel, then the dQ kernel -> (dq1, dq2 `[B, num_q * q_src, half]`, lse,
  delta `[B, Ht, num_q * q_rows]`, the folded partials of aq `[B, programs, Ht, P', H']`
  and cm `[B, programs, Ht, Ho', P']`), float32. `plan`: `backward_plan`'s."""
  b = operands["q1"].shape[0]
  programs = plan.num_q // span
  specs = {n: _per_program(span * plan.q_src, plan.half) for n in ("q1", "q2")}
  specs["dy"] = _per_program(span * plan.out_rows, plan.width)
  specs["qid"] = pl.BlockSpec((None, span * plan.q_rows), lambda i, bb: (bb, i))
  specs.update({n: _whole_row(operands[n]) for n in ("k1", "k2", "v", "kid")})
  stat_spec = pl.BlockSpec((None, plan.targets, span * plan.q_rows), lambda i, bb: (bb, 0, i))
  specs["lse"] = specs["delta"] = stat_spec
  f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  stat = (stat_spec, f32(b, plan.targets, plan.num_q * plan.q_rows))
  source = (_per_program(span * plan.q_src, plan.half), f32(b, plan.num_q * plan.q_src, plan.half))
  p, h, o = (pad2(x) for x in (plan.num_pseudo, plan.heads, plan.out_heads))
  tail = ["aq", "ak", "av", "cm", *_rope_names(plan), "qid", "kid"]
  head = ["q1", "q2", "k1", "k2", "v", "dy"]
  kernel = functools.partial(query_kernel, stats=True)
  outs = [stat, stat, _partials(programs, b, plan.targets, o, p)]
  lse, delta, dcm = _call(
    kernel, "iha_gpu_window_stats", plan, span, operands, head + tail, specs, outs, interpret
  )
  operands = dict(operands, lse=lse, delta=delta)
  kernel = functools.partial(query_kernel, stats=False)
  outs = [source, source, _partials(programs, b, plan.targets, p, h)]
  names = head + ["lse", "delta"] + tail
  dq1, dq2, daq = _call(
    kernel, "iha_gpu_window_dq", plan, span, operands, names, specs, outs, interpret
  )
  return dq1, dq2, lse, delta, daq, dcm


def dkv_call(plan: WindowPlan, span: int, operands: dict, lse, delta, *, interpret: bool):
  """-> (dk1, dk2 `[B, num_k * k_src, half]`, dv `[B, num_k * k_src, width]`, the folded
  partials of ak and av `[B, programs, Gt, P', G']`), float32."""
  b = operands["q1"].shape[0]
  programs = plan.num_k // span
  operands = dict(operands, lse=lse, delta=delta)
  names = ["q1", "q2", "k1", "k2", "v", "dy", "lse", "delta", "aq", "ak", "av", "cm"]
  names += [*_rope_names(plan), "qid", "kid"]
  specs = {n: _whole_row(operands[n]) for n in ("q1", "q2", "dy", "lse", "delta", "qid")}
  specs.update({n: _per_program(span * plan.k_src, plan.half) for n in ("k1", "k2")})
  specs["v"] = _per_program(span * plan.k_src, plan.width)
  specs["kid"] = pl.BlockSpec((None, span * plan.k_rows), lambda i, bb: (bb, i))
  f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  rows = plan.num_k * plan.k_src
  outs = [
    (_per_program(span * plan.k_src, plan.half), f32(b, rows, plan.half)),
    (_per_program(span * plan.k_src, plan.half), f32(b, rows, plan.half)),
    (_per_program(span * plan.k_src, plan.width), f32(b, rows, plan.width)),
  ]
  p, g = pad2(plan.num_pseudo), pad2(plan.kv_heads)
  outs += [_partials(programs, b, plan.kv_targets, p, g)] * 2
  return _call(
    dkv_kernel, "iha_gpu_window_dkv", plan, span, operands, names, specs, outs, interpret
  )


def gradients(plan: WindowPlan, q_span: int, k_span: int, operands: dict) -> tuple:
  """The three kernels (Triton when lowering for cuda/rocm, Pallas' interpreter elsewhere) ->
  (dq1, dq2, dk1, dk2, dv in the operands' row layouts, and the partials of aq, ak, av,
  cm summed: `[Ht, P', H']`, `[Gt, P', G']` twice, `[Ht, Ho', P']`), float32."""

  def call(operands, *, interpret):
    dq1, dq2, lse, delta, daq, dcm = query_calls(plan, q_span, operands, interpret=interpret)
    dk1, dk2, dv, dak, dav = dkv_call(plan, k_span, operands, lse, delta, interpret=interpret)
    total = lambda x: x.sum(axis=(0, 1))
    return dq1, dq2, dk1, dk2, dv, *(total(x) for x in (daq, dak, dav, dcm))

  compiled = functools.partial(call, interpret=False)
  return lax.platform_dependent(
    operands, default=functools.partial(call, interpret=True), cuda=compiled, rocm=compiled
  )


def weight_grads(plan: WindowPlan, scale: float, daq, dak, dav, dcm) -> tuple:
  """The summed folded partials -> (d alpha_q `[H, Ht, P]`, d alpha_k, d alpha_v `[G, Gt,
  P]`, d collapse `[Ho, Ht, P]`, or `[Ht, P]` per head), float32. aq carries the softmax
  `scale`."""
  p, h, g, ho = plan.num_pseudo, plan.heads, plan.kv_heads, plan.out_heads
  alpha = lambda x, s: jnp.transpose(x[:, :p, :s], (2, 0, 1))  # [T, P, S] -> [S, T, P]
  dcollapse = jnp.transpose(dcm[:, :ho, :p], (1, 0, 2))  # [Ht, Ho, P] -> [Ho, Ht, P]
  if plan.per_head:  # collapse [Ht, P] entered as its diagonal [Ho = Ht, Ht, P]
    dcollapse = jnp.einsum("hhp->hp", dcollapse)
  return alpha(daq, h) * scale, alpha(dak, g), alpha(dav, g), dcollapse
