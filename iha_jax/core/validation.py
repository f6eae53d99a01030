"""Argument checks and defaults for the attention entry points.

Everything here runs in Python on static shapes, so bad input fails with a
message naming the argument before anything is traced or compiled.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from iha_jax.checks import is_int, is_traced
from iha_jax.core.options import AttentionOptions, BlockSizes


def _shape(x: Any) -> tuple[int, ...]:
  return tuple(jnp.shape(x))


def check_arrays(
  names: Sequence[str],
  arrays: Sequence[jax.Array],
  rank: int,
  layout: str,
  *,
  same_shape: bool = True,
  prefix: int = 3,
) -> None:
  """Floating arrays of `rank` and one dtype; `same_shape`: all of one shape, else one
  shape prefix of `prefix` axes (`[B, N, H]`: the last axis may differ, e.g. v's width
  `dv`; `[B, N]`: the head counts may differ too, e.g. grouped-query k and v)."""
  for name, x in zip(names, arrays):
    if jnp.ndim(x) != rank:
      raise ValueError(f"{name} must have rank {rank} {layout}, got shape {_shape(x)}.")
    if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
      raise ValueError(f"{name} must be a floating dtype, got {jnp.result_type(x)}.")
  listed = f"{', '.join(names[:-1])} and {names[-1]}"
  shapes = [_shape(x) if same_shape else _shape(x)[:prefix] for x in arrays]
  if any(s != shapes[0] for s in shapes):
    axes = ", ".join(layout.strip("[]").split(", ")[:prefix])
    what = "the same shape" if same_shape else f"the same [{axes}]"
    got = ", ".join(f"{n} {_shape(x)}" for n, x in zip(names, arrays))
    raise ValueError(f"{listed} must have {what} {layout}, got {got}.")
  dtypes = [jnp.result_type(x) for x in arrays]
  if any(t != dtypes[0] for t in dtypes):
    raise ValueError(f"{listed} must share one dtype, got {', '.join(str(t) for t in dtypes)}.")


def check_qkv(
  q: jax.Array, k: jax.Array, v: jax.Array, *, value_width: bool = False, sliced: bool = False
) -> int:
  """q: floating `[B, N, H, d]`; k: `[B, N, G, d]` and v `[B, N, G, d]` (with `value_width`
  `[B, N, G, dv]`) of q's dtype, G dividing H (grouped-query attention: query head h reads
  key/value head `h // (H // G)`; G = H is multi-head, G = 1 multi-query); `sliced`: k and v
  may hold another number of tokens Nk (queries at an offset into longer keys). Returns G."""
  prefix = 1 if sliced else 2
  check_arrays(("q", "k", "v"), (q, k, v), 4, "[B, N, H, d]", same_shape=False, prefix=prefix)
  what = "[B, N, G, dv]" if value_width else "[B, N, G, d]"
  check_arrays(("k", "v"), (k, v), 4, what, same_shape=not value_width)
  if _shape(k)[3] != _shape(q)[3]:
    raise ValueError(
      f"q and k must share the head width d, got q {_shape(q)} and k {_shape(k)} ([B, N, H, d], "
      "[B, N, G, d])."
    )
  return check_kv_heads(_shape(q)[2], _shape(k)[2])


def check_head_axis(q: jax.Array, num_heads: int, source: str) -> None:
  """Raises ValueError for q `[B, H, N, d]` (heads on axis 1) where `[B, N, H, d]` is
  expected: q's axis 2 is not the H = `num_heads` of `source` but its axis 1 is."""
  shape = _shape(q)
  if len(shape) == 4 and shape[2] != num_heads and shape[1] == num_heads:
    raise ValueError(
      f"q {shape} looks laid out [B, H, N, d] (axis 1 has the H = {num_heads} heads of "
      f"{source}); the entry points take [B, N, H, d]: pass jnp.swapaxes(q, 1, 2), and k, v "
      "likewise."
    )


def check_kv_heads(num_heads: int, num_kv_heads: int, names: str = "k and v") -> int:
  """Raises ValueError unless `num_kv_heads` G divides `num_heads` H; returns G."""
  if num_kv_heads < 1 or num_heads % num_kv_heads:
    raise ValueError(
      f"{names} have G = {num_kv_heads} key/value heads, which does not divide the H = "
      f"{num_heads} query heads of q; use a G that divides H (G = H: multi-head, G = 1: "
      "multi-query)."
    )
  return num_kv_heads


