"""Sliding-window IHA on GPU with the pseudo-heads made, attended and collapsed on chip:
the Triton twin of `window.tpu` (same signature and semantics; docs/design.md §8).

One program takes a tile of query tokens and, per target head, mixes its pseudo queries,
walks the band's key groups mixing their pseudo keys and values, attends them with an
online softmax and adds the head's collapsed output into the tile's rows
(`window.gpu_kernel`): only source-sized arrays cross HBM. Triton's block shapes are
powers of two, so a token group's `s*P` pseudo rows and `s*S` source rows are padded with
zero rows (their ids mask them); the sources come in two d/2 halves rotated at `pos * P`
in XLA, so `R(p)` on chip is elementwise and the scores are `q1 k1^T + q2 k2^T`. The
backward is on chip too (`window.gpu_backward_kernel`): the custom VJP saves only the
call's own arrays, and `sources`' transpose takes the kernels' source-row gradients back
to q, k, v. Here: the operands built in XLA, the calls and the custom VJP.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from iha_jax.core.options import AttentionOptions
from iha_jax.core.rope import apply_rope
from iha_jax.core.validation import default_positions
from iha_jax.kernels.gpu import Launch, block_pow2, on_gpu
from iha_jax.kernels.window import common
from iha_jax.kernels.window.common import block_diagonal, full_collapse, key_side, pseudo_angles
from iha_jax.kernels.window.gpu_backward_kernel import dkv_kernel, query_kernel
from iha_jax.kernels.window.gpu_kernel import forward_kernel
from iha_jax.kernels.window.gpu_plan import Plan, backward_plan, tiling


def _pad_to(x: jax.Array, axis: int, size: int, value=0) -> jax.Array:
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, pad, constant_values=value)


def _group_rows(x: jax.Array, tokens: int, groups: int, rows: int) -> jax.Array:
  """`[B, T, S, w]` -> `[B, groups * rows, w]`: groups of `tokens` tokens, each group's
  rows `(n, m)` padded with zero rows to `rows`."""
  b, _, s, w = x.shape
  x = _pad_to(x, 1, groups * tokens).reshape(b, groups, tokens * s, w)
  return _pad_to(x, 2, rows).reshape(b, groups * rows, w)


def _halves(x: jax.Array, lanes: int) -> tuple[jax.Array, jax.Array]:
  half = x.shape[-1] // 2
  return _pad_to(x[..., :half], -1, lanes), _pad_to(x[..., half:], -1, lanes)


def _block_diagonal(weights: jax.Array, s: int, rows: int, cols: int) -> jax.Array:
  """`block_diagonal(weights, s)` `[T, s*P, s*S]` padded with zeros to `[T, rows, cols]`."""
  return _pad_to(_pad_to(block_diagonal(weights, s), 1, rows), 2, cols)


def _collapse_blocks(collapse: jax.Array, plan: Plan) -> jax.Array:
  """`collapse` -> `[Ht, out_rows, q_rows]`: per target head h', rows (n, ho), columns
  (n', p), `delta(n, n') collapse[ho, h', p]` (per head: only ho = h')."""
  collapse = full_collapse(collapse, plan)
  s = plan.q_tokens
  blocks = _block_diagonal(collapse, s, s * plan.num_pseudo, s * plan.out_heads)
  blocks = jnp.swapaxes(blocks, 1, 2)  # [Ht, s*Ho, s*P]
  return _pad_to(_pad_to(blocks, 1, plan.out_rows), 2, plan.q_rows)


def _rope_rows(plan: Plan, tokens: int, rows: int, theta: float):
  """(cos, sin) `[rows, half]` float32 of `R(p)` for a group's pseudo rows (n, p)."""
  pseudo = jnp.tile(jnp.arange(plan.num_pseudo, dtype=jnp.float32), tokens)
  angles = pseudo_angles(pseudo, plan.head_dim, theta)
  return tuple(_pad_to(_pad_to(f(angles), 0, rows), 1, plan.half) for f in (jnp.cos, jnp.sin))


def _row_ids(ids: jax.Array, p: int, tokens: int, groups: int, rows: int, padding: int):
  """Token ids `[B, T]` -> per pseudo row `[B, groups * rows]` (padding: `padding`)."""
  b = ids.shape[0]
  ids = _pad_to(ids.astype(jnp.int32), 1, groups * tokens, padding)
  ids = jnp.repeat(ids, p, axis=1).reshape(b, groups, tokens * p)
  return _pad_to(ids, 2, rows, padding).reshape(b, groups * rows)


