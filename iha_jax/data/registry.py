"""Dataset names, builders, preparation and the errors that explain them.

Names are `builder/config` for the project's builders (`mqar/kv8_len128`,
`relation_composition/binary`, `local_text/lines`, `python_stdlib/chunks` ...; the config
part may be left out for the builder's first config) and `tfds:<tfds name>` for any TFDS
text dataset the user has prepared as `array_record` (`tfds:lm1b`, `tfds:c4/en`).

Task `options` override fields of the builder config (`num_train`, `seed`, `length` ...).
A config with overrides gets its own name, `<config>-<digest of the overrides>`, so it is
prepared into its own directory and never mixed up with the registered config.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shlex
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any

import tensorflow_datasets as tfds
from etils import epath

from iha_jax import storage
from iha_jax.data import (
  builder_base,
  cpm3,
  local_text,
  mqar,
  multikey_retrieval,
  polynomial_filter,
  python_stdlib,
  relation_composition,
)
from iha_jax.data.errors import DataError

TFDS_PREFIX = "tfds:"

TASK_BUILDERS: dict[str, type[builder_base.SyntheticBuilder]] = {
  "relation_composition": relation_composition.RelationComposition,
  "multikey_retrieval": multikey_retrieval.MultikeyRetrieval,
  "mqar": mqar.Mqar,
  "cpm3": cpm3.Cpm3,
  "polynomial_filter": polynomial_filter.PolynomialFilter,
}
TEXT_BUILDERS: dict[str, type[builder_base.ArrayRecordBuilder]] = {
  "local_text": local_text.LocalText,
  "python_stdlib": python_stdlib.PythonStdlib,
}
_BUILDERS = {**TASK_BUILDERS, **TEXT_BUILDERS}
# BuilderConfig fields that describe rather than define the data.
_DESCRIPTIVE_FIELDS = frozenset(f.name for f in dataclasses.fields(tfds.core.BuilderConfig))


def list_datasets() -> list[str]:
  """Returns the `builder/config` names of the project's datasets."""
  return sorted(
    f"{name}/{config.name}" for name, cls in _BUILDERS.items() for config in cls.BUILDER_CONFIGS
  )


def is_text(name: str) -> bool:
  """Whether `name` is a text corpus (else a synthetic task)."""
  return name.startswith(TFDS_PREFIX) or name.split("/")[0] in TEXT_BUILDERS


def build_command(
  name: str, data_dir: str | os.PathLike[str] | None, options: Mapping[str, Any] | None = None
) -> str:
  """The shell command that prepares `name` into `data_dir`."""
  parts = ["python", "-m", "iha_jax.data.build", f"--name={name}"]
  parts.append(f"--data_dir={data_dir if data_dir else 'DATA_DIR'}")
  builder = TEXT_BUILDERS.get(name.split("/")[0])
  if builder is not None and builder.MANUAL_DOWNLOAD_INSTRUCTIONS:
    parts.append("--manual_dir=DIR_WITH_TRAIN_TXT_OR_JSONL")
  parts += [f"--option={key}={value!r}" for key, value in (options or {}).items()]
  return shlex.join(parts)


def _unknown_name_error(name: str) -> DataError:
  return DataError(
    f"Unknown dataset {name!r}. Available: {', '.join(list_datasets())};"
    f" or '{TFDS_PREFIX}<name>[/config]' for a TFDS text dataset prepared as"
    " array_record."
  )


def _builder_class(name: str) -> type[builder_base.ArrayRecordBuilder]:
  builder_name, _, config_name = name.partition("/")
  cls = _BUILDERS.get(builder_name)
  if cls is None or (config_name and config_name not in cls.builder_configs):
    raise _unknown_name_error(name)
  return cls


def builder_config(name: str, options: Mapping[str, Any] | None = None) -> tfds.core.BuilderConfig:
  """The config of project dataset `name` with `options` applied.

  Raises:
    ValueError: for an unknown name, unknown options or invalid values.
  """
  cls = _builder_class(name)
  config_name = name.partition("/")[2]
  base = cls.builder_configs[config_name] if config_name else cls.BUILDER_CONFIGS[0]
  options = dict(options or {})
  allowed = sorted(f.name for f in dataclasses.fields(base) if f.name not in _DESCRIPTIVE_FIELDS)
  unknown = sorted(set(options) - set(allowed))
  if unknown:
    raise DataError(
      f"Unknown option(s) {unknown} for {cls.name}/{base.name}; valid options: {allowed}."
    )
  changed = {k: v for k, v in sorted(options.items()) if getattr(base, k) != v}
  if not changed:
    config = base
  else:
    digest = hashlib.sha256(repr(changed).encode()).hexdigest()[:10]
    overrides = ", ".join(f"{k}={v!r}" for k, v in changed.items())
    config = dataclasses.replace(
      base, name=f"{base.name}-{digest}", description=f"{base.name} with {overrides}.", **changed
    )
  try:
    config.validate()
  except ValueError as e:
    raise DataError(f"Dataset {name!r} with options {options}: {e}") from e
  return config


