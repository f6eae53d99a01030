"""Optional dependencies: what each part of the package needs beyond the layer's own.

`pip install iha-jax` brings what the attention functions, the Flax layers and the
models need (jax, jaxlib, flax, optax, numpy). Training, data pipelines, plots and the
targets' compilers come as extras (pyproject.toml): `iha-jax[data]`, `iha-jax[train]`,
`iha-jax[plots]`, `iha-jax[targets]`. A package that needs one checks for it at import
(`require`) and, missing, fails in one line naming the extra to install.
"""

from __future__ import annotations

import importlib.util

# Extra -> the modules it brings that the code imports (a representative few).
EXTRAS = {
  "data": ("tensorflow_datasets", "grain", "sentencepiece", "etils.epath"),
  "train": ("orbax.checkpoint", "ml_collections", "tensorflow_datasets", "grain"),
  "plots": ("matplotlib",),
}


def missing(extra: str) -> list[str]:
  """The modules of `extra` this environment lacks."""
  found = []
  for module in EXTRAS[extra]:
    try:
      spec = importlib.util.find_spec(module)
    except ModuleNotFoundError:  # a parent package is missing
      spec = None
    if spec is None:
      found.append(module)
  return found


def require(extra: str, user: str) -> None:
  """Raises ImportError in one line unless `extra`'s modules are installed; `user`: what
  needs them (e.g. "iha_jax.train")."""
  absent = missing(extra)
  if absent:
    raise ImportError(
      f"{user} needs the '{extra}' extra ({', '.join(absent)} not installed): "
      f"pip install 'iha-jax[{extra}]'"
    )
