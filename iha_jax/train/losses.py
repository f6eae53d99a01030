"""The losses, in float32: per-position cross-entropy, binary cross-entropy and squared
error, and the chunked cross-entropy that never builds the whole `[B, N, V]` logits.

`loss_terms(model, params, batch, loss, chunk_tokens)` is what the train and eval steps
differentiate and sum. With vocabulary logits (`model.num_outputs` None) and a sequence
longer than `chunk_tokens`, the logits exist one chunk at a time: a loop over chunks of
`chunk_tokens` positions (every row of the batch at once) builds each chunk's logits
`[B, c, V]` from the final normalised hidden states and the output head. Under
differentiation (a custom VJP) the same loop also takes each chunk's logit gradient and
turns it into the gradients of the hidden states and of the head at once, so the
backward only scales them by the loss's cotangent: no logits are saved or recomputed,
and the head is multiplied three times per chunk, as autodiff of the plain loss does.
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

from iha_jax.checks import is_int
from iha_jax.models import TransformerConfig
from iha_jax.models.functional_lm import FunctionalTransformerLM, Params
from iha_jax.models.transformer import output_logits
from iha_jax.parallel.axes import ACTIVATION_BATCH, ACTIVATION_LENGTH, RESIDUAL_AXES, VOCAB
from iha_jax.parallel.rules import free_mesh_axes

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

  Differentiable (reverse mode) in `hidden` and the output head: the gradients are
  computed in the forward pass, chunk by chunk (module docstring). Under a mesh the
  chunks run in `shard_map` over the batch and sequence (`context`) axes, each device
  chunking its own rows and positions, the other axes left to the compiler: the head is
  gathered over the batch axes once, as for the plain loss (logits stay vocab-sharded
  over `tensor`), and its gradient is summed per device over the chunks in float32 and
  reduced over the manual axes once, in the compute dtype, as autodiff of the plain loss
  reduces it.

  Args:
    hidden: final normalised hidden states `[B, N, D]` (the output head's input).
    params: the model's top-level parameters (`embedding [V, D]`, `lm_head [D, V]`).
    targets: `[B, N]` int token ids; weights: `[B, N]` float32 (0 = padding).
    config: the model config (vocabulary logits: `num_outputs` None).
    chunk_tokens: positions per chunk c; the last `N % c` positions form one more chunk.
  """
  tied = "lm_head" not in params
  head = params["embedding"] if tied else params["lm_head"]
  mesh = jax.sharding.get_abstract_mesh()
  batch_axes, length_axes = _row_axes(mesh, hidden.shape[:2])
  axes = batch_axes + length_axes
  if axes:
    # Whole over the batch (FSDP) axes, outside the loop: the compiler gathers it as for
    # the plain loss (and as the embedding lookup does, with which it can share it).
    head = nn.with_logical_constraint(head, (VOCAB, None) if tied else (None, VOCAB))
  local = functools.partial(
    _chunked_local, tied=tied, config=config, chunk_tokens=chunk_tokens, manual=axes
  )

  def run(with_grads: bool, *args: jax.Array) -> tuple[jax.Array, ...]:
    fn = functools.partial(local, with_grads=with_grads)
    if not axes:
      return fn(*args)
    rows = P(_as_spec(batch_axes), _as_spec(length_axes))
    return jax.shard_map(
      fn,
      mesh=mesh,
      in_specs=(P(), rows, rows, rows),
      out_specs=(P(), rows) + ((P(), rows) if with_grads else ()),
      axis_names=set(axes),
    )(*args)

  @jax.custom_vjp
  def loss(head, hidden, targets, weights):
    return run(False, head, hidden, targets, weights)

  def forward(head, hidden, targets, weights):
    total, correct, grad_head, grad_hidden = run(True, head, hidden, targets, weights)
    return (total, correct), (grad_head, grad_hidden)

  head_dtype, hidden_dtype = head.dtype, hidden.dtype

  def backward(residuals, cotangents):
    grad_head, grad_hidden = residuals
    g = cotangents[0]  # of the loss sum; `correct` has none
    return (g * grad_head).astype(head_dtype), (g * grad_hidden).astype(hidden_dtype), None, None

  loss.defvjp(forward, backward)
  return loss(head, hidden, targets, weights)


def _row_axes(mesh: Any, shape: tuple[int, int]) -> tuple[tuple[str, ...], tuple[str, ...]]:
  """The mesh axes the rules split `[B, N]` over (batch axes, sequence axes; those not
  already manual and that `B` or `N` divide over): the chunked loss's `shard_map` runs
  over them, each device chunking its own rows and positions; both () without a mesh."""
  if mesh.empty:
    return (), ()
  sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
  found = []
  for logical, extent in zip((ACTIVATION_BATCH, ACTIVATION_LENGTH), shape):
    axes = free_mesh_axes(mesh, logical)
    found.append(axes if extent % math.prod(sizes[a] for a in axes) == 0 else ())
  return found[0], found[1]


