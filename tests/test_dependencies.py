"""pyproject.toml's dependency ranges span exactly the two sets CI installs and tests:
requirements.txt (the pinned set) and requirements-newest.txt (the newest)."""

from __future__ import annotations

import platform
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
SETS = ("requirements.txt", "requirements-newest.txt")


def _pins(name: str) -> dict[str, Version]:
  """`name==version` lines of a requirements file -> {canonical name: version}."""
  pins = {}
  for line in (ROOT / name).read_text().splitlines():
    line = line.split("#")[0].strip()
    if line:
      requirement = Requirement(line)
      (spec,) = requirement.specifier
      assert spec.operator == "==", line  # each set is fully pinned
      pins[canonicalize_name(requirement.name)] = Version(spec.version)
  return pins


def _project() -> dict:
  return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_pyproject_ranges_span_exactly_the_tested_sets():
  pinned, newest = (_pins(name) for name in SETS)
  assert pinned.keys() == newest.keys()
  project = _project()
  declared = [Requirement(r) for r in project["dependencies"]]
  declared += [Requirement(r) for extra in project["optional-dependencies"].values() for r in extra]
  ranges = {canonicalize_name(r.name): r.specifier for r in declared}
  assert len(ranges) == len(declared), "a dependency is declared twice"
  assert ranges.keys() == pinned.keys()
  for name, specifier in ranges.items():
    low, high = sorted((pinned[name], newest[name]))
    want = {f"=={low}"} if low == high else {f">={low}", f"<={high}"}
    assert {str(s) for s in specifier} == want, (name, str(specifier))


def test_this_python_is_a_supported_one():
  assert (
    Version(platform.python_version())
    in Requirement(f"python{_project()['requires-python']}").specifier
  )
