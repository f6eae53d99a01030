"""Argument checks for the attention entry points.

Everything here runs in Python on static shapes, so bad input fails with a
message naming the argument before anything is traced or compiled.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

IMPLEMENTATIONS = ("reference", "xla", "pallas_tpu", "pallas_gpu", "auto")


def _shape(x: Any) -> tuple[int, ...]:
  return tuple(jnp.shape(x))


def check_qkv(q: jax.Array, k: jax.Array, v: jax.Array) -> None:
  """q, k, v: floating `[B, N, H, d]`, all of one shape and dtype."""
  for name, x in (("q", q), ("k", k), ("v", v)):
    if jnp.ndim(x) != 4:
      raise ValueError(f"{name} must have rank 4 [B, N, H, d], got shape {_shape(x)}.")
    if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
      raise ValueError(f"{name} must be a floating dtype, got {jnp.result_type(x)}.")
  if not _shape(q) == _shape(k) == _shape(v):
    raise ValueError(f"q, k and v must have the same shape [B, N, H, d], got q {_shape(q)}, "
                     f"k {_shape(k)}, v {_shape(v)}.")
  if not jnp.result_type(q) == jnp.result_type(k) == jnp.result_type(v):
    raise ValueError(f"q, k and v must share one dtype, got {jnp.result_type(q)}, "
                     f"{jnp.result_type(k)}, {jnp.result_type(v)}.")


def check_mixing(num_heads: int, alpha_q: jax.Array, alpha_k: jax.Array, alpha_v: jax.Array,
                 collapse: jax.Array) -> int:
  """alpha_*: `[H, H, P]`, collapse `[H, H, P]` or `[H, P]`; returns P."""
  for name, a in (("alpha_q", alpha_q), ("alpha_k", alpha_k), ("alpha_v", alpha_v)):
    s = _shape(a)
    if len(s) != 3 or s[0] != num_heads or s[1] != num_heads:
      raise ValueError(f"{name} must have shape [H, H, P] = [{num_heads}, {num_heads}, P] "
                       f"(H from q), got {s}.")
  num_pseudo = _shape(alpha_q)[2]
  if num_pseudo < 1:
    raise ValueError(f"alpha_q's last axis (num_pseudo P) must be >= 1, got {num_pseudo}.")
  for name, a in (("alpha_k", alpha_k), ("alpha_v", alpha_v)):
    if _shape(a)[2] != num_pseudo:
      raise ValueError(f"{name} has P = {_shape(a)[2]} pseudo-heads but alpha_q has "
                       f"{num_pseudo}; all mixing tensors must share P.")
  full, per_head = (num_heads, num_heads, num_pseudo), (num_heads, num_pseudo)
  if _shape(collapse) not in (full, per_head):
    raise ValueError(f"collapse must have shape {list(full)} (full) or {list(per_head)} "
                     f"(per_head), got {_shape(collapse)}.")
  return num_pseudo


def check_options(q: jax.Array, *, window: int | None, segment_ids: jax.Array | None,
                  positions: jax.Array | None, rope_theta: float | None,
                  implementation: str) -> None:
  """window, segment_ids, positions, rope_theta and implementation against q `[B, N, H, d]`."""
  if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                             or window < 1):
    raise ValueError(f"window must be None (global) or an int >= 1, got {window!r}.")
  batch_tokens = _shape(q)[:2]
  for name, x in (("segment_ids", segment_ids), ("positions", positions)):
    if x is None:
      continue
    if _shape(x) != batch_tokens:
      raise ValueError(f"{name} must have shape [B, N] = {list(batch_tokens)}, "
                       f"got {_shape(x)}.")
    if not jnp.issubdtype(jnp.result_type(x), jnp.integer):
      raise ValueError(f"{name} must be an integer array (int32), got {jnp.result_type(x)}.")
  if rope_theta is not None:
    if not rope_theta > 0:
      raise ValueError(f"rope_theta must be > 0 or None (no RoPE), got {rope_theta!r}.")
    if _shape(q)[-1] % 2:
      raise ValueError(f"RoPE needs an even head_dim d, got d = {_shape(q)[-1]}; "
                       "use an even d or rope_theta=None.")
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, "
                     f"got {implementation!r}.")
