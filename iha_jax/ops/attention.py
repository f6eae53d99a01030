"""IHA and MHA: the public entry points and their reference and XLA implementations.

Both run one pipeline on a flat sequence: IHA mixes source heads into P pseudo-heads,
interleaves them into `T = N * P` virtual tokens, applies RoPE at virtual positions,
attends (causal or bidirectional), de-interleaves and collapses; MHA is the same
pipeline without the mixing (P = 1). `implementation` picks one entry of
`iha_jax.ops.registry`, and every entry computes the same function.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from iha_jax.ops import registry, validation
from iha_jax.ops.interleave import deinterleave, interleave, virtual_positions, virtual_segment_ids
from iha_jax.ops.mixing import collapse_from_virtual, collapse_heads, mix_to_virtual, pseudo_mix
from iha_jax.ops.options import AttentionOptions, BlockSizes, with_overrides
from iha_jax.ops.reference import dense_attention
from iha_jax.ops.rope import apply_rope, rope_tables, rotate
from iha_jax.ops.xla_attention import flash_attention_heads_major

_HIGHEST = jax.lax.Precision.HIGHEST


def resolve_implementation(implementation: str, kind: str = "iha") -> str:
  """ "auto" -> the fused Pallas kernels on TPU / GPU where `kind` has them, else "xla".

  This is the answer without a call's arrays: on GPU a call may pick "cudnn" or
  "pallas_gpu_mha" instead (`registry.resolve`)."""
  return registry.resolve(kind, implementation)


def iha_attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  alpha_q: jax.Array,
  alpha_k: jax.Array,
  alpha_v: jax.Array,
  collapse: jax.Array,
  options: AttentionOptions | None = None,
  **overrides: Any,
) -> jax.Array:
  """Interleaved Head Attention core (docs/design.md, "The math").

  Args:
    q, k, v: source-head projections before RoPE, `[B, N, H, d]`.
    alpha_q, alpha_k, alpha_v: mixing weights `[H, H, P]` (source, target, pseudo).
    collapse: `[H, H, P]` (full) or `[H, P]` (per_head).
    options: the shared options (`AttentionOptions`; `window` in VIRTUAL tokens here).
    **overrides: any `AttentionOptions` field as a keyword (`window=`, `segment_ids=`,
      `positions=`, `rope_theta=`, `causal=`, `block_sizes=`, `implementation=`),
      applied over `options`.

  Returns:
    `[B, N, H, d]` in q.dtype, before the output projection.
  """
  options = with_overrides(options, overrides)
  validation.check_qkv(q, k, v)
  validation.check_mixing(q.shape[2], alpha_q, alpha_k, alpha_v, collapse)
  options = validation.check_options(q, options)
  fn = registry.lookup("iha", options.implementation, q, v, options, alpha_q.shape[2])
  return fn(q, k, v, alpha_q, alpha_k, alpha_v, collapse, options)


def mha_attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  options: AttentionOptions | None = None,
  **overrides: Any,
) -> jax.Array:
  """Standard multi-head attention with the same conventions as `iha_attention`.

  Args and returns as `iha_attention`, without mixing; `window` is in tokens. v may be
  wider than q and k (`[B, N, H, dv]`, returned as `[B, N, H, dv]`).
  """
  options = with_overrides(options, overrides)
  validation.check_qkv(q, k, v, value_width=True)
  options = validation.check_options(q, options)
  fn = registry.lookup("mha", options.implementation, q, v, options)
  return fn(q, k, v, options)


# --- Implementations (registry entries): options checked, positions defaulted. ----------


def _reference_core(q, k, v, options: AttentionOptions, segment_ids, positions):
  """Rotate and attend `[B, T, H, d]` with the dense oracle; ids / positions `[B, T]`."""
  if options.rope_theta is not None:
    q, k = (apply_rope(x, positions, options.rope_theta) for x in (q, k))
  return dense_attention(
    q, k, v, segment_ids=segment_ids, window=options.window, causal=options.causal
  )


def _xla_core(q, k, v, options: AttentionOptions, segment_ids, positions):
  """Rotate and attend head-major sequences `[B, H, T, d]`; ids / positions `[B, T]`."""
  if options.rope_theta is not None:
    cos, sin = rope_tables(positions, q.shape[-1], options.rope_theta)  # shared by q and k
    cos, sin = cos[:, None], sin[:, None]
    q, k = rotate(q, cos, sin), rotate(k, cos, sin)
  blocks = options.block_sizes or BlockSizes()
  return flash_attention_heads_major(
    q,
    k,
    v,
    segment_ids=segment_ids,
    window=options.window,
    causal=options.causal,
    block_q=blocks.block_q,
    block_k=blocks.block_k,
  )


def _virtual(options: AttentionOptions, num_pseudo: int) -> tuple[jax.Array | None, jax.Array]:
  """Segment ids and positions of the virtual sequence `[B, N * P]`."""
  segment_ids = options.segment_ids
  if segment_ids is not None:
    segment_ids = virtual_segment_ids(segment_ids, num_pseudo)
  return segment_ids, virtual_positions(options.positions, num_pseudo)


def iha_reference(q, k, v, alpha_q, alpha_k, alpha_v, collapse, options: AttentionOptions):
  """Dense IHA in float32 at highest precision (`block_sizes` unused)."""
  num_pseudo = alpha_q.shape[2]
  qv, kv, vv = (
    interleave(pseudo_mix(x, a, precision=_HIGHEST))
    for x, a in ((q, alpha_q), (k, alpha_k), (v, alpha_v))
  )
  out = _reference_core(qv, kv, vv, options, *_virtual(options, num_pseudo))
  return collapse_heads(deinterleave(out, num_pseudo), collapse, precision=_HIGHEST)


def iha_xla(q, k, v, alpha_q, alpha_k, alpha_v, collapse, options: AttentionOptions):
  """Blockwise IHA on head-major virtual sequences, the layout the XLA core tiles."""
  num_pseudo = alpha_q.shape[2]
  qv, kv, vv = (mix_to_virtual(x, a) for x, a in ((q, alpha_q), (k, alpha_k), (v, alpha_v)))
  out = _xla_core(qv, kv, vv, options, *_virtual(options, num_pseudo))
  return collapse_from_virtual(out, collapse, num_pseudo)


def iha_via_mha(
  q, k, v, alpha_q, alpha_k, alpha_v, collapse, options: AttentionOptions, *, mha: str
):
  """IHA as materialised pseudo q/k/v `[B, N * P, H, d]` and the MHA implementation `mha`
  over the virtual sequence (virtual segment ids and positions; the window, in virtual
  tokens, and the block sizes carry over). Faster on GPU than the fused kernels, which
  rebuild every pseudo tile from all H source heads per tile pair (docs/performance.md
  §12), for P-times larger activations."""
  num_pseudo = alpha_q.shape[2]
  qv, kv, vv = (interleave(pseudo_mix(x, a)) for x, a in ((q, alpha_q), (k, alpha_k), (v, alpha_v)))
  segment_ids, positions = _virtual(options, num_pseudo)
  inner = options.replace(segment_ids=segment_ids, positions=positions, implementation=mha)
  out = mha_attention(qv, kv, vv, inner)
  return collapse_heads(deinterleave(out, num_pseudo), collapse)


def mha_reference(q, k, v, options: AttentionOptions):
  """Dense MHA in float32 at highest precision (`block_sizes` unused)."""
  return _reference_core(q, k, v, options, options.segment_ids, options.positions)


def mha_xla(q, k, v, options: AttentionOptions):
  """Blockwise MHA (the XLA core on head-major `[B, H, N, d]`)."""
  heads_major = lambda x: jnp.swapaxes(x, 1, 2)
  out = _xla_core(
    *(heads_major(x) for x in (q, k, v)), options, options.segment_ids, options.positions
  )
  return heads_major(out)
