"""Flax Linen counterpart of the NNX attention layers: `AttentionLinen(config)`, the same
parameter tree and call.

`params` holds the names `iha_jax.nn.config.param_specs` lays out (`wq, wk, wv, wo`, plus
`alpha_q, alpha_k, alpha_v, collapse` for IHA, ...), boxed in `nn.LogicallyPartitioned`
with their logical axis names (`iha_jax.nn.partitioning.unbox` gives the plain arrays);
the call is the shared `iha_jax.nn.call.apply_layer`, so NNX and Linen compute one
function. The per-kind names of earlier versions (`InterleavedHeadAttentionLinen(D, H,
d, ...)`, ...) still build it, with a DeprecationWarning.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from iha_jax.checks import warn_deprecated
from iha_jax.kinds import AttentionConfig
from iha_jax.nn.cache import LayerCache, init_layer_cache
from iha_jax.nn.config import DEFAULT_KERNEL_INIT, layer_config, param_specs
from iha_jax.nn.cross import ContextCache, cache_context
from iha_jax.nn.eager import call_layer

Initializer = jax.nn.initializers.Initializer


class AttentionLinen(nn.Module):
  """Linen attention layer of any registered kind, from its `AttentionConfig` (checked on
  construction); the same parameter tree as `Attention(config=config, ...)` (NNX).

  `AttentionLinen(config)(x: [B, N, D], *, mask=None, segment_ids=None, positions=None,
  layer=None, cache=None, deterministic=None, return_probabilities=False, context=None)`
  as the NNX layer's call: `[B, N, out_features]`, or `(y, cache)`, or `(y,
  probabilities)`; dropout draws from the "dropout" rng collection (`apply(...,
  rngs={"dropout": key})`).
  """

  config: AttentionConfig
  param_dtype: Any = jnp.float32
  kernel_init: Initializer = DEFAULT_KERNEL_INIT
  mixing_noise_std: float = 0.0
  deterministic: bool | None = None

  def __post_init__(self):
    if not isinstance(self.config, AttentionConfig):
      raise TypeError(f"config must be an AttentionConfig, got {type(self.config).__name__}")
    if self.deterministic not in (None, True, False):
      raise ValueError(f"deterministic must be None or a bool, got {self.deterministic!r}")
    super().__post_init__()

  @nn.compact
  def __call__(
    self,
    x: jax.Array,
    *,
    mask: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    positions: jax.Array | None = None,
    layer: int | jax.Array | None = None,
    cache: LayerCache | None = None,
    deterministic: bool | None = None,
    return_probabilities: bool = False,
    context: jax.Array | ContextCache | None = None,
  ) -> Any:
    specs = param_specs(
      self.config, kernel_init=self.kernel_init, mixing_noise_std=self.mixing_noise_std
    )
    params = {
      name: self.param(
        name, nn.with_logical_partitioning(spec.init, spec.axes), spec.shape, self.param_dtype
      )
      for name, spec in specs.items()
    }

    def dropout_rng() -> jax.Array | None:
      if nn.merge_param("deterministic", self.deterministic, deterministic):
        return None
      return self.make_rng("dropout")

    return call_layer(
      params,
      x,
      self.config,
      mask=mask,
      segment_ids=segment_ids,
      positions=positions,
      layer=layer,
      cache=cache,
      dropout_rng=dropout_rng,
      return_probabilities=return_probabilities,
      context=context,
    )

  def init_cache(
    self, batch: int, max_len: int, *, mode: str = "source", dtype: Any = None
  ) -> LayerCache:
    """An empty `LayerCache` for `batch` rows of at most `max_len` tokens each (no
    parameters needed: callable on an unbound module)."""
    return init_layer_cache(self.config, batch, max_len, mode, dtype)

  def cache_context(
    self, context: jax.Array, *, mask: jax.Array | None = None, mode: str = "source"
  ) -> ContextCache:
    """The keys and values of `context: [B, M, D]` projected once, for every call over it
    (`layer.apply(variables, x, context=cache)`), as the NNX layer's; run it bound:
    `layer.apply(variables, context, method="cache_context")`."""
    params = nn.meta.unbox(self.variables["params"])
    return cache_context(params, context, self.config, mask, mode)


# The deprecated per-kind constructors: their fields in their order (positional calls),
# those every kind shared, then the kind's own.
_SHARED_FIELDS = tuple(
  "model_dim num_heads head_dim num_kv_heads window causal dtype param_dtype implementation "
  "kernel_init window_tokens dropout_rate deterministic qk_norm use_bias out_features "
  "qkv_features".split()
)
_MODULE_FIELDS = ("param_dtype", "kernel_init", "mixing_noise_std", "deterministic")


def _deprecated_linen(name: str, kind: str, *own_fields: str) -> Callable[..., AttentionLinen]:
  """The per-kind Linen constructor `name` of earlier versions: its fields (positional or
  keywords) -> `AttentionLinen(layer_config(kind=kind, ...), ...)`, warning once. The
  module's class keeps the old name, so that Linen's automatic names (`name_0`), and with
  them parameter trees, stay as they were."""
  named = type(name, (AttentionLinen,), {"__module__": __name__, "__doc__": AttentionLinen.__doc__})
  fields = _SHARED_FIELDS + own_fields

  def build(*args: Any, **kwargs: Any) -> AttentionLinen:
    warn_deprecated(name, f"AttentionLinen(AttentionConfig(..., kind={kind!r}))")
    if len(args) > len(fields):
      raise TypeError(f"{name} takes at most {len(fields)} positional fields, got {len(args)}")
    twice = sorted(set(fields[: len(args)]) & set(kwargs))
    unknown = sorted(set(kwargs) - set(fields) - {"parent", "name"})
    if twice or unknown:
      raise TypeError(f"{name}: keyword(s) {twice or unknown} given twice or unknown; {fields}")
    kwargs.update(zip(fields, args))
    module = {key: kwargs.pop(key) for key in (*_MODULE_FIELDS, "parent", "name") if key in kwargs}
    return named(layer_config(kind=kind, **kwargs), **module)

  build.__name__ = build.__qualname__ = name
  build.__doc__ = f"Deprecated: `AttentionLinen(AttentionConfig(..., kind={kind!r}))`."
  return build


InterleavedHeadAttentionLinen = _deprecated_linen(
  "InterleavedHeadAttentionLinen",
  "iha",
  "num_pseudo",
  "rope_theta",
  "collapse_mode",
  "mixing_noise_std",
)
MultiHeadAttentionLinen = _deprecated_linen("MultiHeadAttentionLinen", "mha", "rope_theta")
TalkingHeadsAttentionLinen = _deprecated_linen(
  "TalkingHeadsAttentionLinen", "talking_heads", "rope_theta", "mixing_noise_std"
)
DifferentialAttentionLinen = _deprecated_linen(
  "DifferentialAttentionLinen", "diff", "layer", "rope_theta"
)
SimplicialAttentionLinen = _deprecated_linen("SimplicialAttentionLinen", "simplicial")
