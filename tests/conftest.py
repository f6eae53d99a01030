"""Shared pytest setup: float32 oracles at highest matmul precision on CPU, and the order
tests run in (longest modules first, so the two workers of `make test` finish together)."""

import collections
import json
import os
import pathlib
import shutil
import tempfile

# Fake CPU devices must be requested before the backend starts; sharding tests use 8.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import pytest  # noqa: E402
from absl import logging as absl_logging  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
jax.config.update("jax_threefry_partitionable", True)

# Seconds per test id as last measured (`make test-durations` rewrites it); a test not listed
# counts as UNKNOWN_SECONDS. Only the order depends on it, never a result.
DURATIONS = pathlib.Path(__file__).with_name("durations.json")
UNKNOWN_SECONDS = 5.0
_measured: dict[str, float] = collections.defaultdict(float)


@pytest.fixture(autouse=True)
def _absl_verbosity():
  """`experiments.run` quiets absl for its process; a later test may read its warnings
  (the order tests run in changes with their durations)."""
  level = absl_logging.get_verbosity()
  yield
  absl_logging.set_verbosity(level)


def pytest_collection_modifyitems(config, items):
  """Modules by their tests' total seconds, longest first, each module's tests in their own
  order (module fixtures are made once per worker); xdist hands tests out in this order
  (`--maxschedchunk` in the Makefile keeps it from handing out long runs of it at once).
  Before all of them, any test whose id starts with one of `IHA_TESTS_FIRST`'s
  comma-separated prefixes (tests/mutants.py puts a mutant's last killer there).
  Deterministic: every xdist worker must collect the same order."""
  seconds = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
  first = [p for p in os.environ.get("IHA_TESTS_FIRST", "").split(",") if p]
  module_seconds: dict[str, float] = collections.defaultdict(float)
  for item in items:
    module_seconds[item.nodeid.split("::")[0]] += seconds.get(item.nodeid, UNKNOWN_SECONDS)

  def key(item):
    named = any(item.nodeid.startswith(p) for p in first)
    return (not named, -module_seconds[item.nodeid.split("::")[0]])

  items.sort(key=key)  # stable: a module's tests keep their order


def pytest_configure(config):
  """Under xdist, one persistent compilation cache for the run's workers (set before they
  start: each reads it when it imports jax), so a program two tests or two workers compile
  is compiled once; removed at the end of the run."""
  if hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None):
    return
  if "JAX_COMPILATION_CACHE_DIR" in os.environ:
    return  # the caller's own cache
  config._iha_compile_cache = tempfile.mkdtemp(prefix="iha-jax-test-cache-")
  os.environ["JAX_COMPILATION_CACHE_DIR"] = config._iha_compile_cache
  os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
  os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"


def pytest_unconfigure(config):
  cache = getattr(config, "_iha_compile_cache", None)
  if cache:
    shutil.rmtree(cache, ignore_errors=True)


def pytest_runtest_logreport(report):
  """Setup + call + teardown seconds per test (on the controller under xdist)."""
  if os.environ.get("IHA_RECORD_DURATIONS"):
    _measured[report.nodeid] += report.duration


def pytest_sessionfinish(session):
  """With IHA_RECORD_DURATIONS=1 on the controller: merge this run's seconds into
  tests/durations.json (tests not run keep theirs)."""
  if not os.environ.get("IHA_RECORD_DURATIONS") or hasattr(session.config, "workerinput"):
    return
  old = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
  merged = {**old, **{k: round(v, 2) for k, v in _measured.items()}}
  DURATIONS.write_text(json.dumps(dict(sorted(merged.items())), indent=0) + "\n")
