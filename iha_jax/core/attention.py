"""IHA and MHA: their reference and XLA implementations (pure functions).

Both run one pipeline on a flat sequence: IHA mixes source heads into P pseudo-heads,
interleaves them into `T = N * P` virtual tokens, applies RoPE at virtual positions,
attends (causal or bidirectional), de-interleaves and collapses; MHA is the same
pipeline without the mixing (P = 1). The kinds' records (`iha_jax.kinds.iha`, `.mha`)
name these functions among their implementations and hold the checked entry points.

Grouped-query attention (docs/design.md §9): k and v may have G heads, G dividing the H
query heads; query head h reads key/value head `h // (H // G)`. IHA then mixes query heads
among themselves (`alpha_q: [H, H, P]`) and key/value heads among themselves
(`alpha_k, alpha_v: [G, G, P]`), and pseudo-query (h, p) attends over the pseudo-keys of
key/value head `h // (H // G)`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from iha_jax.core.grouped import grouped_attention_heads_major, grouped_attention_probabilities
from iha_jax.core.interleave import deinterleave, interleave, virtual_positions, virtual_segment_ids
from iha_jax.core.masking import Mask
from iha_jax.core.mixing import collapse_from_virtual, collapse_heads, mix_to_virtual, pseudo_mix
from iha_jax.core.options import AttentionOptions, BlockSizes
from iha_jax.core.reference import dense_attention
from iha_jax.core.rope import rope_tables, rotate

_HIGHEST = jax.lax.Precision.HIGHEST


# --- Implementations: options checked, positions defaulted. ---------------------------


class _Sequences(NamedTuple):
  """The mask and RoPE inputs of one call in its sequence units (virtual tokens for IHA):
  segment ids and positions of queries `[B, Tq]` and keys `[B, Tk]`, and the first
  query's index minus the first key's (0 unless the call is `options.sliced`)."""

  q_segment: jax.Array | None
  k_segment: jax.Array | None
  q_position: jax.Array
  k_position: jax.Array
  q_offset: Any


def _sequences(options: AttentionOptions, num_pseudo: int = 1) -> _Sequences:
  """`options`' ids / positions (and the key side's) in virtual tokens `n*P + p`."""

  def segments(ids):
    return ids if ids is None or num_pseudo == 1 else virtual_segment_ids(ids, num_pseudo)

  def positions(pos):
    return pos if num_pseudo == 1 else virtual_positions(pos, num_pseudo)

  return _Sequences(
    segments(options.segment_ids),
    segments(options.key_segment_ids),
    positions(options.positions),
    positions(options.key_positions),
    options.query_offset * num_pseudo,
  )


def _rotate_pair(q, k, options: AttentionOptions, seq: _Sequences, head_axis: int):
  """RoPE on q and k at their positions (one table when they share them)."""
  if options.rope_theta is None:
    return q, k
  d = q.shape[-1]
  tables = rope_tables(seq.q_position, d, options.rope_theta)
  k_tables = tables if not options.sliced else rope_tables(seq.k_position, d, options.rope_theta)
  expand = lambda t: tuple(jnp.expand_dims(x, head_axis) for x in t)
  return rotate(q, *expand(tables)), rotate(k, *expand(k_tables))


def _mask(options: AttentionOptions, seq: _Sequences, num_queries: int) -> Mask:
  """The call's `Mask` on its flat sequence: a sliced call's keys carry their own ids and
  its queries sit at `seq.q_offset`."""
  mask = Mask(causal=options.causal, window=options.window, segment_ids=seq.q_segment)
  if not options.sliced:
    return mask
  q_index = seq.q_offset + jnp.arange(num_queries, dtype=jnp.int32)
  return mask.replace(kv_segment_ids=seq.k_segment, q_index=q_index)


def _reference_core(q, k, v, options: AttentionOptions, seq: _Sequences):
  """Rotate and attend `[B, T, H, d]` with the dense oracle."""
  q, k = _rotate_pair(q, k, options, seq, head_axis=2)
  return dense_attention(q, k, v, _mask(options, seq, q.shape[1]))


def _xla_core(q, k, v, options: AttentionOptions, seq: _Sequences):
  """Rotate and attend head-major sequences `[B, H, T, d]`."""
  q, k = _rotate_pair(q, k, options, seq, head_axis=1)
  blocks = options.block_sizes or BlockSizes()
  return grouped_attention_heads_major(
    q,
    k,
    v,
    _mask(options, seq, q.shape[2]),
    block_q=blocks.block_q,
    block_k=blocks.block_k,
    dropout_rate=options.dropout_rate,
    dropout_rng=options.dropout_rng,
  )


def iha_reference(q, k, v, alpha_q, alpha_k, alpha_v, collapse, options: AttentionOptions):
  """Dense IHA in float32 at highest precision (`block_sizes` unused)."""
  num_pseudo = alpha_q.shape[2]
  qv, kv, vv = (
    interleave(pseudo_mix(x, a, precision=_HIGHEST))
    for x, a in ((q, alpha_q), (k, alpha_k), (v, alpha_v))
  )
  out = _reference_core(qv, kv, vv, options, _sequences(options, num_pseudo))
  return collapse_heads(deinterleave(out, num_pseudo), collapse, precision=_HIGHEST)


def iha_xla(q, k, v, alpha_q, alpha_k, alpha_v, collapse, options: AttentionOptions):
  """Blockwise IHA on head-major virtual sequences, the layout the XLA core tiles."""
  num_pseudo = alpha_q.shape[2]
  qv, kv, vv = (mix_to_virtual(x, a) for x, a in ((q, alpha_q), (k, alpha_k), (v, alpha_v)))
  out = _xla_core(qv, kv, vv, options, _sequences(options, num_pseudo))
  return collapse_from_virtual(out, collapse, num_pseudo)


def iha_via_mha(q, k, v, alpha_q, alpha_k, alpha_v, collapse, options: AttentionOptions, *, mha):
  """IHA as materialised pseudo q `[B, N * P, H, d]`, k/v `[B, N * P, G, d]` and an MHA
  implementation `mha(q, k, v, options)` over the virtual sequence (virtual segment ids and
  positions; the window, in virtual tokens, and the block sizes carry over). Autodiff
  saves the P-sized pseudo q/k/v here; the Pallas kernels (`iha_jax.kernels.flash.attention`) mix
  the same way but remake them in the backward."""
  num_pseudo = alpha_q.shape[2]
  qv, kv, vv = (interleave(pseudo_mix(x, a)) for x, a in ((q, alpha_q), (k, alpha_k), (v, alpha_v)))
  # Options checked already: the MHA implementation itself (sliced keys may be longer).
  out = mha(qv, kv, vv, virtual_options(options, num_pseudo))
  return collapse_heads(deinterleave(out, num_pseudo), collapse)


def virtual_options(options: AttentionOptions, num_pseudo: int) -> AttentionOptions:
  """`options` of a call over tokens as the options of an MHA call over its `T = N * P`
  virtual rows: segment ids repeated P times, positions `pos * P + p`, the query offset
  times P (and the key side's ids and positions when `options.sliced`); the window (in
  virtual tokens already), the tiles and the rest carry over. Positions defaulted."""
  seq = _sequences(options, num_pseudo)
  return options.replace(
    segment_ids=seq.q_segment,
    positions=seq.q_position,
    query_offset=seq.q_offset,
    kv_segment_ids=seq.k_segment if options.sliced else None,
    kv_positions=seq.k_position if options.sliced else None,
  )


def mha_reference(q, k, v, options: AttentionOptions):
  """Dense MHA in float32 at highest precision (`block_sizes` unused)."""
  return _reference_core(q, k, v, options, _sequences(options))


def mha_xla(q, k, v, options: AttentionOptions):
  """Blockwise MHA (the XLA core on head-major `[B, H, N, d]`)."""
  heads_major = lambda x: jnp.swapaxes(x, 1, 2)
  out = _xla_core(*(heads_major(x) for x in (q, k, v)), options, _sequences(options))
  return heads_major(out)


# --- Attention probabilities (pictures): the XLA core's weights, dense in keys. --------


def _probabilities(q, k, options: AttentionOptions, seq: _Sequences) -> jax.Array:
  """Rotate `[B, T, H, d]` queries and keys, then the weights of the XLA core over them,
  float32 `[B, H, T, T]` at highest precision."""
  q, k = _rotate_pair(q, k, options, seq, head_axis=2)
  heads_major = lambda x: jnp.swapaxes(x, 1, 2)
  mask = _mask(options, seq, q.shape[1])
  return grouped_attention_probabilities(heads_major(q), heads_major(k), mask, precision=_HIGHEST)


def iha_probabilities(q, k, v, alpha_q, alpha_k, alpha_v, collapse, options: AttentionOptions):
  """IHA's attention probabilities over its `T = N * P` virtual tokens, float32
  `[B, H, T, T]`: `probs[b, h, t, s]` is the weight of pseudo-key s in pseudo-query t of
  head h (`iha_xla`'s core under the same mask; padding rows zeros). v, alpha_v and
  collapse are unused: arguments as every IHA implementation's."""
  num_pseudo = alpha_q.shape[2]
  qv, kv = (interleave(pseudo_mix(x, a)) for x, a in ((q, alpha_q), (k, alpha_k)))
  return _probabilities(qv, kv, options, _sequences(options, num_pseudo))


def mha_probabilities(q, k, v, options: AttentionOptions):
  """MHA's attention probabilities, float32 `[B, H, N, N]` (`iha_probabilities` at P = 1;
  v unused)."""
  return _probabilities(q, k, options, _sequences(options))
