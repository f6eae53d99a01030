"""The import layers of docs/design.md §8 hold (import-linter's contracts in
pyproject.toml, also run by `make lint`: the layers, and no cycle between the modules of
any package, typing-only imports included), and the checks have teeth: the same contracts
on a copy of the package with one upward import, or one import closing a cycle, fail,
naming it. Plus what a static graph cannot see: importing every `iha_jax.core` module at
run time loads nothing above it; and no file imports another file's private names."""

from __future__ import annotations

import ast
import pathlib
import shutil
import subprocess
import sys

from tests.fixtures import REPO_ROOT

ROOT = REPO_ROOT
# import-linter's own entry point, run by this interpreter (its console script may not be
# on PATH when the tests run from a venv that is not activated).
LINT = (
  "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports(no_cache=True))"
)


def _lint(cwd: pathlib.Path) -> subprocess.CompletedProcess:
  return subprocess.run(
    [sys.executable, "-c", LINT], cwd=cwd, capture_output=True, text=True, timeout=120
  )


def test_layers_and_acyclic_packages_hold_and_one_import_breaks_each(tmp_path):
  kept = _lint(ROOT)
  assert kept.returncode == 0, kept.stdout + kept.stderr
  assert "2 kept, 0 broken" in kept.stdout
  # The controls: core (the bottom of the attention stack) importing the kinds above it,
  # and a typing-only import closing a cycle inside core.
  shutil.copytree(
    ROOT / "iha_jax", tmp_path / "iha_jax", ignore=shutil.ignore_patterns("__pycache__")
  )
  shutil.copy(ROOT / "pyproject.toml", tmp_path)
  masking = tmp_path / "iha_jax" / "core" / "masking.py"
  masking.write_text(masking.read_text() + "\nfrom iha_jax.kinds import registry  # upward\n")
  options = tmp_path / "iha_jax" / "core" / "options.py"
  options.write_text(
    options.read_text() + "\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
    "  from iha_jax.core import xla_attention  # closes a cycle\n"
  )
  broken = _lint(tmp_path)
  assert broken.returncode == 1, broken.stdout + broken.stderr
  assert "0 kept, 2 broken" in broken.stdout
  assert "iha_jax.core.masking -> iha_jax.kinds.registry" in broken.stdout
  assert "No cycles are allowed in iha_jax.core" in broken.stdout


def _is_module(dotted: str) -> bool:
  path = ROOT.joinpath(*dotted.split("."))
  return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def private_imports(path: pathlib.Path) -> list[str]:
  """`file:line name` of every private name (`_x`) that `path` takes from an iha_jax
  module, imported (`from iha_jax.m import _x`) or read off the module (`m._x`): a
  module's private names are its own, another file uses its public ones."""
  tree = ast.parse(path.read_text())
  found, modules = [], set()
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("iha_jax"):
      for alias in node.names:
        if alias.name.startswith("_") and not alias.name.startswith("__"):
          found.append(f"{path}:{node.lineno} {alias.name}")
        elif _is_module(f"{node.module}.{alias.name}"):
          modules.add(alias.asname or alias.name)
    elif isinstance(node, ast.Import):
      modules.update(a.asname for a in node.names if a.asname and a.name.startswith("iha_jax"))
  for node in ast.walk(tree):
    if (
      isinstance(node, ast.Attribute)
      and isinstance(node.value, ast.Name)
      and node.value.id in modules
      and node.attr.startswith("_")
      and not node.attr.startswith("__")
    ):
      found.append(f"{path}:{node.lineno} {node.value.id}.{node.attr}")
  return found


def test_no_file_imports_another_files_private_names(tmp_path):
  files = [f for d in ("iha_jax", "benchmarks", "experiments") for f in (ROOT / d).rglob("*.py")]
  found = [line for f in files for line in private_imports(f)]
  assert not found, found
  control = tmp_path / "control.py"
  control.write_text(
    "from iha_jax.core import masking\nfrom iha_jax.core.masking import _private, __doc__\n"
    "masking._band(masking.MASK_VALUE)\n"
  )
  assert [line.split()[-1] for line in private_imports(control)] == ["_private", "masking._band"]


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
