"""Public entry points: `iha_attention` and `mha_attention` (IHA_SPEC section 3).

Both run one pipeline on a flat causal sequence: IHA mixes source heads into P
pseudo-heads, interleaves them into `T = N * P` virtual tokens, applies RoPE at
virtual positions, attends, de-interleaves and collapses; MHA is the same
pipeline without the mixing (P = 1). `implementation` picks only the attention
core, so every implementation computes the same function.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from iha_jax.ops import validation
from iha_jax.ops.interleave import (deinterleave, interleave, virtual_positions,
                                    virtual_segment_ids)
from iha_jax.ops.mixing import collapse_from_virtual, collapse_heads, mix_to_virtual, pseudo_mix
from iha_jax.ops.reference import dense_attention
from iha_jax.ops.rope import apply_rope, rope_tables, rotate
from iha_jax.ops.xla_attention import flash_attention_heads_major

_HIGHEST = jax.lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tile edges, in virtual tokens, for the blockwise implementations (None = default).

  The fused Pallas kernels tile whole tokens: their blocks must be multiples of P
  (token tile = block / P, used by the forward and both backward kernels), with
  GPU token tiles powers of two and TPU query tiles multiples of 8 (16 for
  2-byte dtypes) and key tiles multiples of 128 tokens.
  """
  block_q: int | None = None
  block_k: int | None = None


def resolve_implementation(implementation: str) -> str:
  """"auto" -> the fused Pallas kernels on TPU / GPU, the XLA path elsewhere (CPU)."""
  if implementation != "auto":
    return implementation
  return {"tpu": "pallas_tpu", "gpu": "pallas_gpu"}.get(jax.default_backend(), "xla")


def _xla_core(q, k, v, *, segment_ids, positions, rope_theta, window, block_sizes):
  """Rotate and attend head-major virtual sequences `[B, H, T, d]`; positions `[B, T]`."""
  if rope_theta is not None:
    cos, sin = rope_tables(positions, q.shape[-1], rope_theta)  # shared by q and k
    cos, sin = cos[:, None], sin[:, None]
    q, k = rotate(q, cos, sin), rotate(k, cos, sin)
  blocks = block_sizes or BlockSizes()
  return flash_attention_heads_major(q, k, v, segment_ids=segment_ids, window=window,
                                     block_q=blocks.block_q, block_k=blocks.block_k)


def _reference_core(q, k, v, *, segment_ids, positions, rope_theta, window):
  """Rotate and attend `[B, T, H, d]` with the dense oracle; positions `[B, T]`."""
  if rope_theta is not None:
    q, k = apply_rope(q, positions, rope_theta), apply_rope(k, positions, rope_theta)
  return dense_attention(q, k, v, segment_ids=segment_ids, window=window)


def _pallas():
  """The kernels package, imported lazily: ops sits below kernels in the layering."""
  from iha_jax import kernels  # pylint: disable=import-outside-toplevel
  return kernels


def _default_positions(q, positions):
  """`arange(N)` per row unless given; segment_ids stay None (cheaper masks)."""
  if positions is not None:
    return positions
  b, n = q.shape[:2]
  return jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n))