def check_mixing(
  num_heads: int,
  alpha_q: jax.Array,
  alpha_k: jax.Array,
  alpha_v: jax.Array,
  collapse: jax.Array,
  num_kv_heads: int | None = None,
) -> int:
  """alpha_q: `[H, H, P]`, alpha_k and alpha_v `[G, G, P]` (G = `num_kv_heads`, default H),
  collapse `[H, H, P]` or `[H, P]`; returns P."""
  g = num_heads if num_kv_heads is None else num_kv_heads
  for name, a, heads, source in (
    ("alpha_q", alpha_q, num_heads, "H from q"),
    ("alpha_k", alpha_k, g, "G from k"),
    ("alpha_v", alpha_v, g, "G from v"),
  ):
    s = _shape(a)
    if len(s) != 3 or s[0] != heads or s[1] != heads:
      axes = "H, H" if name == "alpha_q" else "G, G"
      raise ValueError(
        f"{name} must have shape [{axes}, P] = [{heads}, {heads}, P] ({source}), got {s}."
      )
  num_pseudo = _shape(alpha_q)[2]
  if num_pseudo < 1:
    raise ValueError(f"alpha_q's last axis (num_pseudo P) must be >= 1, got {num_pseudo}.")
  for name, a in (("alpha_k", alpha_k), ("alpha_v", alpha_v)):
    if _shape(a)[2] != num_pseudo:
      raise ValueError(
        f"{name} has P = {_shape(a)[2]} pseudo-heads but alpha_q has "
        f"{num_pseudo}; all mixing tensors must share P."
      )
  full, per_head = (num_heads, num_heads, num_pseudo), (num_heads, num_pseudo)
  if _shape(collapse) not in (full, per_head):
    raise ValueError(
      f"collapse must have shape {list(full)} (full) or {list(per_head)} "
      f"(per_head), got {_shape(collapse)}."
    )
  return num_pseudo


def check_options(q: jax.Array, options: AttentionOptions) -> AttentionOptions:
  """`options` checked against q `[B, N, H, ...]`, with `positions` defaulted (`arange(N)`
  per row): what every implementation receives."""
  window, causal, rope_theta = options.window, options.causal, options.rope_theta
  if _shape(q)[1] == 0:
    raise ValueError(
      f"q has N = 0 tokens (shape {_shape(q)}, [B, N, H, d]): attention needs at least one "
      "token per sequence."
    )
  if is_traced(window):
    raise ValueError(
      f"window must be a static Python int, got a traced value ({window!r}): it sets the band "
      "of key tiles at trace time; pass it as a static argument (jax.jit(..., static_argnames="
      "'window')) or close over it."
    )
  if window is not None and not is_int(window, 1):
    raise ValueError(f"window must be None (global) or an int >= 1, got {window!r}.")
  if not isinstance(causal, bool):
    raise ValueError(f"causal must be a bool (True: causal, False: bidirectional), got {causal!r}.")
  rate = options.dropout_rate
  if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate < 1:
    raise ValueError(f"dropout_rate must be a number in [0, 1), got {rate!r}.")
  if rate and options.dropout_rng is None:
    raise ValueError(f"dropout_rate={rate} needs dropout_rng, a PRNG key (jax.random.key).")
  if options.block_sizes is not None and not isinstance(options.block_sizes, BlockSizes):
    raise ValueError(f"block_sizes must be a BlockSizes or None, got {options.block_sizes!r}.")
  _check_token_arrays(options, ("segment_ids", "positions"), _shape(q)[:2], "[B, N]")
  if rope_theta is not None:
    if not rope_theta > 0:
      raise ValueError(f"rope_theta must be > 0 or None (no RoPE), got {rope_theta!r}.")
    if _shape(q)[-1] % 2:
      raise ValueError(
        f"RoPE needs an even head_dim d, got d = {_shape(q)[-1]}; use an even d or rope_theta=None."
      )
  return dataclasses.replace(options, positions=default_positions(q, options.positions))


def check_key_side(k: jax.Array, options: AttentionOptions) -> None:
  """A call whose queries sit at an offset into longer keys k `[B, Nk, ...]`: the keys'
  `kv_segment_ids` and `kv_positions` are `[B, Nk]` integers, `query_offset` an int >= 0
  or an int32 scalar."""
  _check_token_arrays(options, ("kv_segment_ids", "kv_positions"), _shape(k)[:2], "[B, Nk]")
  offset = options.query_offset
  if (isinstance(offset, int) and not is_int(offset, 0)) or jnp.ndim(offset) != 0:
    raise ValueError(f"query_offset must be an int >= 0 or an int32 scalar, got {offset!r}.")


def _check_token_arrays(
  options: AttentionOptions, names: Sequence[str], batch_tokens: tuple[int, ...], layout: str
) -> None:
  """The options' arrays `names` (where given) are integers of shape `batch_tokens`."""
  for name in names:
    x = getattr(options, name)
    if x is None:
      continue
    if _shape(x) != batch_tokens:
      raise ValueError(f"{name} must have shape {layout} = {list(batch_tokens)}, got {_shape(x)}.")
    if not jnp.issubdtype(jnp.result_type(x), jnp.integer):
      raise ValueError(f"{name} must be an integer array (int32), got {jnp.result_type(x)}.")


def default_positions(q: jax.Array, positions: jax.Array | None) -> jax.Array:
  """`positions`, or `arange(N)` per row of q `[B, N, ...]`, int32 `[B, N]`."""
  if positions is not None:
    return positions
  b, n = q.shape[:2]
  return jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n))
