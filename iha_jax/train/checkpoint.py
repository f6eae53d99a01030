"""Orbax checkpoints of the train state, the data iterator state and the config.

Layout: `WORKDIR/checkpoints/<step>/{state, data, config}`; WORKDIR may be a local path
or a URL (`gs://BUCKET/run`: Orbax reaches it through etils.epath and TensorStore's own GCS
driver). Orbax writes each step to a temporary directory and renames it when complete
(atomic; on GCS a commit file marks it complete), saves asynchronously when
`checkpoint.async`, and keeps the last `checkpoint.keep` steps. Restoring takes target
shardings, so a checkpoint saved on one mesh restores onto any other.

Every checkpoint also holds `checksums` (`iha_jax.train.integrity`): digests of the state's
arrays and of the data iterator's state, taken from memory at save time and compared with
what is read back on restore. A checkpoint that cannot be read (truncated files, a
half-copied directory) or whose values differ from its checksums (bytes overwritten in an
array file) is skipped with a warning naming its step: `restore_newest` falls back to the
newest step that restores and verifies. Checkpoints saved before checksums existed restore
unverified, with a warning.

A save that runs out of disk space raises `DiskFullError` naming the directory, the bytes a
checkpoint takes and the bytes free; the partial step is deleted, older steps are kept.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import sys
import time
from collections.abc import Callable
from typing import Any, TypeVar

import grain
import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from iha_jax import storage
from iha_jax.errors import UserError
from iha_jax.train import integrity
from iha_jax.train.config import ConfigError, config_differences, upgrade_saved_config
from iha_jax.train.state import TrainState

STATE, DATA, CONFIG, CHECKSUMS = "state", "data", "config", "checksums"
UNREADABLE_DIR = "checkpoints_unreadable"  # where training moves steps it could not read
TMP_SUFFIX = ".orbax-checkpoint-tmp"  # Orbax's name for a step being written
T = TypeVar("T")


class CheckpointError(UserError, RuntimeError):
  """No checkpoint of a run can be restored; the message names the steps and why."""


class DiskFullError(UserError, OSError):
  """The disk filled up while writing the workdir; names the path and the bytes needed."""


class _RedundantLibraryErrors(logging.Filter):
  """Drops library logs of errors the caller gets as an exception anyway, each with a
  traceback per thread: Orbax's "raised an exception" of a background thread, and Orbax's
  or asyncio's error logs of a full disk (the trainer reports it in one line)."""

  def filter(self, record: logging.LogRecord) -> bool:
    orbax = "/orbax/" in record.pathname
    if record.levelno < logging.ERROR or not (orbax or record.name == "asyncio"):
      return True
    text = record.getMessage()
    if record.exc_info and record.exc_info[1] is not None:
      text += f" {record.exc_info[1]!s}"
    if orbax and "raised an exception" in text:
      return False
    return not _disk_full_text(text)


def quiet_library_noise() -> None:
  """Installs `_RedundantLibraryErrors` on the loggers Orbax and asyncio log through, and
  the closed-loop filter below (idempotent): a damaged checkpoint or a full disk then
  prints the project's one line."""
  for name in ("absl", "asyncio", ""):
    logger = logging.getLogger(name)
    if not any(isinstance(f, _RedundantLibraryErrors) for f in logger.filters):
      logger.addFilter(_RedundantLibraryErrors())
  _ignore_closed_loop_errors()


def _ignore_closed_loop_errors() -> None:
  """A failed restore leaves TensorStore reads in flight whose callbacks hit Orbax's closed
  event loop later (`RuntimeError: Event loop is closed`, printed as unraisable, often at
  exit): harmless, the restore already failed. Hides exactly those (idempotent)."""
  previous = sys.unraisablehook
  if getattr(previous, "_iha_closed_loop_filter", False):
    return

  def hook(unraisable, _previous=previous, _error=RuntimeError):
    value = unraisable.exc_value
    if isinstance(value, _error) and str(value) == "Event loop is closed":
      return
    _previous(unraisable)

  hook._iha_closed_loop_filter = True
  sys.unraisablehook = hook