def sources(q, k, v, options: AttentionOptions, plan: Plan) -> dict:
  """The kernels' source rows (linear in q, k, v: the backward transposes it): q1, q2,
  k1, k2 rotated by `R(pos * P)` in two halves, v; token groups padded to whole rows."""
  if plan.rotary:  # R(pos * P) on the source heads; R(p) per pseudo row on chip
    positions = default_positions(q, options.positions)
    _, key_positions = key_side(q, k, options)
    q = apply_rope(q, positions * plan.num_pseudo, options.rope_theta)
    k = apply_rope(k, key_positions * plan.num_pseudo, options.rope_theta)
  q = _group_rows(q, plan.q_tokens, plan.num_q, plan.q_src)
  k = _group_rows(k, plan.k_tokens, plan.num_k, plan.k_src)
  v = _pad_to(_group_rows(v, plan.k_tokens, plan.num_k, plan.k_src), -1, plan.width)
  (q1, q2), (k1, k2) = _halves(q, plan.half), _halves(k, plan.half)
  return dict(q1=q1, q2=q2, k1=k1, k2=k2, v=v)


def prepare(q, k, v, alphas, collapse, options: AttentionOptions, plan: Plan) -> dict:
  """The kernels' operands (`window.gpu_kernel`): `sources`, the block-diagonal
  constants, RoPE tables and per-row ids."""
  p = plan.num_pseudo
  positions = default_positions(q, options.positions)
  key_ids, _ = key_side(q, k, options)
  operands = sources(q, k, v, options, plan)
  dtype = q.dtype
  alpha_q, alpha_k, alpha_v = (a.astype(jnp.float32) for a in alphas)
  scale = 1 / math.sqrt(plan.head_dim)  # the softmax scale rides on the queries
  operands["aq"] = _block_diagonal(alpha_q * scale, plan.q_tokens, plan.q_rows, plan.q_src)
  operands["ak"] = _block_diagonal(alpha_k, plan.k_tokens, plan.k_rows, plan.k_src)
  operands["av"] = _block_diagonal(alpha_v, plan.k_tokens, plan.k_rows, plan.k_src)
  operands["cm"] = _collapse_blocks(collapse.astype(jnp.float32), plan)
  for name in ("aq", "ak", "av", "cm"):
    operands[name] = operands[name].astype(dtype)
  if plan.rotary:
    theta = options.rope_theta
    operands["cos_q"], operands["sin_q"] = _rope_rows(plan, plan.q_tokens, plan.q_rows, theta)
    operands["cos_k"], operands["sin_k"] = _rope_rows(plan, plan.k_tokens, plan.k_rows, theta)
  query_ids = options.segment_ids
  if query_ids is None:
    query_ids = jnp.ones(q.shape[:1] + (positions.shape[1],), jnp.int32)
  key_ids = jnp.where(key_ids == 0, -1, key_ids)
  operands["qid"] = _row_ids(query_ids, p, plan.q_tokens, plan.num_q, plan.q_rows, 0)
  operands["kid"] = _row_ids(key_ids, p, plan.k_tokens, plan.num_k, plan.k_rows, -1)
  return operands


def _per_program(rows: int, cols: int):
  return pl.BlockSpec((None, rows, cols), lambda i, bb: (bb, i, 0))


def _whole_row(x: jax.Array):
  return pl.BlockSpec((None, *x.shape[1:]), lambda i, bb: (bb,) + (0,) * (x.ndim - 1))


def _whole(x: jax.Array):
  return pl.BlockSpec(x.shape, lambda i, bb: (0,) * x.ndim)


def _rope_names(plan: Plan) -> list[str]:
  return ["cos_q", "sin_q", "cos_k", "sin_k"] if plan.rotary else []


def forward_launch(plan: Plan) -> Launch:
  """Eight warps (two warpgroups share the 64-row tiles' products and hold the float32
  accumulators); two pipeline stages only for 16-row key groups, whose prefetched source
  rows are few: with 32- or 64-row groups a second stage spilled registers on H100
  (tests/kernels/test_compile_targets.py)."""
  return Launch(num_warps=8, num_stages=2 if plan.k_rows < 32 else 1)


# The backward's kernels: eight warps (two warpgroups share the 64-row products), one
# pipeline stage: a second one, or four or sixteen warps, spilled more registers on H100.
BACKWARD_LAUNCH = Launch(num_warps=8, num_stages=1)


def _call(kernel, name: str, plan: Plan, programs: int, launch: Launch, args):
  """`kernel` over the grid `(programs, B)`; `args`: (operands, the `names` of those it
  takes, their BlockSpecs by name (the constants': whole), `outs`: (BlockSpec,
  ShapeDtypeStruct) per output, `interpret`)."""
  operands, names, specs, outs, interpret = args
  for n in ("aq", "ak", "av", "cm", *_rope_names(plan)):
    specs[n] = _whole(operands[n])
  return pl.pallas_call(
    kernel,
    grid=(programs, operands["q1"].shape[0]),
    in_specs=[specs[n] for n in names],
    out_specs=[spec for spec, _ in outs],
    out_shape=[shape for _, shape in outs],
    compiler_params=launch.compiler_params(),
    interpret=interpret,
    name=name,
  )(*[operands[n] for n in names])


