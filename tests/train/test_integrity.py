"""Nothing lost, nothing silently wrong: the workdir lock, checksums, and the one-line errors
of bad inputs (each raised before anything is compiled). Checkpoint corruption, a full disk
and a locked workdir during training: tests/train/test_train.py; two train.py at once and a
missing config file: tests/test_cli.py."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from configs import tiny
from iha_jax import parallel, storage, workdir_lock
from iha_jax.errors import UserError
from iha_jax.train import checkpoint as ckpt
from iha_jax.train import integrity, lowering, train
from iha_jax.train.loop import Trainer
from iha_jax.workdir_lock import WorkdirBusyError, WorkdirError, WorkdirLock
from tests import fake_bucket


def _lock_files(workdir: str) -> list[str]:
  directory = os.path.join(workdir, workdir_lock.LOCK_DIR)
  return sorted(os.listdir(directory)) if os.path.isdir(directory) else []


def _dead_pid() -> int:
  proc = subprocess.Popen([sys.executable, "-c", ""])
  proc.wait()
  return proc.pid


@pytest.mark.parametrize("remote", [False, True])
def test_one_lock_holder_named_to_others_and_stale_once_gone(tmp_path, monkeypatch, remote):
  """Local disk and gs:// (a bucket served from a directory): a second lock refuses naming
  the first; a lock whose process is gone (this host) or whose heartbeat is older than
  STALE_AFTER_S (another host) is taken over; a holder finds out it was taken over."""
  root = str(tmp_path / "run")
  workdir = root
  if remote:
    fake_bucket.mount(monkeypatch, str(tmp_path / "bucket"))
    workdir, root = "gs://bkt/run", str(tmp_path / "bucket" / "bkt" / "run")
  first = WorkdirLock(workdir)
  first.acquire()
  with pytest.raises(WorkdirBusyError, match=rf"host {socket.gethostname()}, pid {os.getpid()},"):
    WorkdirLock(workdir).acquire()
  first.release()
  assert _lock_files(root) == []

  def plant(number: int, **info) -> None:
    os.makedirs(os.path.join(root, "lock"), exist_ok=True)
    with open(os.path.join(root, "lock", f"{number:08d}.json"), "w", encoding="utf-8") as f:
      json.dump({"heartbeat": time.time(), **info}, f)

  plant(3, host=socket.gethostname(), pid=_dead_pid())
  plant(4, host="elsewhere", pid=1, heartbeat=time.time() - workdir_lock.STALE_AFTER_S - 5)
  second = WorkdirLock(workdir)
  second.acquire()
  assert _lock_files(root) == ["00000005.json"]  # stale locks removed
  plant(6, host="elsewhere", pid=1)  # a run that judged this one stale
  second.heartbeat()
  with pytest.raises(WorkdirBusyError, match=r"another run took over .* \(host elsewhere, pid 1,"):
    second.check()
  second.release()
  assert _lock_files(root) == ["00000006.json"]  # the newer holder's file stays
  with pytest.raises(WorkdirBusyError, match="host elsewhere, pid 1, .*heartbeat 0 s ago"):
    WorkdirLock(workdir).acquire()


@pytest.mark.parametrize("pause_after_create_s", [0.0, 0.05])
def test_racing_locks_have_one_winner(tmp_path, monkeypatch, pause_after_create_s):
  """Eight runs take one workdir's lock at the same moment: exactly one holds it.

  The pause widens the moment between a winner's file appearing and `acquire` returning,
  where a racing thread of the same process once judged the new file stale and won too.
  """
  create_new = storage.create_new

  def slow_create_new(path, text):
    created = create_new(path, text)
    time.sleep(pause_after_create_s if created else 0.0)
    return created

  monkeypatch.setattr(storage, "create_new", slow_create_new)
  workdir, start = str(tmp_path), threading.Barrier(8)
  won, refused = [], []

  def contend() -> None:
    lock = WorkdirLock(workdir)
    start.wait()
    try:
      lock.acquire()
      won.append(lock)
    except WorkdirBusyError:
      refused.append(lock)

  threads = [threading.Thread(target=contend) for _ in range(8)]
  for thread in threads:
    thread.start()
  for thread in threads:
    thread.join()
  assert len(won) == 1 and len(refused) == 7
  won[0].release()


def test_checksums_see_one_changed_word_and_not_the_mesh():
  """The digest changes with any one word of any dtype, not with the array's sharding."""
  mesh = parallel.create_mesh(dict(data=1, fsdp=8, tensor=1))
  x = jax.random.normal(jax.random.key(0), (86, 32))
  tree = {"f32": x, "bf16": x.astype(jnp.bfloat16), "i32": jnp.arange(5), "b": x > 0}
  split, whole = (
    NamedSharding(mesh, PartitionSpec(None, "fsdp")),
    NamedSharding(mesh, PartitionSpec()),
  )
  sharded = {k: jax.device_put(v, whole if v.ndim == 1 else split) for k, v in tree.items()}
  digests = integrity.tree_digests(tree)
  assert integrity.tree_digests(sharded) == digests
  for key, changed in {
    "f32": x.at[85, 31].set(np.nextafter(x[85, 31], np.inf)),
    "bf16": tree["bf16"].at[0, 0].multiply(-1),
    "i32": tree["i32"].at[2].add(1),
    "b": tree["b"].at[3, 3].set(~tree["b"][3, 3]),
  }.items():
    new = integrity.tree_digests({**tree, key: changed})
    assert new[key] != digests[key], key
    del new[key]
    assert new == {k: v for k, v in digests.items() if k != key}


