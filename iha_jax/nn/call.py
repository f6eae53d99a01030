"""The one call of an attention layer, shared by the NNX and Linen modules.

Every use of a layer runs one body (`run_layer`): check the input, cast it and the
parameters to the computation dtype, hand the kind what this use attends with (`Handed`:
projections and options), make the one call into the kind (`_attend`), project out. The
uses differ only in what they hand it:
- the full forward (training, encoding): x itself, to the kind's forward
  (`AttentionKind.core`: its own projections, then its entry point), with key validity,
  packed segments, positions and attention dropout;
- attention probabilities (pictures): the forward, and the same call's weights from the
  kind's entry point asked for them (`registry.attend(..., probabilities=True)`);
- cross-attention (`iha_jax.nn.cross`): queries from x, keys and values from a context;
- the cached call (prefill and decoding, `iha_jax.nn.cache`): queries from x, keys and
  values from the cache's ring and x, then the new tokens written.
Under a mesh with Explicit axes (the default of `jax.make_mesh`) the layer runs in
`jax.sharding.auto_axes`: inside, the compiler places the activations by the logical-axis
rules' constraints, as on an Auto mesh, and the outputs leave with the input's sharding.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax.linen import with_logical_constraint
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import AxisType, PartitionSpec

from iha_jax.kinds import ATTENTION_OUT, project_out, project_qkv, registry
from iha_jax.kinds.config import AttentionConfig
from iha_jax.kinds.mha import MHA
from iha_jax.nn.cache import LayerCache, cached_heads, check_cache, write_cache
from iha_jax.nn.cross import ContextCache, check_context, cross_heads
from iha_jax.nn.functional import (
  Handed,
  check_input,
  mask_segments,
  new_token_validity,
  to_compute_dtype,
)
from iha_jax.parallel.axes import HEADS_AXES


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
  context: jax.Array | ContextCache | None = None,
) -> Any:
  """One call of the layer of `cfg` with parameters `params` on `x: [B, N, D]`
  (`run_layer`, under `auto_axes` on a mesh with Explicit axes), after refusing the
  arguments of another use.

  `dropout_rng`: called, only for a full forward of a layer with `cfg.dropout_rate > 0`,
  for the dropout key (None: deterministic); cached and probability calls never drop out.

  Returns:
    - `y: [B, N, out]` with a `context: [B, M, D]` (or its `ContextCache`): queries from
      x, keys and values from the context, `mask` over the context;
    - `y: [B, N, out]` (no cache, no probabilities): the full forward, with key-validity
      `mask` and attention dropout;
    - `(y, cache)` with a `cache`: each row's next N tokens after the `cache.length[b]`
      it holds, `mask` (flax's key validity over them) marking padding;
    - `(y, probabilities [B, H, T, T])` with `return_probabilities`.
  """
  probabilities = return_probabilities or None
  _refuse_other_uses(mask, segment_ids, positions, layer, cache, probabilities, context)
  dropout_key = None
  if (
    cache is None and not return_probabilities and cfg.dropout_rate > 0 and dropout_rng is not None
  ):
    dropout_key = dropout_rng()
    if context is not None and dropout_key is not None:
      raise ValueError(
        f"context= (cross-attention) has no attention dropout (dropout_rate="
        f"{cfg.dropout_rate}): call it with deterministic=True, or use a layer with "
        "dropout_rate=0"
      )
  inputs = CallInputs(mask, segment_ids, positions, dropout_key, context, cache)
  body = lambda params, x, inputs: run_layer(
    params, x, cfg, inputs, layer=layer, probabilities=return_probabilities
  )
  if not _explicit_mesh():
    return body(params, x, inputs)
  out_sharding = jax.typeof(x).sharding
  if cache is not None:
    out_sharding = (out_sharding, jax.tree.map(lambda a: jax.typeof(a).sharding, cache))
  elif return_probabilities:
    out_sharding = (out_sharding, PartitionSpec(out_sharding.spec[0]))
  return jax.sharding.auto_axes(body, out_sharding=out_sharding)(params, x, inputs)


class CallInputs(NamedTuple):
  """The arrays of one call of the layer besides x (`apply_layer`'s; None where the call
  has none), `dropout_key` the dropout key drawn for a full forward."""

  mask: jax.Array | None = None
  segment_ids: jax.Array | None = None
  positions: jax.Array | None = None
  dropout_key: jax.Array | None = None
  context: jax.Array | ContextCache | None = None
  cache: LayerCache | None = None


def run_layer(
  params: Mapping[str, jax.Array],
  x: jax.Array,
  cfg: AttentionConfig,
  inputs: CallInputs,
  *,
  layer: int | jax.Array | None = None,
  probabilities: bool = False,
) -> Any:
  """The body of every use of the layer (module docstring; arguments as `apply_layer`'s):
  `y: [B, N, out]`, `(y, cache)` or `(y, probabilities)`."""
  mask, segment_ids, positions, dropout_key, context, cache = inputs
  check_input(x, cfg)
  if context is not None:
    check_context(context, x, cfg)
  if cache is not None:
    valid = None if mask is None else new_token_validity(mask, x)
    check_cache(cfg, cache, x, valid)
  params, x = to_compute_dtype(params, x, cfg)
  if cache is not None:
    handed, written = cached_heads(params, x, cfg, cache, valid)
  elif context is not None:
    if not isinstance(context, ContextCache):
      context = jnp.asarray(context, x.dtype)
    handed = cross_heads(params, x, context, cfg, mask)
  else:
    if mask is not None:
      segment_ids = mask_segments(mask, segment_ids, x)
    options = cfg.options(segment_ids=segment_ids, positions=positions, dropout_rng=dropout_key)
    handed = Handed(options)
  y = project_out(params, _attend(params, x, cfg, handed, layer))
  if cache is not None:
    return write_cache(y, cache, written)
  if probabilities:
    weights = Handed(handed.options, project_qkv(params, x))
    return y, _attend(params, x, cfg, weights, layer, probabilities=True)
  return y


def _attend(
  params: Mapping[str, jax.Array],
  x: jax.Array,
  cfg: AttentionConfig,
  handed: Handed,
  layer: int | jax.Array | None,
  *,
  probabilities: bool = False,
) -> jax.Array:
  """The one call into the kind: its forward on x (`handed.heads` None), tagged for remat,
  or its entry point on the handed heads through the registry (MHA's over a "pseudo"
  cache's virtual rows, then the kind's collapse). Per-head outputs `[B, N, H, dv]`, or
  with `probabilities` the attention probabilities `[B, H, T, T]`."""
  record = cfg.record
  if handed.heads is None:
    out = record.core(params, x, cfg, handed.options, cfg.layer if layer is None else layer)
    return checkpoint_name(with_logical_constraint(out, HEADS_AXES), ATTENTION_OUT)
  kind = MHA if handed.pseudo else record
  out = registry.attend(
    kind,
    *kind.entry_arrays(params, *handed.heads, cfg),
    options=handed.options,
    new_tokens=handed.new_tokens,
    probabilities=probabilities,
  )
  return record.collapse(params, cfg, out) if handed.pseudo else out


def _explicit_mesh() -> bool:
  """Whether the current mesh (`jax.set_mesh`) has an Explicit axis."""
  mesh = jax.sharding.get_abstract_mesh()
  return not mesh.empty and AxisType.Explicit in mesh.axis_types


def _refuse_other_uses(mask, segment_ids, positions, layer, cache, probabilities, context):
  """Raises ValueError naming the given arguments that belong to another use of the layer
  than the one `context` (cross-attention) or `cache` (a cached call) asks for."""
  if isinstance(context, ContextCache):
    _refuse("a context cache holds its context's validity; {} with it", mask=mask)
  if context is not None:
    _refuse(
      "context= (cross-attention) takes x, the context and a mask over the context; {} "
      "to self-attention (no context)",
      segment_ids=segment_ids,
      positions=positions,
      layer=layer,
      cache=cache,
      return_probabilities=probabilities,
    )
  if cache is not None:
    _refuse(
      "cache= takes each row's next tokens of one sequence, at positions cache.length + "
      "0, 1, .. (padding: mask=); {} to the full forward (no cache)",
      segment_ids=segment_ids,
      positions=positions,
      return_probabilities=probabilities,
    )


def _refuse(message: str, **arguments: Any) -> None:
  """Raises ValueError, `message` naming those of `arguments` that are not None, if any."""
  given = [name for name, value in arguments.items() if value is not None]
  if given:
    names = ", ".join(given) + (" belong" if len(given) > 1 else " belongs")
    raise ValueError(message.format(names))
