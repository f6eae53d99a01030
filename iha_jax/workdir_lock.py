"""One writer per workdir: the lock a training run holds while it writes `WORKDIR`.

The lock is the highest-numbered file of `WORKDIR/lock/` (`00000001.json`, ...), holding
the run's host, process id, command and a heartbeat time. Taking it means creating the
next number with `storage.create_new` (create-only, on local disks and on `gs://` alike),
so of two runs that race for it exactly one wins, and the loser names the winner.

A holder is gone (its lock stale, taken over by the next number) when
- on this host: its process id is not running, or runs a process started at another time
  (a reused id), or is this very process without holding that lock any more;
- on another host: its heartbeat (rewritten every `HEARTBEAT_S` seconds by a thread of the
  holder) is older than `STALE_AFTER_S` by this host's clock.
A holder that finds a higher number than its own on a heartbeat has been taken over (its
heartbeats stalled for `STALE_AFTER_S`, or someone deleted its file): `check` then raises,
and the trainer stops before writing another checkpoint.

Reading a workdir (eval.py) takes no lock. Multi-process runs: process 0 holds it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import sys
import threading
import time
import uuid
from typing import Any

from iha_jax import storage
from iha_jax.errors import UserError

LOCK_DIR = "lock"
HEARTBEAT_S = 30.0
STALE_AFTER_S = 300.0
_HELD: set[str] = set()  # run ids of the locks this process holds


class WorkdirBusyError(UserError, RuntimeError):
  """Another run writes the workdir; the message names it (host, process id, command)."""


class WorkdirError(UserError, OSError):
  """`--workdir` is not a directory this run can write; the message says why."""


def _start_time(pid: int) -> str | None:
  """The start time of process `pid` in clock ticks since boot (Linux), else None."""
  try:
    with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
      return f.read().rsplit(")", 1)[1].split()[19]
  except (OSError, IndexError):
    return None


def _running(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # another user's process
    return True
  return True


def holder_gone(info: dict[str, Any], now: float | None = None) -> bool:
  """Whether the run described by a lock file's `info` is gone (see the module doc)."""
  if info.get("host") != socket.gethostname():
    return (time.time() if now is None else now) - float(info.get("heartbeat", 0)) > STALE_AFTER_S
  pid = int(info.get("pid", -1))
  if pid == os.getpid():
    return info.get("run") not in _HELD
  if pid <= 0 or not _running(pid):
    return True
  started = info.get("start_time")
  return started is not None and _start_time(pid) not in (None, started)


def describe(info: dict[str, Any], now: float | None = None) -> str:
  """`host H, pid P, started T, heartbeat 12 s ago (train.py --config ...)`."""
  age = (time.time() if now is None else now) - float(info.get("heartbeat", 0))
  command = str(info.get("command", "?"))
  command = command if len(command) <= 120 else command[:117] + "..."
  return (
    f"host {info.get('host', '?')}, pid {info.get('pid', '?')}, started "
    f"{info.get('started', '?')}, heartbeat {age:.0f} s ago ({command})"
  )


