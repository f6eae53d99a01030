"""The import layers of docs/design.md §8 hold (import-linter's layers contract in
pyproject.toml, also run by `make lint`), and the check has teeth: the same contract on a
copy of the package with one upward import fails, naming it. Plus what a static graph
cannot see: importing every `iha_jax.core` module at run time loads nothing above it."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
# import-linter's own entry point, run by this interpreter (its console script may not be
# on PATH when the tests run from a venv that is not activated).
LINT = (
  "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports(no_cache=True))"
)


def _lint(cwd: pathlib.Path) -> subprocess.CompletedProcess:
  return subprocess.run(
    [sys.executable, "-c", LINT], cwd=cwd, capture_output=True, text=True, timeout=120
  )


def test_layers_hold_and_an_upward_import_breaks_them(tmp_path):
  kept = _lint(ROOT)
  assert kept.returncode == 0, kept.stdout + kept.stderr
  assert "1 kept, 0 broken" in kept.stdout
  # The control: core (the bottom of the attention stack) importing the kinds above it.
  shutil.copytree(
    ROOT / "iha_jax", tmp_path / "iha_jax", ignore=shutil.ignore_patterns("__pycache__")
  )
  shutil.copy(ROOT / "pyproject.toml", tmp_path)
  masking = tmp_path / "iha_jax" / "core" / "masking.py"
  masking.write_text(masking.read_text() + "\nfrom iha_jax.kinds import registry  # upward\n")
  broken = _lint(tmp_path)
  assert broken.returncode == 1, broken.stdout + broken.stderr
  assert "0 kept, 1 broken" in broken.stdout
  assert "iha_jax.core.masking -> iha_jax.kinds.registry" in broken.stdout


def test_core_imports_nothing_above_it_at_run_time():
  """`importlib` calls and the like escape the static graph: import every core module and
  look at what got loaded."""
  code = """
import importlib, pkgutil, sys
import iha_jax.core as core
for module in pkgutil.iter_modules(core.__path__):
  importlib.import_module("iha_jax.core." + module.name)
above = {"kernels", "kinds", "ops", "nn", "models", "data", "train", "eval", "cli"}
loaded = [m for m in sys.modules if m.startswith("iha_jax.") and m.split(".")[1] in above]
assert not loaded, loaded
"""
  subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)
