"""Evaluation of trained checkpoints: metrics, long-context sweep, attention pictures."""

from iha_jax.extras import require

require("train", "iha_jax.eval")

from iha_jax.eval.runs import (
  EvalError,
  RunNotFoundError,
  attention_pictures,
  evaluate_workdir,
  parse_mesh,
  restore_run,
)
from iha_jax.eval.sweep import length_sweep, parse_lengths, sweep_png

__all__ = [
  "EvalError",
  "RunNotFoundError",
  "attention_pictures",
  "evaluate_workdir",
  "length_sweep",
  "parse_lengths",
  "parse_mesh",
  "restore_run",
  "sweep_png",
]
