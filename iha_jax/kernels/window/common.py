"""What IHA's two on-chip window paths share (TPU: `window.tpu`, GPU: `window.gpu`): the
call's static shape (`WindowShape`) and refusals (`UnsupportedShape`), the band
(`in_band`), a sliced call's key side (`key_side`), the block-diagonal constants of mixing
and collapse, RoPE's `R(p)` angles, and the skeleton of the entry and of its custom VJP.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import ClassVar

import jax
import jax.numpy as jnp

from iha_jax.core.options import AttentionOptions
from iha_jax.core.rope import rope_frequencies


class UnsupportedShape(ValueError):
  """A call an on-chip window path cannot take (the materialised pipeline can): one line
  naming the limit and the implementation that takes the call. Each path raises its own
  subclass, which names the path."""

  implementation: ClassVar[str]  # the path's implementation name
  path: ClassVar[str]  # what it is, in words
  fallback: ClassVar[str]  # the materialised pipeline's implementation name

  def __init__(self, limit: str):
    super().__init__(
      f"implementation '{self.implementation}' ({self.path}): {limit}; use "
      f"'{self.fallback}' (the materialised pipeline) or 'auto'"
    )


@dataclasses.dataclass(frozen=True)
class WindowShape:
  """A window call's sizes and mask, the part of both paths' plans that is the call's
  (hashable: a custom_vjp argument)."""

  heads: int  # H: source query heads
  kv_heads: int  # G: source key/value heads
  out_heads: int  # Ho: collapsed heads the call outputs
  targets: int  # Ht: target query heads computed here
  kv_targets: int  # Gt: target key/value heads computed here
  num_pseudo: int  # P
  head_dim: int  # d
  window: int  # virtual rows
  causal: bool
  per_head: bool  # collapse [Ht, P] (else [Ho, Ht, P])
  rotary: bool  # RoPE


def window_shape(
  q_shape: tuple[int, ...],
  kv_heads: int,
  alphas_shape: tuple[tuple[int, ...], ...],
  collapse_shape: tuple[int, ...],
  options: AttentionOptions,
  offset,
  max_head_dim: int,
  refusal: type[UnsupportedShape],
) -> WindowShape:
  """The call's `WindowShape`, or `refusal` (the path's `UnsupportedShape`) for a call
  neither path takes: no window, a traced query offset, an odd head_dim or one over
  `max_head_dim`."""
  _, _, h, d = q_shape
  if options.window is None:
    raise refusal("it takes sliding windows only (window=None is a global layer)")
  if not isinstance(offset, int):
    raise refusal("it needs a static query offset (a window layer's shard has one)")
  (_, ht, p), (_, gt, _) = alphas_shape[0], alphas_shape[1]
  per_head = len(collapse_shape) == 2
  if d % 2 or d > max_head_dim:
    raise refusal(f"head_dim {d}: it takes an even head_dim <= {max_head_dim}")
  return WindowShape(
    heads=h,
    kv_heads=kv_heads,
    out_heads=ht if per_head else collapse_shape[0],
    targets=ht,
    kv_targets=gt,
    num_pseudo=p,
    head_dim=d,
    window=options.window,
    causal=options.causal,
    per_head=per_head,
    rotary=options.rope_theta is not None,
  )


def in_band(delta, window: int, causal: bool):
  """Whether a query sees a key `delta = t - s` virtual rows before it (NumPy or jax
  arrays): `core.masking.visible`'s rule without segments, `0 <= t - s < window` causal,
  `|t - s| < window` bidirectional. The window paths' one statement of the band: the TPU
  score tiles' bias and the GPU kernels' masks."""
  ok = delta < window
  ok &= delta >= 0 if causal else delta > -window
  return ok


def key_side(q: jax.Array, k: jax.Array, options: AttentionOptions) -> tuple[jax.Array, jax.Array]:
  """A sliced call's key segment ids and positions `[B, Nk]`: the options' own, else the
  queries' (keys of the queries' length), else one unpadded sequence `arange(Nk)`."""
  b, nk = k.shape[:2]
  segment_ids, positions = options.key_segment_ids, options.key_positions
  if nk != q.shape[1]:
    if options.kv_segment_ids is None and options.segment_ids is not None:
      raise ValueError(
        f"keys of {nk} tokens for {q.shape[1]} queries need kv_segment_ids [B, {nk}] "
        "when segment_ids are given"
      )
    segment_ids, positions = options.kv_segment_ids, options.kv_positions
  if segment_ids is None:
    segment_ids = jnp.ones((b, nk), jnp.int32)
  if positions is None:
    positions = jnp.broadcast_to(jnp.arange(nk, dtype=jnp.int32), (b, nk))
  return segment_ids, positions


def block_diagonal(weights: jax.Array, s: int) -> jax.Array:
  """`weights [S, T, P]` -> `[T, s*P, s*S]`: per target t, `kron(I_s, weights[:, t, :]^T)`
  (rows (n, p), columns (n', m): the products that map a group of s tokens' source rows
  to its pseudo rows)."""
  eye = jnp.eye(s, dtype=weights.dtype)
  out = jnp.einsum("nN,mtp->tnpNm", eye, weights)
  t, _, p, _, m = out.shape
  return out.reshape(t, s * p, s * m)


def full_collapse(collapse: jax.Array, shape: WindowShape) -> jax.Array:
  """`collapse` as `[Ho, Ht, P]`: a per-head `[Ht, P]` as its diagonal (only ho = h')."""
  if not shape.per_head:
    return collapse
  eye = jnp.eye(shape.targets, dtype=collapse.dtype)
  return jnp.einsum("hp,hg->hgp", collapse, eye)


def pseudo_angles(pseudo: jax.Array, head_dim: int, theta: float) -> jax.Array:
  """RoPE's angles `[rows, d/2]` of `R(p)` for pseudo-head indices p `[rows]` float32: at
  virtual position `pos * P + p` a row is rotated by `R(p) R(pos * P)`, the second on the
  source heads in XLA (source-sized), the first here per pseudo row."""
  return pseudo[:, None] * rope_frequencies(head_dim, theta)


def plan_for(tiling: Callable, q, k, alphas, collapse, options: AttentionOptions, **platform):
  """`tiling(...)`, a path's `Plan`, of a call (arrays or ShapeDtypeStructs): its shapes,
  static query offset and requested blocks; `platform`: the path's own arguments."""
  offset = options.query_offset if (options.sliced or k.shape[1] != q.shape[1]) else 0
  blocks = options.block_sizes
  shapes = (q.shape, k.shape[1], k.shape[2], tuple(a.shape for a in alphas), collapse.shape)
  requested = (blocks and blocks.block_q, blocks and blocks.block_k)
  return tiling(*shapes, options, offset, *requested, **platform)


def unsupported(plan_for: Callable, q, v, num_pseudo: int, options: AttentionOptions):
  """Why a path (its `plan_for`) cannot take a call of q `[B, N, H, d]` and v `[B, Nk, G,
  d]` at P pseudo-heads (full mixing and collapse), or None."""
  h, g = q.shape[2], v.shape[2]
  shape = lambda s: jax.ShapeDtypeStruct(s, jnp.float32)
  alphas = tuple(shape((x, x, num_pseudo)) for x in (h, g, g))
  try:
    plan_for(q, v, alphas, shape((h, h, num_pseudo)), options)
  except UnsupportedShape as error:
    return str(error)
  return None


def window_iha(attend: Callable, plan_for: Callable, q, k, v, alphas, collapse, options):
  """Sliding-window IHA on a path (docs/design.md §8, the on-chip window paths): its
  `plan_for` and `attend(plan, options, q, k, v, alphas, collapse)` -> `[B, N, Ho, d]`
  float32: Ho = H for a full collapse `[H, Ht, P]` (a partial sum over the Ht local target
  heads), Ht for per_head `[Ht, P]`; padding queries output zeros.

  q `[B, N, H, d]`, k and v `[B, Nk, G, d]` source heads (Nk = N unless a sequence shard,
  whose query offset must be static); `alphas = (alpha_q [H, Ht, P], alpha_k [G, Gt, P],
  alpha_v [G, Gt, P])`; `options`: a window (virtual rows), causal or not, segment ids,
  positions, RoPE, and `block_sizes` (the path's tiles). Raises the path's
  `UnsupportedShape` (one line, naming the limit) for calls it cannot take."""
  plan = plan_for(q, k, alphas, collapse, options)
  y = attend(plan, options, q, k, v, tuple(alphas), collapse)
  if options.segment_ids is not None:  # padding queries output zeros
    y = jnp.where((options.segment_ids != 0)[:, :, None, None], y, 0.0)
  return y


def saving_the_call(outputs: Callable, gradients: Callable) -> Callable:
  """`outputs(plan, options, q, k, v, alphas, collapse)` with a custom VJP whose residuals
  are the call's own arrays: nothing P-sized, no padded or rotated copy (the backward
  remakes them, source-sized XLA work). `gradients(plan, options, q, k, v, alphas,
  collapse, dy)` -> the cotangents of q, k, v, alphas, collapse."""

  @functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
  def attend(plan, options, q, k, v, alphas, collapse):
    return outputs(plan, options, q, k, v, alphas, collapse)

  def attend_fwd(plan, options, q, k, v, alphas, collapse):
    y = outputs(plan, options, q, k, v, alphas, collapse)
    return y, (options, q, k, v, alphas, collapse)

  def attend_bwd(plan, residuals, dy):
    options, *arrays = residuals
    return (jax.tree.map(lambda _: None, options), *gradients(plan, options, *arrays, dy))

  attend.defvjp(attend_fwd, attend_bwd)
  return attend
