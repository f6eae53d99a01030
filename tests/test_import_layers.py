"""The import layers of docs/design.md §8: importing every `iha_jax.core` module at run
time loads nothing above it."""

from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


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
