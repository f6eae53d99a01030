"""Orbax checkpoints of the train state, the data iterator state and the config.

Layout: `WORKDIR/checkpoints/<step>/{state, data, config}`. Orbax writes each step to a
temporary directory and renames it when complete (atomic), saves asynchronously when
`checkpoint.async`, and keeps the last `checkpoint.keep` steps. Restoring takes target
shardings, so a checkpoint saved on one mesh restores onto any other.
"""
from __future__ import annotations

import json
import os
from typing import Any

import grain
import jax
import ml_collections
import orbax.checkpoint as ocp

from iha_jax.train.config import ConfigError, config_differences
from iha_jax.train.state import TrainState

STATE, DATA, CONFIG = "state", "data", "config"


def checkpoint_dir(workdir: str) -> str:
  return os.path.join(os.path.abspath(workdir), "checkpoints")


def make_manager(workdir: str, config: ml_collections.ConfigDict | None = None
                 ) -> ocp.CheckpointManager:
  """The run's CheckpointManager (read-only defaults when `config` is None)."""
  options = ocp.CheckpointManagerOptions(
      max_to_keep=config.checkpoint.keep if config else None,
      enable_async_checkpointing=bool(config.checkpoint["async"]) if config else False,
      create=config is not None, read_only=config is None)
  return ocp.CheckpointManager(checkpoint_dir(workdir), options=options)


def save(manager: ocp.CheckpointManager, step: int, state: TrainState,
         data_iterator: grain.DatasetIterator, config: ml_collections.ConfigDict) -> None:
  """Saves step `step` (returns once device arrays are copied when asynchronous)."""
  manager.save(step, args=ocp.args.Composite(**{
      STATE: ocp.args.StandardSave(state),
      DATA: grain.checkpoint.CheckpointSave(data_iterator),
      CONFIG: ocp.args.JsonSave(json.loads(config.to_json())),
  }), force=True)


def restore_config(manager: ocp.CheckpointManager, step: int | None = None
                   ) -> ml_collections.ConfigDict:
  """The config saved with `step` (default: the latest)."""
  step = manager.latest_step() if step is None else step
  saved = manager.restore(step, args=ocp.args.Composite(**{CONFIG: ocp.args.JsonRestore()}))
  return ml_collections.ConfigDict(saved[CONFIG])


def check_compatible(saved: ml_collections.ConfigDict, config: ml_collections.ConfigDict,
                     sections: tuple[str, ...] = ("model",)) -> None:
  """Raises ConfigError naming every key of `sections` that differs from the checkpoint."""
  diffs = []
  for section in sections:
    diffs += config_differences(saved[section].to_dict(), config[section].to_dict(),
                                prefix=f"{section}.")
  if diffs:
    raise ConfigError("the checkpoint was saved with a different model config; differing "
                      "keys:\n  " + "\n  ".join(diffs))


def restore(manager: ocp.CheckpointManager, step: int, target: Any,
            data_iterator: grain.DatasetIterator | None = None) -> TrainState:
  """Restores the state onto `target`'s shardings (any mesh) and, when given, the data
  iterator's position in place."""
  args = {STATE: ocp.args.StandardRestore(target)}
  if data_iterator is not None:
    args[DATA] = grain.checkpoint.CheckpointRestore(data_iterator)
  return manager.restore(step, args=ocp.args.Composite(**args))[STATE]


def restore_params(manager: ocp.CheckpointManager, step: int, target: TrainState) -> TrainState:
  """Restores step and parameters only onto `target`'s shardings. The optimizer state
  (AdamW: 2x the parameters) is never read; it comes back as `ocp.PLACEHOLDER`s."""
  item = {"step": target.step, "params": target.params}
  # The manager's handler for STATE takes whole-tree StandardRestore args only; a plain
  # PyTree checkpointer reads the same files with partial_restore.
  path = os.path.join(os.fspath(manager.directory), str(step), STATE)
  with ocp.PyTreeCheckpointer() as checkpointer:
    restored = checkpointer.restore(path, args=ocp.args.PyTreeRestore(
        item=item, partial_restore=True,
        restore_args=ocp.checkpoint_utils.construct_restore_args(item)))
  return TrainState(step=restored["step"], params=restored["params"],
                    opt_state=jax.tree.map(lambda _: ocp.PLACEHOLDER, target.opt_state))
