"""Differential attention (`D`; Ye et al. 2024), a baseline of the paper."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from iha_jax.kinds.base import (
  KEY_PROJ,
  QUERY_PROJ,
  VALUE_PROJ,
  AttentionKind,
  Letter,
  ParamSpec,
  project,
  projection_spec,
)
from iha_jax.kinds.initializers import fold_fan_in
from iha_jax.ops import diff_attention, diff_lambda_init
from iha_jax.parallel.axes import EMBED, HEAD_DIM, HEADS, QK_PAIR

NORM_EPS = 1e-5  # the per-head RMSNorm of differential attention (as Ye et al.)


class Differential(AttentionKind):
  """`A1 v - lam A2 v` per head (two query/key maps, value width 2d), a per-head RMSNorm
  and the scale `1 - lambda_init`. In a model of H heads its layers have H/2 heads, which
  match an MHA layer of H heads in parameters. Both maps run as one MHA call over 2H
  heads, so every MHA implementation, the kernels included, serves it. With G key/value
  heads in the model, its layers have G/2 (grouped-query in both maps)."""

  name = "diff"
  letters = (
    Letter("D", False, "global differential attention, num_heads/2 heads of value width 2d"),
  )
  implementations = {
    name: ("iha_jax.ops.differential:diff_via_mha", {})
    for name in ("reference", "xla", "pallas_tpu", "pallas_gpu", "pallas_gpu_mha")
  }
  sequence_roles = ("q", "kv", "kv", "-")

  def layer_heads(self, num_heads):
    if num_heads % 2:
      raise ValueError(
        f"num_heads must be even for 'D' (differential) layers, which use "
        f"num_heads/2 heads of value width 2*head_dim; got {num_heads}"
      )
    return num_heads // 2

  def layer_kv_heads(self, num_kv_heads):
    if num_kv_heads % 2:
      raise ValueError(
        f"num_kv_heads must be even for 'D' (differential) layers, which use "
        f"num_kv_heads/2 key/value heads (each with two key maps); got {num_kv_heads}"
      )
    return num_kv_heads // 2

  def value_dim(self, cfg):
    return 2 * cfg.head_dim

  def param_specs(self, cfg, kernel_init, mixing_noise_std):
    """`wq: [D, H, 2, d]`, `wk: [D, G, 2, d]`, `wv: [D, G, 2d]` (G = `cfg.kv_heads`),
    `wo: [H, 2d, D]`, `lambda_q1, lambda_k1, lambda_q2, lambda_k2: [d]` (N(0, 0.1^2)), the
    output RMSNorm's `norm_scale: [2d]`."""
    d_model, d = cfg.model_dim, cfg.head_dim
    pair = lambda heads: ParamSpec(
      (d_model, heads, 2, d), (EMBED, HEADS, QK_PAIR, HEAD_DIM), fold_fan_in(kernel_init, 1)
    )
    lam = ParamSpec((d,), (HEAD_DIM,), jax.nn.initializers.normal(0.1))
    specs = super().param_specs(cfg, kernel_init, mixing_noise_std)
    return {
      "wq": pair(cfg.num_heads),
      "wk": pair(cfg.kv_heads),
      "wv": projection_spec(cfg, kernel_init, self.value_dim(cfg), cfg.kv_heads),
      "wo": specs["wo"],
      "lambda_q1": lam,
      "lambda_k1": lam,
      "lambda_q2": lam,
      "lambda_k2": lam,
      "norm_scale": ParamSpec((2 * d,), (HEAD_DIM,), jax.nn.initializers.ones),
    }

  def core(self, params, x, cfg, options, layer):
    """`lam = exp(lambda_q1 . lambda_k1) - exp(lambda_q2 . lambda_k2) + lambda_init`, then
    a per-head RMSNorm of `A1 v - lam A2 v` (float32 statistics, learned `norm_scale`)
    and the scale `1 - lambda_init`: `[B, N, H, 2d]`."""
    q = project(x, params["wq"], QUERY_PROJ)  # [B, N, H, 2, d]
    k = project(x, params["wk"], KEY_PROJ)  # [B, N, G, 2, d]
    v = project(x, params["wv"], VALUE_PROJ)  # [B, N, G, 2d]
    f32 = lambda name: params[name].astype(jnp.float32)
    lambda_init = diff_lambda_init(layer)
    lam = (
      jnp.exp(jnp.dot(f32("lambda_q1"), f32("lambda_k1")))
      - jnp.exp(jnp.dot(f32("lambda_q2"), f32("lambda_k2")))
      + lambda_init
    )
    y = diff_attention(q, k, v, lam, options).astype(jnp.float32)
    y = y * jax.lax.rsqrt(jnp.mean(jnp.square(y), axis=-1, keepdims=True) + NORM_EPS)
    return (y * f32("norm_scale") * (1.0 - lambda_init)).astype(x.dtype)

  def core_flops(self, cfg, seq_len):
    # Two maps, each QK (2d) and PV (2 dv) per pair and head.
    return 2 * super().core_flops(cfg, seq_len)


DIFFERENTIAL = Differential()
