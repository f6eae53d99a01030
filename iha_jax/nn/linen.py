"""Flax Linen counterparts of the NNX attention layers, with the same parameter trees.

`params` holds the names `iha_jax.nn.config.param_specs` lays out (`wq, wk, wv, wo`, plus
`alpha_q, alpha_k, alpha_v, collapse` for IHA, ...), boxed in `nn.LogicallyPartitioned`
with their logical axis names (`iha_jax.nn.partitioning.unbox` gives the plain arrays);
the call is the shared `iha_jax.nn.call.apply_layer`, so NNX and Linen compute one
function. A layer checks its fields when it is constructed, as the NNX layers do.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp

from iha_jax.kinds import AttentionConfig
from iha_jax.nn.cache import LayerCache, init_layer_cache
from iha_jax.nn.call import apply_layer
from iha_jax.nn.config import DEFAULT_KERNEL_INIT, layer_config, param_specs

Initializer = jax.nn.initializers.Initializer
_CONFIG_FIELDS = frozenset(f.name for f in dataclasses.fields(AttentionConfig))


def _check_deterministic(value: Any) -> None:
  if value not in (None, True, False):
    raise ValueError(f"deterministic must be None or a bool, got {value!r}")


class _LinenLayer(nn.Module):
  """What every Linen attention layer shares: parameters from `self.config` (a field or a
  property of the subclass), the one call and `init_cache`.

  `__call__(x: [B, N, D], *, mask=None, segment_ids=None, positions=None, layer=None,
  cache=None, deterministic=None, return_probabilities=False, context=None)` as the NNX
  layer's: `[B, N, out_features]`, or `(y, cache)`, or `(y, probabilities)`; dropout
  draws from the "dropout" rng collection (`apply(..., rngs={"dropout": key})`).
  """

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
    context: jax.Array | None = None,
  ) -> Any:
    cfg = self.config
    specs = param_specs(
      cfg, kernel_init=self.kernel_init, mixing_noise_std=getattr(self, "mixing_noise_std", 0.0)
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

    return apply_layer(
      params,
      x,
      cfg,
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


class _AttentionLinen(_LinenLayer):
  """Fields every kind shares; subclasses set `kind` and add the fields only their kind
  reads (named as `AttentionConfig`'s, which validates them all on construction). The
  call is `_LinenLayer`'s.
  """

  kind: ClassVar[str]
  model_dim: int
  num_heads: int
  head_dim: int | None = None  # or qkv_features (below), flax's name for num_heads * head_dim
  num_kv_heads: int | None = None
  window: int | None = None
  causal: bool = True
  dtype: Any = None
  param_dtype: Any = jnp.float32
  implementation: str = "auto"
  kernel_init: Initializer = DEFAULT_KERNEL_INIT
  # Added after the fields above, so that positional construction keeps its meaning.
  window_tokens: int | None = None
  dropout_rate: float = 0.0
  deterministic: bool | None = None
  qk_norm: bool = False
  use_bias: bool = False
  out_features: int | None = None
  qkv_features: int | None = None

  def __post_init__(self):
    self.config  # noqa: B018 - validates every field now, as the NNX layer's constructor
    _check_deterministic(self.deterministic)
    super().__post_init__()

  @property
  def config(self) -> AttentionConfig:
    """The validated layer configuration: this module's `AttentionConfig` fields."""
    fields = {
      f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name in _CONFIG_FIELDS
    }
    return layer_config(
      window_tokens=self.window_tokens, qkv_features=self.qkv_features, kind=self.kind, **fields
    )


class InterleavedHeadAttentionLinen(_AttentionLinen):
  """Linen Interleaved Head Attention; fields, defaults (RoPE on, P = H when `num_pseudo`
  is None, `window` in VIRTUAL tokens) and the call as `InterleavedHeadAttention`."""

  kind: ClassVar[str] = "iha"
  num_pseudo: int | None = None
  rope_theta: float | None = 10000.0
  collapse_mode: str = "full"
  mixing_noise_std: float = 0.0


class MultiHeadAttentionLinen(_AttentionLinen):
  """Linen multi-head attention; fields and semantics as `MultiHeadAttention`."""

  kind: ClassVar[str] = "mha"
  rope_theta: float | None = 10000.0


class TalkingHeadsAttentionLinen(_AttentionLinen):
  """Linen Talking-Heads attention; fields and semantics as `TalkingHeadsAttention`."""

  kind: ClassVar[str] = "talking_heads"
  rope_theta: float | None = 10000.0
  mixing_noise_std: float = 0.0


class DifferentialAttentionLinen(_AttentionLinen):
  """Linen differential attention; fields and semantics as `DifferentialAttention`
  (`__call__` also takes `layer`, overriding the field)."""

  kind: ClassVar[str] = "diff"
  layer: int = 1
  rope_theta: float | None = 10000.0


class SimplicialAttentionLinen(_AttentionLinen):
  """Linen 2-simplicial attention (no RoPE); fields and semantics as
  `SimplicialAttention`."""

  kind: ClassVar[str] = "simplicial"


class AttentionLinen(_LinenLayer):
  """Linen layer of any registered kind (e.g. one a user registered), from its config.

  `AttentionLinen(config)(x: [B, N, D], *, mask=None, segment_ids=None, positions=None,
  layer=None, cache=None, deterministic=None, return_probabilities=False)`; the same
  parameter tree as `Attention.from_config(config, ...)` (NNX).
  """

  config: AttentionConfig
  param_dtype: Any = jnp.float32
  kernel_init: Initializer = DEFAULT_KERNEL_INIT
  mixing_noise_std: float = 0.0
  deterministic: bool | None = None

  def __post_init__(self):
    if not isinstance(self.config, AttentionConfig):
      raise TypeError(f"config must be an AttentionConfig, got {type(self.config).__name__}")
    _check_deterministic(self.deterministic)
    super().__post_init__()