def _forward_call(plan: Plan, operands: dict[str, jax.Array], *, interpret: bool):
  """The forward kernel -> y `[B, num_q * out_rows, width]` float32."""
  b = operands["q1"].shape[0]
  names = ["q1", "q2", "k1", "k2", "v", "aq", "ak", "av", "cm", *_rope_names(plan), "qid", "kid"]
  specs = {n: _per_program(plan.q_src, plan.half) for n in ("q1", "q2")}
  specs["qid"] = pl.BlockSpec((None, plan.q_rows), lambda i, bb: (bb, i))
  specs.update({n: _whole_row(operands[n]) for n in ("k1", "k2", "v", "kid")})
  y = jax.ShapeDtypeStruct((b, plan.num_q * plan.out_rows, plan.width), jnp.float32)
  args = (operands, names, specs, [(_per_program(plan.out_rows, plan.width), y)], interpret)
  kernel = functools.partial(forward_kernel, plan=plan, interpret=interpret)
  return _call(kernel, "iha_gpu_window_forward", plan, plan.num_q, forward_launch(plan), args)[0]


# The backward's kernels write float32 source-row gradients in the operands' row layouts,
# two numbers per pseudo query row and target head between them (`lse`, `delta`), and the
# weights' partials, one per program, matrix and target head, folded to the weights'
# shapes padded to powers of two >= 16 (`[P', H']`, `[P', G']`, `[Ho', P']`): with
# `PROGRAMS` programs per batch row, independent of N (docs/compile_checks.md).


def _backward_call(kernel, name, plan, span, operands, names, specs, outs, interpret):
  programs = (plan.num_k if kernel is dkv_kernel else plan.num_q) // span
  kernel = functools.partial(kernel, plan=plan, span=span, interpret=interpret)
  args = (operands, names, specs, outs, interpret)
  return _call(kernel, name, plan, programs, BACKWARD_LAUNCH, args)


def _partials(programs: int, b: int, heads: int, rows: int, cols: int):
  spec = pl.BlockSpec((None, None, heads, rows, cols), lambda i, bb: (bb, i, 0, 0, 0))
  return spec, jax.ShapeDtypeStruct((b, programs, heads, rows, cols), jnp.float32)


def _query_calls(plan: Plan, span: int, operands: dict, *, interpret: bool):
  """The stats kernel, then the dQ kernel -> (dq1, dq2 `[B, num_q * q_src, half]`, lse,
  delta `[B, Ht, num_q * q_rows]`, the folded partials of aq `[B, programs, Ht, P', H']`
  and cm `[B, programs, Ht, Ho', P']`), float32. `plan`: `gpu_plan.backward_plan`'s."""
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
  p, h, o = (block_pow2(x) for x in (plan.num_pseudo, plan.heads, plan.out_heads))
  tail = ["aq", "ak", "av", "cm", *_rope_names(plan), "qid", "kid"]
  head = ["q1", "q2", "k1", "k2", "v", "dy"]
  kernel = functools.partial(query_kernel, stats=True)
  outs = [stat, stat, _partials(programs, b, plan.targets, o, p)]
  lse, delta, dcm = _backward_call(
    kernel, "iha_gpu_window_stats", plan, span, operands, head + tail, specs, outs, interpret
  )
  operands = dict(operands, lse=lse, delta=delta)
  kernel = functools.partial(query_kernel, stats=False)
  outs = [source, source, _partials(programs, b, plan.targets, p, h)]
  names = head + ["lse", "delta"] + tail
  dq1, dq2, daq = _backward_call(
    kernel, "iha_gpu_window_dq", plan, span, operands, names, specs, outs, interpret
  )
  return dq1, dq2, lse, delta, daq, dcm


def _dkv_call(plan: Plan, span: int, operands: dict, lse, delta, *, interpret: bool):
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
  p, g = block_pow2(plan.num_pseudo), block_pow2(plan.kv_heads)
  outs += [_partials(programs, b, plan.kv_targets, p, g)] * 2
  return _backward_call(
    dkv_kernel, "iha_gpu_window_dkv", plan, span, operands, names, specs, outs, interpret
  )


