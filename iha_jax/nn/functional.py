"""The attention layer's forward pass as a pure function of its parameters.

Both the NNX and the Linen modules call `attention_forward`, so the layer math exists
once for every kind: projections, the kind's core from `iha_jax.ops`, output projection.

The layer makes one call per kind with one `AttentionOptions` (`cfg.options`); the ops
registry picks the implementation, and under a mesh (`jax.set_mesh`, e.g.
`iha_jax.parallel.activate`) the Pallas kernels run inside `jax.shard_map` over the
logical-axis rules' batch and head axes (`iha_jax.kernels.sharded`): a `pallas_call`
has no partitioning rule, so XLA would otherwise gather the whole batch's q/k/v onto
every device.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
from flax.linen import with_logical_constraint
from jax.ad_checkpoint import checkpoint_name

from iha_jax.nn.config import AttentionConfig
from iha_jax.ops import (
  apply_rope,
  diff_attention,
  diff_lambda_init,
  iha_attention,
  interleave,
  mha_attention,
  pseudo_mix,
  simplicial_attention,
  talking_heads_attention,
  virtual_positions,
)
from iha_jax.ops.options import AttentionOptions
from iha_jax.parallel.axes import HEADS_AXES, SOURCE_HEADS_AXES

# Names for remat policies (e.g. `jax.checkpoint_policies.save_only_these_names`):
# the q/k/v projections and the core's output are what a memory-efficient attention
# backward needs, so saving them avoids recomputing the projections and the forward core.
QUERY_PROJ = "query_proj"
KEY_PROJ = "key_proj"
VALUE_PROJ = "value_proj"
ATTENTION_OUT = "attention_out"

DIFF_NORM_EPS = 1e-5  # the per-head RMSNorm of differential attention (as Ye et al.)


def check_input(x: jax.Array, cfg: AttentionConfig) -> None:
  """Raises ValueError unless `x` is a floating `[B, N, model_dim]` array."""
  if jnp.ndim(x) != 3 or jnp.shape(x)[-1] != cfg.model_dim:
    raise ValueError(
      f"x must have shape [B, N, model_dim={cfg.model_dim}], got {tuple(jnp.shape(x))}"
    )
  if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
    raise ValueError(f"x must be a floating array, got dtype {jnp.result_type(x)}")


def to_compute_dtype(
  params: Mapping[str, jax.Array], x: jax.Array, cfg: AttentionConfig
) -> tuple[dict[str, jax.Array], jax.Array]:
  """`params` and `x` cast to the layer's computation dtype: `cfg.dtype`, or the promoted
  dtype of `x` and the parameters when None. Parameters stay stored in param_dtype; the
  whole layer, mixing included, runs in the computation dtype."""
  # `is None`, not `or`: a numpy dtype instance is falsy (len(np.dtype('f4')) == 0).
  dtype = jnp.result_type(x, *params.values()) if cfg.dtype is None else cfg.dtype
  cast = {name: jnp.asarray(value, dtype) for name, value in params.items()}
  return cast, jnp.asarray(x, dtype)


def project_qkv(p: Mapping[str, jax.Array], x: jax.Array) -> tuple[jax.Array, ...]:
  """Source-head projections `x: [B, N, D]` -> q, k, v `[B, N, H, d]`, tagged for remat."""
  return tuple(
    checkpoint_name(jnp.einsum("bnD,Dhd->bnhd", x, p[w]), name)
    for w, name in (("wq", QUERY_PROJ), ("wk", KEY_PROJ), ("wv", VALUE_PROJ))
  )


def attention_forward(
  params: Mapping[str, jax.Array],
  x: jax.Array,
  cfg: AttentionConfig,
  *,
  segment_ids: jax.Array | None = None,
  positions: jax.Array | None = None,
  layer: int | jax.Array | None = None,
) -> jax.Array:
  """Applies one attention layer of kind `cfg.kind`.

  Args:
    params: `{name: array}` as laid out by `iha_jax.nn.config.param_specs(cfg)`.
    x: `[B, N, D]` input.
    cfg: the layer configuration.
    segment_ids: optional `[B, N]` int32 packed-sequence ids (0 = padding).
    positions: optional `[B, N]` int32 token positions (default `arange(N)`).
    layer: overrides `cfg.layer` (differential attention's depth, counted from 1); may be
      traced, e.g. inside a scan over layers.

  Returns:
    `[B, N, D]` in the computation dtype (`cfg.dtype`, or the promoted dtype of `x` and
    the parameters when None).
  """
  check_input(x, cfg)
  p, x = to_compute_dtype(params, x, cfg)
  options = cfg.options(segment_ids=segment_ids, positions=positions)
  if cfg.kind == "diff":
    y = _differential(p, x, options, cfg.layer if layer is None else layer)
  elif cfg.kind == "simplicial":
    q, k1, k2, v1, v2 = (
      jnp.einsum("bnD,Dhd->bnhd", x, p[w]) for w in ("wq", "wk1", "wk2", "wv1", "wv2")
    )
    y = simplicial_attention(q, k1, k2, v1, v2, options)
  else:
    q, k, v = project_qkv(p, x)
    if cfg.kind in ("iha", "talking_heads"):
      # Both mix across heads: gather the small source-head q/k/v over the head axis
      # rather than communicate P-times larger pseudo-heads or [B, H, N, N] score maps
      # (a no-op unless a mesh and logical-axis rules are active).
      q, k, v = (with_logical_constraint(t, SOURCE_HEADS_AXES) for t in (q, k, v))
    if cfg.interleaved:
      mixing = (p["alpha_q"], p["alpha_k"], p["alpha_v"], p["collapse"])
      y = iha_attention(q, k, v, *mixing, options)
    elif cfg.kind == "talking_heads":
      y = talking_heads_attention(q, k, v, p["talk_logits"], p["talk_weights"], options)
    else:
      y = mha_attention(q, k, v, options)
  y = checkpoint_name(with_logical_constraint(y, HEADS_AXES), ATTENTION_OUT)
  return jnp.einsum("bnhd,hdD->bnD", y, p["wo"])


def _differential(
  p: Mapping[str, jax.Array], x: jax.Array, options: AttentionOptions, layer: int | jax.Array
) -> jax.Array:
  """Differential attention (Ye et al. 2024) up to the output projection: `[B, N, H, 2d]`.

  `lam = exp(lambda_q1 . lambda_k1) - exp(lambda_q2 . lambda_k2) + lambda_init`, then a
  per-head RMSNorm of `A1 v - lam A2 v` (float32 statistics, learned `norm_scale`) and
  the scale `1 - lambda_init`.
  """
  q = checkpoint_name(jnp.einsum("bnD,Dhcd->bnhcd", x, p["wq"]), QUERY_PROJ)
  k = checkpoint_name(jnp.einsum("bnD,Dhcd->bnhcd", x, p["wk"]), KEY_PROJ)
  v = checkpoint_name(jnp.einsum("bnD,Dhe->bnhe", x, p["wv"]), VALUE_PROJ)
  f32 = lambda name: p[name].astype(jnp.float32)
  lambda_init = diff_lambda_init(layer)
  lam = (
    jnp.exp(jnp.dot(f32("lambda_q1"), f32("lambda_k1")))
    - jnp.exp(jnp.dot(f32("lambda_q2"), f32("lambda_k2")))
    + lambda_init
  )
  y = diff_attention(q, k, v, lam, options).astype(jnp.float32)
  y = y * jax.lax.rsqrt(jnp.mean(jnp.square(y), axis=-1, keepdims=True) + DIFF_NORM_EPS)
  return (y * f32("norm_scale") * (1.0 - lambda_init)).astype(x.dtype)


def pseudo_heads(x: jax.Array, alpha: jax.Array | None) -> jax.Array:
  """Source heads `[B, N, H, d]` -> interleaved pseudo-heads `[B, N*P, H, d]` (None: MHA, x)."""
  if alpha is None:
    return x
  return interleave(pseudo_mix(x, alpha, precision=jax.lax.Precision.HIGHEST))


def virtual_per_token(cfg: AttentionConfig) -> int:
  """Virtual tokens per token: P for an IHA layer, 1 for an MHA layer."""
  return cfg.pseudo if cfg.interleaved else 1


def rotated_pseudo_heads(
  x: jax.Array, alpha: jax.Array | None, positions: jax.Array, cfg: AttentionConfig
) -> jax.Array:
  """Pseudo-heads of `x: [B, N, H, d]`, rotated at virtual positions `pos*P + p`.

  `positions: [B, N]` token positions. Returns `[B, N*P, H, d]` (`[B, N, H, d]` for MHA).
  """
  xv = pseudo_heads(x, alpha)
  if cfg.rope_theta is None:
    return xv
  return apply_rope(xv, virtual_positions(positions, virtual_per_token(cfg)), cfg.rope_theta)
