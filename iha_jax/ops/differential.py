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
from typing import Any

import jax
import jax.numpy as jnp

from iha_jax.ops import registry, validation
from iha_jax.ops.options import AttentionOptions, with_overrides


def diff_lambda_init(layer: int | jax.Array) -> jax.Array | float:
  """`0.8 - 0.6 * exp(-0.3 * (layer - 1))`, layer counted from 1 (may be traced)."""
  if isinstance(layer, int):
    return 0.8 - 0.6 * math.exp(-0.3 * (layer - 1))
  return 0.8 - 0.6 * jnp.exp(-0.3 * (jnp.asarray(layer, jnp.float32) - 1.0))


def diff_attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  lam: jax.Array | float,
  options: AttentionOptions | None = None,
  **overrides: Any,
) -> jax.Array:
  """Differential attention `A1 v - lam * A2 v` (before the layer's norm and scale).

  Args:
    q: `[B, N, H, 2, d]` projections before RoPE (map i's queries at index i).
    k: `[B, N, G, 2, d]` (map i's keys at index i), G dividing H: grouped-query
      differential attention, head h reading key/value head `h // (H // G)` in both maps.
    v: `[B, N, G, dv]` (the paper's layer uses dv = 2d).
    lam: a scalar or `[H]` (per head).
    options, **overrides: `AttentionOptions` as `mha_attention` (window in tokens);
      `implementation` is any MHA implementation ("reference", "xla", "pallas_tpu",
      "pallas_gpu", "auto"): both maps run through it.

  Returns:
    `[B, N, H, dv]` in q.dtype; the subtraction is done in float32.
  """
  validation.check_arrays(("q", "k"), (q, k), 5, "[B, N, H, 2, d]", same_shape=False, prefix=2)
  if q.shape[3] != 2 or k.shape[3] != 2 or q.shape[4] != k.shape[4]:
    raise ValueError(
      "q and k must hold the two maps on axis 3, [B, N, H, 2, d] and [B, N, G, 2, d]; got "
      f"q {tuple(q.shape)} and k {tuple(k.shape)}."
    )
  g = validation.check_kv_heads(q.shape[2], k.shape[2], "k")
  if jnp.ndim(v) != 4 or tuple(v.shape[:3]) != (*q.shape[:2], g):
    raise ValueError(
      f"v must have shape [B, N, G, dv] with [B, N, G] = {[*q.shape[:2], g]} "
      f"from q and k, got {tuple(jnp.shape(v))}."
    )
  if jnp.result_type(v) != jnp.result_type(q):
    raise ValueError(
      f"q, k and v must share one dtype, got {jnp.result_type(q)} and {jnp.result_type(v)}."
    )
  h = q.shape[2]
  if jnp.ndim(lam) not in (0, 1) or (jnp.ndim(lam) == 1 and jnp.shape(lam)[0] != h):
    raise ValueError(f"lam must be a scalar or [H] = [{h}], got shape {tuple(jnp.shape(lam))}.")
  options = validation.check_options(q, with_overrides(options, overrides))
  fn = registry.lookup("diff", options.implementation, q)
  return fn(q, k, v, lam, options)


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


def diff_via_mha(q, k, v, lam, options: AttentionOptions):
  """Both maps as one `mha_attention` call over 2H heads (the same implementation, so the
  kernels, under shard_map when a mesh is current, serve it too)."""
  b, n, h, _, d = q.shape
  g = k.shape[2]
  # Heads of the one MHA call (module docstring); keys may be longer than the queries in
  # a sequence-sharded call.
  q2, k2, v2 = _query_heads(q, g), k.reshape(b, k.shape[1], 2 * g, d), jnp.repeat(v, 2, 2)
  # The options are checked: the MHA implementation directly (keys may differ in length).
  mha = registry.lookup("mha", options.implementation, q2, v2, options)
  first, second = _map_outputs(mha(q2, k2, v2, options).astype(jnp.float32), g)
  lam = jnp.broadcast_to(jnp.asarray(lam, jnp.float32), (h,))[:, None]
  return (first - lam * second).astype(q.dtype)
