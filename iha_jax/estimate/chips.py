"""The TPU chips the estimator knows: what turns bundles and bytes into seconds."""

from __future__ import annotations

import dataclasses

from iha_jax.errors import UserError


class EstimateError(UserError, RuntimeError):
  """The schedule cannot be read (dump not enabled, libtpu missing, unknown chip)."""


@dataclasses.dataclass(frozen=True)
class Chip:
  """What turns bundles and bytes into seconds (public specifications)."""

  name: str
  cores: int  # TensorCores per chip that split a kernel's "parallel" grid dimension
  clock_hz: float  # one bundle per cycle
  hbm_bytes_per_s: float
  peak_bf16_flops: float  # per chip, for MFU and the MXU floor
  mxu_edge: int = 128  # an MXU pass's width (v6e: 256)
  # How far the 8192^3 bf16 matmul's estimate is from its time at peak
  # (`benchmarks/tpu_estimate.py --calibrate`); None: within 10%.
  uncalibrated: str | None = None

  @property
  def flops_per_core_cycle(self) -> float:
    return self.peak_bf16_flops / self.cores / self.clock_hz


CHIPS = {
  "v5p": Chip("v5p", 2, 1.75e9, 2.765e12, 459e12),
  # v5e and v6e: clocks from their public peaks and MXU counts; their schedules misplace
  # the calibration matmul (`uncalibrated`): compare implementations there, not times.
  "v5e": Chip("v5e", 1, 1.5e9, 8.19e11, 197e12, uncalibrated="matmul -17%"),
  "v6e": Chip("v6e", 1, 1.75e9, 1.64e12, 918e12, mxu_edge=256, uncalibrated="matmul +27%"),
}


def chip(name: str) -> Chip:
  """`v5p`, `v5e`, `v6e` (or a slice name such as `v5p-128`) -> its `Chip`."""
  generation = name.split("-")[0]
  if generation not in CHIPS:
    raise EstimateError(f"unknown TPU {name!r}; choose one of {', '.join(CHIPS)}")
  return CHIPS[generation]
