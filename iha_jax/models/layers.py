"""Building blocks of `TransformerLM` (Flax NNX): RMSNorm, SwiGLU MLP, decoder block."""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from iha_jax.models.config import TransformerConfig
from iha_jax.nn import InterleavedHeadAttention, MultiHeadAttention, logical_param

EMBED = "embed"
MLP = "mlp"
DEFAULT_KERNEL_INIT = jax.nn.initializers.lecun_normal()


class RMSNorm(nnx.Module):
  """Root-mean-square norm over the last axis, with a learned `scale: [D]` ("embed",)."""

  def __init__(self, dim: int, *, eps: float = 1e-6, dtype: Any = None,
               param_dtype: Any = jnp.float32, rngs: nnx.Rngs):
    self.eps = eps
    self.dtype = dtype
    self.scale = logical_param(jax.nn.initializers.ones, (EMBED,), rngs.params(), (dim,),
                               param_dtype)

  def __call__(self, x: jax.Array) -> jax.Array:
    """`x: [..., D]` -> same shape, in `dtype` (x.dtype when None); statistics in float32."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(jnp.square(xf), axis=-1, keepdims=True) + self.eps)
    dtype = x.dtype if self.dtype is None else self.dtype
    return (y * self.scale[...].astype(jnp.float32)).astype(dtype)


class SwiGLU(nnx.Module):
  """`w_down(silu(x @ w_gate) * (x @ w_up))` with `w_gate, w_up: [D, F]`, `w_down: [F, D]`."""

  def __init__(self, model_dim: int, mlp_dim: int, *, dtype: Any = jnp.float32,
               param_dtype: Any = jnp.float32,
               kernel_init: jax.nn.initializers.Initializer = DEFAULT_KERNEL_INIT,
               rngs: nnx.Rngs):
    self.dtype = dtype
    self.w_gate = logical_param(kernel_init, (EMBED, MLP), rngs.params(), (model_dim, mlp_dim),
                                param_dtype)
    self.w_up = logical_param(kernel_init, (EMBED, MLP), rngs.params(), (model_dim, mlp_dim),
                              param_dtype)
    self.w_down = logical_param(kernel_init, (MLP, EMBED), rngs.params(), (mlp_dim, model_dim),
                                param_dtype)

  def __call__(self, x: jax.Array) -> jax.Array:
    """`x: [B, N, D]` -> `[B, N, D]` in `dtype`."""
    x = x.astype(self.dtype)
    gate = jnp.einsum("bnD,DF->bnF", x, self.w_gate[...].astype(self.dtype))
    up = jnp.einsum("bnD,DF->bnF", x, self.w_up[...].astype(self.dtype))
    return jnp.einsum("bnF,FD->bnD", jax.nn.silu(gate) * up, self.w_down[...].astype(self.dtype))


class GeluMLP(nnx.Module):
  """`w_down(gelu(x @ w_up))` with `w_up: [D, F]`, `w_down: [F, D]` (the 2-matrix MLP)."""

  def __init__(self, model_dim: int, mlp_dim: int, *, dtype: Any = jnp.float32,
               param_dtype: Any = jnp.float32,
               kernel_init: jax.nn.initializers.Initializer = DEFAULT_KERNEL_INIT,
               rngs: nnx.Rngs):
    self.dtype = dtype
    self.w_up = logical_param(kernel_init, (EMBED, MLP), rngs.params(), (model_dim, mlp_dim),
                              param_dtype)
    self.w_down = logical_param(kernel_init, (MLP, EMBED), rngs.params(), (mlp_dim, model_dim),
                                param_dtype)

  def __call__(self, x: jax.Array) -> jax.Array:
    """`x: [B, N, D]` -> `[B, N, D]` in `dtype`."""
    x = x.astype(self.dtype)
    up = jnp.einsum("bnD,DF->bnF", x, self.w_up[...].astype(self.dtype))
    return jnp.einsum("bnF,FD->bnD", jax.nn.gelu(up), self.w_down[...].astype(self.dtype))


MLPS = {"swiglu": SwiGLU, "gelu": GeluMLP}


def make_attention(config: TransformerConfig, letter: str, *,
                   rngs: nnx.Rngs) -> InterleavedHeadAttention | MultiHeadAttention:
  """The attention module of a layer with schedule letter `letter` (I, L, M or S)."""
  cfg = config.attention_config(letter)
  common = dict(window=cfg.window, rope_theta=cfg.rope_theta, dtype=cfg.dtype,
                param_dtype=config.param_dtype, implementation=cfg.implementation, rngs=rngs)
  if cfg.interleaved:
    return InterleavedHeadAttention(cfg.model_dim, cfg.num_heads, cfg.head_dim,
                                    num_pseudo=cfg.num_pseudo, collapse_mode=cfg.collapse_mode,
                                    **common)
  return MultiHeadAttention(cfg.model_dim, cfg.num_heads, cfg.head_dim, **common)


class DecoderBlock(nnx.Module):
  """Pre-norm residual block: `x + attn(norm(x))`, then `x + mlp(norm(x))`.

  Kept a standalone module so scan-over-layers and remat can wrap it unchanged.
  """

  def __init__(self, config: TransformerConfig, letter: str, *, rngs: nnx.Rngs):
    self.letter = letter
    norm = dict(eps=config.norm_eps, dtype=config.dtype, param_dtype=config.param_dtype)
    self.attn_norm = RMSNorm(config.model_dim, **norm, rngs=rngs)
    self.attn = make_attention(config, letter, rngs=rngs)
    self.mlp_norm = RMSNorm(config.model_dim, **norm, rngs=rngs)
    self.mlp = MLPS[config.mlp_type](config.model_dim, config.mlp_dim, dtype=config.dtype,
                                     param_dtype=config.param_dtype, rngs=rngs)

  def __call__(self, x: jax.Array, *, segment_ids: jax.Array | None = None,
               positions: jax.Array | None = None) -> jax.Array:
    """`x: [B, N, D]` -> `[B, N, D]`; segment_ids, positions: optional `[B, N]` int32."""
    x = x + self.attn(self.attn_norm(x), segment_ids=segment_ids, positions=positions)
    return x + self.mlp(self.mlp_norm(x))
