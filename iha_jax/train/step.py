"""The train step (with gradient accumulation and a non-finite guard) and the eval step;
the losses are in `iha_jax.train.losses`."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

from iha_jax.models.functional_lm import FunctionalTransformerLM, Params
from iha_jax.train.losses import DEFAULT_LOSS_CHUNK_TOKENS, Batch, check_loss, loss_terms
from iha_jax.train.state import TrainState


def _grads(
  model: FunctionalTransformerLM,
  params: Params,
  batch: Batch,
  accum_steps: int,
  loss: str,
  chunk_tokens: int | None,
) -> tuple[jax.Array, jax.Array, Params]:
  """(loss_sum, weight_sum, grads of loss_sum) over `accum_steps` microbatches, microbatch
  `i` the rows `i::accum_steps` (each keeps the batch's sharding without a reshuffle)."""

  def micro(params, micro_batch):
    loss_sum, aux = loss_terms(model, params, micro_batch, loss, chunk_tokens)
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
  model: FunctionalTransformerLM,
  tx: optax.GradientTransformation,
  schedule: optax.Schedule,
  accum_steps: int,
  loss: str = "cross_entropy",
  loss_chunk_tokens: int | None = DEFAULT_LOSS_CHUNK_TOKENS,
) -> Callable[[TrainState, Batch], tuple[TrainState, dict[str, jax.Array]]]:
  """`(state, batch) -> (new_state, metrics)`; jit it with shardings and donation.

  `loss` is one of `iha_jax.train.losses.LOSSES`; `loss_chunk_tokens` the sequence
  positions per chunk of the chunked cross-entropy (None or 0: whole logits).

  The loss is the weighted mean over all (micro)batches, identical to one big batch.
  A non-finite loss or gradient leaves the state unchanged (`metrics["finite"]` is
  False), so a NaN never reaches the parameters or a checkpoint.
  """

  def step(state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, jax.Array]]:
    loss_sum, weight_sum, grads = _grads(
      model, state.params, batch, accum_steps, loss, loss_chunk_tokens
    )
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
  model: FunctionalTransformerLM,
  loss: str = "cross_entropy",
  loss_chunk_tokens: int | None = DEFAULT_LOSS_CHUNK_TOKENS,
) -> Callable[[Params, Batch], dict[str, jax.Array]]:
  """`(params, batch) -> sums`: loss_sum, weight_sum, exact-match count and examples
  (+ for mean_squared_error, per output column over the weighted positions:
  `value_sum`, `value_sq_sum` and `sq_err_sum`, `[O]`, from which R^2 follows).

  An example is a row with any weighted position (tasks are one example per row);
  it is exactly matched when every weighted target position is predicted right.
  The loss path is the train step's (`loss_chunk_tokens` alike).
  """

  def step(params: Params, batch: Batch) -> dict[str, jax.Array]:
    loss_sum, aux = loss_terms(model, params, batch, loss, loss_chunk_tokens)
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
