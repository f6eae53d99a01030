"""The training/eval input pipeline: `make_dataset` and its config.

Per process, the pipeline is::

  TFDS array_record split (random access)
    -> records as LM examples (synthetic: stored fields; text: tokenized)
    -> shard [shard_index::shard_count] -> shuffle(seed) -> repeat(num_epochs)
    -> truncate to seq_len (counted)
    -> pack (first fit, text default) or pad (synthetic default) to seq_len
    -> batch [global_batch_size / shard_count, seq_len]
    -> background prefetch (a thread, or `num_workers` processes)

Everything is deterministic given `seed`, the data and the config (`num_workers`
included), and the iterator's `get_state`/`set_state` resume at the exact next batch.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import grain
import jax
import ml_collections
import tensorflow_datasets as tfds
from absl import flags

from iha_jax.data import registry, tokenizers, transforms
from iha_jax.data.errors import DataError


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
  """What to read and how (the trainer's `config.data`).

  Attributes:
    name: dataset name, see `registry.list_datasets`; `tfds:<name>` for a TFDS text
      dataset prepared as array_record.
    seq_len: row length `L` of the batches.
    data_dir: TFDS data directory holding the prepared dataset.
    packing: pack several examples per row; `None` packs text corpora and pads synthetic
      tasks (one example per row).
    options: builder-config overrides of a project dataset, e.g.
      `{"num_train": 1000, "seed": 1}`.
    tokenizer: text corpora only: `"byte"` or a SentencePiece model path.
    text_key: text corpora only: the feature holding the text.
    num_workers: worker processes (Grain `mp_prefetch`); 0 runs the pipeline in one
      background thread of this process.
    read_threads: threads reading and converting records per process.
    prefetch_batches: batches kept ready ahead of the consumer.
  """

  name: str
  seq_len: int
  data_dir: str | None = None
  packing: bool | None = None
  options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  tokenizer: str = "byte"
  text_key: str = "text"
  num_workers: int = 0
  read_threads: int = 2
  prefetch_batches: int = 2

  @classmethod
  def from_config(
    cls, config: DataConfig | ml_collections.ConfigDict | Mapping[str, Any]
  ) -> DataConfig:
    """Builds a `DataConfig` from a ConfigDict or a mapping of its fields."""
    if isinstance(config, DataConfig):
      return config
    if isinstance(config, ml_collections.ConfigDict):
      config = config.to_dict()
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(config) - fields)
    if unknown:
      raise DataError(f"Unknown data config field(s) {unknown}; valid: {sorted(fields)}.")
    return cls(**{**config, "options": dict(config.get("options") or {})})


def default_config() -> ml_collections.ConfigDict:
  """The `data` section of a training config, with every field."""
  return ml_collections.ConfigDict(
    dataclasses.asdict(DataConfig(name="mqar/cpu_demo", seq_len=64)), type_safe=False
  )


def vocab_size(config: DataConfig | ml_collections.ConfigDict) -> int:
  """Number of token ids the model must embed for this data config."""
  config = DataConfig.from_config(config)
  if registry.is_text(config.name):
    return tokenizers.load_tokenizer(config.tokenizer).vocab_size
  return registry.builder_config(config.name, config.options).vocab_size


def _record_transform(
  config: DataConfig, builder: tfds.core.DatasetBuilder
) -> grain.transforms.Map:
  if not registry.is_text(config.name):
    return transforms.TaskToLM()
  if config.text_key not in builder.info.features:
    raise DataError(
      f"Dataset {config.name!r} has no feature {config.text_key!r}; set"
      f" text_key to one of {sorted(builder.info.features)}."
    )
  return transforms.TextToLM(tokenizers.load_tokenizer(config.tokenizer), config.text_key)


def make_dataset(
  config: DataConfig | ml_collections.ConfigDict | Mapping[str, Any],
  split: str,
  *,
  global_batch_size: int,
  seed: int = 0,
  shard_index: int | None = None,
  shard_count: int | None = None,
  shuffle: bool = True,
  num_epochs: int | None = None,
) -> transforms.BatchIterator:
  """Returns this process's iterator of LM batches.

  Args:
    config: a `DataConfig` or a ConfigDict/mapping of its fields.
    split: `"train"`, `"validation"`, `"test"` (what the dataset has).
    global_batch_size: rows per step over all processes; a multiple of `shard_count`.
    seed: shuffle and packing seed.
    shard_index: this process's shard; defaults to `jax.process_index()`.
    shard_count: number of shards; defaults to `jax.process_count()`.
    shuffle: shuffle examples (reshuffled every epoch).
    num_epochs: passes over the shard; `None` repeats forever. With a finite count the
      last batch is filled with padding rows, and without packing every shard yields the
      same number of batches.

  Returns:
    A Grain `DatasetIterator` of dicts with `inputs`, `targets`, `segment_ids`,
    `positions` (int32) and `weights` (float32), each
    `[global_batch_size // shard_count, seq_len]` (+ `features` / `values`
    `[..., seq_len, width]` float32 where the task has them); `num_truncated` counts the
    examples cut to `seq_len`.

  Raises:
    ValueError: for an unknown or unprepared dataset (with the command that prepares it),
      an unknown split, or inconsistent sizes.
  """
  config = DataConfig.from_config(config)
  shard_index = jax.process_index() if shard_index is None else shard_index
  shard_count = jax.process_count() if shard_count is None else shard_count
  if not 0 <= shard_index < shard_count:
    raise DataError(f"Need 0 <= shard_index < shard_count, got {shard_index}, {shard_count}.")
  if global_batch_size < 1 or global_batch_size % shard_count:
    raise DataError(
      f"global_batch_size={global_batch_size} must be a positive multiple of"
      f" shard_count={shard_count}."
    )
  if config.seq_len < 1:
    raise DataError(f"seq_len must be >= 1, got {config.seq_len}.")
  if num_epochs is not None and num_epochs < 1:
    raise DataError(f"num_epochs must be None or >= 1, got {num_epochs}.")
  packing = registry.is_text(config.name) if config.packing is None else config.packing
  builder, source = registry.open_split(config.name, split, config.data_dir, config.options)

  records = grain.MapDataset.source(source).map(_record_transform(config, builder))
  continuous = [k for k in transforms.CONTINUOUS if k in builder.info.features]
  if continuous and packing:
    raise DataError(
      f"Dataset {config.name!r} has per-position {continuous}: set data.packing=False "
      "(one example per row)."
    )
  examples = records[shard_index::shard_count]
  if num_epochs is not None and not packing:
    # Equal shard sizes give every process the same number of batches.
    missing = math.ceil(len(source) / shard_count) - len(examples)
    like = records[0] if continuous else None  # the padding rows' feature widths
    padding = grain.MapDataset.source([transforms.empty_example(like)] * missing)
    examples = grain.MapDataset.concatenate([examples, padding])
  if shuffle:
    examples = examples.shuffle(seed)
  examples = examples.repeat(num_epochs).map(transforms.Truncate(config.seq_len))
  batches = _batch(
    examples, config, batch_size=global_batch_size // shard_count, packing=packing, seed=seed
  )
  return iter(transforms.BatchDataset(batches, name=config.name, seq_len=config.seq_len))


def _batch(
  examples: grain.MapDataset, config: DataConfig, *, batch_size: int, packing: bool, seed: int
) -> grain.IterDataset:
  """Packs or pads, batches and prefetches truncated LM examples."""
  ds = examples.to_iter_dataset(
    grain.ReadOptions(
      num_threads=config.read_threads, prefetch_buffer_size=batch_size * config.prefetch_batches
    )
  )
  if packing:
    ds = transforms.pack(ds, seq_len=config.seq_len, num_bins=batch_size, seed=seed)
  else:
    ds = ds.map(transforms.PadToLength(config.seq_len))
  ds = ds.batch(batch_size).map(transforms.PadBatch(batch_size))
  if not config.num_workers:
    return grain.experimental.ThreadPrefetchIterDataset(
      ds, prefetch_buffer_size=config.prefetch_batches
    )
  if not flags.FLAGS.is_parsed():
    # Grain's workers read absl flags; outside absl.app none were parsed.
    flags.FLAGS.mark_as_parsed()
  return ds.mp_prefetch(
    grain.MultiprocessingOptions(
      num_workers=config.num_workers, per_worker_buffer_size=config.prefetch_batches
    )
  )