def iha_attention(q: jax.Array, k: jax.Array, v: jax.Array, alpha_q: jax.Array,
                  alpha_k: jax.Array, alpha_v: jax.Array, collapse: jax.Array, *,
                  window: int | None = None, segment_ids: jax.Array | None = None,
                  positions: jax.Array | None = None, rope_theta: float | None = 10000.0,
                  implementation: str = "auto",
                  block_sizes: BlockSizes | None = None) -> jax.Array:
  """Interleaved Head Attention core (IHA_SPEC 1.2-1.6).

  Args:
    q, k, v: source-head projections before RoPE, `[B, N, H, d]`.
    alpha_q, alpha_k, alpha_v: mixing weights `[H, H, P]` (source, target, pseudo).
    collapse: `[H, H, P]` (full) or `[H, P]` (per_head).
    window: sliding window in virtual tokens (`t - s < window`), None = global.
    segment_ids: `[B, N]` int32 packed-sequence ids; 0 = padding (zero output).
    positions: `[B, N]` int32 token positions (default `arange(N)`).
    rope_theta: RoPE base, None disables RoPE.
    implementation: "reference", "xla", "pallas_tpu", "pallas_gpu" or "auto".
    block_sizes: optional tile sizes for the blockwise implementations.

  Returns:
    `[B, N, H, d]` in q.dtype, before the output projection.
  """
  validation.check_qkv(q, k, v)
  num_pseudo = validation.check_mixing(q.shape[2], alpha_q, alpha_k, alpha_v, collapse)
  validation.check_options(q, window=window, segment_ids=segment_ids, positions=positions,
                           rope_theta=rope_theta, implementation=implementation)
  implementation = resolve_implementation(implementation)
  positions = _default_positions(q, positions)
  if implementation.startswith("pallas_"):
    # Fused kernels take the source heads and build pseudo-heads on chip.
    if segment_ids is None:
      segment_ids = jnp.ones(q.shape[:2], jnp.int32)
    return _pallas().iha_attention(
        q, k, v, alpha_q, alpha_k, alpha_v, collapse, window=window,
        segment_ids=segment_ids, positions=positions, rope_theta=rope_theta,
        platform=implementation.removeprefix("pallas_"), block_sizes=block_sizes)
  vpos = virtual_positions(positions, num_pseudo)
  vseg = None if segment_ids is None else virtual_segment_ids(segment_ids, num_pseudo)
  if implementation == "reference":
    qv, kv, vv = (interleave(pseudo_mix(x, a, precision=_HIGHEST))
                  for x, a in ((q, alpha_q), (k, alpha_k), (v, alpha_v)))
    out = _reference_core(qv, kv, vv, segment_ids=vseg, positions=vpos, rope_theta=rope_theta,
                          window=window)
    return collapse_heads(deinterleave(out, num_pseudo), collapse, precision=_HIGHEST)
  # xla: head-major virtual sequences, the layout the blockwise core tiles.
  qv, kv, vv = (mix_to_virtual(x, a) for x, a in ((q, alpha_q), (k, alpha_k), (v, alpha_v)))
  out = _xla_core(qv, kv, vv, segment_ids=vseg, positions=vpos, rope_theta=rope_theta,
                  window=window, block_sizes=block_sizes)
  return collapse_from_virtual(out, collapse, num_pseudo)


def mha_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, window: int | None = None,
                  segment_ids: jax.Array | None = None, positions: jax.Array | None = None,
                  rope_theta: float | None = 10000.0, implementation: str = "auto",
                  block_sizes: BlockSizes | None = None) -> jax.Array:
  """Standard causal multi-head attention with the same conventions as `iha_attention`.

  Args and returns as `iha_attention`, without mixing; `window` is in tokens.
  """
  validation.check_qkv(q, k, v)
  validation.check_options(q, window=window, segment_ids=segment_ids, positions=positions,
                           rope_theta=rope_theta, implementation=implementation)
  implementation = resolve_implementation(implementation)
  positions = _default_positions(q, positions)
  if implementation.startswith("pallas_"):
    if segment_ids is None:
      segment_ids = jnp.ones(q.shape[:2], jnp.int32)
    return _pallas().mha_attention(
        q, k, v, window=window, segment_ids=segment_ids, positions=positions,
        rope_theta=rope_theta, platform=implementation.removeprefix("pallas_"),
        block_sizes=block_sizes)
  if implementation == "reference":
    return _reference_core(q, k, v, segment_ids=segment_ids, positions=positions,
                           rope_theta=rope_theta, window=window)
  heads_major = lambda x: jnp.swapaxes(x, 1, 2)
  out = _xla_core(heads_major(q), heads_major(k), heads_major(v), segment_ids=segment_ids,
                  positions=positions, rope_theta=rope_theta, window=window,
                  block_sizes=block_sizes)
  return heads_major(out)