class WorkdirLock:
  """The lock of `workdir` (see the module doc): `acquire()`, `check()`, `release()`."""

  def __init__(self, workdir: str):
    self.workdir = storage.resolve(workdir, name="--workdir")
    self.directory = storage.join(self.workdir, LOCK_DIR)
    self.run = uuid.uuid4().hex
    self.number: int | None = None
    self.taken_over: str | None = None  # who took the lock over, once a heartbeat sees it
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None
    self._info = {
      "host": socket.gethostname(),
      "pid": os.getpid(),
      "start_time": _start_time(os.getpid()),
      "run": self.run,
      "command": " ".join([os.path.basename(sys.argv[0]), *sys.argv[1:]])[:200],
      "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }

  def _path(self, number: int) -> str:
    return storage.join(self.directory, f"{number:08d}.json")

  def _numbers(self) -> list[int]:
    names = storage.list_names(self.directory)
    return sorted(int(n[:-5]) for n in names if n.endswith(".json") and n[:-5].isdigit())

  def _read(self, number: int) -> dict[str, Any] | None:
    """The lock file `number`, or None when it vanished or is unreadable."""
    try:
      return json.loads(storage.as_path(self._path(number)).read_text(encoding="utf-8"))
    except (OSError, ValueError):
      return None

  def _text(self) -> str:
    return json.dumps({**self._info, "heartbeat": time.time()})

  def acquire(self, attempts: int = 5) -> None:
    """Takes the lock or raises WorkdirBusyError naming the run that holds it."""
    for _ in range(attempts):
      numbers = self._numbers()
      top = numbers[-1] if numbers else 0
      if top:
        info = self._read(top)
        if info is None:  # vanished (released) or half-written by a racing run: look again
          time.sleep(0.2)
          info = self._read(top)
        if info is not None and not holder_gone(info):
          raise WorkdirBusyError(
            f"--workdir {self.workdir!r} is in use by another training run: {describe(info)}; "
            "wait for it to end, stop it, or pass another --workdir (its lock "
            f"{self._path(top)} lapses when that process is gone)"
          )
      # Held before the file exists: another thread of this process that reads the new
      # file must never judge it stale (pid == ours and run not yet held).
      _HELD.add(self.run)
      if storage.create_new(self._path(top + 1), self._text()):
        self.number = top + 1
        for old in numbers:  # stale locks: the highest number is the one that counts
          storage.remove(self._path(old))
        self._thread = threading.Thread(target=self._beat, name="iha_jax lock", daemon=True)
        self._thread.start()
        return
      _HELD.discard(self.run)
    raise WorkdirBusyError(
      f"--workdir {self.workdir!r}: could not take its lock in {attempts} attempts (other "
      f"runs keep taking it over); look at {self.directory}"
    )

  def _beat(self) -> None:
    while not self._stop.wait(HEARTBEAT_S):
      with contextlib.suppress(Exception):  # a missed beat is retried at the next one
        self.heartbeat()

  def heartbeat(self) -> None:
    """Refreshes the heartbeat, or records `taken_over` when a higher number exists."""
    if self.number is None or self.taken_over:
      return
    numbers = self._numbers()
    if numbers and numbers[-1] > self.number:
      info = self._read(numbers[-1]) or {}
      self.taken_over = describe(info)
      logging.error("the lock of %s was taken over by %s", self.workdir, self.taken_over)
      return
    storage.replace_text(self._path(self.number), self._text())

  def check(self) -> None:
    """Raises WorkdirBusyError when another run took the lock over."""
    if self.taken_over:
      raise WorkdirBusyError(
        f"another run took over --workdir {self.workdir!r} ({self.taken_over}); this run "
        f"stops without writing more (its heartbeats had stopped for "
        f"{STALE_AFTER_S:.0f} s, or its lock file was deleted)"
      )

  def release(self) -> None:
    """Stops the heartbeat and deletes this run's lock file (never a newer holder's)."""
    self._stop.set()
    if self._thread is not None:
      self._thread.join(timeout=5)
    if self.number is not None:
      _HELD.discard(self.run)
      info = self._read(self.number)
      if info is not None and info.get("run") == self.run:
        storage.remove(self._path(self.number))
      self.number = None


def lock_workdir(workdir: str) -> WorkdirLock:
  """Creates `workdir` if missing and takes its lock.

  Raises:
    WorkdirError: `workdir` is a file or cannot be written (naming why).
    WorkdirBusyError: another run holds it.
  """
  workdir = storage.resolve(workdir, name="--workdir")
  path = storage.as_path(workdir)
  if path.exists() and not path.is_dir():
    raise WorkdirError(
      f"--workdir {workdir!r} is a file, not a directory; pass a directory (it is created "
      "when missing)"
    )
  lock = WorkdirLock(workdir)
  try:
    storage.makedirs(workdir)
    lock.acquire()
  except OSError as e:
    if isinstance(e, UserError):
      raise
    reason = e.strerror or type(e).__name__
    raise WorkdirError(
      f"--workdir {workdir!r} cannot be written ({reason}: {e.filename or workdir}); pass a "
      "directory this user can write, or fix its permissions"
    ) from e
  return lock