def _gradients(plan: Plan, q_span: int, k_span: int, operands: dict) -> tuple:
  """The three kernels (Triton when lowering for cuda/rocm, Pallas' interpreter elsewhere)
  -> (dq1, dq2, dk1, dk2, dv in the operands' row layouts, and the partials of aq, ak, av,
  cm summed: `[Ht, P', H']`, `[Gt, P', G']` twice, `[Ht, Ho', P']`), float32."""

  def call(operands, *, interpret):
    dq1, dq2, lse, delta, daq, dcm = _query_calls(plan, q_span, operands, interpret=interpret)
    dk1, dk2, dv, dak, dav = _dkv_call(plan, k_span, operands, lse, delta, interpret=interpret)
    total = lambda x: x.sum(axis=(0, 1))
    return dq1, dq2, dk1, dk2, dv, *(total(x) for x in (daq, dak, dav, dcm))

  return on_gpu(call, operands)


def _weight_grads(plan: Plan, scale: float, daq, dak, dav, dcm) -> tuple:
  """The summed folded partials -> (d alpha_q `[H, Ht, P]`, d alpha_k, d alpha_v `[G, Gt,
  P]`, d collapse `[Ho, Ht, P]`, or `[Ht, P]` per head), float32. aq carries the softmax
  `scale`."""
  p, h, g, ho = plan.num_pseudo, plan.heads, plan.kv_heads, plan.out_heads
  alpha = lambda x, s: jnp.transpose(x[:, :p, :s], (2, 0, 1))  # [T, P, S] -> [S, T, P]
  dcollapse = jnp.transpose(dcm[:, :ho, :p], (1, 0, 2))  # [Ht, Ho, P] -> [Ho, Ht, P]
  if plan.per_head:  # collapse [Ht, P] entered as its diagonal [Ho = Ht, Ht, P]
    dcollapse = jnp.einsum("hhp->hp", dcollapse)
  return alpha(daq, h) * scale, alpha(dak, g), alpha(dav, g), dcollapse


def _forward_output(plan: Plan, options: AttentionOptions, q, k, v, alphas, collapse):
  """y `[B, N, Ho, d]` float32: the forward kernel (Triton when lowering for cuda/rocm,
  Pallas' interpreter elsewhere) on `prepare`'s operands."""
  b, n, _, d = q.shape
  operands = prepare(q, k, v, alphas, collapse, options, plan)
  y = on_gpu(functools.partial(_forward_call, plan), operands)
  y = y.reshape(b, plan.num_q, plan.out_rows, plan.width)[:, :, : plan.q_tokens * plan.out_heads]
  return y.reshape(b, -1, plan.out_heads, plan.width)[:, :n, :, :d]


def _backward_output(plan: Plan, options: AttentionOptions, q, k, v, alphas, collapse, dy):
  """The cotangents of q, k, v, alphas, collapse, on chip: the kernels remake the pseudo
  tiles from the source-sized operands (made again here, in XLA) and write source-row
  gradients, which the transpose of `sources` (padding, halves, R(pos * P)) takes back to
  q, k, v."""
  padded, q_span, k_span = backward_plan(plan)
  operands = prepare(q, k, v, alphas, collapse, options, padded)
  rows = _pad_to(dy, -1, plan.width).astype(q.dtype)
  operands["dy"] = _group_rows(rows, plan.q_tokens, padded.num_q, plan.out_rows)
  dq1, dq2, dk1, dk2, dv, *partials = _gradients(padded, q_span, k_span, operands)
  f32 = lambda x: x.astype(jnp.float32)
  _, transpose = jax.vjp(lambda *x: sources(*x, options, padded), f32(q), f32(k), f32(v))
  grads = transpose(dict(q1=dq1, q2=dq2, k1=dk1, k2=dk2, v=dv))
  scale = 1 / math.sqrt(plan.head_dim)
  *dalphas, dcollapse = _weight_grads(plan, scale, *partials)
  return (
    *(g.astype(x.dtype) for g, x in zip(grads, (q, k, v))),
    tuple(g.astype(a.dtype) for g, a in zip(dalphas, alphas)),
    dcollapse.astype(collapse.dtype),
  )


_output = common.saving_the_call(_forward_output, _backward_output)


def window_iha(q, k, v, alphas, collapse, options: AttentionOptions) -> jax.Array:
  """Sliding-window IHA on GPU (`common.window_iha`'s arguments and result): `block_sizes`'
  `block_q` the pseudo rows of a query tile, `block_k` those of a key group (powers of two
  >= 16 and >= P); refuses with `GpuUnsupportedShape`."""
  return common.window_iha(_output, plan_for, q, k, v, alphas, collapse, options)


def plan_for(q, k, alphas, collapse, options: AttentionOptions) -> Plan:
  """The `Plan` of a call (arrays or ShapeDtypeStructs)."""
  return common.plan_for(tiling, q, k, alphas, collapse, options)


def unsupported(q, v, num_pseudo: int, options: AttentionOptions) -> str | None:
  """`common.unsupported` of this path: why it cannot take a call, or None."""
  return common.unsupported(plan_for, q, v, num_pseudo, options)
