"""Flax NNX attention layers: `InterleavedHeadAttention`, `MultiHeadAttention` and the
paper's baselines `TalkingHeadsAttention`, `DifferentialAttention`, `SimplicialAttention`.

Parameters are `nnx.Param` attributes named as `iha_jax.nn.config.param_specs` lays them
out (`wq, wk, wv, wo`, plus `alpha_q, alpha_k, alpha_v, collapse` for IHA, ...), so
`nnx.state(m, nnx.Param)` is a flat dict of exactly those keys. Each carries its logical
axis names (see `iha_jax.nn.config`) as metadata only
(`iha_jax.nn.partitioning.logical_param`), so the modules build without a mesh.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from iha_jax.nn.config import DEFAULT_KERNEL_INIT, AttentionConfig, param_specs
from iha_jax.nn.functional import attention_forward
from iha_jax.nn.partitioning import logical_param

Initializer = jax.nn.initializers.Initializer


class _Attention(nnx.Module):
  """Creates the parameters of `config` and applies `attention_forward`."""

  def __init__(
    self,
    config: AttentionConfig,
    *,
    param_dtype: Any,
    kernel_init: Initializer,
    mixing_noise_std: float,
    rngs: nnx.Rngs,
  ):
    self.config = config
    specs = param_specs(config, kernel_init=kernel_init, mixing_noise_std=mixing_noise_std)
    for name, spec in specs.items():
      setattr(
        self, name, logical_param(spec.init, spec.axes, rngs.params(), spec.shape, param_dtype)
      )
    self._param_names = tuple(specs)

  def __call__(
    self, x: jax.Array, *, segment_ids: jax.Array | None = None, positions: jax.Array | None = None
  ) -> jax.Array:
    """`x: [B, N, D]` -> `[B, N, D]`; segment_ids, positions: optional `[B, N]` int32."""
    return attention_forward(
      self.param_values(), x, self.config, segment_ids=segment_ids, positions=positions
    )

  def param_values(self) -> dict[str, jax.Array]:
    """`{name: array}` of the layer's parameters, as `attention_forward` takes them."""
    return {name: getattr(self, name)[...] for name in self._param_names}


class InterleavedHeadAttention(_Attention):
  """Interleaved Head Attention layer, causal or bidirectional, optionally windowed.

  Parameters: `wq, wk, wv: [D, H, d]`, `wo: [H, d, D]`, `alpha_q, alpha_k, alpha_v:
  [H, H, P]` (source, target, pseudo), `collapse: [H, H, P]` ("full") or `[H, P]`
  ("per_head"). Mixing and collapse start at the identity (docs/design.md §1, Initialisation).
  """

  def __init__(
    self,
    model_dim: int,
    num_heads: int,
    head_dim: int,
    *,
    num_pseudo: int | None = None,
    window: int | None = None,
    rope_theta: float | None = 10000.0,
    collapse_mode: str = "full",
    causal: bool = True,
    mixing_noise_std: float = 0.0,
    dtype: Any = None,
    param_dtype: Any = jnp.float32,
    implementation: str = "auto",
    kernel_init: Initializer = DEFAULT_KERNEL_INIT,
    rngs: nnx.Rngs,
  ):
    """Builds the layer.

    Args:
      model_dim: D.
      num_heads: H.
      head_dim: d (even when RoPE is on).
      num_pseudo: P pseudo-heads per head; None means P = H (the paper's default).
      window: sliding window in virtual tokens (`N*P` per sequence); None is global.
      rope_theta: RoPE base, None disables RoPE.
      collapse_mode: "full" or "per_head".
      causal: causal attention; False: bidirectional (every pseudo-key of the segment).
      mixing_noise_std: std of Gaussian noise added to the identity mixing/collapse init.
      dtype: computation dtype; None promotes the input and parameter dtypes.
      param_dtype: storage dtype of the parameters.
      implementation: attention core backend ("reference", "xla", "pallas_tpu",
        "pallas_gpu", "auto").
      kernel_init: 2-D initializer for the projections, applied to `[D, H*d]` and
        `[H*d, D]` so that fan-in is the true input width.
      rngs: `nnx.Rngs` with a `params` stream.
    """
    config = AttentionConfig(
      model_dim,
      num_heads,
      head_dim,
      kind="iha",
      num_pseudo=num_pseudo,
      window=window,
      rope_theta=rope_theta,
      collapse_mode=collapse_mode,
      causal=causal,
      dtype=dtype,
      implementation=implementation,
    )
    super().__init__(
      config,
      param_dtype=param_dtype,
      kernel_init=kernel_init,
      mixing_noise_std=mixing_noise_std,
      rngs=rngs,
    )


class MultiHeadAttention(_Attention):
  """Standard multi-head attention with the same conventions as IHA.

  Parameters: `wq, wk, wv: [D, H, d]`, `wo: [H, d, D]`.
  """

  def __init__(
    self,
    model_dim: int,
    num_heads: int,
    head_dim: int,
    *,
    window: int | None = None,
    rope_theta: float | None = 10000.0,
    causal: bool = True,
    dtype: Any = None,
    param_dtype: Any = jnp.float32,
    implementation: str = "auto",
    kernel_init: Initializer = DEFAULT_KERNEL_INIT,
    rngs: nnx.Rngs,
  ):
    """Builds the layer; arguments as `InterleavedHeadAttention`, `window` in tokens."""
    config = AttentionConfig(
      model_dim,
      num_heads,
      head_dim,
      kind="mha",
      window=window,
      rope_theta=rope_theta,
      causal=causal,
      dtype=dtype,
      implementation=implementation,
    )
    super().__init__(
      config, param_dtype=param_dtype, kernel_init=kernel_init, mixing_noise_std=0.0, rngs=rngs
    )


