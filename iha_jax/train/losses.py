"""The losses, in float32: per-position cross-entropy, binary cross-entropy and squared
error, and the chunked cross-entropy that never builds the whole `[B, N, V]` logits.

`loss_terms(model, params, batch, loss, chunk_tokens)` is what the train and eval steps
differentiate and sum. With vocabulary logits (`model.num_outputs` None) and a sequence
longer than `chunk_tokens`, the logits exist one chunk at a time: `lax.scan` over chunks
of `chunk_tokens` positions (every row of the batch at once), each chunk's logits
`[B, c, V]` computed from the final normalised hidden states and the output head inside
`jax.checkpoint`, so the backward recomputes them chunk by chunk instead of saving them.
The last `N % chunk_tokens` positions, if any, form one shorter chunk. Loss sum, weight
sum, per-position correctness and every gradient equal the plain loss's (to float
summation order). Per-token heads (`num_outputs` O, a few) give `[B, N, O]` outputs, at
most O / V of the logits: they always take the plain path.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import linen as nn
from jax.sharding import PartitionSpec as P

from iha_jax.models import TransformerConfig
from iha_jax.models.language_model import LanguageModel, Params
from iha_jax.models.transformer import output_logits
from iha_jax.ops.validation import is_int
from iha_jax.parallel.axes import RESIDUAL_AXES
from iha_jax.parallel.sharding import kernel_axes

# inputs, targets, segment_ids, positions, weights: [B, N]; with continuous inputs also
# features [B, N, F]; for regression, values [B, N, num_outputs].
Batch = Mapping[str, jax.Array]

# "cross_entropy": softmax over the outputs (vocabulary or num_outputs classes), integer
# targets. "binary_cross_entropy": one sigmoid output per position (num_outputs=1),
# targets 0/1 (e.g. per-cell labels of an encoder). "mean_squared_error": regression of
# the num_outputs outputs on `values` (the squared error averaged over the outputs).
LOSSES = ("cross_entropy", "binary_cross_entropy", "mean_squared_error")
# A regression position counts as correct when every output is within this of its value.
REGRESSION_TOLERANCE = 0.1
# Sequence positions per loss chunk (`train.loss_chunk_tokens`): at the paper's 2.4B
# shape (V = 128256) one chunk of 2 rows is 1 GiB of float32 logits instead of 7.8 GiB
# for 8192 positions; sequences no longer than this take the plain loss.
DEFAULT_LOSS_CHUNK_TOKENS = 1024


def check_loss(loss: str) -> None:
  if loss not in LOSSES:
    raise ValueError(f"loss must be one of {LOSSES}, got {loss!r}")


def chunk_tokens_problem(value: Any) -> str | None:
  """Why `value` is not a valid `train.loss_chunk_tokens` (None: it is)."""
  if value is None or is_int(value, 0):
    return None
  return (
    f"train.loss_chunk_tokens must be an integer >= 0 (sequence positions per loss chunk; "
    f"0 or None: the plain loss), got {value!r}"
  )


def loss_chunk_tokens(train_cfg: Any) -> int | None:
  """`train.loss_chunk_tokens` of a train config (its default when absent, e.g. in an
  older checkpoint's config); None for the plain loss."""
  return train_cfg.get("loss_chunk_tokens", DEFAULT_LOSS_CHUNK_TOKENS) or None


def position_losses(
  logits: jax.Array, targets: jax.Array, loss: str, values: jax.Array | None = None
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
  """float32 `logits: [B, N, O]` -> (per-position loss `[B, N]`, correct `[B, N]` bool,
  errors `[B, N, O]` for mean_squared_error else None).

  A position is correct when the argmax output (cross_entropy) or the sign of the logit
  (binary_cross_entropy) matches its target, or every output is within
  `REGRESSION_TOLERANCE` of its `values` (mean_squared_error, `values: [B, N, O]`).
  """
  if loss == "mean_squared_error":
    errors = logits - values.astype(jnp.float32)
    correct = jnp.all(jnp.abs(errors) <= REGRESSION_TOLERANCE, axis=-1)
    return jnp.mean(jnp.square(errors), axis=-1), correct, errors
  if loss == "binary_cross_entropy":
    logit = logits[..., 0]
    per_position = optax.sigmoid_binary_cross_entropy(logit, targets.astype(jnp.float32))
    return per_position, (logit > 0) == (targets > 0), None
  per_position = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
  return per_position, jnp.argmax(logits, axis=-1) == targets, None


def chunked_cross_entropy(
  hidden: jax.Array,
  params: Params,
  targets: jax.Array,
  weights: jax.Array,
  config: TransformerConfig,
  chunk_tokens: int,
) -> tuple[jax.Array, jax.Array]:
  """Weighted cross-entropy sum (float32 scalar) and correct `[B, N]` bool of the
  vocabulary logits of `hidden`, built `chunk_tokens` positions at a time.

  Under a mesh this runs in `shard_map` over the batch axes (rows are independent), the
  vocabulary axis left to the compiler (logits stay vocab-sharded over `tensor`): the
  output head is gathered once at the boundary and its gradient is summed per device
  over the chunks and reduced over the batch axes once, not once per chunk.

  Args:
    hidden: final normalised hidden states `[B, N, D]` (the output head's input).
    params: the model's top-level parameters (`embedding [V, D]`, `lm_head [D, V]`).
    targets: `[B, N]` int token ids; weights: `[B, N]` float32 (0 = padding).
    config: the model config (vocabulary logits: `num_outputs` None).
    chunk_tokens: positions per chunk c; the last `N % c` positions form one more chunk.
  """
  # float32 head, cast per chunk inside `output_logits`: its gradient sums in float32.
  lm_head = params.get("lm_head")
  heads = {"embedding": None if lm_head is not None else params["embedding"], "lm_head": lm_head}
  local = functools.partial(_chunked_local, config=config, chunk_tokens=chunk_tokens)
  mesh = jax.sharding.get_abstract_mesh()
  axes = _batch_axes(mesh, hidden.shape[0])
  if not axes:
    return local(heads, hidden, targets, weights, manual=())
  rows = P(axes)
  return jax.shard_map(
    functools.partial(local, manual=axes),
    mesh=mesh,
    in_specs=(P(), rows, rows, rows),
    out_specs=(P(), rows),
    axis_names=set(axes),
  )(heads, hidden, targets, weights)


def _batch_axes(mesh: Any, rows: int) -> tuple[str, ...]:
  """The mesh axes the rules split the batch over (not already manual), if the `rows`
  divide over them; () runs the chunked loss without `shard_map`."""
  axes = kernel_axes(mesh)
  if not axes or not axes["batch_axes"]:
    return ()
  batch_axes = tuple(axes["batch_axes"])
  size = math.prod(dict(zip(mesh.axis_names, mesh.axis_sizes))[a] for a in batch_axes)
  return batch_axes if rows % size == 0 else ()


def _chunked_local(
  heads: Params,
  hidden: jax.Array,
  targets: jax.Array,
  weights: jax.Array,
  *,
  config: TransformerConfig,
  chunk_tokens: int,
  manual: tuple[str, ...],
) -> tuple[jax.Array, jax.Array]:
  """`chunked_cross_entropy` on this device's rows (all rows without a mesh); `manual`:
  the batch axes `shard_map` made manual (the loss sum is reduced over them)."""
  b, n, _ = hidden.shape
  full = n - n % chunk_tokens
  # Inside shard_map the manual axes leave the rules: constraints name only auto axes.
  rules = tuple(
    (name, _without(mesh_axes, manual)) for name, mesh_axes in nn.get_logical_axis_rules()
  )

  # Saves only its inputs: the backward recomputes this chunk's logits.
  @functools.partial(jax.checkpoint, prevent_cse=False)
  def chunk(heads: Params, h: jax.Array, t: jax.Array, w: jax.Array) -> tuple[jax.Array, ...]:
    with nn.logical_axis_rules(rules):
      h = nn.with_logical_constraint(h, RESIDUAL_AXES)  # [B, c, D]
      logits = output_logits(h, heads, config)  # [B, c, V] float32, vocab-sharded
    per_position, correct, _ = position_losses(logits, t, "cross_entropy")
    return jnp.sum(per_position * w), correct

  def split(x: jax.Array) -> jax.Array:  # [B, full, ...] -> [full / c, B, c, ...]
    x = x[:, :full].reshape(b, full // chunk_tokens, chunk_tokens, *x.shape[2:])
    return jnp.swapaxes(x, 0, 1)

  if manual:
    # The head becomes per-device once, here: the transpose of that cast, the sum of
    # the head's gradient over the batch axes, then runs once after the loop.
    heads = jax.lax.pcast(heads, manual, to="varying")
  # Chunk sums as outputs, not a carry: no float sum crosses iterations of the loop.
  sums, correct = jax.lax.map(
    lambda xs: chunk(heads, *xs), (split(hidden), split(targets), split(weights))
  )
  total = jnp.sum(sums)
  correct = jnp.swapaxes(correct, 0, 1).reshape(b, full)
  if full < n:
    tail_sum, tail_correct = chunk(heads, hidden[:, full:], targets[:, full:], weights[:, full:])
    total = total + tail_sum
    correct = jnp.concatenate([correct, tail_correct], axis=1)
  if manual:
    total = jax.lax.psum(total, manual)
  return total, correct


def _without(mesh_axes: Any, manual: tuple[str, ...]) -> Any:
  """A rule's mesh axes (None, a name or a tuple of names) minus the `manual` ones."""
  names = (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes or ())
  kept = tuple(a for a in names if a not in manual)
  return None if not kept else kept[0] if len(kept) == 1 else kept


def uses_chunks(config: TransformerConfig, loss: str, chunk_tokens: int | None, n: int) -> bool:
  """Whether `loss_terms` builds the logits in chunks: vocabulary logits, cross-entropy,
  and a sequence of `n` positions longer than `chunk_tokens`."""
  return (
    config.num_outputs is None
    and loss == "cross_entropy"
    and bool(chunk_tokens)
    and n > chunk_tokens
  )


def loss_terms(
  model: LanguageModel,
  params: Params,
  batch: Batch,
  loss: str = "cross_entropy",
  chunk_tokens: int | None = DEFAULT_LOSS_CHUNK_TOKENS,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Summed weighted loss (float32) and per-position correctness.

  `chunk_tokens`: positions per loss chunk (module docstring); None or 0: the whole
  logits at once.

  Returns:
    `loss_sum` (scalar), and `{"weight_sum": scalar, "correct": [B, N] bool}` (+ for
    mean_squared_error `"errors": [B, N, O]`, output minus value); the mean loss is
    `loss_sum / weight_sum`. Correctness: `position_losses`.
  """
  problem = chunk_tokens_problem(chunk_tokens)
  if problem:
    raise ValueError(problem)
  hidden = model.hidden_states(
    params,
    batch["inputs"],
    features=batch.get("features"),
    # Absent: one unpadded document per row (what cuDNN's attention needs, see
    # iha_jax.ops.cudnn_attention); the input pipelines always give both.
    segment_ids=batch.get("segment_ids"),
    positions=batch.get("positions"),
  )  # [B, N, D]
  targets = batch["targets"]
  weights = batch["weights"].astype(jnp.float32)
  aux = {"weight_sum": jnp.sum(weights)}
  if uses_chunks(model.config, loss, chunk_tokens, targets.shape[1]):
    loss_sum, aux["correct"] = chunked_cross_entropy(
      hidden, params, targets, weights, model.config, chunk_tokens
    )
    return loss_sum, aux
  logits = output_logits(hidden, params, model.config)  # [B, N, V or O] float32
  per_position, aux["correct"], errors = position_losses(logits, targets, loss, batch.get("values"))
  if errors is not None:
    aux["errors"] = errors
  return jnp.sum(per_position * weights), aux
