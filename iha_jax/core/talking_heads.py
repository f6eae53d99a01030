"""Talking-Heads attention (Shazeer et al. 2020, arXiv 2003.02436), a baseline of the paper.

Per query and key, the H heads' scaled logits are mixed by `talk_logits [H, H]` before
the (masked) softmax, and the H probability maps by `talk_weights [H, H]` after it:

    J[h]   = rope(q_h) rope(k_h)^T / sqrt(d)
    L[h']  = sum_h talk_logits[h, h'] J[h]          (then the mask)
    W      = softmax(L) over keys, float32
    U[h''] = sum_h' talk_weights[h', h''] W[h']
    out[h''] = U[h''] v_h''

Every step mixes whole score maps across heads, so the online softmax of flash attention
does not apply; the memory-efficient path ("xla") runs the dense math one query block at
a time (`iha_jax.core.query_blocks`), never a `[B, H, N, N]` tensor.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from iha_jax.core.masking import MASK_VALUE
from iha_jax.core.options import AttentionOptions
from iha_jax.core.query_blocks import block_mask, map_query_blocks, plan_query_blocks, zero_padding
from iha_jax.core.rope import apply_rope

_HIGHEST = jax.lax.Precision.HIGHEST
DEFAULT_BLOCK = 128  # queries per block of the XLA path


def _attend(q, k, v, talk_logits, talk_weights, mask, precision):
  """Dense talking-heads math on one block: q `[B, Q, H, d]`, k `[B, S, H, d]`,
  v `[B, S, H, dv]`, mask bool broadcastable to `[B, H, Q, S]` -> float32 `[B, Q, H, dv]`."""
  f32 = lambda x: x.astype(jnp.float32)
  scores = (
    jnp.einsum("bqhd,bshd->bhqs", q, k, precision=precision, preferred_element_type=jnp.float32)
    * q.shape[-1] ** -0.5
  )
  logits = jnp.einsum("bhqs,hg->bgqs", scores, f32(talk_logits), precision=precision)
  weights = jax.nn.softmax(jnp.where(mask, logits, MASK_VALUE), axis=-1)
  mixed = jnp.einsum("bhqs,hg->bgqs", weights, f32(talk_weights), precision=precision)
  return jnp.einsum(
    "bgqs,bsgd->bqgd",
    mixed.astype(v.dtype),
    v,
    precision=precision,
    preferred_element_type=jnp.float32,
  )


def _rotate(q, k, options: AttentionOptions):
  if options.rope_theta is None:
    return q, k
  theta = options.rope_theta
  return apply_rope(q, options.positions, theta), apply_rope(k, options.key_positions, theta)


def talking_heads_reference(q, k, v, talk_logits, talk_weights, options: AttentionOptions):
  """Dense `[B, H, N, N]` math in float32 at highest precision (the test oracle)."""
  dtype = q.dtype
  q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
  q, k = _rotate(q, k, options)
  q_index = options.query_offset + jnp.arange(q.shape[1])
  mask = block_mask(
    q_index,
    jnp.arange(k.shape[1]),
    options.segment_ids,
    options.key_segment_ids,
    options.window,
    options.causal,
  )
  out = _attend(q, k, v, talk_logits, talk_weights, mask, _HIGHEST)
  return zero_padding(out, options.segment_ids).astype(dtype)


def talking_heads_xla(q, k, v, talk_logits, talk_weights, options: AttentionOptions):
  """Query-blocked math: `[B, H, block, slab]` scores at a time, recomputed in backward."""
  window, causal = options.window, options.causal
  q, k = _rotate(q, k, options)
  block = (options.block_sizes.block_q if options.block_sizes else None) or DEFAULT_BLOCK
  plan = plan_query_blocks(
    q.shape[1], block, window, causal, key_length=k.shape[1], q_offset=options.query_offset
  )

  def attend(q_side, k_side, q_index, k_index):
    (q_blk, q_seg), (k_slab, v_slab, k_seg) = q_side, k_side
    mask = block_mask(q_index, k_index, q_seg, k_seg, window, causal)
    return _attend(q_blk, k_slab, v_slab, talk_logits, talk_weights, mask, None).astype(q.dtype)

  keys = (k, v, options.key_segment_ids)
  out = map_query_blocks(attend, plan, (q, options.segment_ids), keys)
  return zero_padding(out, options.segment_ids)
