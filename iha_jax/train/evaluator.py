"""The evaluation pass over one split: loss, perplexity, exact match.

`Evaluator` is the one evaluation computation: the training loop (`Trainer`) runs it every
`eval_every` steps, and `iha_jax.eval` (behind `eval.py`) runs it on saved runs, beside
the tools only saved runs need (length sweeps, attention maps, completions).
"""

from __future__ import annotations

import math
from typing import Any

import grain
import jax
import numpy as np
from jax.sharding import Mesh

from iha_jax import parallel
from iha_jax.models import FunctionalTransformerLM
from iha_jax.train.losses import DEFAULT_LOSS_CHUNK_TOKENS
from iha_jax.train.step import make_eval_step


class Evaluator:
  """Compiles the eval step once for a model, mesh and parameter shardings; the loss
  path is the train step's (`loss_chunk_tokens`: `iha_jax.train.losses.loss_chunk_tokens`
  of the run's train config)."""

  def __init__(
    self,
    model: FunctionalTransformerLM,
    mesh: Mesh,
    param_shardings: Any,
    loss: str = "cross_entropy",
    loss_chunk_tokens: int | None = DEFAULT_LOSS_CHUNK_TOKENS,
  ):
    self.mesh = mesh
    with parallel.activate(mesh):
      self._step = jax.jit(
        make_eval_step(model, loss, loss_chunk_tokens),
        in_shardings=(param_shardings, parallel.batch_sharding(mesh)),
        out_shardings=parallel.replicated(mesh),
      )

  def evaluate(self, params: Any, batches: grain.DatasetIterator) -> dict[str, float]:
    """One pass over `batches` -> loss, perplexity, token_accuracy, exact_match, examples
    (+ r_squared for regression).

    `exact_match` is the fraction of examples (rows with a weighted target) whose every
    weighted target is predicted right (argmax, or the logit's sign for binary outputs,
    or every output within `REGRESSION_TOLERANCE` for regression). `r_squared` is the
    coefficient of determination of each output column over the weighted positions,
    averaged over the columns (each column counts alike, whatever its scale).
    """
    totals: dict[str, Any] = {}
    with parallel.activate(self.mesh):
      for local_batch in batches:
        sums = self._step(params, parallel.shard_batch(local_batch, self.mesh))
        for key, value in jax.device_get(sums).items():
          totals[key] = totals.get(key, 0.0) + np.asarray(value, np.float64)
    totals = {k: float(v) if np.ndim(v) == 0 else v for k, v in totals.items()}
    weights = max(totals.get("weight_sum", 0.0), 1.0)
    loss = totals.get("loss_sum", 0.0) / weights
    extra = {}
    if "sq_err_sum" in totals:
      total_sq = totals["value_sq_sum"] - np.square(totals["value_sum"]) / weights
      extra["r_squared"] = float(np.mean(1.0 - totals["sq_err_sum"] / np.maximum(total_sq, 1e-12)))
    return {
      **extra,
      "loss": loss,
      "perplexity": math.exp(min(loss, 700.0)),
      "token_accuracy": totals.get("token_correct", 0.0) / weights,
      "exact_match": totals.get("exact_match", 0.0) / max(totals.get("examples", 0.0), 1.0),
      "examples": int(totals.get("examples", 0.0)),
    }
