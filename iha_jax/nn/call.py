"""The one call of an attention layer, shared by the NNX and Linen modules.

`apply_layer` serves every use of a layer: the full forward (training, encoding), the
full forward plus its attention probabilities (pictures), and the cached call (prefill
and decoding, `iha_jax.nn.cache`). Under a mesh with Explicit axes (the default of
`jax.make_mesh`) the layer runs in `jax.sharding.auto_axes`: inside, the compiler places
the activations by the logical-axis rules' constraints, as on an Auto mesh, and the
outputs leave with the input's sharding.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
from jax.sharding import AxisType, PartitionSpec

from iha_jax.kinds.config import AttentionConfig
from iha_jax.nn.cache import LayerCache, cached_attention
from iha_jax.nn.cross import cross_attention
from iha_jax.nn.functional import attention_forward, layer_attention_probabilities


def explicit_mesh() -> bool:
  """Whether the current mesh (`jax.set_mesh`) has an Explicit axis."""
  mesh = jax.sharding.get_abstract_mesh()
  return not mesh.empty and AxisType.Explicit in mesh.axis_types


def _on_auto_axes(fn: Callable[..., Any], out_sharding: Callable[[], Any], *args: Any) -> Any:
  """`fn(*args)`, inside `auto_axes` on a mesh with Explicit axes (module docstring), its
  outputs sharded as `out_sharding()` says."""
  if not explicit_mesh():
    return fn(*args)
  return jax.sharding.auto_axes(fn, out_sharding=out_sharding())(*args)


def _sharding(x: Any) -> Any:
  return jax.typeof(x).sharding


def _refuse(message: str, **arguments: Any) -> None:
  """Raises ValueError, `message` naming the given ones, if any of `arguments` is not
  None."""
  given = [name for name, value in arguments.items() if value is not None]
  if given:
    raise ValueError(message.format(", ".join(given)))


def apply_layer(
  params: Mapping[str, jax.Array],
  x: jax.Array,
  cfg: AttentionConfig,
  *,
  mask: jax.Array | None = None,
  segment_ids: jax.Array | None = None,
  positions: jax.Array | None = None,
  layer: int | jax.Array | None = None,
  cache: LayerCache | None = None,
  dropout_rng: Callable[[], jax.Array | None] | None = None,
  return_probabilities: bool = False,
  context: jax.Array | None = None,
) -> Any:
  """One call of the layer of `cfg` with parameters `params` on `x: [B, N, D]`.

  `dropout_rng`: called, only for a full forward of a layer with `cfg.dropout_rate > 0`,
  for the dropout key (None: deterministic); cached and probability calls never drop out.

  Returns:
    - `y: [B, N, out]` with a `context: [B, M, D]` (`iha_jax.nn.cross.cross_attention`):
      queries from x, keys and values from the context, `mask` over the context;
    - `y: [B, N, out]` (no cache, no probabilities): the full forward
      (`attention_forward`), with key-validity `mask` and attention dropout;
    - `(y, cache)` with a `cache` (`iha_jax.nn.cache.cached_attention`): the next N
      tokens of every row after the `cache.length` it holds;
    - `(y, probabilities [B, H, T, T])` with `return_probabilities`
      (`layer_attention_probabilities`).
  """
  probabilities = return_probabilities or None
  if context is not None:
    _refuse(
      "context= (cross-attention) takes x, the context and a mask over the context; {} "
      "belong to self-attention (no context)",
      segment_ids=segment_ids,
      positions=positions,
      layer=layer,
      cache=cache,
      return_probabilities=probabilities,
    )
    if cfg.dropout_rate > 0 and dropout_rng is not None and dropout_rng() is not None:
      raise ValueError(
        f"context= (cross-attention) has no attention dropout (dropout_rate="
        f"{cfg.dropout_rate}): call it with deterministic=True, or use a layer with "
        "dropout_rate=0"
      )
    fn = lambda p, x, c, m: cross_attention(p, x, c, cfg, mask=m)
    return _on_auto_axes(fn, lambda: _sharding(x), params, x, context, mask)
  if cache is not None:
    _refuse(
      "cache= takes the next tokens of one unpadded sequence per row, at positions "
      "cache.length + arange(N); {} belong to the full forward (no cache)",
      mask=mask,
      segment_ids=segment_ids,
      positions=positions,
      return_probabilities=probabilities,
    )
    out_sharding = lambda: (_sharding(x), jax.tree.map(_sharding, cache))
    fn = lambda p, x, c: cached_attention(p, x, cfg, c)
    return _on_auto_axes(fn, out_sharding, params, x, cache)
  arrays = dict(mask=mask, segment_ids=segment_ids, positions=positions)
  forward = lambda p, x, a, rng: attention_forward(p, x, cfg, layer=layer, dropout_rng=rng, **a)
  if not return_probabilities:
    key = dropout_rng() if dropout_rng is not None and cfg.dropout_rate > 0 else None
    return _on_auto_axes(forward, lambda: _sharding(x), params, x, arrays, key)

  def with_probabilities(p, x, a):
    return forward(p, x, a, None), layer_attention_probabilities(p, x, cfg, **a)

  out_sharding = lambda: (_sharding(x), PartitionSpec(_sharding(x).spec[0]))
  return _on_auto_axes(with_probabilities, out_sharding, params, x, arrays)
