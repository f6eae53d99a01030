"""Building blocks of `TransformerLM` (Flax NNX): RMSNorm, MLP (SwiGLU or GELU), the block."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.linen import with_logical_constraint

from iha_jax.models.config import TransformerConfig
from iha_jax.nn import Attention, LayerCache
from iha_jax.nn.config import DEFAULT_KERNEL_INIT
from iha_jax.nn.partitioning import logical_param
from iha_jax.ops import rms_norm
from iha_jax.parallel.axes import EMBED, MLP, RESIDUAL_AXES


class RMSNorm(nnx.Module):
  """Root-mean-square norm over the last axis, with a learned `scale: [D]` ("embed",)."""

  def __init__(
    self,
    dim: int,
    *,
    eps: float = 1e-6,
    dtype: Any = None,
    param_dtype: Any = jnp.float32,
    rngs: nnx.Rngs,
  ):
    self.eps = eps
    self.dtype = dtype
    self.scale = logical_param(
      jax.nn.initializers.ones, (EMBED,), rngs.params(), (dim,), param_dtype
    )

  def __call__(self, x: jax.Array) -> jax.Array:
    """`x: [..., D]` -> same shape, in `dtype` (x.dtype when None); statistics in float32."""
    return rms_norm(x, self.scale[...], self.eps, self.dtype)


class FeedForward(nnx.Module):
  """The block's MLP: SwiGLU `w_down(silu(x @ w_gate) * (x @ w_up))` or GELU
  `w_down(gelu(x @ w_up))`, with `w_gate, w_up: [D, F]`, `w_down: [F, D]`."""

  def __init__(
    self,
    model_dim: int,
    mlp_dim: int,
    *,
    mlp_type: str = "swiglu",
    dtype: Any = jnp.float32,
    param_dtype: Any = jnp.float32,
    kernel_init: jax.nn.initializers.Initializer = DEFAULT_KERNEL_INIT,
    rngs: nnx.Rngs,
  ):
    self.dtype = dtype
    self.gated = mlp_type == "swiglu"

    def param(axes, shape):
      return logical_param(kernel_init, axes, rngs.params(), shape, param_dtype)

    if self.gated:
      self.w_gate = param((EMBED, MLP), (model_dim, mlp_dim))
    self.w_up = param((EMBED, MLP), (model_dim, mlp_dim))
    self.w_down = param((MLP, EMBED), (mlp_dim, model_dim))

  def __call__(self, x: jax.Array) -> jax.Array:
    """`x: [B, N, D]` -> `[B, N, D]` in `dtype`."""
    x = x.astype(self.dtype)
    project = lambda w: jnp.einsum("bnD,DF->bnF", x, w[...].astype(self.dtype))
    hidden = (
      jax.nn.silu(project(self.w_gate)) * project(self.w_up)
      if self.gated
      else jax.nn.gelu(project(self.w_up))
    )
    return jnp.einsum("bnF,FD->bnD", hidden, self.w_down[...].astype(self.dtype))


def make_attention(
  config: TransformerConfig, letter: str, *, layer: int = 1, rngs: nnx.Rngs
) -> Attention:
  """The attention module of layer number `layer` (counted from 1) with schedule letter
  `letter`, whatever its kind (`iha_jax.kinds`)."""
  return Attention.from_config(
    config.attention_config(letter, layer),
    param_dtype=config.param_dtype,
    mixing_noise_std=config.mixing_noise_std,
    rngs=rngs,
  )


class DecoderBlock(nnx.Module):
  """Pre-norm residual block: `x + attn(norm(x))`, then `x + mlp(norm(x))` (no MLP and no
  `mlp_norm` with `mlp_type="none"`: attention-only blocks, e.g. for theory probes).

  Kept a standalone module so scan-over-layers and remat can wrap it unchanged. Its call
  passes a KV cache or the request for attention probabilities on to the attention layer
  (decoding and attention maps run the block itself).
  """

  def __init__(self, config: TransformerConfig, letter: str, *, layer: int = 1, rngs: nnx.Rngs):
    self.letter = letter
    norm = dict(eps=config.norm_eps, dtype=config.dtype, param_dtype=config.param_dtype)
    self.attn_norm = RMSNorm(config.model_dim, **norm, rngs=rngs)
    self.attn = make_attention(config, letter, layer=layer, rngs=rngs)
    if config.mlp_type == "none":
      return
    self.mlp_norm = RMSNorm(config.model_dim, **norm, rngs=rngs)
    self.mlp = FeedForward(
      config.model_dim,
      config.mlp_dim,
      mlp_type=config.mlp_type,
      dtype=config.dtype,
      param_dtype=config.param_dtype,
      rngs=rngs,
    )

  def __call__(
    self,
    x: jax.Array,
    *,
    segment_ids: jax.Array | None = None,
    positions: jax.Array | None = None,
    layer: jax.Array | None = None,
    cache: LayerCache | None = None,
    return_probabilities: bool = False,
  ) -> Any:
    """`x: [B, N, D]` -> `[B, N, D]`; segment_ids, positions: optional `[B, N]` int32.

    `layer` (counted from 1, may be traced) overrides the block's own (a scan over layers
    passes it). With a `cache` (the attention layer's) returns `(out, cache)`, segment id
    0 marking padding among the new tokens (a ragged batch); with
    `return_probabilities`, `(out, probabilities [B, H, T, T])`, as the attention layer.
    """
    h = self.attn_norm(x)
    aux = None
    if cache is not None:  # segment id 0: padding of a ragged batch
      valid = None if segment_ids is None else (segment_ids != 0)[:, None, None, :]
      y, aux = self.attn(h, cache=cache, mask=valid)
    else:
      y = self.attn(
        h,
        segment_ids=segment_ids,
        positions=positions,
        layer=layer,
        return_probabilities=return_probabilities,
      )
      if return_probabilities:
        y, aux = y
    x = x + y
    if hasattr(self, "mlp"):
      x = x + self.mlp(self.mlp_norm(x))
    x = with_logical_constraint(x, RESIDUAL_AXES)
    return x if aux is None else (x, aux)