def test_library_error_logs_of_a_full_disk_are_dropped():
  """Orbax logs a failed save once per thread, with a traceback, and asyncio once more per
  task: those go (the trainer reports the full disk once); other errors stay."""
  noise = ckpt._RedundantLibraryErrors()  # pylint: disable=protected-access

  def record(name: str, path: str, msg: str, error: Exception | None = None) -> bool:
    exc_info = (type(error), error, None) if error else None
    return noise.filter(logging.LogRecord(name, logging.ERROR, path, 1, msg, (), exc_info))

  full = ValueError("RESOURCE_EXHAUSTED: Failed to write 235 bytes: No space left on device")
  orbax = "/site-packages/orbax/checkpoint/_src/futures/future.py"
  assert not record("absl", orbax, "_SignalingThread.run() raised an exception: x")
  assert not record("absl", orbax, "Save Finalize thread (save_finalize) failed.", full)
  assert not record("asyncio", "/asyncio/base_events.py", "Future exception was never", full)
  assert record("absl", orbax, "Save Finalize thread (save_finalize) failed.", ValueError("bug"))
  assert record("root", "/iha_jax/train/loop.py", "disk", full)
  try:
    raise RuntimeError("save failed") from OSError(28, "No space left on device")
  except RuntimeError as e:
    assert ckpt.is_disk_full(e)
  assert not ckpt.is_disk_full(RuntimeError("RESOURCE_EXHAUSTED: out of memory"))


def _unwritable(tmp_path) -> str:
  """A directory this user cannot create: root ignores permissions, so /sys (read-only)."""
  if os.geteuid() == 0:
    return "/sys/iha_jax_test_run"
  locked = tmp_path / "locked"
  locked.mkdir(mode=0o500)
  return str(locked / "run")


BAD_INPUTS = {
  "workdir_is_a_file": ({}, WorkdirError, r"--workdir '.*afile' is a file, not a directory"),
  "unwritable_workdir": ({}, WorkdirError, r"--workdir '.*' cannot be written \("),
  "fsdp_3_of_8_devices_batch_30": (
    {"mesh": {"fsdp": 3}, "train": {"batch_size": 30}},
    UserError,
    r"mesh\.fsdp=3 does not divide axis 1 of parameter embedding \[86, 32\]: "
    r"32 = model\.model_dim .* \(1, 2, 4, 8 fit here\)",
  ),
  "vocab_smaller_than_data": (
    {"model": {"vocab_size": 10}},
    UserError,
    r"model\.vocab_size=10 is smaller than the vocabulary of data\.name='multikey_retrieval"
    r"/cpu_demo' \(token ids 0\.\.85\): set model\.vocab_size=-1",
  ),
  "tfds_with_leftover_options": (
    {"data": {"name": "tfds:lm1b"}},
    UserError,
    r"'tfds:lm1b' takes no options, got \['length', .*clear them: --config\.data\.options=\{\}",
  ),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_inputs_fail_in_one_line_before_any_compile(tmp_path, monkeypatch, case):
  overrides, error, message = BAD_INPUTS[case]
  config = tiny.get_config()
  config.data.data_dir = str(tmp_path / "data")
  for section, values in overrides.items():
    config[section].update(values)
  workdir = str(tmp_path / "run")
  if case == "unwritable_workdir":
    workdir = _unwritable(tmp_path)
  if case == "workdir_is_a_file":
    workdir = str(tmp_path / "afile")
    open(workdir, "w").close()

  def compiled(*args, **kwargs):
    raise AssertionError("compiled before the error")

  monkeypatch.setattr(lowering, "lower_train_step", compiled)
  with pytest.raises(error, match=message) as e:
    train(config, workdir)
  assert "\n" not in str(e.value)
  assert not os.path.isdir(os.path.join(workdir, "checkpoints"))
  assert _lock_files(workdir) == []


@pytest.mark.parametrize(
  ("loss", "grad_norm", "saved", "expected"),
  [
    (
      4.875,
      float("inf"),
      4,
      "step 7: the gradient norm is inf (the loss, 4.875, is finite); stopped before this "
      "step changed the state. Last good checkpoint: step 4 in {ckpt} (a rerun resumes "
      "there). Try a lower train.learning_rate (now 0.003), or gradient clipping "
      "(train.grad_clip=1.0; now off), or model.dtype='float32' (now 'bfloat16')",
    ),
    (
      float("nan"),
      float("nan"),
      None,
      "step 7: the loss is nan (and the gradient norm nan); stopped before this step changed "
      "the state. No checkpoint was saved yet (checkpoint.every=10): a rerun starts from "
      "step 0. Try a lower train.learning_rate (now 0.003), or gradient clipping "
      "(train.grad_clip=1.0; now off), or model.dtype='float32' (now 'bfloat16')",
    ),
  ],
)
def test_non_finite_stop_says_what_where_and_what_to_try(loss, grad_norm, saved, expected):
  config = tiny.get_config()
  config.train.grad_clip, config.model.dtype = 0.0, "bfloat16"
  trainer = types.SimpleNamespace(config=config, workdir="/runs/a", last_checkpoint=saved)
  with pytest.raises(UserError) as e:
    Trainer.check_finite(trainer, 7, {"finite": False, "loss": loss, "grad_norm": grad_norm})
  assert str(e.value) == expected.format(ckpt="/runs/a/checkpoints")
