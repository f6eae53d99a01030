"""`benchmarks/step_hashes.py`, the proof that a refactor changed no program, has teeth:
its hash of a config's lowered train step ignores where code sits (source locations are
stripped, so moving a function changes nothing) and sees any change to the program."""

from __future__ import annotations

import shutil
import sys

import pytest

from tests.fixtures import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
import step_hashes  # noqa: E402


def _tree(tmp_path, name: str):
  tree = tmp_path / name
  for part in ("iha_jax", "configs"):
    shutil.copytree(REPO_ROOT / part, tree / part, ignore=shutil.ignore_patterns("__pycache__"))
  return tree


@pytest.mark.full
def test_hash_ignores_where_code_sits_and_sees_what_it_computes(tmp_path):
  moved, changed = _tree(tmp_path, "moved"), _tree(tmp_path, "changed")
  masking = "iha_jax/core/masking.py"
  text = (REPO_ROOT / masking).read_text()
  (moved / masking).write_text("# every line below moves down\n\n" + text)
  assert text.count("MASK_VALUE = ") == 1
  (changed / masking).write_text(text.replace("MASK_VALUE = ", "MASK_VALUE = 0.5 * "))
  original = step_hashes.hashes(str(REPO_ROOT), "cpu", ["tiny"])["tiny"]
  assert len(original) == 12 and not original.startswith("error"), original
  assert step_hashes.hashes(str(moved), "cpu", ["tiny"]) == {"tiny": original}
  assert step_hashes.hashes(str(changed), "cpu", ["tiny"])["tiny"] != original
