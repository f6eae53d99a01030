"""Loss, the train step (with gradient accumulation and a non-finite guard), the eval step."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import optax

from iha_jax.models.language_model import LanguageModel, Params
from iha_jax.train.state import TrainState

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


def check_loss(loss: str) -> None:
  if loss not in LOSSES:
    raise ValueError(f"loss must be one of {LOSSES}, got {loss!r}")


def loss_terms(
  model: LanguageModel, params: Params, batch: Batch, loss: str = "cross_entropy"
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Summed weighted loss (float32) and per-position correctness.

  Returns:
    `loss_sum` (scalar), and `{"weight_sum": scalar, "correct": [B, N] bool}` (+ for
    mean_squared_error `"errors": [B, N, O]`, output minus value); the mean loss is
    `loss_sum / weight_sum`. A position is correct when the argmax output
    (cross_entropy) or the sign of the logit (binary_cross_entropy) matches its target,
    or every output is within `REGRESSION_TOLERANCE` of its value (mean_squared_error).
  """
  logits = model.apply(
    params,
    batch["inputs"],
    features=batch.get("features"),
    # Absent: one unpadded document per row (what cuDNN's attention needs, see
    # iha_jax.ops.cudnn_attention); the input pipelines always give both.
    segment_ids=batch.get("segment_ids"),
    positions=batch.get("positions"),
  )  # [B, N, V] float32
  targets = batch["targets"]
  extra = {}
  if loss == "mean_squared_error":
    errors = logits - batch["values"].astype(jnp.float32)
    per_position = jnp.mean(jnp.square(errors), axis=-1)
    correct = jnp.all(jnp.abs(errors) <= REGRESSION_TOLERANCE, axis=-1)
    extra["errors"] = errors
  elif loss == "binary_cross_entropy":
    logit = logits[..., 0]
    per_position = optax.sigmoid_binary_cross_entropy(logit, targets.astype(jnp.float32))
    correct = (logit > 0) == (targets > 0)
  else:
    per_position = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    correct = jnp.argmax(logits, axis=-1) == targets
  weights = batch["weights"].astype(jnp.float32)
  aux = {"weight_sum": jnp.sum(weights), "correct": correct, **extra}
  return jnp.sum(per_position * weights), aux


def _grads(
  model: LanguageModel, params: Params, batch: Batch, accum_steps: int, loss: str
) -> tuple[jax.Array, jax.Array, Params]:
  """(loss_sum, weight_sum, grads of loss_sum) over `accum_steps` microbatches.

  Microbatch `i` is rows `i::accum_steps`, so every microbatch keeps the batch's
  ("data", "fsdp") sharding without a reshuffle between devices.
  """

  def micro(params, micro_batch):
    loss_sum, aux = loss_terms(model, params, micro_batch, loss)
    return loss_sum, aux["weight_sum"]

  grad_fn = jax.value_and_grad(micro, has_aux=True)
  if accum_steps == 1:
    (loss_sum, weight_sum), grads = grad_fn(params, batch)
    return loss_sum, weight_sum, grads

  def split(x: jax.Array) -> jax.Array:  # [B, N] -> [accum, B / accum, N]
    return jnp.swapaxes(x.reshape(x.shape[0] // accum_steps, accum_steps, *x.shape[1:]), 0, 1)

  def body(carry, micro_batch):
    loss_sum, weight_sum, grads = carry
    (l, w), g = grad_fn(params, micro_batch)
    return (loss_sum + l, weight_sum + w, jax.tree.map(jnp.add, grads, g)), None

  zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
  init = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32), zeros)
  (loss_sum, weight_sum, grads), _ = jax.lax.scan(body, init, jax.tree.map(split, dict(batch)))
  return loss_sum, weight_sum, grads


def make_train_step(
  model: LanguageModel,
  tx: optax.GradientTransformation,
  schedule: optax.Schedule,
  accum_steps: int,
  loss: str = "cross_entropy",
) -> Callable[[TrainState, Batch], tuple[TrainState, dict[str, jax.Array]]]:
  """`(state, batch) -> (new_state, metrics)`; jit it with shardings and donation.

  `loss` is one of `LOSSES`.

  The loss is the weighted mean over all (micro)batches, identical to one big batch.
  A non-finite loss or gradient leaves the state unchanged (`metrics["finite"]` is
  False), so a NaN never reaches the parameters or a checkpoint.
  """

  def step(state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, jax.Array]]:
    loss_sum, weight_sum, grads = _grads(model, state.params, batch, accum_steps, loss)
    denom = jnp.maximum(weight_sum, 1.0)
    mean_loss = loss_sum / denom
    grads = jax.tree.map(lambda g, p: (g / denom).astype(p.dtype), grads, state.params)
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(mean_loss) & jnp.isfinite(grad_norm)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    new = TrainState(step=state.step + 1, params=params, opt_state=opt_state)
    # Select, not cond: both branches are already computed and this keeps shardings.
    new = jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, state)
    metrics = {
      "loss": mean_loss,
      "grad_norm": grad_norm,
      "learning_rate": schedule(state.step),
      "finite": finite,
      "weight_sum": weight_sum,
    }
    return new, metrics

  check_loss(loss)
  return step


def make_eval_step(
  model: LanguageModel, loss: str = "cross_entropy"
) -> Callable[[Params, Batch], dict[str, jax.Array]]:
  """`(params, batch) -> sums`: loss_sum, weight_sum, exact-match count and examples
  (+ for mean_squared_error, per output column over the weighted positions:
  `value_sum`, `value_sq_sum` and `sq_err_sum`, `[O]`, from which R^2 follows).

  An example is a row with any weighted position (tasks are one example per row);
  it is exactly matched when every weighted target position is predicted right.
  """

  def step(params: Params, batch: Batch) -> dict[str, jax.Array]:
    loss_sum, aux = loss_terms(model, params, batch, loss)
    scored = batch["weights"] > 0
    has_target = jnp.any(scored, axis=-1)
    all_right = jnp.all(aux["correct"] | ~scored, axis=-1) & has_target
    sums = {
      "loss_sum": loss_sum,
      "weight_sum": aux["weight_sum"],
      "token_correct": jnp.sum(aux["correct"] & scored),
      "exact_match": jnp.sum(all_right),
      "examples": jnp.sum(has_target),
    }
    if loss == "mean_squared_error":
      w = batch["weights"].astype(jnp.float32)[..., None]
      values = batch["values"].astype(jnp.float32)
      sums["value_sum"] = jnp.sum(w * values, axis=(0, 1))
      sums["value_sq_sum"] = jnp.sum(w * jnp.square(values), axis=(0, 1))
      sums["sq_err_sum"] = jnp.sum(w * jnp.square(aux["errors"]), axis=(0, 1))
    return sums

  check_loss(loss)
  return step
