"""Differential attention (`D`; Ye et al. 2024), a baseline of the paper."""

from __future__ import annotations

import functools
from typing import Unpack

import jax
import jax.numpy as jnp

from iha_jax.core import validation
from iha_jax.core.differential import diff_lambda_init, diff_via_mha
from iha_jax.core.options import AttentionOptions, OptionFields
from iha_jax.kinds import registry
from iha_jax.kinds.base import (
  KEY_PROJ,
  QUERY_PROJ,
  VALUE_PROJ,
  AttentionKind,
  Implementation,
  Letter,
  ParamSpec,
  project,
  projection_spec,
)
from iha_jax.kinds.initializers import fold_fan_in
from iha_jax.kinds.mha import MHA
from iha_jax.parallel.axes import EMBED, HEAD_DIM, HEADS, KV_HEADS, QK_PAIR

NORM_EPS = 1e-5  # the per-head RMSNorm of differential attention (as Ye et al.)


def _via(mha: str) -> Implementation:
  """Both maps through MHA's implementation `mha` (one MHA call over 2H heads)."""
  return functools.partial(diff_via_mha, mha=MHA.implementations[mha])


# MHA's "pallas_gpu_mha" is its "pallas_gpu": so is this kind's (one object: no path of
# its own for "auto"). No cuDNN: its value width 2d is one cuDNN's path lacks.
_GPU = _via("pallas_gpu")


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
    "reference": _via("reference"),
    "xla": _via("xla"),
    "pallas_tpu": _via("pallas_tpu"),
    "pallas_gpu": _GPU,
    "pallas_gpu_mha": _GPU,
    "splash": _via("splash"),
  }
  dropout_implementations = frozenset({"xla"})  # MHA's, over both maps
  sequence_roles = ("q", "kv", "kv", "-")

  def check_arrays(self, q, k, v, lam):
    validation.check_arrays(("q", "k"), (q, k), 5, "[B, N, H, 2, d]", same_shape=False, prefix=2)
    if q.shape[3] != 2 or k.shape[3] != 2 or q.shape[4] != k.shape[4]:
      raise ValueError(
        "q and k must hold the two maps on axis 3, [B, N, H, 2, d] and [B, N, G, 2, d]; got "
        f"q {tuple(q.shape)} and k {tuple(k.shape)}."
      )
    g = validation.check_kv_heads(q.shape[2], k.shape[2], "k")
    if jnp.ndim(v) != 4 or tuple(v.shape[:3]) != (*q.shape[:2], g):
      raise ValueError(
        f"v must have shape [B, N, G, dv] with [B, N, G] = {[*q.shape[:2], g]} "
        f"from q and k, got {tuple(jnp.shape(v))}."
      )
    if jnp.result_type(v) != jnp.result_type(q):
      raise ValueError(
        f"q, k and v must share one dtype, got {jnp.result_type(q)} and {jnp.result_type(v)}."
      )
    h = q.shape[2]
    if jnp.ndim(lam) not in (0, 1) or (jnp.ndim(lam) == 1 and jnp.shape(lam)[0] != h):
      raise ValueError(f"lam must be a scalar or [H] = [{h}], got shape {tuple(jnp.shape(lam))}.")

  def layer_heads(self, num_heads):
    return _halved("num_heads", num_heads, "heads of value width 2*head_dim")

  def layer_kv_heads(self, num_kv_heads):
    return _halved("num_kv_heads", num_kv_heads, "key/value heads (each with two key maps)")

  def value_dim(self, cfg):
    return 2 * cfg.head_dim

  def param_specs(self, cfg, kernel_init, mixing_noise_std):
    """`wq: [D, H, 2, d]`, `wk: [D, G, 2, d]`, `wv: [D, G, 2d]` (G = `cfg.kv_heads`),
    `wo: [H, 2d, D]`, `lambda_q1, lambda_k1, lambda_q2, lambda_k2: [d]` (N(0, 0.1^2)), the
    output RMSNorm's `norm_scale: [2d]`."""
    d_model, d = cfg.model_dim, cfg.head_dim
    pair = lambda heads, axis: ParamSpec(
      (d_model, heads, 2, d), (EMBED, axis, QK_PAIR, HEAD_DIM), fold_fan_in(kernel_init, 1)
    )
    lam = ParamSpec((d,), (HEAD_DIM,), jax.nn.initializers.normal(0.1))
    specs = super().param_specs(cfg, kernel_init, mixing_noise_std)
    return {
      "wq": pair(cfg.num_heads, HEADS),
      "wk": pair(cfg.kv_heads, KV_HEADS),
      "wv": projection_spec(cfg, kernel_init, self.value_dim(cfg), cfg.kv_heads, KV_HEADS),
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


def _halved(name: str, count: int, what: str) -> int:
  if count % 2:
    raise ValueError(
      f"{name} must be even for 'D' (differential) layers, which use {name}/2 {what}; got {count}"
    )
  return count // 2


def diff_attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  lam: jax.Array | float,
  options: AttentionOptions | None = None,
  **overrides: Unpack[OptionFields],
) -> jax.Array:
  """Differential attention `A1 v - lam * A2 v` (before the layer's norm and scale).

  Args:
    q: `[B, N, H, 2, d]` projections before RoPE (map i's queries at index i).
    k: `[B, N, G, 2, d]` (map i's keys at index i), G dividing H: grouped-query
      differential attention, head h reading key/value head `h // (H // G)` in both maps.
    v: `[B, N, G, dv]` (the paper's layer uses dv = 2d).
    lam: a scalar or `[H]` (per head).
    options, **overrides: `AttentionOptions` as `mha_attention` (window in tokens);
      `implementation` names an MHA implementation ("reference", "xla", "pallas_tpu",
      "pallas_gpu", "pallas_gpu_mha", "auto"; not "cudnn"): both maps run through it.

  Returns:
    `[B, N, H, dv]` in q.dtype; the subtraction is done in float32.
  """
  return registry.attend(DIFFERENTIAL, q, k, v, lam, options=options, **overrides)
