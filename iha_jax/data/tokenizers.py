"""Tokenizers for text corpora: byte-level (default) and SentencePiece.

Both share the special-id layout ``0`` PAD, ``1`` BOS, ``2`` EOS (SentencePiece
models trained with ``python -m iha_jax.data.train_tokenizer`` also put UNK
at ``3``). Padding positions are marked by ``segment_ids == 0`` in batches, so
the PAD id itself is never scored.
"""

from __future__ import annotations

import os
from typing import Any, Protocol

import numpy as np
import sentencepiece as spm

PAD_ID = 0
BOS_ID = 1
EOS_ID = 2
UNK_ID = 3


class Tokenizer(Protocol):
  """What the text pipeline needs from a tokenizer."""

  @property
  def vocab_size(self) -> int:
    ...

  @property
  def bos_id(self) -> int:
    ...

  @property
  def eos_id(self) -> int:
    ...

  def encode(self, text: str | bytes) -> np.ndarray:
    """Returns int32 [n] token ids, without BOS/EOS."""
    ...

  def decode(self, ids: np.ndarray) -> str:
    """Inverts ``encode``; special ids are skipped."""
    ...


class ByteTokenizer:
  """UTF-8 bytes offset by 3: byte ``b`` is id ``b + 3``; vocabulary 259."""

  OFFSET = 3

  @property
  def vocab_size(self) -> int:
    return 256 + self.OFFSET

  @property
  def bos_id(self) -> int:
    return BOS_ID

  @property
  def eos_id(self) -> int:
    return EOS_ID

  def encode(self, text: str | bytes) -> np.ndarray:
    data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
    return np.frombuffer(data, np.uint8).astype(np.int32) + self.OFFSET

  def decode(self, ids: np.ndarray) -> str:
    ids = np.asarray(ids)
    data = (ids[ids >= self.OFFSET] - self.OFFSET).astype(np.uint8).tobytes()
    return data.decode("utf-8", errors="replace")


class SentencePieceTokenizer:
  """A SentencePiece model; picklable (it carries the serialized model)."""

  def __init__(self, model_path: str | os.PathLike[str]):
    with open(model_path, "rb") as f:
      self._load(f.read())

  def _load(self, model_proto: bytes) -> None:
    self._model_proto = model_proto
    self._processor = spm.SentencePieceProcessor(model_proto=model_proto)

  def __getstate__(self) -> dict[str, Any]:
    return {"model_proto": self._model_proto}

  def __setstate__(self, state: dict[str, Any]) -> None:
    self._load(state["model_proto"])

  @property
  def vocab_size(self) -> int:
    return self._processor.vocab_size()

  @property
  def bos_id(self) -> int:
    return self._processor.bos_id()

  @property
  def eos_id(self) -> int:
    return self._processor.eos_id()

  def encode(self, text: str | bytes) -> np.ndarray:
    if isinstance(text, bytes):
      text = text.decode("utf-8")
    return np.asarray(self._processor.encode(text), np.int32)

  def decode(self, ids: np.ndarray) -> str:
    return self._processor.decode(np.asarray(ids).tolist())


def load_tokenizer(spec: str) -> ByteTokenizer | SentencePieceTokenizer:
  """Returns the tokenizer named by ``spec``.

  Args:
    spec: ``"byte"`` or the path of a SentencePiece ``.model`` file.

  Raises:
    ValueError: if ``spec`` is neither.
  """
  if spec == "byte":
    return ByteTokenizer()
  if os.path.isfile(spec):
    return SentencePieceTokenizer(spec)
  raise ValueError(
      f"tokenizer must be 'byte' or an existing SentencePiece .model file, got"
      f" {spec!r}. Train one with: python -m iha_jax.data.train_tokenizer"
      " --name=DATASET --data_dir=DATA_DIR --output=PREFIX"
  )