class TalkingHeadsAttention(_Attention):
  """Talking-Heads attention (Shazeer et al. 2020): logits mixed across heads before the
  softmax, probabilities after it.

  Parameters: `wq, wk, wv: [D, H, d]`, `wo: [H, d, D]`, `talk_logits, talk_weights:
  [H, H]` (source head, target head), identity at init (= MHA).
  """

  def __init__(
    self,
    model_dim: int,
    num_heads: int,
    head_dim: int,
    *,
    window: int | None = None,
    rope_theta: float | None = 10000.0,
    causal: bool = True,
    mixing_noise_std: float = 0.0,
    dtype: Any = None,
    param_dtype: Any = jnp.float32,
    implementation: str = "auto",
    kernel_init: Initializer = DEFAULT_KERNEL_INIT,
    rngs: nnx.Rngs,
  ):
    """Builds the layer; arguments as `InterleavedHeadAttention`, `window` in tokens,
    `mixing_noise_std` perturbing the identity `talk_*`."""
    config = AttentionConfig(
      model_dim,
      num_heads,
      head_dim,
      kind="talking_heads",
      window=window,
      rope_theta=rope_theta,
      causal=causal,
      dtype=dtype,
      implementation=implementation,
    )
    super().__init__(
      config,
      param_dtype=param_dtype,
      kernel_init=kernel_init,
      mixing_noise_std=mixing_noise_std,
      rngs=rngs,
    )


class DifferentialAttention(_Attention):
  """Differential attention (Ye et al. 2024): `A1 v - lam A2 v`, per-head RMSNorm, scale
  `1 - lambda_init`.

  Parameters: `wq, wk: [D, H, 2, d]`, `wv: [D, H, 2d]`, `wo: [H, 2d, D]`,
  `lambda_q1, lambda_k1, lambda_q2, lambda_k2: [d]`, `norm_scale: [2d]`. H differential
  heads of value width 2d match an MHA layer of 2H heads of width d in parameters.
  """

  def __init__(
    self,
    model_dim: int,
    num_heads: int,
    head_dim: int,
    *,
    layer: int = 1,
    window: int | None = None,
    rope_theta: float | None = 10000.0,
    causal: bool = True,
    dtype: Any = None,
    param_dtype: Any = jnp.float32,
    implementation: str = "auto",
    kernel_init: Initializer = DEFAULT_KERNEL_INIT,
    rngs: nnx.Rngs,
  ):
    """Builds the layer; `layer` (counted from 1) sets `lambda_init`, the rest as
    `MultiHeadAttention` (any MHA implementation, kernels included, runs both maps)."""
    config = AttentionConfig(
      model_dim,
      num_heads,
      head_dim,
      kind="diff",
      window=window,
      rope_theta=rope_theta,
      causal=causal,
      layer=layer,
      dtype=dtype,
      implementation=implementation,
    )
    super().__init__(
      config, param_dtype=param_dtype, kernel_init=kernel_init, mixing_noise_std=0.0, rngs=rngs
    )

  def __call__(
    self,
    x: jax.Array,
    *,
    segment_ids: jax.Array | None = None,
    positions: jax.Array | None = None,
    layer: int | jax.Array | None = None,
  ) -> jax.Array:
    """As `MultiHeadAttention.__call__`; `layer` overrides the configured depth (it may be
    traced, e.g. in a scan over layers)."""
    return attention_forward(
      self.param_values(), x, self.config, segment_ids=segment_ids, positions=positions, layer=layer
    )


class SimplicialAttention(_Attention):
  """2-simplicial attention (Roy et al. 2025): every query attends to pairs of keys
  through a trilinear form; no RoPE. O(N^2) scores per query (see
  `iha_jax.ops.simplicial_attention` for the size limit).

  Parameters: `wq, wk1, wk2, wv1, wv2: [D, H, d]`, `wo: [H, d, D]`.
  """

  def __init__(
    self,
    model_dim: int,
    num_heads: int,
    head_dim: int,
    *,
    window: int | None = None,
    causal: bool = True,
    dtype: Any = None,
    param_dtype: Any = jnp.float32,
    implementation: str = "auto",
    kernel_init: Initializer = DEFAULT_KERNEL_INIT,
    rngs: nnx.Rngs,
  ):
    """Builds the layer; arguments as `MultiHeadAttention` (no RoPE)."""
    config = AttentionConfig(
      model_dim,
      num_heads,
      head_dim,
      kind="simplicial",
      window=window,
      rope_theta=None,
      causal=causal,
      dtype=dtype,
      implementation=implementation,
    )
    super().__init__(
      config, param_dtype=param_dtype, kernel_init=kernel_init, mixing_noise_std=0.0, rngs=rngs
    )
