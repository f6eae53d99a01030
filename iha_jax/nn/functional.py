"""What every use of an attention layer shares (`iha_jax.nn.call.run_layer`): the input
check, the cast to the computation dtype, flax's mask as segment ids, and `Handed`, what
one use hands the kind.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp

from iha_jax.core.options import AttentionOptions
from iha_jax.kinds.config import AttentionConfig
from iha_jax.ops import apply_rope, virtual_positions


class Handed(NamedTuple):
  """What one use of the layer hands the kind (`iha_jax.nn.call.run_layer`).

  Attributes:
    options: the call's options (window, mask, positions, dropout, query offset).
    heads: the projected `(q [B, N, H, d], k, v [B, Nk, G, d])` for the kind's entry
      point (`AttentionKind.entry_arrays`, `registry.attend`); None: the full forward,
      the kind's own projections and entry point on x (`AttentionKind.core`).
    pseudo: the heads are the kind's rotated pseudo-heads over virtual rows (a "pseudo"
      cache): MHA's entry point attends with them, then the kind's `collapse`.
    new_tokens: a cached call's new tokens (`registry.resolve`: one token stays on XLA).
  """

  options: AttentionOptions
  heads: tuple[jax.Array, jax.Array, jax.Array] | None = None
  pseudo: bool = False
  new_tokens: int | None = None


def check_input(x: jax.Array, cfg: AttentionConfig) -> None:
  """Raises ValueError unless `x` is a floating `[B, N, model_dim]` array with N >= 1."""
  if jnp.ndim(x) != 3 or jnp.shape(x)[-1] != cfg.model_dim:
    raise ValueError(
      f"x must have shape [B, N, model_dim={cfg.model_dim}], got {tuple(jnp.shape(x))}"
    )
  if jnp.shape(x)[1] == 0:
    raise ValueError(
      f"x has N = 0 tokens (shape {tuple(jnp.shape(x))}, [B, N, D]): attention needs at "
      "least one token per sequence"
    )
  if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
    raise ValueError(f"x must be a floating array, got dtype {jnp.result_type(x)}")


def to_compute_dtype(
  params: Mapping[str, jax.Array], x: jax.Array, cfg: AttentionConfig
) -> tuple[dict[str, jax.Array], jax.Array]:
  """`params` and `x` cast to the layer's computation dtype: `cfg.dtype`, or the promoted
  dtype of `x` and the parameters when None. Parameters stay stored in param_dtype; the
  whole layer, mixing included, runs in the computation dtype."""
  # `is None`, not `or`: a numpy dtype instance is falsy (len(np.dtype('f4')) == 0).
  dtype = jnp.result_type(x, *params.values()) if cfg.dtype is None else cfg.dtype
  cast = {name: jnp.asarray(value, dtype) for name, value in params.items()}
  return cast, jnp.asarray(x, dtype)


def key_validity(mask: jax.Array, batch: int, length: int, meaning: str) -> jax.Array:
  """Flax's key-validity `mask: [B, 1, 1, L]` (or `[1, 1, 1, L]`; bool or integer, True =
  attend) as `[B, L]` bool; ValueError naming `mask` otherwise, `meaning` saying what a
  mask can mean at this call."""
  shape = tuple(jnp.shape(mask))
  if len(shape) != 4 or shape[0] not in (1, batch) or shape[1:] != (1, 1, length):
    raise ValueError(f"mask of shape {shape}: {meaning}")
  dtype = jnp.result_type(mask)
  if not (dtype == jnp.bool_ or jnp.issubdtype(dtype, jnp.integer)):
    raise ValueError(f"mask must be bool (True = attend) or integer, got dtype {dtype}")
  return jnp.broadcast_to(jnp.asarray(mask)[:, 0, 0, :] != 0, (batch, length))


def mask_segments(mask: jax.Array, segment_ids: jax.Array | None, x: jax.Array) -> jax.Array:
  """Flax's key-validity `mask` (`key_validity`) as segment ids `[B, N]` int32 (with
  `segment_ids` where given): keys where it is False are padding, never seen, with zero
  outputs (flax's layer would still give them one, which a padded position does not use).
  Any other mask (causal, banded) is refused: those are `causal=` and `window=`."""
  b, n = jnp.shape(x)[:2]
  meaning = (
    f"only key validity (padding) is expressible here, a mask [B, 1, 1, N] = [{b}, 1, 1, "
    f"{n}] (valid[:, None, None, :]); causality is causal=, a band is window= (or "
    "window_tokens=), packed sequences are segment_ids=[B, N]"
  )
  valid = key_validity(mask, b, n, meaning)
  base = jnp.ones((b, n), jnp.int32) if segment_ids is None else segment_ids
  return jnp.where(valid, base, 0).astype(jnp.int32)


def new_token_validity(mask: jax.Array, x: jax.Array) -> jax.Array:
  """A cached call's flax key-validity `mask` (`key_validity`) over its new tokens `x: [B,
  N, D]` as `[B, N]` bool: False marks padding (a ragged batch), which takes no position,
  is never seen and writes nothing."""
  b, n = jnp.shape(x)[:2]
  meaning = (
    f"with cache=, mask marks which new tokens are real (padding False), [B, 1, 1, N] = "
    f"[{b}, 1, 1, {n}] (valid[:, None, None, :])"
  )
  return key_validity(mask, b, n, meaning)


def rotated_pseudo_heads(
  params: Mapping[str, jax.Array],
  cfg: AttentionConfig,
  which: str,
  x: jax.Array,
  positions: jax.Array,
) -> jax.Array:
  """Source heads `x: [B, N, H', d]` of projection `which` ("q", "k", "v") -> the kind's
  pseudo-heads (`AttentionKind.pseudo_heads`), rotated at virtual positions `pos*P + p`
  (`positions: [B, N]` token positions) when the layer has RoPE: `[B, N*P, H', d]`
  (`[B, N, H', d]` for MHA)."""
  xv = cfg.record.pseudo_heads(params, cfg, which, x)
  if cfg.rope_theta is None:
    return xv
  return apply_rope(xv, virtual_positions(positions, cfg.record.num_pseudo(cfg)), cfg.rope_theta)
