"""Flax Linen counterparts of the NNX attention layers, with the same parameter tree.

`params` holds `wq, wk, wv, wo` (+ `alpha_q, alpha_k, alpha_v, collapse` for IHA), boxed
in `nn.LogicallyPartitioned` with the logical axis names of `iha_jax.nn.config`; the
forward pass is the shared `attention_forward`, so NNX and Linen compute one function.
"""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from iha_jax.nn.config import DEFAULT_KERNEL_INIT, AttentionConfig, param_specs
from iha_jax.nn.functional import attention_forward

Initializer = jax.nn.initializers.Initializer


def _apply(module: nn.Module, config: AttentionConfig, x: jax.Array, *,
           segment_ids: jax.Array | None, positions: jax.Array | None,
           mixing_noise_std: float) -> jax.Array:
  """Declares `config`'s parameters on `module` (inside its compact call) and runs it."""
  specs = param_specs(config, kernel_init=module.kernel_init, mixing_noise_std=mixing_noise_std)
  params = {
      name: module.param(name, nn.with_logical_partitioning(spec.init, spec.axes), spec.shape,
                         module.param_dtype)
      for name, spec in specs.items()
  }
  return attention_forward(params, x, config, segment_ids=segment_ids, positions=positions)


class InterleavedHeadAttentionLinen(nn.Module):
  """Linen Interleaved Head Attention; fields and semantics as `InterleavedHeadAttention`.

  `__call__(x: [B, N, D], *, segment_ids=None, positions=None) -> [B, N, D]`.
  """
  model_dim: int
  num_heads: int
  head_dim: int
  num_pseudo: int | None = None
  window: int | None = None
  rope_theta: float | None = 10000.0
  collapse_mode: str = "full"
  mixing_noise_std: float = 0.0
  dtype: Any = None
  param_dtype: Any = jnp.float32
  implementation: str = "auto"
  kernel_init: Initializer = DEFAULT_KERNEL_INIT

  @property
  def config(self) -> AttentionConfig:
    """The validated layer configuration."""
    return AttentionConfig(self.model_dim, self.num_heads, self.head_dim, interleaved=True,
                           num_pseudo=self.num_pseudo, window=self.window,
                           rope_theta=self.rope_theta, collapse_mode=self.collapse_mode,
                           dtype=self.dtype, implementation=self.implementation)

  @nn.compact
  def __call__(self, x: jax.Array, *, segment_ids: jax.Array | None = None,
               positions: jax.Array | None = None) -> jax.Array:
    return _apply(self, self.config, x, segment_ids=segment_ids, positions=positions,
                  mixing_noise_std=self.mixing_noise_std)


class MultiHeadAttentionLinen(nn.Module):
  """Linen multi-head attention; fields and semantics as `MultiHeadAttention`.

  `__call__(x: [B, N, D], *, segment_ids=None, positions=None) -> [B, N, D]`.
  """
  model_dim: int
  num_heads: int
  head_dim: int
  window: int | None = None
  rope_theta: float | None = 10000.0
  dtype: Any = None
  param_dtype: Any = jnp.float32
  implementation: str = "auto"
  kernel_init: Initializer = DEFAULT_KERNEL_INIT

  @property
  def config(self) -> AttentionConfig:
    """The validated layer configuration."""
    return AttentionConfig(self.model_dim, self.num_heads, self.head_dim, interleaved=False,
                           window=self.window, rope_theta=self.rope_theta, dtype=self.dtype,
                           implementation=self.implementation)

  @nn.compact
  def __call__(self, x: jax.Array, *, segment_ids: jax.Array | None = None,
               positions: jax.Array | None = None) -> jax.Array:
    return _apply(self, self.config, x, segment_ids=segment_ids, positions=positions,
                  mixing_noise_std=0.0)
