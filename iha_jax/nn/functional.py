"""The attention layer's forward pass as a pure function of its parameters.

Both the NNX and the Linen modules call `attention_forward`, so the layer math exists
once: input checks and dtype, the kind's core (`iha_jax.kinds`: projections and the
kind's `iha_jax.ops` entry point), the output projection.

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

from iha_jax.kinds import ATTENTION_OUT, KEY_PROJ, QUERY_PROJ, VALUE_PROJ, project_qkv
from iha_jax.kinds.config import AttentionConfig
from iha_jax.ops import apply_rope, virtual_positions
from iha_jax.parallel.axes import HEADS_AXES

__all__ = [
  "ATTENTION_OUT",
  "KEY_PROJ",
  "QUERY_PROJ",
  "VALUE_PROJ",
  "attention_forward",
  "check_input",
  "project_qkv",
  "pseudo_heads",
  "rotated_pseudo_heads",
  "to_compute_dtype",
  "virtual_per_token",
]


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
    layer: overrides `cfg.layer` (the layer's number, counted from 1; differential
      attention's depth); may be traced, e.g. inside a scan over layers.

  Returns:
    `[B, N, D]` in the computation dtype (`cfg.dtype`, or the promoted dtype of `x` and
    the parameters when None).
  """
  check_input(x, cfg)
  p, x = to_compute_dtype(params, x, cfg)
  options = cfg.options(segment_ids=segment_ids, positions=positions)
  y = cfg.record.core(p, x, cfg, options, cfg.layer if layer is None else layer)
  y = checkpoint_name(with_logical_constraint(y, HEADS_AXES), ATTENTION_OUT)
  return jnp.einsum("bnhd,hdD->bnD", y, p["wo"])


def virtual_per_token(cfg: AttentionConfig) -> int:
  """Virtual tokens per token: P for an IHA layer, 1 for the other kinds."""
  return cfg.pseudo


def pseudo_heads(
  params: Mapping[str, jax.Array], cfg: AttentionConfig, which: str, x: jax.Array
) -> jax.Array:
  """Source heads `x: [B, N, H, d]` of projection `which` ("q", "k", "v") -> the heads
  the kind attends with over virtual tokens, `[B, N * P, H, d]` (MHA: x)."""
  return cfg.record.pseudo_heads(params, cfg, which, x)


def rotated_pseudo_heads(
  params: Mapping[str, jax.Array],
  cfg: AttentionConfig,
  which: str,
  x: jax.Array,
  positions: jax.Array,
) -> jax.Array:
  """`pseudo_heads`, rotated at virtual positions `pos*P + p` (`positions: [B, N]` token
  positions). Returns `[B, N*P, H, d]` (`[B, N, H, d]` for MHA)."""
  xv = pseudo_heads(params, cfg, which, x)
  if cfg.rope_theta is None:
    return xv
  return apply_rope(xv, virtual_positions(positions, virtual_per_token(cfg)), cfg.rope_theta)
