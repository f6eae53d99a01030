"""Metric sinks: WORKDIR/metrics.jsonl, TensorBoard events, a progress bar on terminals.

Only process 0 writes; the others keep silent no-op writers.
"""
from __future__ import annotations

import json
import logging
import os
import sys
from typing import Any, Mapping

import jax


class MetricsWriter:
  """Appends one JSON object per logged step to `metrics.jsonl` and mirrors scalars to
  TensorBoard (tensorboardX, no TensorFlow needed) under `workdir/tensorboard`."""

  def __init__(self, workdir: str, *, total_steps: int, initial_step: int = 0):
    self.enabled = jax.process_index() == 0
    self._jsonl = self._tb = self._bar = None
    if not self.enabled:
      return
    os.makedirs(workdir, exist_ok=True)
    # Append: a resumed run continues the same file (steps after the restore point
    # of a killed run may appear twice; readers keep the last occurrence).
    self._jsonl = open(os.path.join(workdir, "metrics.jsonl"), "a", encoding="utf-8")
    try:
      import tensorboardX  # pylint: disable=import-outside-toplevel
      self._tb = tensorboardX.SummaryWriter(os.path.join(workdir, "tensorboard"))
    except ImportError:
      logging.warning("tensorboardX is not installed: no TensorBoard events")
    if sys.stdout.isatty():
      import tqdm  # pylint: disable=import-outside-toplevel
      self._bar = tqdm.tqdm(total=total_steps, initial=initial_step, unit="step",
                            dynamic_ncols=True)

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
    if self._bar is not None and "loss" in record:
      self._bar.set_postfix(loss=f"{record['loss']:.4f}")
    else:
      logging.info("step %d: %s", step, ", ".join(
          f"{k}={v:.5g}" if isinstance(v, float) else f"{k}={v}"
          for k, v in record.items() if k != "step"))

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
        part in record.pathname for part in self.QUIET)


def quiet_library_logs() -> None:
  """Keeps this project's INFO logs and hides Orbax/Grain/JAX INFO chatter."""
  from absl import logging as absl_logging  # pylint: disable=import-outside-toplevel
  absl_logging.get_absl_handler().addFilter(_LibraryInfoFilter())
