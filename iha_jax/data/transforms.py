"""Grain transformations from dataset records to fixed-shape LM batches.

An *LM example* is a dict of `inputs`, `targets` (int32 [n]) and `weights` (float32 [n]);
position `t` is trained to predict `targets[t]` from `inputs[:t + 1]` with loss weight
`weights[t]`. Rows of a batch add `segment_ids` (int32 [L]; 0 = padding, documents `1..k`)
and `positions` (int32 [L]; restarting at 0 in every document). Tasks with continuous data
add `features` (float32 [n, F], model inputs) and/or `values` (float32 [n, O], regression
targets); such examples are padded, never packed. Until the last pipeline stage every
element also carries `num_truncated`, how many source examples it holds that were cut to
`seq_len`.
"""

from __future__ import annotations

import math
import time
from typing import Any

import grain
import numpy as np
from absl import logging

from iha_jax.data import tokenizers

LMExample = dict[str, np.ndarray]
FEATURES: tuple[str, ...] = ("inputs", "targets", "weights")
# Per-position float arrays [n, ...] a task record may carry besides FEATURES.
CONTINUOUS: tuple[str, ...] = ("features", "values")
NUM_TRUNCATED = "num_truncated"
_LOG_INTERVAL_S = 60.0
_DTYPES = {"inputs": np.int32, "targets": np.int32, "weights": np.float32}


def empty_example(like: LMExample | None = None) -> LMExample:
  """A zero-length example (it becomes an all-padding row), with the continuous fields of
  `like` (zero rows of their width)."""
  out = {key: np.zeros(0, dtype) for key, dtype in _DTYPES.items()}
  for key in CONTINUOUS:
    if like is not None and key in like:
      out[key] = np.zeros((0, *np.shape(like[key])[1:]), np.float32)
  return out


def _keys(example: LMExample) -> list[str]:
  return [*FEATURES, *(key for key in CONTINUOUS if key in example)]


class TaskToLM(grain.transforms.Map):
  """Keeps the `inputs`/`targets`/`weights` (and `features`/`values`, if any) of a
  synthetic-task record."""

  def map(self, record: dict[str, Any]) -> LMExample:
    out = {key: np.asarray(record[key], _DTYPES[key]) for key in FEATURES}
    for key in CONTINUOUS:
      if key in record:
        out[key] = np.asarray(record[key], np.float32)
    return out


class TextToLM(grain.transforms.Map):
  """Tokenizes a text record into a next-token-prediction example.

  The document `[BOS] + encode(text) + [EOS]` (ids below 0, i.e. special tokens a
  SentencePiece model lacks, are left out) is split into `inputs = doc[:-1]` and
  `targets = doc[1:]`, all weighted 1.
  """

  def __init__(self, tokenizer: tokenizers.Tokenizer, text_key: str):
    self._tokenizer = tokenizer
    self._text_key = text_key

  def map(self, record: dict[str, Any]) -> LMExample:
    bos = [self._tokenizer.bos_id] if self._tokenizer.bos_id >= 0 else []
    eos = [self._tokenizer.eos_id] if self._tokenizer.eos_id >= 0 else []
    tokens = self._tokenizer.encode(record[self._text_key])
    document = np.concatenate([bos, tokens, eos]).astype(np.int32)
    return {
      "inputs": document[:-1],
      "targets": document[1:],
      "weights": np.ones_like(document[1:], np.float32),
    }


class Truncate(grain.transforms.Map):
  """Cuts examples to `seq_len` and records whether it did."""

  def __init__(self, seq_len: int):
    self._seq_len = seq_len

  def map(self, example: LMExample) -> LMExample:
    truncated = len(example["inputs"]) > self._seq_len
    out = {key: example[key][: self._seq_len] for key in _keys(example)}
    out[NUM_TRUNCATED] = np.int32(truncated)
    return out