def checkpoint_dir(workdir: str) -> str:
  """`WORKDIR/checkpoints`, absolute for a local WORKDIR, unchanged for a URL."""
  return storage.join(workdir, "checkpoints")


def make_manager(
  workdir: str, config: ml_collections.ConfigDict | None = None
) -> ocp.CheckpointManager:
  """The run's CheckpointManager (read-only defaults when `config` is None)."""
  quiet_library_noise()
  options = ocp.CheckpointManagerOptions(
    max_to_keep=config.checkpoint.keep if config else None,
    enable_async_checkpointing=bool(config.checkpoint["async"]) if config else False,
    create=config is not None,
    read_only=config is None,
    # Steps a killed or failed save left half-written (the writer holds the workdir lock).
    cleanup_tmp_directories=config is not None,
  )
  return ocp.CheckpointManager(storage.as_path(checkpoint_dir(workdir)), options=options)


def save(
  manager: ocp.CheckpointManager,
  step: int,
  state: TrainState,
  data_iterator: grain.DatasetIterator,
  config: ml_collections.ConfigDict,
) -> None:
  """Saves step `step` with its checksums (returns once device arrays are copied when
  asynchronous)."""
  checksums = integrity.record(state, _data_digests(data_iterator))
  manager.save(
    step,
    args=ocp.args.Composite(
      **{
        STATE: ocp.args.StandardSave(state),
        DATA: grain.checkpoint.CheckpointSave(data_iterator),
        CONFIG: ocp.args.JsonSave(json.loads(config.to_json())),
        CHECKSUMS: ocp.args.JsonSave(checksums),
      }
    ),
    force=True,
  )


def _data_digests(data_iterator: grain.DatasetIterator) -> list[str]:
  """Every process's data-state digest, in process order (process 0 writes the JSON)."""
  mine = integrity.json_digest(data_iterator.get_state())
  if jax.process_count() == 1:
    return [mine]
  gathered = multihost_utils.process_allgather(np.frombuffer(bytes.fromhex(mine), np.uint8))
  return [bytes(row).hex() for row in np.asarray(gathered).reshape(jax.process_count(), -1)]


def _saved_checksums(manager: ocp.CheckpointManager, step: int) -> dict[str, Any] | None:
  """The `checksums` item of `step`, or None (with a warning) for a checkpoint saved
  before checksums existed."""
  if not (storage.as_path(manager.directory) / str(step) / CHECKSUMS).exists():
    logging.warning(
      "checkpoint step %d in %s has no checksums (saved by an older version): restored unverified",
      step,
      manager.directory,
    )
    return None
  saved = manager.restore(step, args=ocp.args.Composite(**{CHECKSUMS: ocp.args.JsonRestore()}))
  return dict(saved[CHECKSUMS])


def restore_config(
  manager: ocp.CheckpointManager, step: int | None = None
) -> ml_collections.ConfigDict:
  """The config saved with `step` (default: the latest)."""
  step = manager.latest_step() if step is None else step
  saved = manager.restore(step, args=ocp.args.Composite(**{CONFIG: ocp.args.JsonRestore()}))
  return ml_collections.ConfigDict(upgrade_saved_config(dict(saved[CONFIG])))


# Model keys that shape no parameter: a run that starts from another run's parameters
# (`train.init_from`, e.g. a long-context stage) may change them.
NON_PARAMETER_KEYS = frozenset(
  {"iha_window", "mha_window", "rope_theta", "implementation", "remat_policy", "dtype"}
)


