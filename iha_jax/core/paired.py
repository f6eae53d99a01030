"""Paired-head attention (PHA) as MHA over views (docs/design.md §8, "Paired-head attention").

Query heads form H/P groups of P consecutive heads; group j's virtual token `t = n*P + p`
carries head `j*P + p` of token n. A group attends like one MHA head over the `T = N * P`
virtual tokens (section 1's mask rules, RoPE at `pos * P + p`), and its virtual output
`n*P + p` is head `j*P + p`'s output at token n. No mixing: the pseudo-heads are a
transposition of the source heads (`pair_heads`), the collapse its inverse
(`unpair_heads`), and every MHA implementation (kernels included) runs the attention.

Grouped-query attention (G key/value heads, `r = H // G` query heads per key/value head):
member p of group j reads key/value head `(j*P + p) // r`, so group j's key/value virtual
sequence interleaves those heads (`pair_kv_heads`):
- r = 1: the same transposition as the queries (H/P key/value rows);
- P divides r: every member of group j reads head `j // (r/P)`: each key/value token
  repeated P times (G key/value rows; MHA's grouped-query attention over them);
- otherwise: key/value heads repeated to H, then the queries' transposition (H/P rows).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from iha_jax.core.attention import mha_probabilities, mha_reference, mha_xla, virtual_options
from iha_jax.core.options import AttentionOptions


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class Pairing:
  """The static P of a PHA call (no arrays: jit, grad and shard_map see no leaf): query
  heads in groups of `num_pseudo` consecutive heads, `num_pseudo` virtual tokens per token."""

  num_pseudo: int


def pair_heads(x: jax.Array, num_pseudo: int) -> jax.Array:
  """`[B, N, H', d]` -> `[B, N * P, H'/P, d]`: row `n*P + p` of group j is head `j*P + p`."""
  b, n, h, d = x.shape
  grouped = x.reshape(b, n, h // num_pseudo, num_pseudo, d)
  return jnp.swapaxes(grouped, 2, 3).reshape(b, n * num_pseudo, h // num_pseudo, d)


def unpair_heads(y: jax.Array, num_pseudo: int) -> jax.Array:
  """`[B, N * P, H/P, dv]` -> `[B, N, H, dv]`; the inverse of `pair_heads`."""
  b, t, groups, d = y.shape
  split = y.reshape(b, t // num_pseudo, num_pseudo, groups, d)
  return jnp.swapaxes(split, 2, 3).reshape(b, t // num_pseudo, groups * num_pseudo, d)


def paired_kv_heads(num_heads: int, num_kv_heads: int, num_pseudo: int) -> int:
  """Key/value heads of the virtual rows (`pair_kv_heads`): G where P divides `r = H // G`
  (r > 1), else H/P."""
  per_kv = num_heads // num_kv_heads
  return num_kv_heads if per_kv > 1 and per_kv % num_pseudo == 0 else num_heads // num_pseudo


def pair_kv_heads(x: jax.Array, num_heads: int, num_pseudo: int) -> jax.Array:
  """Keys or values `[B, N, G, d]` -> the virtual rows group j reads, `[B, N * P, G', d]`
  (G' = `paired_kv_heads`): row `n*P + p` of the group's key/value head holds head
  `(j*P + p) // (H // G)` of token n (module docstring)."""
  per_kv = num_heads // x.shape[2]
  if per_kv == 1:
    return pair_heads(x, num_pseudo)
  if per_kv % num_pseudo == 0:  # one key/value head per group: each token P times
    return jnp.repeat(x, num_pseudo, axis=1)
  return pair_heads(jnp.repeat(x, per_kv, axis=2), num_pseudo)


def pha_via_mha(q, k, v, pairing: Pairing, options: AttentionOptions, *, mha) -> jax.Array:
  """PHA: q `[B, N, H, d]`, k `[B, Nk, G, d]`, v `[B, Nk, G, dv]` -> `[B, N, H, dv]`, as
  `mha(q, k, v, options)` (an MHA implementation) over the virtual rows (`pair_heads`,
  `pair_kv_heads`, `virtual_options`), then `unpair_heads`. Options checked already."""
  p, h = pairing.num_pseudo, q.shape[2]
  qv = pair_heads(q, p)
  kv, vv = (pair_kv_heads(x, h, p) for x in (k, v))
  return unpair_heads(mha(qv, kv, vv, virtual_options(options, p)), p)


def pha_reference(q, k, v, pairing: Pairing, options: AttentionOptions) -> jax.Array:
  """Dense PHA in float32 at highest precision: `mha_reference` over the virtual rows."""
  return pha_via_mha(q, k, v, pairing, options, mha=mha_reference)


def pha_xla(q, k, v, pairing: Pairing, options: AttentionOptions) -> jax.Array:
  """Blockwise PHA: `mha_xla` over the virtual rows (attention dropout as MHA's)."""
  return pha_via_mha(q, k, v, pairing, options, mha=mha_xla)


def pha_probabilities(q, k, v, pairing: Pairing, options: AttentionOptions) -> jax.Array:
  """PHA's attention probabilities over its `T = N * P` virtual tokens, float32
  `[B, H/P, T, T]`: `probs[b, j, t, s]` is the weight of virtual key s in virtual query t
  of group j (v unused)."""
  p, h = pairing.num_pseudo, q.shape[2]
  kv = pair_kv_heads(k, h, p)
  return mha_probabilities(pair_heads(q, p), kv, None, virtual_options(options, p))
