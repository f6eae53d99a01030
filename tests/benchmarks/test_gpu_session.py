"""`benchmarks/gpu_session.sh`, rehearsed without a GPU: its default plan fits one
10-minute call in order of value, and on a machine without a GPU it stops at once."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from tests.fixtures import REPO_ROOT

SCRIPT = REPO_ROOT / "benchmarks" / "gpu_session.sh"


def test_default_plan_fits_one_call_in_order_of_value():
  out = subprocess.run(["bash", str(SCRIPT), "--plan"], capture_output=True, text=True, check=True)
  lines = out.stdout.split()
  stages = [line.split(":")[0] for line in lines[:-2]]
  assert stages == ["env", "kernels4", "kernels2", "train", "train_nosegs", "kernel_tests"]
  total = int(lines[-1].rstrip("s"))
  assert total == sum(int(line.split(":")[1]) for line in lines[:-2])
  assert total <= 570  # 600 s per call, wheel installs included


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has a GPU")
def test_without_a_gpu_it_stops_before_anything(tmp_path):
  proc = subprocess.run(
    ["bash", str(SCRIPT)],
    capture_output=True,
    text=True,
    timeout=60,
    env={**os.environ, "OUT": str(tmp_path)},
  )
  assert proc.returncode == 2
  assert proc.stdout.strip() == "gpu_session: no GPU here (nvidia-smi finds none): nothing run"
  assert not any(tmp_path.iterdir())  # no stage ran
