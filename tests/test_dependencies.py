"""What `pip install iha-jax` asks for: the layer's own needs as ranges over the two sets
CI installs and tests (requirements.txt, the pinned set; requirements-newest.txt, the
newest), everything else as extras over the same; and, built as a wheel into a clean
environment with no extras, the layer trains and decodes while a package that needs an
extra says which one in one line."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
import textwrap
import tomllib

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests.fixtures import REPO_ROOT

ROOT = REPO_ROOT
SETS = ("requirements.txt", "requirements-newest.txt")
TARGET_SETS = ("requirements-targets-tpu.txt", "requirements-targets-cuda.txt")
# What `import iha_jax.nn` (and .ops, .models) needs: the only unconditional dependencies.
LAYER_NEEDS = {"jax", "jaxlib", "flax", "optax", "numpy"}


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


def _declared() -> tuple[dict, dict]:
  """({name: specifier} of the dependencies, {name: specifier} of every extra's)."""
  project = _project()
  core = {
    canonicalize_name(Requirement(r).name): Requirement(r).specifier
    for r in project["dependencies"]
  }
  extras = {}
  for requirements in project["optional-dependencies"].values():
    for line in requirements:
      requirement = Requirement(line)
      if canonicalize_name(requirement.name) == "iha-jax":
        continue  # an extra that includes another
      extras[canonicalize_name(requirement.name)] = requirement.specifier
  return core, extras


def test_the_layer_needs_only_jax_flax_optax_numpy_and_the_rest_are_extras():
  pinned, newest = (_pins(name) for name in SETS)
  assert pinned.keys() == newest.keys()
  core, extras = _declared()
  assert set(core) == LAYER_NEEDS
  assert not set(core) & set(extras), "declared both as a dependency and as an extra"
  assert set(core) | set(extras) >= set(pinned), set(pinned) - set(core) - set(extras)
  for name in pinned:
    specifier = core.get(name, extras.get(name))
    low, high = sorted((pinned[name], newest[name]))
    # Both tested versions inside; the lower bound is the oldest one CI tests.
    assert low in specifier and high in specifier, (name, str(specifier))
    assert {s.operator for s in specifier} >= {">="}, (name, str(specifier))
    assert Version(next(s.version for s in specifier if s.operator == ">=")) == low, name


def test_the_targets_extra_spans_the_compile_packages():
  _, extras = _declared()
  for requirements in TARGET_SETS:
    for name, version in _pins(requirements).items():
      assert version in extras[name], (name, str(extras[name]))


def test_this_python_is_a_supported_one():
  assert (
    Version(platform.python_version())
    in Requirement(f"python{_project()['requires-python']}").specifier
  )


# The layer in a clean environment: what a user gets from `pip install iha-jax`.
LAYER_SCRIPT = textwrap.dedent(
  """
  import jax, jax.numpy as jnp
  from flax import nnx
  from iha_jax.nn import InterleavedHeadAttention

  layer = InterleavedHeadAttention(16, num_heads=2, head_dim=8, num_pseudo=2, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(0), (2, 6, 16))
  grads = nnx.grad(lambda m: jnp.sum(m(x) ** 2))(layer)
  assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))
  cache = layer.init_cache(2, 6)
  steps = []
  for t in range(6):
    y, cache = layer(x[:, t : t + 1], cache=cache)
    steps.append(y)
  assert jnp.allclose(jnp.concatenate(steps, 1), layer(x), atol=1e-4)
  for package, extra in (("iha_jax.train", "train"), ("iha_jax.data", "data")):
    try:
      __import__(package)
    except ImportError as error:
      message = str(error)
      assert "\\n" not in message and f"pip install 'iha-jax[{extra}]'" in message, message
    else:
      raise AssertionError(package + " imported without its extra")
  print("layer ok")
  """
)


@pytest.mark.full
@pytest.mark.slow
def test_the_wheel_without_extras_trains_and_decodes_a_layer(tmp_path):
  """Build the wheel, install it with no extras into a fresh venv (its dependencies from
  the package index or pip's cache), run a layer forward/backward and a decode there,
  and find the training and data packages refusing in one line naming their extra."""
  env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS")}
  run = lambda *args, **kw: subprocess.run(
    args, capture_output=True, text=True, env=env, timeout=900, **kw
  )
  source = tmp_path / "source"  # a copy: setuptools builds in the tree it is given
  source.mkdir()
  for name in ("pyproject.toml", "README.md"):
    shutil.copy(ROOT / name, source / name)
  shutil.copytree(
    ROOT / "iha_jax", source / "iha_jax", ignore=shutil.ignore_patterns("__pycache__")
  )
  wheel_dir = tmp_path / "wheel"
  built = run(sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(wheel_dir), str(source))
  assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
  (wheel,) = wheel_dir.glob("iha_jax-*.whl")
  venv = tmp_path / "venv"
  made = run(sys.executable, "-m", "venv", str(venv))
  assert made.returncode == 0, made.stderr
  python = venv / "bin" / "python"
  pins = [f"{name}=={v}" for name, v in _pins("requirements.txt").items() if name in LAYER_NEEDS]
  installed = run(str(python), "-m", "pip", "install", "--quiet", str(wheel), *pins)
  assert installed.returncode == 0, installed.stdout[-2000:] + installed.stderr[-2000:]
  listed = run(str(python), "-m", "pip", "list", "--format=freeze").stdout.lower()
  # (orbax-checkpoint comes with flax itself.)
  for extra_only in ("tensorflow-datasets", "grain", "matplotlib", "tiktoken"):
    assert extra_only not in listed, extra_only
  result = run(str(python), "-c", LAYER_SCRIPT, cwd=tmp_path)
  assert result.returncode == 0 and "layer ok" in result.stdout, result.stderr[-3000:]


# Attention maps with the 'plots' extra only: the modules that only the 'train' and 'data'
# extras bring are made unimportable (flax itself brings orbax and etils).
PLOTS_ONLY_SCRIPT = textwrap.dedent(
  """
  import importlib.machinery, sys

  ONLY_IN_EXTRAS = {
    "ml_collections", "tensorflow_datasets", "tensorflow", "grain", "array_record",
    "sentencepiece", "tokenizers", "tiktoken", "gcsfs", "tensorboardX", "tqdm",
  }

  class Missing(importlib.machinery.PathFinder):  # not found, as if not installed
    @classmethod
    def find_spec(cls, name, path=None, target=None):
      if name.split(".")[0] in ONLY_IN_EXTRAS:
        return None
      return super().find_spec(name, path, target)

  sys.meta_path = [
    Missing if f is importlib.machinery.PathFinder else f for f in sys.meta_path
  ]
  import jax
  from flax import nnx
  from iha_jax.eval.attention_maps import attention_maps, plot_attention_maps
  from iha_jax.models import TransformerConfig, TransformerLM

  config = TransformerConfig(vocab_size=11, num_layers=1, model_dim=16, num_heads=2,
                             head_dim=8, mlp_dim=16, num_pseudo=2, attention_schedule="I")
  model = TransformerLM(config, rngs=nnx.Rngs(0))
  probs = attention_maps(model, jax.numpy.arange(5), layer_number=1)
  plot_attention_maps(probs, 2, sys.argv[1])
  try:
    from iha_jax.eval import evaluate_workdir
  except ImportError as error:
    assert "pip install 'iha-jax[train]'" in str(error) and "\\n" not in str(error), error
  else:
    raise AssertionError("evaluate_workdir imported without the train extra")
  print("maps ok")
  """
)


def test_attention_maps_need_only_the_plots_extra(tmp_path):
  png = tmp_path / "maps.png"
  run = subprocess.run(
    [sys.executable, "-c", PLOTS_ONLY_SCRIPT, str(png)],
    capture_output=True,
    text=True,
    cwd=ROOT,
    check=False,
  )
  assert run.returncode == 0 and "maps ok" in run.stdout, run.stderr[-2000:]
  assert png.stat().st_size > 0
