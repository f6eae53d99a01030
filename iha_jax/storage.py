"""Where runs, data and outputs live: local paths or remote URLs (`gs://`, `s3://`, ...).

Every workdir, data dir, checkpoint dir, metrics file, TensorBoard log and eval output goes
through `etils.epath`, the path layer Orbax and TFDS use, so a URL reaches them unchanged.
`os.path.abspath("gs://B/run")` is `$PWD/gs:/B/run`, a local directory: local paths are
made absolute here, URLs never are.

Remote object stores cannot append to an object, so `TextLog` (metrics.jsonl) and the
TensorBoard event files on remote storage are kept in memory and rewritten whole on each
flush (they stay small).

Small files a reader must see whole or not at all (the workdir lock) use `create_new`
(create-only: of two writers exactly one wins) and `replace_text` (readers see the old or
the new text, never a mix).
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shutil
import uuid
from typing import IO

from etils import epath

PathLike = str | os.PathLike
# URL schemes etils.epath maps to a storage backend (fsspec: gcsfs, s3fs, adlfs, hf).
REMOTE_SCHEMES = ("gs", "s3", "az", "hf")
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def scheme(path: PathLike) -> str | None:
  """`"gs"` for `gs://B/x`, None for a local path."""
  match = _URL.match(os.fspath(path))
  return match.group(1) if match else None


def is_remote(path: PathLike) -> bool:
  """Whether `path` is a URL of remote storage (not a local path, not `file://`)."""
  return scheme(path) not in (None, "file")


def resolve(path: PathLike, *, name: str = "path") -> str:
  """The canonical string of `path`: URLs as given (no trailing slash), local paths
  absolute with `~` expanded. `name` (e.g. "--workdir") labels the error.

  Raises:
    ValueError: for a URL scheme etils.epath has no backend for.
  """
  text = os.fspath(path)
  kind = scheme(text)
  if kind == "file":
    text, kind = text[len("file://") :], None
  if kind is None:
    return os.path.abspath(os.path.expanduser(text))
  if kind not in REMOTE_SCHEMES:
    raise ValueError(
      f"{name} {text!r}: unsupported URL scheme {kind}://; use a local path "
      f"or one of {', '.join(s + '://' for s in REMOTE_SCHEMES)}"
    )
  return str(epath.Path(text))


def as_path(path: PathLike, *, name: str = "path") -> epath.Path:
  """`resolve(path)` as an `epath.Path` (local or remote)."""
  return epath.Path(resolve(path, name=name))


def join(base: PathLike, *parts: str) -> str:
  """`base/part/...` for a local path or a URL."""
  return str(as_path(base).joinpath(*parts))


def parent(path: PathLike) -> str:
  """The directory holding `path` (`gs://B/runs/a` -> `gs://B/runs`)."""
  return str(as_path(path).parent)


def basename(path: PathLike) -> str:
  """The last component of `path` (`gs://B/runs/a/` -> `a`)."""
  return as_path(path).name


def makedirs(path: PathLike) -> epath.Path:
  """Creates `path` and its parents if missing; returns it as an `epath.Path`."""
  result = as_path(path)
  result.mkdir(parents=True, exist_ok=True)
  return result


def write_text(path: PathLike, text: str) -> str:
  """Writes `text` to the file `path` (its directory is created); returns the path."""
  target = as_path(path)
  target.parent.mkdir(parents=True, exist_ok=True)
  target.write_text(text, encoding="utf-8")
  return str(target)


def _temporary_sibling(path: str) -> str:
  """A unique name next to `path` (same directory, so a link or rename stays local)."""
  head, tail = os.path.split(path)
  return os.path.join(head, f".{tail}.{uuid.uuid4().hex}.tmp")


def create_new(path: PathLike, text: str) -> bool:
  """Writes `text` to the file `path` unless a file is there; returns whether it did.

  Atomic and exclusive: readers see no file or all of `text`, and of writers racing for
  one path exactly one gets True. Locally a complete temporary file is hard-linked to
  `path` (the link fails if `path` exists); on object stores the upload carries a
  create-only precondition (GCS `ifGenerationMatch=0`, gcsfs's mode "xb").
  """
  target = as_path(path)
  target.parent.mkdir(parents=True, exist_ok=True)
  data = text.encode("utf-8")
  if is_remote(target):
    fs = epath.backend.fsspec_backend.fs(str(target))
    try:
      with fs.open(str(target), "xb") as f:
        f.write(data)
    except FileExistsError:
      return False
    return True
  temporary = _temporary_sibling(str(target))
  with open(temporary, "wb") as f:
    f.write(data)
    f.flush()
    os.fsync(f.fileno())
  try:
    os.link(temporary, target)
  except FileExistsError:
    return False
  except OSError:  # a filesystem without hard links: exclusive, readers may see it grow
    try:
      descriptor = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
      return False
    with os.fdopen(descriptor, "wb") as f:
      f.write(data)
  finally:
    os.unlink(temporary)
  return True


def list_names(path: PathLike) -> list[str]:
  """The names in the directory `path` (empty when it is missing), read afresh: fsspec
  caches remote listings, which would hide what other processes wrote since."""
  text = resolve(path)
  try:
    if not is_remote(text):
      return sorted(os.listdir(text))
    fs = epath.backend.fsspec_backend.fs(text)
    fs.invalidate_cache()
    return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(text, detail=False))
  except (FileNotFoundError, NotADirectoryError):
    return []


def replace_text(path: PathLike, text: str) -> None:
  """Replaces the file `path` by `text` so that readers see the old or the new text whole
  (locally a rename over it; an object store replaces an object in one upload)."""
  target = as_path(path)
  if is_remote(target):
    target.write_text(text, encoding="utf-8")
    return
  temporary = _temporary_sibling(str(target))
  with open(temporary, "w", encoding="utf-8") as f:
    f.write(text)
  os.replace(temporary, target)


def remove(path: PathLike) -> None:
  """Deletes the file `path`; a missing file is no error."""
  with contextlib.suppress(FileNotFoundError):
    as_path(path).unlink()


def free_bytes(path: PathLike) -> int | None:
  """Free bytes on the local filesystem holding `path` (its nearest existing parent);
  None for remote storage."""
  if is_remote(path):
    return None
  current = resolve(path)
  while not os.path.exists(current) and os.path.dirname(current) != current:
    current = os.path.dirname(current)
  return shutil.disk_usage(current).free


def tree_bytes(path: PathLike) -> int:
  """Total size of the files under the local directory `path` (0 if missing or remote)."""
  if is_remote(path):
    return 0
  total = 0
  for root, _, files in os.walk(resolve(path)):
    for name in files:
      with contextlib.suppress(OSError):
        total += os.path.getsize(os.path.join(root, name))
  return total


class WholeObjectWriter(io.RawIOBase):
  """A writable binary file on remote storage that rewrites the whole object on every
  flush, so readers (TensorBoard, a person) see the data while the run goes on."""

  def __init__(self, path: PathLike, *, append: bool = False):
    super().__init__()
    self._path = as_path(path)
    self._buffer = bytearray()
    if append and self._path.exists():
      self._buffer += self._path.read_bytes()
    self._dirty = False

  def writable(self) -> bool:
    return True

  def write(self, data: bytes) -> int:
    self._buffer += data
    self._dirty = True
    return len(data)

  def flush(self) -> None:
    if self._dirty and not self.closed:
      self._path.write_bytes(bytes(self._buffer))
      self._dirty = False

  def close(self) -> None:
    if not self.closed:
      self.flush()
    super().close()


class TextLog:
  """A text file that grows by lines (metrics.jsonl): appended to locally, kept whole
  and rewritten on each flush on remote storage."""

  def __init__(self, path: PathLike):
    target = as_path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    self._file: IO[str]
    if is_remote(target):
      self._file = io.TextIOWrapper(
        WholeObjectWriter(target, append=True), encoding="utf-8", write_through=True
      )
    else:
      self._file = open(target, "a", encoding="utf-8")  # pylint: disable=consider-using-with

  def write(self, text: str) -> None:
    self._file.write(text)

  def flush(self) -> None:
    self._file.flush()

  def close(self) -> None:
    self._file.close()


class _TensorBoardFactory:
  """tensorboardX writer factory for remote URLs (its own handles only s3 and, with
  google-cloud-storage, gs): event files go through epath like everything else."""

  @staticmethod
  def directory_check(path: str) -> None:
    makedirs(path)

  @staticmethod
  def open(path: str) -> WholeObjectWriter:
    return WholeObjectWriter(path)


def register_tensorboard_factories() -> None:
  """Routes tensorboardX's remote event files through epath (idempotent)."""
  from tensorboardX import record_writer  # pylint: disable=import-outside-toplevel

  for kind in REMOTE_SCHEMES:
    record_writer.register_writer_factory(kind, _TensorBoardFactory())