def check_compatible(
  saved: ml_collections.ConfigDict,
  config: ml_collections.ConfigDict,
  sections: tuple[str, ...] = ("model",),
  may_differ: frozenset[str] = frozenset(),
) -> None:
  """Raises ConfigError naming every key of `sections` that differs from the checkpoint
  (but the `may_differ` keys of the model section)."""
  diffs = []
  for section in sections:
    diffs += config_differences(
      saved[section].to_dict(), config[section].to_dict(), prefix=f"{section}."
    )
  diffs = [d for d in diffs if d.split(":")[0].removeprefix("model.") not in may_differ]
  if diffs:
    raise ConfigError(
      "the checkpoint was saved with a different model config; differing "
      "keys:\n  " + "\n  ".join(diffs)
    )


def init_params_from(
  source: str, target: TrainState, config: ml_collections.ConfigDict
) -> tuple[int, Any]:
  """`(step, params)` of the newest verified checkpoint of the run in workdir `source`,
  restored onto `target`'s parameter shardings (any mesh). Its model keys must equal
  `config`'s but for `NON_PARAMETER_KEYS` (sequence length, window, RoPE base, mesh and
  the whole train section may change). The source is only read: a damaged step there is
  skipped with a warning, never moved.

  Raises:
    CheckpointError: no checkpoint in `source` restores and verifies (or none exists).
  """
  manager = make_manager(source)

  def restore_step(step: int) -> Any:
    check_compatible(restore_config(manager, step), config, may_differ=NON_PARAMETER_KEYS)
    return restore_params(manager, step, target).params

  try:
    restored = restore_newest(manager, restore_step)
  finally:
    manager.close()
  if restored is None:
    raise CheckpointError(
      f"train.init_from={source!r}: no checkpoint in {checkpoint_dir(source)}; point it at "
      "the workdir of the run whose parameters this one starts from"
    )
  step, params, _ = restored
  return step, params


def restore(
  manager: ocp.CheckpointManager,
  step: int,
  target: Any,
  data_iterator: grain.DatasetIterator | None = None,
) -> TrainState:
  """Restores the state onto `target`'s shardings (any mesh) and, when given, the data
  iterator's position in place, and verifies both against the step's checksums.

  Raises:
    integrity.ChecksumMismatch: a value differs from its checksum (damaged files).
  """
  checksums = _saved_checksums(manager, step)
  args = {STATE: ocp.args.StandardRestore(target)}
  if data_iterator is not None:
    args[DATA] = grain.checkpoint.CheckpointRestore(data_iterator)
  state = manager.restore(step, args=ocp.args.Composite(**args))[STATE]
  if checksums is not None:
    integrity.verify_tree(checksums, state)
    if data_iterator is not None:
      _verify_data(checksums, data_iterator)
  return state


def _verify_data(checksums: dict[str, Any], data_iterator: grain.DatasetIterator) -> None:
  """Compares the restored data position with its digest; all processes agree."""
  saved = checksums.get("data", [])
  if len(saved) != jax.process_count():  # saved by another number of processes
    return
  bad = integrity.json_digest(data_iterator.get_state()) != saved[jax.process_index()]
  if jax.process_count() > 1:
    bad = bool(np.any(multihost_utils.process_allgather(np.asarray(bad))))
  if bad:
    raise integrity.ChecksumMismatch(
      "the data iterator's position differs from the checksum saved with it"
    )


def restore_params(manager: ocp.CheckpointManager, step: int, target: TrainState) -> TrainState:
  """Restores step and parameters only onto `target`'s shardings. The optimizer state
  (AdamW: 2x the parameters) is never read; it comes back as `ocp.PLACEHOLDER`s."""
  checksums = _saved_checksums(manager, step)
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
  state = TrainState(
    step=restored["step"],
    params=restored["params"],
    opt_state=jax.tree.map(lambda _: ocp.PLACEHOLDER, target.opt_state),
  )
  if checksums is not None:
    integrity.verify_tree(checksums, state, "parameter arrays")
  return state


