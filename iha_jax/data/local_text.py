"""A TFDS builder that turns the user's local `.txt`/`.jsonl` files into
an `array_record` text dataset (feature `text`), offline."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator, Sequence

import tensorflow_datasets as tfds
from etils import epath

from iha_jax.data import builder_base

SUFFIXES: tuple[str, ...] = (".txt", ".jsonl")


@dataclasses.dataclass(eq=False, kw_only=True)
class LocalTextConfig(tfds.core.BuilderConfig):
  """How local files are cut into documents.

  Attributes:
    document: for `.txt` files, `"line"` makes every non-blank line a
      document, `"file"` makes the whole file one document.
    jsonl_key: field holding the text in each `.jsonl` record (one document
      per non-blank line, whatever `document` says).
  """

  document: str = "line"
  jsonl_key: str = "text"

  def validate(self) -> None:
    if self.document not in ("line", "file"):
      raise ValueError(f"document must be 'line' or 'file', got {self.document!r}.")


def split_files(root: epath.Path) -> dict[str, list[epath.Path]]:
  """Maps each split to its files `<split>*.txt` / `<split>*.jsonl`."""
  files = {}
  for split in builder_base.SPLITS:
    matches = sorted(path for path in root.glob(f"{split}*") if path.suffix in SUFFIXES)
    if matches:
      files[split] = matches
  return files


class LocalText(builder_base.ArrayRecordBuilder):
  """Documents read from local text files.

  Put `train*.txt`/`train*.jsonl` (and optionally `validation*`,
  `test*`) in the manual directory; each split gets the documents of its
  files in sorted file order. Configs: `lines` (one document per non-blank
  line of a `.txt`) and `files` (one document per `.txt` file).
  `.jsonl` files always give one document per record, read from
  `jsonl_key`. Feature: `text` (a string).
  """

  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {"1.0.0": "Initial release."}
  MANUAL_DOWNLOAD_INSTRUCTIONS = """\
  Put train*.txt / train*.jsonl files (and optionally validation*, test*) in
  the manual directory, e.g. `python -m iha_jax.data.build
  --name=local_text/lines --data_dir=DATA_DIR --manual_dir=DIR`.
  """
  BUILDER_CONFIGS = [
    LocalTextConfig(name="lines", description="One document per line."),
    LocalTextConfig(name="files", description="One document per file.", document="file"),
  ]

  def _info(self) -> tfds.core.DatasetInfo:
    return tfds.core.DatasetInfo(
      builder=self,
      description=type(self).__doc__,
      features=tfds.features.FeaturesDict({"text": tfds.features.Text()}),
    )

  def _split_generators(self, dl_manager: tfds.download.DownloadManager):
    self.builder_config.validate()
    files = split_files(dl_manager.manual_dir)
    if "train" not in files:
      raise ValueError(f"No train*.txt or train*.jsonl file in {dl_manager.manual_dir}.")
    return {split: self._generate_examples(paths) for split, paths in files.items()}

  def _generate_examples(self, paths: Sequence[epath.Path]) -> Iterator[tuple[str, dict[str, str]]]:
    for path in paths:
      for key, text in self._documents(path):
        yield f"{path.name}:{key}", {"text": text}

  def _documents(self, path: epath.Path) -> Iterator[tuple[int, str]]:
    config = self.builder_config
    content = path.read_text(encoding="utf-8")
    if path.suffix == ".txt" and config.document == "file":
      yield 0, content
      return
    for line_number, line in enumerate(content.splitlines()):
      if not line.strip():
        continue
      if path.suffix == ".jsonl":
        yield line_number, json.loads(line)[config.jsonl_key]
      else:
        yield line_number, line
