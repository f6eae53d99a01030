"""Flax Linen counterparts of the NNX attention layers, with the same parameter trees.

`params` holds the names `iha_jax.nn.config.param_specs` lays out (`wq, wk, wv, wo`, plus
`alpha_q, alpha_k, alpha_v, collapse` for IHA, ...), boxed in `nn.LogicallyPartitioned`
with their logical axis names; the forward pass is the shared `attention_forward`, so
NNX and Linen compute one function.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp

from iha_jax.kinds import AttentionConfig
from iha_jax.nn.config import DEFAULT_KERNEL_INIT, param_specs
from iha_jax.nn.functional import attention_forward

Initializer = jax.nn.initializers.Initializer
_CONFIG_FIELDS = frozenset(f.name for f in dataclasses.fields(AttentionConfig))


class _AttentionLinen(nn.Module):
  """Fields every kind shares; subclasses set `kind` and add the fields only their kind
  reads (named as `AttentionConfig`'s, which validates them all).

  `__call__(x: [B, N, D], *, segment_ids=None, positions=None) -> [B, N, D]`.
  """

  kind: ClassVar[str]
  model_dim: int
  num_heads: int
  head_dim: int
  num_kv_heads: int | None = None
  window: int | None = None
  causal: bool = True
  dtype: Any = None
  param_dtype: Any = jnp.float32
  implementation: str = "auto"
  kernel_init: Initializer = DEFAULT_KERNEL_INIT

  @property
  def config(self) -> AttentionConfig:
    """The validated layer configuration: this module's `AttentionConfig` fields."""
    fields = {
      f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name in _CONFIG_FIELDS
    }
    return AttentionConfig(kind=self.kind, **fields)

  @nn.compact
  def __call__(
    self,
    x: jax.Array,
    *,
    segment_ids: jax.Array | None = None,
    positions: jax.Array | None = None,
    layer: int | jax.Array | None = None,
  ) -> jax.Array:
    config = self.config
    specs = param_specs(
      config, kernel_init=self.kernel_init, mixing_noise_std=getattr(self, "mixing_noise_std", 0.0)
    )
    params = {
      name: self.param(
        name, nn.with_logical_partitioning(spec.init, spec.axes), spec.shape, self.param_dtype
      )
      for name, spec in specs.items()
    }
    return attention_forward(
      params, x, config, segment_ids=segment_ids, positions=positions, layer=layer
    )


class InterleavedHeadAttentionLinen(_AttentionLinen):
  """Linen Interleaved Head Attention; fields and semantics as `InterleavedHeadAttention`."""

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


class AttentionLinen(nn.Module):
  """Linen layer of any registered kind (e.g. one a user registered), from its config.

  `AttentionLinen(config)(x: [B, N, D], *, segment_ids=None, positions=None, layer=None)`;
  the same parameter tree as `Attention.from_config(config, ...)` (NNX).
  """

  config: AttentionConfig
  param_dtype: Any = jnp.float32
  kernel_init: Initializer = DEFAULT_KERNEL_INIT
  mixing_noise_std: float = 0.0

  @nn.compact
  def __call__(
    self,
    x: jax.Array,
    *,
    segment_ids: jax.Array | None = None,
    positions: jax.Array | None = None,
    layer: int | jax.Array | None = None,
  ) -> jax.Array:
    specs = param_specs(
      self.config, kernel_init=self.kernel_init, mixing_noise_std=self.mixing_noise_std
    )
    params = {
      name: self.param(
        name, nn.with_logical_partitioning(spec.init, spec.axes), spec.shape, self.param_dtype
      )
      for name, spec in specs.items()
    }
    return attention_forward(
      params, x, self.config, segment_ids=segment_ids, positions=positions, layer=layer
    )