def restore_newest(
  manager: ocp.CheckpointManager, restore_step: Callable[[int], T]
) -> tuple[int, T, list[int]] | None:
  """`restore_step(step)` for the newest step that restores; None without checkpoints.

  A step whose files cannot be read (a run killed while copying a checkpoint, truncated
  files) or whose values fail their checksums is skipped with a one-line warning that
  names it; a `UserError` (e.g. a `ConfigError`: the run's config does not match) is not a
  damaged checkpoint and propagates.

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
        "checkpoint step %d in %s %s (%s); trying the previous step",
        step,
        manager.directory,
        "fails its checksums" if isinstance(e, integrity.ChecksumMismatch) else "cannot be read",
        reason,
      )
      unreadable.append((step, reason))
  if not unreadable:
    return None
  raise CheckpointError(
    f"no checkpoint in {manager.directory} can be read and verified: "
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
  """Moves unreadable or corrupt steps to `WORKDIR/checkpoints_unreadable/<step>`: the
  resumed run saves those steps again, and the damaged files stay for inspection."""
  source = storage.as_path(checkpoint_dir(workdir))
  target = storage.makedirs(storage.join(workdir, UNREADABLE_DIR))
  for step in steps:
    destination = target / str(step)
    if destination.exists():
      destination.rmtree()
    (source / str(step)).rename(destination)
    logging.warning("moved the damaged checkpoint step %d to %s", step, destination)


def _disk_full_text(text: str) -> bool:
  return "No space left on device" in text or "Disk quota exceeded" in text


def is_disk_full(error: BaseException | None) -> bool:
  """Whether `error` (or its cause) is a full disk or quota: OSError ENOSPC/EDQUOT, or
  TensorStore's `RESOURCE_EXHAUSTED ... No space left on device` through Orbax."""
  while error is not None:
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
      return True
    if _disk_full_text(str(error)):
      return True
    error = error.__cause__ or error.__context__
  return False


def partial_steps(workdir: str) -> list[str]:
  """Orbax's temporary directories of steps whose writing never finished."""
  directory = storage.as_path(checkpoint_dir(workdir))
  if not directory.is_dir():
    return []
  return sorted(str(p) for p in directory.iterdir() if TMP_SUFFIX in p.name)


def complete_steps(workdir: str) -> list[int]:
  """The steps Orbax finished writing (plain numeric directories), ascending."""
  directory = storage.as_path(checkpoint_dir(workdir))
  if not directory.is_dir():
    return []
  return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


def disk_full_error(workdir: str, state_bytes: int, error: BaseException) -> DiskFullError:
  """The one-line error of a full disk: where, how many bytes a checkpoint needs (the
  newest complete step's files, else the state's size) and how many are free. Deletes the
  partial step (call it once the checkpoint manager is closed), so that the space it took
  is free again; complete steps are kept."""
  partial = partial_steps(workdir)
  # Writes of the failed save may still land after it raised: delete until none reappear
  # (what remains is deleted by the next run's manager, `cleanup_tmp_directories`).
  for _ in range(5):
    leftover = partial_steps(workdir)
    if not leftover:
      break
    for path in leftover:
      with contextlib.suppress(OSError):
        storage.as_path(path).rmtree()
    time.sleep(0.2)
  steps = complete_steps(workdir)
  directory = checkpoint_dir(workdir)
  needed = storage.tree_bytes(storage.join(directory, str(steps[-1]))) if steps else 0
  needed = needed or state_bytes
  if partial:
    step = storage.basename(partial[0]).split(".", 1)[0]
    where = f"checkpoint step {step} to {directory} (its partial files are deleted)"
  else:
    where = getattr(error, "filename", None) or workdir
  free = storage.free_bytes(directory)
  kept = (
    f"step {steps[-1]} is kept and a rerun resumes from it" if steps else "no checkpoint is kept"
  )
  result = DiskFullError(
    f"no space left on the device writing {where}: a checkpoint takes about {needed:,} "
    f"bytes{'' if free is None else f', {free:,} are free there'}; {kept}. Free space (or "
    "lower checkpoint.keep) and rerun, or pass a --workdir on a larger disk"
  )
  result.errno = errno.ENOSPC
  return result
