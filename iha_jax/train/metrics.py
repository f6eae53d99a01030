"""Metric sinks: WORKDIR/metrics.jsonl, TensorBoard events, a progress bar on terminals.

WORKDIR may be local or remote (`gs://...`): both files go through etils.epath
(`iha_jax.storage`). Only process 0 writes; the others keep silent no-op writers.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Mapping
from typing import Any

import jax

from iha_jax import storage


class MetricsWriter:
  """Appends one JSON object per logged step to `metrics.jsonl` and mirrors scalars to
  TensorBoard (tensorboardX, no TensorFlow needed) under `workdir/tensorboard`.

  `progress_bar` (default: whether stdout is a terminal) shows a tqdm bar; evaluation
  results are then printed above it, other steps only update its loss."""

  def __init__(
    self, workdir: str, *, total_steps: int, initial_step: int = 0, progress_bar: bool | None = None
  ):
    self.enabled = jax.process_index() == 0
    self._jsonl = self._tb = self._bar = None
    if not self.enabled:
      return
    storage.makedirs(workdir)
    # Append: a resumed run continues the same file (steps after the restore point
    # of a killed run may appear twice; readers keep the last occurrence).
    self._jsonl = storage.TextLog(storage.join(workdir, "metrics.jsonl"))
    try:
      import tensorboardX  # pylint: disable=import-outside-toplevel

      storage.register_tensorboard_factories()
      self._tb = tensorboardX.SummaryWriter(storage.join(workdir, "tensorboard"))
    except ImportError:
      logging.warning("tensorboardX is not installed: no TensorBoard events")
    if sys.stdout.isatty() if progress_bar is None else progress_bar:
      import tqdm  # pylint: disable=import-outside-toplevel

      self._bar = tqdm.tqdm(
        total=total_steps, initial=initial_step, unit="step", dynamic_ncols=True
      )

  def write(self, step: int, metrics: Mapping[str, Any]) -> None:
    """Records `metrics` (scalars) for `step`."""
    if not self.enabled:
      return
    record = {"step": int(step), **{k: _scalar(v) for k, v in metrics.items()}}
    self._jsonl.write(json.dumps(record) + "\n")
    self._jsonl.flush()
    if self._tb is not None:
      for key, value in record.items():
        if key != "step" and isinstance(value, (int, float)):
          self._tb.add_scalar(key, value, step)
      self._tb.flush()
    line = f"step {step}: " + ", ".join(
      f"{k}={v:.5g}" if isinstance(v, float) else f"{k}={v}"
      for k, v in record.items()
      if k != "step"
    )
    if self._bar is None or "loss" not in record:
      logging.info("%s", line)
      return
    self._bar.set_postfix(loss=f"{record['loss']:.4f}")
    evals = {k: v for k, v in record.items() if k.startswith("eval_")}
    if evals:  # evaluations are rare and worth keeping on screen: print above the bar
      self._bar.write(
        f"step {step}: "
        + ", ".join(
          f"{k}={v:.5g}" if isinstance(v, float) else f"{k}={v}" for k, v in evals.items()
        )
      )

  def advance(self, steps: int = 1) -> None:
    """Moves the progress bar (terminals only)."""
    if self._bar is not None:
      self._bar.update(steps)

  def close(self) -> None:
    for sink in (self._bar, self._tb, self._jsonl):
      if sink is not None:
        sink.close()


def _scalar(value: Any) -> Any:
  """Device/numpy scalars -> Python numbers (bools stay bools)."""
  if hasattr(value, "item"):
    value = value.item()
  return value


class _LibraryInfoFilter(logging.Filter):
  """Drops INFO/DEBUG records of chatty libraries (Orbax logs every file it writes)."""

  QUIET = ("/orbax/", "/grain/", "/jax/_src/")

  def filter(self, record: logging.LogRecord) -> bool:
    return record.levelno >= logging.WARNING or not any(
      part in record.pathname for part in self.QUIET
    )


def quiet_library_logs() -> None:
  """Keeps this project's INFO logs and hides Orbax/Grain/JAX INFO chatter."""
  from absl import logging as absl_logging  # pylint: disable=import-outside-toplevel

  absl_logging.get_absl_handler().addFilter(_LibraryInfoFilter())
