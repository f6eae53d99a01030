"""The running interpreter's standard library source as a text corpus (`python_stdlib`).

Every machine that runs the project carries this corpus, written by people outside it:
the `.py` files under `sysconfig.get_paths()["stdlib"]` (or the config's `root`). It is
read offline and stored as an `array_record` dataset with features `text` (a document) and
`path` (its file, relative to the root, `/`-separated).

* **Splits** by a hash of the relative path (`sha256`, first 8 hex digits, mod 100):
  `validation_percent` and `test_percent` of the files, the rest train. A file is never
  divided between splits, and a file keeps its split when others are added or removed.
* **Documents**: config `files` keeps one document per file; `chunks` (the default) cuts
  each file into runs of whole lines of at most `chunk_bytes` UTF-8 bytes (a longer line
  is a document of its own). The pipeline truncates documents longer than `seq_len`
  instead of splitting them, so chunks are sized to the rows (the default fits 256-token
  rows of a byte-level BPE; with the byte tokenizer, `chunk_bytes = seq_len - 1`).
* **Excluded**: third-party packages (`site-packages/`, `dist-packages/`), build-specific
  generated files (`_sysconfigdata_*.py`, `config-*/`), `pydoc_data/topics.py` (generated
  documentation strings in one file, which would dominate a held-out split) and, unless
  `include_tests`, every test package (`test/`, `tests/`, `idle_test/` at any depth: most
  of the bytes, mostly repetitive assertions, and the only deliberately malformed files).
* **Encodings**: each file is decoded as Python decodes it (`tokenize.detect_encoding`: a
  BOM or coding cookie, else UTF-8); a file that does not decode is skipped and counted in
  the metadata.
* **Metadata** (`builder.info.metadata`), so that a result names its data: the Python
  version and implementation, the root, files and bytes per split, and `files_digest`, a
  sha256 over the sorted `path<TAB>sha256(file bytes)` lines of the files used.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import hashlib
import io
import os
import platform
import sysconfig
import tokenize
from collections.abc import Iterator, Sequence

import tensorflow_datasets as tfds
from absl import logging

from iha_jax.data import builder_base
from iha_jax.data.errors import DataError

# Relative paths never read: third-party packages and build-specific generated files.
EXCLUDED = (
  "site-packages/*",
  "dist-packages/*",
  "config-*/*",
  "_sysconfigdata_*.py",
  "pydoc_data/topics.py",
)
TEST_DIRS = frozenset({"test", "tests", "idle_test"})


@dataclasses.dataclass(eq=False, kw_only=True)
class PythonStdlibConfig(tfds.core.BuilderConfig):
  """Which files, how they are split and cut into documents.

  Attributes:
    root: directory of `.py` files; "" is the running interpreter's stdlib directory.
    include_tests: keep the test packages (`test/`, `tests/`, `idle_test/`).
    chunk_bytes: documents of whole lines of at most this many UTF-8 bytes; 0 keeps
      one document per file.
    validation_percent: share of the files (by path hash) in `validation`.
    test_percent: share of the files (by path hash) in `test`.
    max_files: at most this many files per split (0: all), the first in the order of
      their path hashes: a small deterministic sample (the tests' `tiny` corpus).
    max_file_bytes: leave out files larger than this (0: no limit).
  """

  root: str = ""
  include_tests: bool = False
  chunk_bytes: int = 768
  validation_percent: int = 5
  test_percent: int = 5
  max_files: int = 0
  max_file_bytes: int = 0

  def validate(self) -> None:
    if self.chunk_bytes < 0:
      raise ValueError(f"chunk_bytes must be >= 0 (0: whole files), got {self.chunk_bytes}.")
    held_out = (self.validation_percent, self.test_percent)
    if min(held_out) < 1 or sum(held_out) > 99:
      raise ValueError(
        "validation_percent and test_percent must each be >= 1 and leave files for train,"
        f" got {held_out}."
      )
    if self.max_files < 0 or self.max_file_bytes < 0:
      raise ValueError("max_files and max_file_bytes must be >= 0 (0: no limit).")


def stdlib_dir(root: str = "") -> str:
  """`root`, or the running interpreter's stdlib directory; DataError if it is missing."""
  path = root or sysconfig.get_paths()["stdlib"]
  if not os.path.isdir(path):
    where = "the config's root" if root else "sysconfig.get_paths()['stdlib']"
    raise DataError(
      f"python_stdlib: no source directory {path!r} ({where}); this interpreter may ship"
      " its standard library zipped or without sources. Pass"
      " --option=root=DIR_WITH_PY_FILES, or use local_text for other files."
    )
  return path


def path_bucket(relative_path: str) -> int:
  """The file's bucket in 0..99 from its relative path (what decides its split)."""
  return int(hashlib.sha256(relative_path.encode("utf-8")).hexdigest()[:8], 16) % 100


def split_of(relative_path: str, config: PythonStdlibConfig) -> str:
  bucket = path_bucket(relative_path)
  if bucket < config.validation_percent:
    return "validation"
  if bucket < config.validation_percent + config.test_percent:
    return "test"
  return "train"


def is_excluded(relative_path: str, include_tests: bool) -> bool:
  if any(fnmatch.fnmatchcase(relative_path, pattern) for pattern in EXCLUDED):
    return True
  return not include_tests and bool(TEST_DIRS.intersection(relative_path.split("/")[:-1]))


def list_files(root: str, config: PythonStdlibConfig) -> dict[str, list[str]]:
  """Split name -> the relative paths of its `.py` files, in path-hash order."""
  splits: dict[str, list[str]] = {split: [] for split in builder_base.SPLITS}
  for directory, subdirs, names in os.walk(root):
    subdirs.sort()
    for name in sorted(names):
      if not name.endswith(".py"):
        continue
      full = os.path.join(directory, name)
      relative = os.path.relpath(full, root).replace(os.sep, "/")
      if is_excluded(relative, config.include_tests) or not os.path.isfile(full):
        continue
      if config.max_file_bytes and os.path.getsize(full) > config.max_file_bytes:
        continue
      splits[split_of(relative, config)].append(relative)
  for paths in splits.values():
    paths.sort(key=lambda p: (hashlib.sha256(p.encode("utf-8")).hexdigest(), p))
    if config.max_files:
      del paths[config.max_files :]
  return splits


def decode_source(data: bytes) -> str | None:
  """The file's text as Python reads it (BOM or coding cookie, else UTF-8); None if it
  does not decode."""
  try:
    encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
    text = data.decode(encoding)
  except (SyntaxError, UnicodeDecodeError, LookupError):
    return None
  return text.removeprefix("\ufeff")


def chunk_lines(text: str, chunk_bytes: int) -> list[str]:
  """`text` as consecutive runs of whole lines of at most `chunk_bytes` UTF-8 bytes each
  (a longer line is a run of its own); 0 keeps the text whole. Joined, they are `text`."""
  if not chunk_bytes:
    return [text] if text else []
  chunks, current, size = [], [], 0
  for line in text.splitlines(keepends=True):
    length = len(line.encode("utf-8"))
    if current and size + length > chunk_bytes:
      chunks.append("".join(current))
      current, size = [], 0
    current.append(line)
    size += length
  if current:
    chunks.append("".join(current))
  return chunks


class PythonStdlib(builder_base.ArrayRecordBuilder):
  """The `.py` files of the Python standard library (see the module docstring).

  Configs: `chunks` (documents of whole lines, at most 768 bytes) and `files` (one
  document per file). Features: `text`, `path`.
  """

  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {"1.0.0": "Initial release."}
  BUILDER_CONFIGS = [
    PythonStdlibConfig(name="chunks", description="Runs of whole lines, <= 768 bytes."),
    PythonStdlibConfig(name="files", description="One document per file.", chunk_bytes=0),
  ]

  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    saved = self.info.metadata.get("python_version") if self.info.metadata else None
    if saved and saved != platform.python_version():
      logging.warning(
        "python_stdlib in %s was prepared from Python %s; this is Python %s. Its data is"
        " the one named in its metadata (files_digest %s).",
        self.data_dir,
        saved,
        platform.python_version(),
        self.info.metadata.get("files_digest"),
      )

  @property
  def config(self) -> PythonStdlibConfig:
    return self.builder_config  # pytype: disable=bad-return-type

  def _info(self) -> tfds.core.DatasetInfo:
    return tfds.core.DatasetInfo(
      builder=self,
      description=type(self).__doc__,
      features=tfds.features.FeaturesDict(
        {"text": tfds.features.Text(), "path": tfds.features.Text()}
      ),
      metadata=tfds.core.MetadataDict(),
    )

  def _split_generators(self, dl_manager: tfds.download.DownloadManager):
    del dl_manager  # Nothing is downloaded.
    self.config.validate()
    root = stdlib_dir(self.config.root)
    files = list_files(root, self.config)
    if not files["train"]:
      raise DataError(f"python_stdlib: no .py files for the train split under {root!r}.")
    texts, digests, skipped = {}, [], []
    for path in (p for paths in files.values() for p in paths):
      with open(os.path.join(root, path), "rb") as f:
        data = f.read()
      text = decode_source(data)
      if text is None:
        skipped.append(path)
        continue
      texts[path] = text
      digests.append(f"{path}\t{hashlib.sha256(data).hexdigest()}")
    kept = {split: [p for p in paths if p in texts] for split, paths in files.items()}
    self.info.metadata.update(
      python_version=platform.python_version(),
      python_implementation=platform.python_implementation(),
      root=root,
      files_digest=hashlib.sha256("\n".join(sorted(digests)).encode("utf-8")).hexdigest(),
      num_files={split: len(paths) for split, paths in kept.items()},
      num_bytes={
        split: sum(len(texts[p].encode("utf-8")) for p in paths) for split, paths in kept.items()
      },
      skipped_files=sorted(skipped),
    )
    return {
      split: self._generate_examples([(p, texts[p]) for p in paths])
      for split, paths in kept.items()
      if paths
    }

  def _generate_examples(
    self, files: Sequence[tuple[str, str]]
  ) -> Iterator[tuple[str, dict[str, str]]]:
    for path, text in files:
      for index, chunk in enumerate(chunk_lines(text, self.config.chunk_bytes)):
        yield f"{path}:{index}", {"text": chunk, "path": path}
