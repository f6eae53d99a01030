"""The attention layer's forward pass as a pure function of its parameters.

Both the NNX and the Linen modules call these (through `iha_jax.nn.call.apply_layer`),
so the layer math exists once: input checks and dtype, the kind's core (`iha_jax.kinds`:
projections and the kind's `iha_jax.ops` entry point), the output projection.

The layer makes one call per kind with one `AttentionOptions` (`cfg.options`); the
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

from iha_jax.core.grouped import grouped_attention_probabilities
from iha_jax.core.masking import Mask
from iha_jax.core.validation import default_positions
from iha_jax.kinds import ATTENTION_OUT, KEY_PROJ, QUERY_PROJ, VALUE_PROJ, project_out, project_qkv
from iha_jax.kinds.config import AttentionConfig
from iha_jax.ops import apply_rope, virtual_positions, virtual_segment_ids
from iha_jax.parallel.axes import HEADS_AXES

__all__ = [
  "ATTENTION_OUT",
  "KEY_PROJ",
  "QUERY_PROJ",
  "VALUE_PROJ",
  "attention_forward",
  "check_input",
  "layer_attention_probabilities",
  "mask_segments",
  "project_qkv",
  "pseudo_heads",
  "rotated_pseudo_heads",
  "to_compute_dtype",
]


def check_input(x: jax.Array, cfg: AttentionConfig) -> None:
  """Raises ValueError unless `x` is a floating `[B, N, model_dim]` array with N >= 1."""
  if jnp.ndim(x) != 3 or jnp.shape(x)[-1] != cfg.model_dim:
    raise ValueError(
      f"x must have shape [B, N, model_dim={cfg.model_dim}], got {tuple(jnp.shape(x))}"
    )
  if jnp.shape(x)[1] == 0:
    raise ValueError(
      f"x has N = 0 tokens (shape {tuple(jnp.shape(x))}, [B, N, D]): attention needs at "
      "least one token per sequence"
    )
  if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
    raise ValueError(f"x must be a floating array, got dtype {jnp.result_type(x)}")


def mask_segments(mask: jax.Array, segment_ids: jax.Array | None, x: jax.Array) -> jax.Array:
  """A flax-convention `mask` (True = attend, broadcastable to `[B, H, N, N]`) as segment
  ids `[B, N]` int32, where it says which keys are valid (padding).

  Only key validity is expressible: `mask: [B, 1, 1, N]` (or `[1, 1, 1, N]`), bool or
  integer, e.g. `valid[:, None, None, :]`. Keys where it is False are padding: never seen,
  and their own outputs are zeros (segment id 0; flax's layer would still give them an
  output, which a padded position does not use). Combined with `segment_ids` (packed
  sequences) when both are given. Any other mask (a causal or banded `[B, 1, N, N]`) is
  refused: the layer is causal by `causal=`, windowed by `window=`, and packs sequences by
  `segment_ids=`.
  """
  b, n = jnp.shape(x)[:2]
  shape = tuple(jnp.shape(mask))
  if len(shape) != 4 or shape[0] not in (1, b) or shape[1:] != (1, 1, n):
    raise ValueError(
      f"mask of shape {shape}: only key validity (padding) is expressible here, a mask "
      f"[B, 1, 1, N] = [{b}, 1, 1, {n}] (valid[:, None, None, :]); causality is causal=, "
      "a band is window= (or window_tokens=), packed sequences are segment_ids=[B, N]"
    )
  dtype = jnp.result_type(mask)
  if not (dtype == jnp.bool_ or jnp.issubdtype(dtype, jnp.integer)):
    raise ValueError(f"mask must be bool (True = attend) or integer, got dtype {dtype}")
  valid = jnp.broadcast_to(jnp.asarray(mask)[:, 0, 0, :] != 0, (b, n))
  base = jnp.ones((b, n), jnp.int32) if segment_ids is None else segment_ids
  return jnp.where(valid, base, 0).astype(jnp.int32)


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
  mask: jax.Array | None = None,
  dropout_rng: jax.Array | None = None,
) -> jax.Array:
  """Applies one attention layer of kind `cfg.kind` (the full forward: training, encoding).

  Args:
    params: `{name: array}` as laid out by `iha_jax.nn.config.param_specs(cfg)`.
    x: `[B, N, D]` input.
    cfg: the layer configuration.
    segment_ids: optional `[B, N]` int32 packed-sequence ids (0 = padding).
    positions: optional `[B, N]` int32 token positions (default `arange(N)`).
    layer: overrides `cfg.layer` (the layer's number, counted from 1; differential
      attention's depth); may be traced, e.g. inside a scan over layers.
    mask: optional key validity in flax's convention, `[B, 1, 1, N]` (`mask_segments`).
    dropout_rng: a PRNG key: apply `cfg.dropout_rate` (training); None: no dropout.

  Returns:
    `[B, N, D]` in the computation dtype (`cfg.dtype`, or the promoted dtype of `x` and
    the parameters when None).
  """
  check_input(x, cfg)
  if mask is not None:
    segment_ids = mask_segments(mask, segment_ids, x)
  p, x = to_compute_dtype(params, x, cfg)
  options = cfg.options(segment_ids=segment_ids, positions=positions, dropout_rng=dropout_rng)
  y = cfg.record.core(p, x, cfg, options, cfg.layer if layer is None else layer)
  y = checkpoint_name(with_logical_constraint(y, HEADS_AXES), ATTENTION_OUT)
  return project_out(p, y)


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
  num_pseudo = cfg.record.num_pseudo(cfg)
  return apply_rope(xv, virtual_positions(positions, num_pseudo), cfg.rope_theta)


def layer_attention_probabilities(
  params: Mapping[str, jax.Array],
  x: jax.Array,
  cfg: AttentionConfig,
  *,
  segment_ids: jax.Array | None = None,
  positions: jax.Array | None = None,
  mask: jax.Array | None = None,
) -> jax.Array:
  """The attention probabilities of one layer over its virtual sequence, float32
  `[B, H, T, T]` (`T = N*P` for IHA, N for MHA): `probs[b, h, t, s]` is the weight of
  virtual key s in virtual query t of head h; every non-padding row sums to 1, padding
  rows are zeros. From the XLA core's log-sum-exp under the training mask (its function
  exactly, at highest precision), dense in keys: for pictures of small N. Kinds that read
  as pseudo-head attention only (IHA, MHA: `AttentionKind.decodes`)."""
  if not cfg.record.decodes:
    raise ValueError(
      f"attention probabilities need a kind that reads as pseudo-head attention (IHA, "
      f"MHA: AttentionKind.decodes); this layer is {cfg.kind!r}"
    )
  check_input(x, cfg)
  if mask is not None:
    segment_ids = mask_segments(mask, segment_ids, x)
  p, x = to_compute_dtype(params, x, cfg)
  q, k, _ = project_qkv(p, x)
  positions = default_positions(x, positions)
  queries, keys = (
    jnp.swapaxes(rotated_pseudo_heads(p, cfg, which, t, positions), 1, 2)
    for which, t in (("q", q), ("k", k))
  )
  segments = None
  if segment_ids is not None:
    segments = virtual_segment_ids(segment_ids, cfg.record.num_pseudo(cfg))
  mask = Mask(causal=cfg.causal, window=cfg.window, segment_ids=segments)
  # Keys may have G < H heads (grouped-query).
  return grouped_attention_probabilities(queries, keys, mask, precision=jax.lax.Precision.HIGHEST)
