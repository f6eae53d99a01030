"""Differential attention (Ye et al. 2024, arXiv 2410.05258), a baseline of the paper.

Two softmax maps per head from two query/key pairs, subtracted:

    out = A1 v - lam * A2 v,    A_i = softmax(rope(q_i) rope(k_i)^T / sqrt(d))

with `q, k: [B, N, H, 2, d]` (the pairs on axis 3) and `v: [B, N, H, dv]`. Both maps run
as ONE multi-head attention call over 2H heads (head `2h + i` is map i of head h, v
repeated), so every MHA implementation, the Pallas kernels included, serves it, the two
maps cost exactly what two softmax attentions cost, and a head-sharded call keeps both
maps of a head on one device.

Grouped-query: k `[B, N, G, 2, d]` and v `[B, N, G, dv]` with G dividing H; head h reads
key/value head `h // r` (r = H // G) in both maps. The one MHA call is then grouped-query
too: its 2H query heads are ordered (group, map, member) and its 2G key heads (group,
map), so MHA's own grouping sends map i of head h to keys (h // r, i); for G = H this is
the order above.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from iha_jax.core.options import AttentionOptions


def diff_lambda_init(layer: int | jax.Array) -> jax.Array | float:
  """`0.8 - 0.6 * exp(-0.3 * (layer - 1))`, layer counted from 1 (may be traced)."""
  if isinstance(layer, int):
    return 0.8 - 0.6 * math.exp(-0.3 * (layer - 1))
  return 0.8 - 0.6 * jnp.exp(-0.3 * (jnp.asarray(layer, jnp.float32) - 1.0))


def _query_heads(q: jax.Array, num_kv_heads: int) -> jax.Array:
  """`[B, N, H, 2, d]` -> `[B, N, 2H, d]`, heads ordered (group, map, member)."""
  b, n, h, _, d = q.shape
  r = h // num_kv_heads
  grouped = q.reshape(b, n, num_kv_heads, r, 2, d)
  return jnp.swapaxes(grouped, 3, 4).reshape(b, n, 2 * h, d)


def _map_outputs(out: jax.Array, num_kv_heads: int) -> tuple[jax.Array, jax.Array]:
  """The MHA call's `[B, N, 2H, dv]` (heads as `_query_heads`) -> `A1 v`, `A2 v`
  `[B, N, H, dv]`."""
  b, n, h2, dv = out.shape
  maps = out.reshape(b, n, num_kv_heads, 2, h2 // (2 * num_kv_heads), dv)
  return tuple(maps[:, :, :, i].reshape(b, n, h2 // 2, dv) for i in range(2))


def diff_via_mha(q, k, v, lam, options: AttentionOptions, *, mha: Callable[..., jax.Array]):
  """Both maps as one call of the MHA implementation `mha(q, k, v, options)` over 2H heads
  (`iha_jax.kinds.differential` binds each of MHA's, so the kernels, under shard_map when a
  mesh is current, serve it too)."""
  b, n, h, _, d = q.shape
  g = k.shape[2]
  # Heads of the one MHA call (module docstring); keys may be longer than the queries in
  # a sequence-sharded call.
  q2, k2, v2 = _query_heads(q, g), k.reshape(b, k.shape[1], 2 * g, d), jnp.repeat(v, 2, 2)
  # The options are checked: the MHA implementation directly (keys may differ in length).
  first, second = _map_outputs(mha(q2, k2, v2, options).astype(jnp.float32), g)
  lam = jnp.broadcast_to(jnp.asarray(lam, jnp.float32), (h,))[:, None]
  return (first - lam * second).astype(q.dtype)
