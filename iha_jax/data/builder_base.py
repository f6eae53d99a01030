"""Base classes shared by the project's offline TFDS builders.

Every builder here writes `array_record` files by default, so that
`tfds.builder(name, data_dir=...).download_and_prepare()` followed by
`tfds.data_source(name, data_dir=...)` works without TensorFlow and without network
access. Synthetic builders derive every example from a seed held in their `BuilderConfig`:
example `i` of split `s` is a pure function of `(config, seed, s, i)`, independent of
generation order.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Iterator
from typing import Any, ClassVar

import numpy as np
import tensorflow_datasets as tfds

SPLITS: tuple[str, ...] = ("train", "validation", "test")

Example = dict[str, np.ndarray]


class ArrayRecordBuilder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
  """A `GeneratorBasedBuilder` whose default file format is `array_record`.

  `array_record` gives random access (`tfds.data_source`, Grain) and needs
  no TensorFlow. Passing `file_format=...` explicitly still overrides it.
  """

  def __init__(self, *, file_format: str | None = None, **kwargs: Any):
    super().__init__(file_format=file_format or tfds.core.FileFormat.ARRAY_RECORD, **kwargs)


@dataclasses.dataclass(eq=False, kw_only=True)
class SyntheticConfig(tfds.core.BuilderConfig):
  """Fields every synthetic task config has.

  Subclasses add their task's fields and a `vocab_size` property (token ids
  are `0 .. vocab_size - 1`, with 0 the padding id).

  Attributes:
    seed: generation seed; together with the other fields it fully determines
      the dataset.
    num_train: number of examples in the `train` split.
    num_validation: number of examples in the `validation` split.
    num_test: number of examples in the `test` split.
  """

  seed: int = 0
  num_train: int = 40_000
  num_validation: int = 5_000
  num_test: int = 5_000

  def split_sizes(self) -> dict[str, int]:
    return {"train": self.num_train, "validation": self.num_validation, "test": self.num_test}

  def validate(self) -> None:
    """Raises `ValueError` if the fields are inconsistent.

    Subclasses extend this with their own checks.
    """
    for split, size in self.split_sizes().items():
      if size < 1:
        raise ValueError(f"num_{split} must be >= 1, got {size}.")


class SyntheticBuilder(ArrayRecordBuilder, skip_registration=True):
  """Builder for a deterministic synthetic task rendered for a decoder-only LM.

  Subclasses set `BUILDER_CONFIGS` (`SyntheticConfig` subclasses) and
  implement `generate_example`. Every example has at least
  `inputs` (int32 [L]), `targets` (int32 [L]) and `weights`
  (float32 [L], 1 on scored positions).
  """

  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES: ClassVar[dict[str, str]] = {"1.0.0": "Initial release."}

  @property
  def config(self) -> SyntheticConfig:
    return self.builder_config  # pytype: disable=bad-return-type

  @abc.abstractmethod
  def generate_example(self, rng: np.random.Generator) -> Example:
    """Draws one example from `rng` for `self.config`."""

  def extra_features(self) -> dict[str, tfds.features.FeatureConnector]:
    """Features stored beside `inputs`, `targets` and `weights`."""
    return {}

  def _info(self) -> tfds.core.DatasetInfo:
    features = {
      "inputs": tfds.features.Tensor(shape=(None,), dtype=np.int32),
      "targets": tfds.features.Tensor(shape=(None,), dtype=np.int32),
      "weights": tfds.features.Tensor(shape=(None,), dtype=np.float32),
      **self.extra_features(),
    }
    return tfds.core.DatasetInfo(
      builder=self,
      description=type(self).__doc__,
      features=tfds.features.FeaturesDict(features),
      metadata=tfds.core.MetadataDict(vocab_size=self.config.vocab_size),
    )

  def _split_generators(self, dl_manager: tfds.download.DownloadManager):
    del dl_manager  # Nothing is downloaded.
    self.config.validate()
    return {
      split: self._generate_examples(split_index=index, num_examples=size)
      for index, (split, size) in enumerate(self.config.split_sizes().items())
    }

  def _generate_examples(
    self, split_index: int, num_examples: int
  ) -> Iterator[tuple[int, Example]]:
    for index in range(num_examples):
      rng = np.random.default_rng([self.config.seed, split_index, index])
      yield index, self.generate_example(rng)