def _chunked_local(
  head: jax.Array,
  hidden: jax.Array,
  targets: jax.Array,
  weights: jax.Array,
  *,
  tied: bool,
  config: TransformerConfig,
  chunk_tokens: int,
  manual: tuple[str, ...],
  with_grads: bool,
) -> tuple[jax.Array, ...]:
  """`chunked_cross_entropy` on this device's rows (all rows without a mesh): loss sum
  and correct `[B, N]`, and `with_grads` the loss sum's gradients w.r.t. `head` (compute
  dtype) and `hidden` (float32 `[B, N, D]`); sums reduced over the `manual` axes (those
  `shard_map` made manual)."""
  n = hidden.shape[1]
  full = n - n % chunk_tokens
  # Inside shard_map the manual axes leave the rules: constraints name only auto axes.
  rules = tuple(
    (name, _without(mesh_axes, manual)) for name, mesh_axes in nn.get_logical_axis_rules()
  )
  whole = head.astype(config.dtype)  # cast once (`output_logits` would cast per chunk)
  heads = {"embedding": whole, "lm_head": None} if tied else {"embedding": None, "lm_head": whole}

  def chunk(h: jax.Array, t: jax.Array, w: jax.Array) -> tuple[jax.Array, ...]:
    """One chunk `h: [B, c, D]`: loss sum, correct `[B, c]` (+ the gradients w.r.t. the
    logits `[B, c, V]` and w.r.t. `h`, float32)."""
    with nn.logical_axis_rules(rules):
      h = nn.with_logical_constraint(h, RESIDUAL_AXES)
      logits = output_logits(h, heads, config)  # [B, c, V] float32, vocab-sharded

    def loss_sum(logits: jax.Array) -> tuple[jax.Array, jax.Array]:
      per_position, correct, _ = position_losses(logits, t, "cross_entropy")
      return jnp.sum(per_position * w), correct

    if not with_grads:
      return loss_sum(logits)
    (total, correct), grad_logits = jax.value_and_grad(loss_sum, has_aux=True)(logits)
    # The two products autodiff makes of `output_logits`, with its operand dtypes (float32
    # logit gradients times the compute-dtype head or `h`, no upcast copy of the head).
    grad_h = jax.lax.dot_general(
      grad_logits,
      whole,
      (((2,), (0 if tied else 1,)), ((), ())),
      preferred_element_type=jnp.float32,
    )
    return total, correct, grad_logits, grad_h

  xs = tuple(_split(x, full, chunk_tokens) for x in (hidden, targets, weights))
  tail = (hidden[:, full:], targets[:, full:], weights[:, full:])
  if not with_grads:
    sums, correct = jax.lax.map(lambda x: chunk(*x), xs)
    parts = [(jnp.sum(sums), _merge(correct))]
    if full < n:
      parts.append(chunk(*tail))
    total, correct = sum(p[0] for p in parts), jnp.concatenate([p[1] for p in parts], axis=1)
    return (jax.lax.psum(total, manual) if manual else total), correct

  def body(acc: jax.Array, x: tuple[jax.Array, ...]) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    total, correct, grad_logits, grad_h = chunk(*x)
    return acc + _head_grad(x[0], grad_logits, tied), (total, correct, grad_h)

  # The head's gradient sums over the chunks in float32 on each device.
  acc = jnp.zeros(whole.shape, jnp.float32)
  if manual:
    acc = jax.lax.pcast(acc, manual, to="varying")
  acc, (sums, correct, grad_hidden) = jax.lax.scan(body, acc, xs)
  parts = [(jnp.sum(sums), _merge(correct), _merge(grad_hidden))]
  if full < n:
    acc, last = body(acc, tail)
    parts.append(last)
  total = sum(p[0] for p in parts)
  correct, grad_hidden = (jnp.concatenate([p[i] for p in parts], axis=1) for i in (1, 2))
  grad_head = acc.astype(config.dtype)
  if manual:
    total = jax.lax.psum(total, manual)
    grad_head = jax.lax.psum(grad_head, manual)
  return total, correct, grad_head, grad_hidden


def _split(x: jax.Array, full: int, chunk_tokens: int) -> jax.Array:
  """`[B, N, ...]` -> its first `full` positions as `[full / c, B, c, ...]`."""
  x = x[:, :full].reshape(x.shape[0], full // chunk_tokens, chunk_tokens, *x.shape[2:])
  return jnp.swapaxes(x, 0, 1)


def _merge(x: jax.Array) -> jax.Array:
  """`[K, B, c, ...]` -> `[B, K * c, ...]`."""
  return jnp.swapaxes(x, 0, 1).reshape(x.shape[1], -1, *x.shape[3:])


def _head_grad(h: jax.Array, grad_logits: jax.Array, tied: bool) -> jax.Array:
  """One chunk's gradient of the head, float32 `[V, D]` (tied) or `[D, V]`."""
  lhs, rhs = (grad_logits, h) if tied else (h, grad_logits)
  return jax.lax.dot_general(
    lhs, rhs, (((0, 1), (0, 1)), ((), ())), preferred_element_type=jnp.float32
  )


def _names(mesh_axes: Any) -> tuple[str, ...]:
  """A rule's mesh axes (None, a name or a tuple of names) as a tuple."""
  return (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes or ())


def _as_spec(names: tuple[str, ...]) -> Any:
  """Mesh axis names as one `PartitionSpec` entry (None, a name or a tuple)."""
  return None if not names else names[0] if len(names) == 1 else names


def _without(mesh_axes: Any, manual: tuple[str, ...]) -> Any:
  """A rule's mesh axes minus the `manual` ones."""
  return _as_spec(tuple(a for a in _names(mesh_axes) if a not in manual))


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
  model: FunctionalTransformerLM,
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
    # iha_jax.core.cudnn_attention); the input pipelines always give both.
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
