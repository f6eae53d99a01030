"""Evaluation of trained checkpoints: metrics, long-context sweep, attention pictures.

Evaluating saved runs (`evaluate_workdir`, `length_sweep`, ...) needs the 'train' extra,
checked when one of those names is first read; the attention maps
(`iha_jax.eval.attention_maps`) need only the model, and drawing them the 'plots' extra.
"""

from __future__ import annotations

import importlib
from typing import Any

from iha_jax.extras import require

# Name -> the submodule that defines it (both need the 'train' extra).
_TRAIN_NAMES = {
  "EvalError": "runs",
  "RunNotFoundError": "runs",
  "attention_pictures": "runs",
  "evaluate_workdir": "runs",
  "parse_mesh": "runs",
  "restore_run": "runs",
  "length_sweep": "sweep",
  "parse_lengths": "sweep",
  "sweep_png": "sweep",
}


def __getattr__(name: str) -> Any:
  """The evaluation names, imported on first use (PEP 562), so that importing a submodule
  that needs no extra (`attention_maps`) does not import the training stack."""
  if name not in _TRAIN_NAMES:
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
  require("train", "iha_jax.eval")
  return getattr(importlib.import_module(f"{__name__}.{_TRAIN_NAMES[name]}"), name)


__all__ = sorted(_TRAIN_NAMES)
