"""Orbax checkpoints of the train state, the data iterator state and the config.

Layout: `WORKDIR/checkpoints/<step>/{state, data, config}`; WORKDIR may be a local path
or a URL (`gs://BUCKET/run`: Orbax reaches it through etils.epath and TensorStore's own GCS
driver). Orbax writes each step to a temporary directory and renames it when complete
(atomic; on GCS a commit file marks it complete), saves asynchronously when
`checkpoint.async`, and keeps the last `checkpoint.keep` steps. Restoring takes target
shardings, so a checkpoint saved on one mesh restores onto any other.

A checkpoint that cannot be read (truncated files, a half-copied directory) is skipped with
a warning naming its step: `restore_newest` falls back to the newest step that restores.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import grain
import jax
import ml_collections
import orbax.checkpoint as ocp

from iha_jax import storage
from iha_jax.errors import UserError
from iha_jax.train.config import ConfigError, config_differences
from iha_jax.train.state import TrainState

STATE, DATA, CONFIG = "state", "data", "config"
UNREADABLE_DIR = "checkpoints_unreadable"  # where training moves steps it could not read
T = TypeVar("T")


class CheckpointError(UserError, RuntimeError):
  """No checkpoint of a run can be restored; the message names the steps and why."""


def checkpoint_dir(workdir: str) -> str:
  """`WORKDIR/checkpoints`, absolute for a local WORKDIR, unchanged for a URL."""
  return storage.join(workdir, "checkpoints")


def make_manager(
  workdir: str, config: ml_collections.ConfigDict | None = None
) -> ocp.CheckpointManager:
  """The run's CheckpointManager (read-only defaults when `config` is None)."""
  options = ocp.CheckpointManagerOptions(
    max_to_keep=config.checkpoint.keep if config else None,
    enable_async_checkpointing=bool(config.checkpoint["async"]) if config else False,
    create=config is not None,
    read_only=config is None,
  )
  return ocp.CheckpointManager(storage.as_path(checkpoint_dir(workdir)), options=options)


def save(
  manager: ocp.CheckpointManager,
  step: int,
  state: TrainState,
  data_iterator: grain.DatasetIterator,
  config: ml_collections.ConfigDict,
) -> None:
  """Saves step `step` (returns once device arrays are copied when asynchronous)."""
  manager.save(
    step,
    args=ocp.args.Composite(
      **{
        STATE: ocp.args.StandardSave(state),
        DATA: grain.checkpoint.CheckpointSave(data_iterator),
        CONFIG: ocp.args.JsonSave(json.loads(config.to_json())),
      }
    ),
    force=True,
  )


def restore_config(
  manager: ocp.CheckpointManager, step: int | None = None
) -> ml_collections.ConfigDict:
  """The config saved with `step` (default: the latest)."""
  step = manager.latest_step() if step is None else step
  saved = manager.restore(step, args=ocp.args.Composite(**{CONFIG: ocp.args.JsonRestore()}))
  return ml_collections.ConfigDict(saved[CONFIG])


def check_compatible(
  saved: ml_collections.ConfigDict,
  config: ml_collections.ConfigDict,
  sections: tuple[str, ...] = ("model",),
) -> None:
  """Raises ConfigError naming every key of `sections` that differs from the checkpoint."""
  diffs = []
  for section in sections:
    diffs += config_differences(
      saved[section].to_dict(), config[section].to_dict(), prefix=f"{section}."
    )
  if diffs:
    raise ConfigError(
      "the checkpoint was saved with a different model config; differing "
      "keys:\n  " + "\n  ".join(diffs)
    )


def restore(
  manager: ocp.CheckpointManager,
  step: int,
  target: Any,
  data_iterator: grain.DatasetIterator | None = None,
) -> TrainState:
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
  path = storage.as_path(manager.directory) / str(step) / STATE
  with ocp.PyTreeCheckpointer() as checkpointer:
    restored = checkpointer.restore(
      path,
      args=ocp.args.PyTreeRestore(
        item=item,
        partial_restore=True,
        restore_args=ocp.checkpoint_utils.construct_restore_args(item),
      ),
    )
  return TrainState(
    step=restored["step"],
    params=restored["params"],
    opt_state=jax.tree.map(lambda _: ocp.PLACEHOLDER, target.opt_state),
  )


def restore_newest(
  manager: ocp.CheckpointManager, restore_step: Callable[[int], T]
) -> tuple[int, T, list[int]] | None:
  """`restore_step(step)` for the newest step that restores; None without checkpoints.

  A step whose files cannot be read is skipped with a warning that names it (a run killed
  while copying a checkpoint, truncated files); a `UserError` (e.g. a `ConfigError`: the
  run's config does not match) is not a damaged checkpoint and propagates.

  Returns:
    `(step, restore_step(step), unreadable newer steps)`.

  Raises:
    CheckpointError: when every step fails, naming each with its error.
  """
  unreadable: list[tuple[int, str]] = []
  for step in sorted(manager.all_steps(), reverse=True):
    try:
      return step, restore_step(step), [s for s, _ in unreadable]
    except Exception as e:  # pylint: disable=broad-except
      if not is_read_error(e):
        raise
      reason = describe(e)
      logging.warning(
        "checkpoint step %d in %s cannot be read (%s); trying the previous step",
        step,
        manager.directory,
        reason,
      )
      unreadable.append((step, reason))
  if not unreadable:
    return None
  raise CheckpointError(
    f"no checkpoint in {manager.directory} can be read: "
    + "; ".join(f"step {s}: {r}" for s, r in unreadable)
    + ". Restore the directory from a copy, or remove it to start afresh"
  )


def is_read_error(error: Exception) -> bool:
  """Whether restoring failed on the checkpoint's files (missing, truncated, garbled:
  Orbax, TensorStore and json raise many types, TensorStore often a bare Exception) rather
  than on the person's config (a `UserError`) or on memory."""
  return not isinstance(error, (UserError, MemoryError)) and (
    "RESOURCE_EXHAUSTED" not in str(error)
  )


def describe(error: BaseException) -> str:
  """`"ValueError: first line of the message"`, at most 300 characters."""
  lines = str(error).strip().splitlines()
  return f"{type(error).__name__}: {lines[0] if lines else ''}"[:300]


def set_aside(workdir: str, steps: list[int]) -> None:
  """Moves unreadable steps to `WORKDIR/checkpoints_unreadable/<step>`: the resumed run
  saves those steps again, and the damaged files stay for inspection."""
  source = storage.as_path(checkpoint_dir(workdir))
  target = storage.makedirs(storage.join(workdir, UNREADABLE_DIR))
  for step in steps:
    destination = target / str(step)
    if destination.exists():
      destination.rmtree()
    (source / str(step)).rename(destination)
    logging.warning("moved the unreadable checkpoint step %d to %s", step, destination)
