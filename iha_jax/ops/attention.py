"""IHA and MHA: the public entry points and their reference and XLA implementations.

Both run one pipeline on a flat sequence: IHA mixes source heads into P pseudo-heads,
interleaves them into `T = N * P` virtual tokens, applies RoPE at virtual positions,
attends (causal or bidirectional), de-interleaves and collapses; MHA is the same
pipeline without the mixing (P = 1). `implementation` picks one entry of
`iha_jax.ops.registry`, and every entry computes the same function.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from iha_jax.ops import registry, validation
from iha_jax.ops.interleave import deinterleave, interleave, virtual_positions, virtual_segment_ids
from iha_jax.ops.mixing import collapse_from_virtual, collapse_heads, mix_to_virtual, pseudo_mix
from iha_jax.ops.options import BlockSizes
from iha_jax.ops.reference import dense_attention
from iha_jax.ops.rope import apply_rope, rope_tables, rotate
from iha_jax.ops.xla_attention import flash_attention_heads_major

_HIGHEST = jax.lax.Precision.HIGHEST


def resolve_implementation(implementation: str, kind: str = "iha") -> str:
  """ "auto" -> the fused Pallas kernels on TPU / GPU where `kind` has them, else "xla"."""
  return registry.resolve(kind, implementation)


def iha_attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  alpha_q: jax.Array,
  alpha_k: jax.Array,
  alpha_v: jax.Array,
  collapse: jax.Array,
  *,
  window: int | None = None,
  segment_ids: jax.Array | None = None,
  positions: jax.Array | None = None,
  rope_theta: float | None = 10000.0,
  causal: bool = True,
  implementation: str = "auto",
  block_sizes: BlockSizes | None = None,
) -> jax.Array:
  """Interleaved Head Attention core (docs/design.md, "The math").

  Args:
    q, k, v: source-head projections before RoPE, `[B, N, H, d]`.
    alpha_q, alpha_k, alpha_v: mixing weights `[H, H, P]` (source, target, pseudo).
    collapse: `[H, H, P]` (full) or `[H, P]` (per_head).
    window: sliding window in virtual tokens (`t - s < window`; `|t - s| < window`
      when not causal), None = global.
    segment_ids: `[B, N]` int32 packed-sequence ids; 0 = padding (zero output).
    positions: `[B, N]` int32 token positions (default `arange(N)`).
    rope_theta: RoPE base, None disables RoPE.
    causal: virtual query t sees keys `s <= t`; False: every key of its segment
      (bidirectional, for encoders).
    implementation: "reference", "xla", "pallas_tpu", "pallas_gpu" or "auto".
    block_sizes: optional tile sizes for the blockwise implementations.

  Returns:
    `[B, N, H, d]` in q.dtype, before the output projection.
  """
  validation.check_qkv(q, k, v)
  validation.check_mixing(q.shape[2], alpha_q, alpha_k, alpha_v, collapse)
  validation.check_options(
    q,
    window=window,
    segment_ids=segment_ids,
    positions=positions,
    rope_theta=rope_theta,
    causal=causal,
  )
  fn = registry.lookup("iha", implementation)
  return fn(
    q,
    k,
    v,
    alpha_q,
    alpha_k,
    alpha_v,
    collapse,
    window=window,
    segment_ids=segment_ids,
    positions=validation.default_positions(q, positions),
    rope_theta=rope_theta,
    causal=causal,
    block_sizes=block_sizes,
  )


def mha_attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  *,
  window: int | None = None,
  segment_ids: jax.Array | None = None,
  positions: jax.Array | None = None,
  rope_theta: float | None = 10000.0,
  causal: bool = True,
  implementation: str = "auto",
  block_sizes: BlockSizes | None = None,
) -> jax.Array:
  """Standard multi-head attention with the same conventions as `iha_attention`.

  Args and returns as `iha_attention`, without mixing; `window` is in tokens. v may be
  wider than q and k (`[B, N, H, dv]`, returned as `[B, N, H, dv]`).
  """
  validation.check_qkv(q, k, v, value_width=True)
  validation.check_options(
    q,
    window=window,
    segment_ids=segment_ids,
    positions=positions,
    rope_theta=rope_theta,
    causal=causal,
  )
  fn = registry.lookup("mha", implementation)
  return fn(
    q,
    k,
    v,
    window=window,
    segment_ids=segment_ids,
    positions=validation.default_positions(q, positions),
    rope_theta=rope_theta,
    causal=causal,
    block_sizes=block_sizes,
  )


# --- Implementations (registry entries): arguments checked, positions defaulted. ----------


def _reference_core(q, k, v, *, segment_ids, positions, rope_theta, window, causal):
  """Rotate and attend `[B, T, H, d]` with the dense oracle; positions `[B, T]`."""
  if rope_theta is not None:
    q, k = apply_rope(q, positions, rope_theta), apply_rope(k, positions, rope_theta)
  return dense_attention(q, k, v, segment_ids=segment_ids, window=window, causal=causal)


def _xla_core(q, k, v, *, segment_ids, positions, rope_theta, window, causal, block_sizes):
  """Rotate and attend head-major virtual sequences `[B, H, T, d]`; positions `[B, T]`."""
  if rope_theta is not None:
    cos, sin = rope_tables(positions, q.shape[-1], rope_theta)  # shared by q and k
    cos, sin = cos[:, None], sin[:, None]
    q, k = rotate(q, cos, sin), rotate(k, cos, sin)
  blocks = block_sizes or BlockSizes()
  return flash_attention_heads_major(
    q,
    k,
    v,
    segment_ids=segment_ids,
    window=window,
    causal=causal,
    block_q=blocks.block_q,
    block_k=blocks.block_k,
  )


def iha_reference(
  q,
  k,
  v,
  alpha_q,
  alpha_k,
  alpha_v,
  collapse,
  *,
  window,
  segment_ids,
  positions,
  rope_theta,
  causal,
  block_sizes=None,
):
  """Dense IHA in float32 at highest precision (`block_sizes` unused)."""
  del block_sizes
  num_pseudo = alpha_q.shape[2]
  qv, kv, vv = (
    interleave(pseudo_mix(x, a, precision=_HIGHEST))
    for x, a in ((q, alpha_q), (k, alpha_k), (v, alpha_v))
  )
  vseg = None if segment_ids is None else virtual_segment_ids(segment_ids, num_pseudo)
  out = _reference_core(
    qv,
    kv,
    vv,
    segment_ids=vseg,
    positions=virtual_positions(positions, num_pseudo),
    rope_theta=rope_theta,
    window=window,
    causal=causal,
  )
  return collapse_heads(deinterleave(out, num_pseudo), collapse, precision=_HIGHEST)


def iha_xla(
  q,
  k,
  v,
  alpha_q,
  alpha_k,
  alpha_v,
  collapse,
  *,
  window,
  segment_ids,
  positions,
  rope_theta,
  causal,
  block_sizes=None,
):
  """Blockwise IHA on head-major virtual sequences, the layout the XLA core tiles."""
  num_pseudo = alpha_q.shape[2]
  qv, kv, vv = (mix_to_virtual(x, a) for x, a in ((q, alpha_q), (k, alpha_k), (v, alpha_v)))
  vseg = None if segment_ids is None else virtual_segment_ids(segment_ids, num_pseudo)
  out = _xla_core(
    qv,
    kv,
    vv,
    segment_ids=vseg,
    positions=virtual_positions(positions, num_pseudo),
    rope_theta=rope_theta,
    window=window,
    causal=causal,
    block_sizes=block_sizes,
  )
  return collapse_from_virtual(out, collapse, num_pseudo)


def mha_reference(q, k, v, *, window, segment_ids, positions, rope_theta, causal, block_sizes=None):
  """Dense MHA in float32 at highest precision (`block_sizes` unused)."""
  del block_sizes
  return _reference_core(
    q,
    k,
    v,
    segment_ids=segment_ids,
    positions=positions,
    rope_theta=rope_theta,
    window=window,
    causal=causal,
  )


def mha_xla(q, k, v, *, window, segment_ids, positions, rope_theta, causal, block_sizes=None):
  """Blockwise MHA (the XLA core on head-major `[B, H, N, d]`)."""
  heads_major = lambda x: jnp.swapaxes(x, 1, 2)
  out = _xla_core(
    heads_major(q),
    heads_major(k),
    heads_major(v),
    segment_ids=segment_ids,
    positions=positions,
    rope_theta=rope_theta,
    window=window,
    causal=causal,
    block_sizes=block_sizes,
  )
  return heads_major(out)