def get_builder(
  name: str, data_dir: str | os.PathLike[str] | None, options: Mapping[str, Any] | None = None
) -> tfds.core.DatasetBuilder:
  """Returns the TFDS builder of `name` in `data_dir` (not prepared).

  Raises:
    ValueError: for an unknown name, unknown options, or no `data_dir`.
  """
  options = dict(options or {})
  if not data_dir:
    raise DataError(
      f"No data_dir given for dataset {name!r}. Prepare it with:\n  "
      f"{build_command(name, None, options)}\nand pass that --data_dir."
    )
  if name.startswith(TFDS_PREFIX):
    if options:
      raise DataError(
        f"{name!r} takes no options, got {sorted(options)} (data.options is meant for "
        "the project's own datasets); clear them: --config.data.options={}"
      )
    try:
      return tfds.builder(name[len(TFDS_PREFIX) :], data_dir=data_dir)
    except tfds.core.registered.DatasetNotFoundError as e:
      raise _unknown_name_error(name) from e
  cls = _builder_class(name)
  return cls(config=builder_config(name, options), data_dir=data_dir)


def prepare(
  name: str,
  data_dir: str | os.PathLike[str],
  *,
  options: Mapping[str, Any] | None = None,
  manual_dir: str | os.PathLike[str] | None = None,
) -> tfds.core.DatasetBuilder:
  """Prepares `name` into `data_dir` as array_record unless already there.

  Args:
    name: dataset name (see `list_datasets`), or `tfds:<name>`.
    data_dir: the TFDS data directory.
    options: builder-config overrides (synthetic tasks, `local_text`).
    manual_dir: directory of the source files, for `local_text`.

  Returns:
    The prepared builder.
  """
  if storage.is_remote(data_dir):
    return _prepare_remote(name, data_dir, options=options, manual_dir=manual_dir)
  builder = get_builder(name, data_dir, options)
  download_config = tfds.download.DownloadConfig(manual_dir=manual_dir)
  builder.download_and_prepare(
    download_config=download_config, file_format=tfds.core.FileFormat.ARRAY_RECORD
  )
  return builder


def _prepare_remote(
  name: str,
  data_dir: str | os.PathLike[str],
  *,
  options: Mapping[str, Any] | None,
  manual_dir: str | os.PathLike[str] | None,
) -> tfds.core.DatasetBuilder:
  """Prepares into a local temporary directory, then copies the dataset up.

  ArrayRecord's C++ writer only knows local files (its reader reads `gs://` itself), so
  TFDS cannot write the shards straight to a bucket.
  """
  builder = get_builder(name, data_dir, options)
  if builder.is_prepared():
    return builder
  with tempfile.TemporaryDirectory(prefix="iha_jax_data_") as local:
    local_builder = prepare(name, local, options=options, manual_dir=manual_dir)
    source = epath.Path(local_builder.data_dir)
    target = epath.Path(builder.data_dir)
    for path in sorted(source.rglob("*")):
      if path.is_file():
        destination = target / path.relative_to(source)
        destination.parent.mkdir(parents=True, exist_ok=True)
        destination.write_bytes(path.read_bytes())
  return get_builder(name, data_dir, options)


def open_split(
  name: str,
  split: str,
  data_dir: str | os.PathLike[str] | None,
  options: Mapping[str, Any] | None = None,
) -> tuple[tfds.core.DatasetBuilder, Sequence[dict[str, Any]]]:
  """Returns the builder and a random-access source of one prepared split.

  Raises:
    ValueError: if the dataset is unknown or not prepared in `data_dir` (the message gives
      the command that prepares it), or `split` does not exist.
  """
  builder = get_builder(name, data_dir, options)
  if not builder.is_prepared():
    raise DataError(
      f"Dataset {name!r} is not prepared in data_dir {os.fspath(data_dir)!r}"
      f" (looked for {os.fspath(builder.data_path)}). Prepare it with:\n  "
      f"{build_command(name, data_dir, options)}"
    )
  if split not in builder.info.splits:
    raise DataError(
      f"Dataset {name!r} has no split {split!r}; available: {sorted(builder.info.splits)}."
    )
  try:
    source = builder.as_data_source(split=split)
  except NotImplementedError as e:
    raise DataError(
      f"Dataset {name!r} in {os.fspath(data_dir)!r} is stored as"
      f" {builder.info.file_format}, not array_record. Prepare it into"
      f" another data_dir with:\n  {build_command(name, 'NEW_DATA_DIR', options)}"
    ) from e
  return builder, source
