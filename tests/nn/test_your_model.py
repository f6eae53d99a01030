"""Every Python block of docs/your_model.md runs, in order, as one program: an NNX and a
Linen decoder of a user's own, cache decoding equal to the full forward, and sharding on
a two-axis mesh of the user's own names (8 fake CPU devices, so in a process of its own:
the device count is fixed when JAX starts)."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.fixtures import REPO_ROOT
from tests.test_readme import python_blocks

REPO = str(REPO_ROOT)


def test_your_model_page_runs(tmp_path):
  with open(os.path.join(REPO, "docs", "your_model.md"), encoding="utf-8") as f:
    blocks = python_blocks(f.read())
  assert len(blocks) >= 6, blocks
  program = "\n".join(f"# docs/your_model.md:{line}\n{code}" for line, code in blocks)
  (tmp_path / "your_model.py").write_text(program)
  env = dict(os.environ, PYTHONPATH=REPO, XLA_FLAGS="--xla_force_host_platform_device_count=8")
  proc = subprocess.run(
    [sys.executable, "your_model.py"],
    cwd=tmp_path,
    env=env,
    capture_output=True,
    text=True,
    timeout=900,
    check=False,
  )
  assert proc.returncode == 0, proc.stderr[-4000:]
  assert "loss on the mesh" in proc.stdout, proc.stdout
