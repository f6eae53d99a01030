"""Input side of training: the data directory, preparing the task on first use, iterators."""

from __future__ import annotations

import logging
import os

import grain
import jax
import ml_collections
from jax.experimental import multihost_utils

from iha_jax import data as data_lib
from iha_jax import storage

ENV_DATA_DIR = "IHA_DATA_DIR"


def resolve_data_dir(config: ml_collections.ConfigDict, workdir: str) -> str:
  """`data.data_dir`, else `$IHA_DATA_DIR`, else `<parent of workdir>/data` (shared by
  the runs of one workdirs/ folder, so the MHA twin reuses the IHA run's data). Local
  paths become absolute; URLs (`gs://BUCKET/data`) stay as given."""
  if config.data.data_dir:
    return storage.resolve(config.data.data_dir, name="data.data_dir")
  if os.environ.get(ENV_DATA_DIR):
    return storage.resolve(os.environ[ENV_DATA_DIR], name=f"${ENV_DATA_DIR}")
  return storage.join(storage.parent(storage.resolve(workdir, name="--workdir")), "data")


def resolve_tokenizer(config: ml_collections.ConfigDict) -> str:
  """`data.tokenizer` with a local file path made absolute (eval may run elsewhere)."""
  spec = config.data.get("tokenizer", "byte")
  if spec in data_lib.BUILTIN_TOKENIZERS:
    return spec
  return storage.resolve(spec, name="data.tokenizer")


def prepare(config: ml_collections.ConfigDict) -> None:
  """Generates a synthetic task into `data.data_dir` unless already there (no network).
  Process 0 goes first; the others then find it prepared on a shared filesystem or
  bucket, or generate the identical data locally. Text corpora are prepared by the user
  (`python -m iha_jax.data.build`): reading one that is missing names that command."""
  if data_lib.is_text(config.data.name):
    return

  def run():
    logging.info("preparing %s in %s (no-op when prepared)", config.data.name, config.data.data_dir)
    data_lib.prepare(
      config.data.name, config.data.data_dir, options=dict(config.data.options or {})
    )

  if jax.process_index() == 0:
    run()
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices("iha_jax data prepared")
    if jax.process_index() != 0:
      run()


def train_iterator(config: ml_collections.ConfigDict) -> grain.DatasetIterator:
  """Endless shuffled training batches, this process's `batch_size / process_count` rows."""
  return data_lib.make_dataset(
    config.data, "train", global_batch_size=config.train.batch_size, seed=config.train.seed
  )


def eval_iterator(
  config: ml_collections.ConfigDict, split: str, batch_size: int | None = None
) -> grain.DatasetIterator:
  """One ordered pass over `split` (the last batch padded with weight-0 rows)."""
  return data_lib.make_dataset(
    config.data,
    split,
    global_batch_size=batch_size or config.train.batch_size,
    shuffle=False,
    num_epochs=1,
  )
