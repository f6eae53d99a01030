"""Checks a training run makes before it compiles or writes anything, each failing in one
line that names the config key or flag and the fix: the vocabulary covers the data's token
ids, every parameter splits evenly over the mesh, and the workdir is a writable directory
that no other run is writing (its lock, `iha_jax.workdir_lock`).

Multi-process runs agree on each outcome (process 0 takes the lock and tells the others),
so that no process waits in a collective for one that stopped.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import ml_collections
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding

from iha_jax import data as data_lib
from iha_jax.errors import UserError
from iha_jax.train.config import ConfigError
from iha_jax.train.integrity import leaf_name
from iha_jax.train.state import TrainState
from iha_jax.workdir_lock import WorkdirBusyError, WorkdirLock, lock_workdir


def check_vocab(config: ml_collections.ConfigDict, model: Any) -> None:
  """Raises ConfigError when `model.vocab_size` is smaller than the data's vocabulary (an
  id past the embedding would otherwise reach the loss as NaN at step 1)."""
  if config.model.vocab_size == -1:
    return  # the data's own vocabulary
  data_vocab = data_lib.vocab_size(config.data)
  if model.vocab_size < data_vocab:
    raise ConfigError(
      f"model.vocab_size={model.vocab_size} is smaller than the vocabulary of "
      f"data.name={config.data.name!r} (token ids 0..{data_vocab - 1}): set "
      f"model.vocab_size=-1 (the data's, {data_vocab}) or a value >= {data_vocab}"
    )


def _size_keys(model: Any) -> dict[int, list[str]]:
  """Which config keys a parameter dimension's size may come from."""
  sizes = {
    "model.vocab_size": model.vocab_size,
    "model.model_dim": model.model_dim,
    "model.mlp_dim": model.mlp_dim,
    "model.num_heads": model.num_heads,
    "model.head_dim": model.head_dim,
    "model.num_heads * model.head_dim": model.num_heads * model.head_dim,
    "model.num_pseudo": getattr(model, "num_pseudo", None),
    "model.num_outputs": getattr(model, "num_outputs", None),
  }
  keys: dict[int, list[str]] = {}
  for key, size in sizes.items():
    if size:
      keys.setdefault(size, []).append(key)
  return keys


def check_shardable(target: TrainState, mesh: Mesh, model: Any) -> None:
  """Raises ConfigError when a mesh axis does not divide the parameter axis it splits (the
  parameters could not be created or restored), naming the mesh key and the model key."""
  problems = []
  for path, leaf in jax.tree_util.tree_leaves_with_path(target.params):
    sharding = leaf.sharding
    if not isinstance(sharding, NamedSharding):
      continue
    for axis, (size, entry) in enumerate(zip(leaf.shape, sharding.spec)):
      names = () if entry is None else (entry if isinstance(entry, tuple) else (entry,))
      ways = math.prod(mesh.shape[n] for n in names)
      if size % ways:
        problems.append((leaf_name(path), leaf.shape, axis, size, names, ways))
  if not problems:
    return
  name, shape, axis, size, names, ways = problems[0]
  keys = _size_keys(model).get(size)
  split = " * ".join(f"mesh.{n}={mesh.shape[n]}" for n in names)
  fits = [d for d in range(1, jax.device_count() + 1) if size % d == 0]
  more = f" (and {len(problems) - 1} more parameters)" if len(problems) > 1 else ""
  raise ConfigError(
    f"{split} does not divide axis {axis} of parameter {name} {list(shape)}: "
    f"{size}{' = ' + ' or '.join(keys) if keys else ''} is not a multiple of {ways}{more}; "
    f"choose mesh sizes whose product on that axis divides {size} "
    f"({', '.join(map(str, fits))} fit here), or change {keys[0] if keys else 'the model'}"
  )


def agree(flag: bool) -> bool:
  """Process 0's `flag`, on every process."""
  if jax.process_count() == 1:
    return flag
  return bool(multihost_utils.broadcast_one_to_all(np.asarray(flag)))


def take_workdir(workdir: str) -> WorkdirLock | None:
  """Process 0 creates `workdir` and takes its lock (None on the other processes).

  Raises:
    WorkdirError, WorkdirBusyError: on every process when process 0 could not.
  """
  lock, error = None, None
  if jax.process_index() == 0:
    try:
      lock = lock_workdir(workdir)
    except UserError as e:
      error = e
  if agree(error is not None):
    if error is not None:
      raise error
    raise WorkdirBusyError(f"process 0 could not take the lock of --workdir {workdir!r}")
  return lock


def check_lock(lock: WorkdirLock | None) -> None:
  """Raises WorkdirBusyError on every process when another run took the lock over."""
  lost = lock is not None and lock.taken_over is not None
  if agree(lost):
    if lock is not None:
      lock.check()
    raise WorkdirBusyError("another run took over the workdir (see process 0's message)")