class PadToLength(grain.transforms.Map):
  """Pads one example to `seq_len` as a single-document row."""

  def __init__(self, seq_len: int):
    self._seq_len = seq_len

  def map(self, example: LMExample) -> LMExample:
    length = len(example["inputs"])
    pad = self._seq_len - length
    out = {
      key: np.pad(example[key], [(0, pad)] + [(0, 0)] * (example[key].ndim - 1))
      for key in _keys(example)
    }
    real = np.arange(self._seq_len) < length
    out["segment_ids"] = real.astype(np.int32)
    out["positions"] = np.where(real, np.arange(self._seq_len), 0).astype(np.int32)
    out[NUM_TRUNCATED] = example[NUM_TRUNCATED]
    return out


def _finish_packed_row(row: dict[str, Any]) -> LMExample:
  """Renames Grain's packing outputs and totals the row's truncations."""
  out = {key: row[key] for key in FEATURES}
  out["segment_ids"] = row["inputs_segment_ids"]
  out["positions"] = row["inputs_positions"]
  out[NUM_TRUNCATED] = np.int32(sum(row[NUM_TRUNCATED]))
  return out


def pack(ds: grain.IterDataset, *, seq_len: int, num_bins: int, seed: int) -> grain.IterDataset:
  """First-fit packs examples into rows of `seq_len` tokens.

  Args:
    ds: LM examples no longer than `seq_len` (see `Truncate`).
    seq_len: row length `L`.
    num_bins: rows packed at a time (the per-process batch size).
    seed: seed of the row order within each group of `num_bins` rows.

  Returns:
    Rows with `segment_ids` and `positions`; documents never share a segment id within a
    row and never straddle rows.
  """
  packed = grain.experimental.FirstFitPackIterDataset(
    ds,
    length_struct={key: seq_len for key in FEATURES},
    num_packing_bins=num_bins,
    seed=seed,
    meta_features=(NUM_TRUNCATED,),
  )
  return packed.map(_finish_packed_row)


class PadBatch(grain.transforms.Map):
  """Pads a short final batch with all-padding rows to `batch_size`."""

  def __init__(self, batch_size: int):
    self._batch_size = batch_size

  def map(self, batch: LMExample) -> LMExample:
    missing = self._batch_size - len(batch["inputs"])
    if not missing:
      return batch
    return {
      key: np.pad(value, [(0, missing)] + [(0, 0)] * (value.ndim - 1))
      for key, value in batch.items()
    }


class BatchIterator(grain.DatasetIterator):
  """The iterator `make_dataset` returns.

  Yields dicts of numpy arrays `inputs`, `targets`, `weights`, `segment_ids` and
  `positions`, each [batch, seq_len]. It removes `num_truncated` from the batches, adds it
  up (exposed as `num_truncated`, kept in the checkpointable state) and logs the total
  when it grows, at most once a minute.
  """

  def __init__(self, parent: grain.DatasetIterator, *, name: str, seq_len: int):
    super().__init__(parent)
    self._name = name
    self._seq_len = seq_len
    self._num_truncated = 0
    self._last_log_time = -math.inf

  @property
  def num_truncated(self) -> int:
    """Source examples cut to `seq_len` so far."""
    return self._num_truncated

  def __next__(self) -> LMExample:
    batch = next(self._parent)
    truncated = int(batch.pop(NUM_TRUNCATED).sum())
    if truncated:
      self._num_truncated += truncated
      now = time.monotonic()
      if now - self._last_log_time >= _LOG_INTERVAL_S:
        self._last_log_time = now
        logging.warning(
          "%s: %d examples longer than seq_len=%d were truncated so far.",
          self._name,
          self._num_truncated,
          self._seq_len,
        )
    return batch

  def get_state(self) -> dict[str, Any]:
    return {"parent": self._parent.get_state(), "num_truncated": self._num_truncated}

  def set_state(self, state: dict[str, Any]) -> None:
    self._parent.set_state(state["parent"])
    self._num_truncated = state["num_truncated"]


class BatchDataset(grain.IterDataset):
  """Final pipeline stage; its iterator is a `BatchIterator`."""

  def __init__(self, parent: grain.IterDataset, *, name: str, seq_len: int):
    super().__init__(parent)
    self._name = name
    self._seq_len = seq_len

  def __iter__(self) -> BatchIterator:
    return BatchIterator(self._parent.__iter__(), name=self._name, seq_len=self._seq_len)
