"""Differential attention (Ye et al. 2024, arXiv 2410.05258), a baseline of the paper.

Two softmax maps per head from two query/key pairs, subtracted:

    out = A1 v - lam * A2 v,    A_i = softmax(rope(q_i) rope(k_i)^T / sqrt(d))

with `q, k: [B, N, H, 2, d]` (the pairs on axis 3) and `v: [B, N, H, dv]`. Both maps run
as ONE multi-head attention call over 2H heads (head `2h + i` is map i of head h, v
repeated), so every MHA implementation, the Pallas kernels included, serves it, the two
maps cost exactly what two softmax attentions cost, and a head-sharded call keeps both
maps of a head on one device.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from iha_jax.ops import registry, validation
from iha_jax.ops.attention import mha_attention
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
    q, k: `[B, N, H, 2, d]` projections before RoPE (map i's queries / keys at index i).
    v: `[B, N, H, dv]` (the paper's layer uses dv = 2d).
    lam: a scalar or `[H]` (per head).
    options, **overrides: `AttentionOptions` as `mha_attention` (window in tokens);
      `implementation` is any MHA implementation ("reference", "xla", "pallas_tpu",
      "pallas_gpu", "auto"): both maps run through it.

  Returns:
    `[B, N, H, dv]` in q.dtype; the subtraction is done in float32.
  """
  validation.check_arrays(("q", "k"), (q, k), 5, "[B, N, H, 2, d]")
  if q.shape[3] != 2:
    raise ValueError(
      f"q and k must hold the two maps on axis 3, [B, N, H, 2, d]; got shape {tuple(q.shape)}."
    )
  if jnp.ndim(v) != 4 or tuple(v.shape[:3]) != tuple(q.shape[:3]):
    raise ValueError(
      f"v must have shape [B, N, H, dv] with [B, N, H] = {list(q.shape[:3])} "
      f"from q, got {tuple(jnp.shape(v))}."
    )
  if jnp.result_type(v) != jnp.result_type(q):
    raise ValueError(
      f"q, k and v must share one dtype, got {jnp.result_type(q)} and {jnp.result_type(v)}."
    )
  h = q.shape[2]
  if jnp.ndim(lam) not in (0, 1) or (jnp.ndim(lam) == 1 and jnp.shape(lam)[0] != h):
    raise ValueError(f"lam must be a scalar or [H] = [{h}], got shape {tuple(jnp.shape(lam))}.")
  options = validation.check_options(q, with_overrides(options, overrides))
  fn = registry.lookup("diff", options.implementation)
  return fn(q, k, v, lam, options)


def diff_via_mha(q, k, v, lam, options: AttentionOptions):
  """Both maps as one `mha_attention` call over 2H heads (the same implementation, so the
  kernels, under shard_map when a mesh is current, serve it too)."""
  b, n, h, _, d = q.shape
  # [B, N, H, 2, d] -> [B, N, 2H, d]: head 2h + i is map i of head h.
  out = mha_attention(
    q.reshape(b, n, 2 * h, d), k.reshape(b, n, 2 * h, d), jnp.repeat(v, 2, axis=2), options
  ).astype(jnp.float32)
  lam = jnp.broadcast_to(jnp.asarray(lam, jnp.float32), (h,))[:, None]
  return (out[:, :, 0::2] - lam * out[:, :, 1::2]).astype(q.dtype)
