"""Tokenizers for text corpora, named by `data.tokenizer`.

* `"byte"` (default): UTF-8 bytes, `0` PAD, `1` BOS, `2` EOS, vocabulary 259.
* a Hugging Face `tokenizer.json` (the `tokenizers` package), e.g. Llama 3's;
* a tiktoken BPE file (`base64-token rank` lines), e.g. Llama 3's original
  `tokenizer.model`: the ranks, then 256 special tokens as in Llama 3 (`<|begin_of_text|>`
  BOS, `<|end_of_text|>` EOS): 128,000 + 256 = 128,256 ids;
* a SentencePiece `.model` (`python -m iha_jax.data.train_tokenizer` trains one with `0`
  PAD, `1` BOS, `2` EOS, `3` UNK).

The file's format is read from its content; the path may be local or a URL (`gs://...`).
The vocabulary (the embedding size) is the tokenizer's. Padding positions are marked by
`segment_ids == 0` in batches, so the PAD id itself is never scored.
"""

from __future__ import annotations

import base64
import os
import re
from typing import Any, Protocol

import numpy as np
import sentencepiece as spm
from etils import epath

from iha_jax.data.errors import DataError

PAD_ID = 0
BOS_ID = 1
EOS_ID = 2
UNK_ID = 3
BUILTIN_TOKENIZERS = ("byte",)
# Special tokens a tokenizer.json may use for the document boundaries, most specific first.
BOS_TOKENS = ("<|begin_of_text|>", "<s>", "<bos>", "<|bos|>", "[BOS]", "<|startoftext|>")
EOS_TOKENS = ("<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[EOS]", "<|endoftext|>")
# Llama 3's pre-tokenizer split and its 256 special tokens after the BPE ranks.
LLAMA3_PATTERN = (
  r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
  r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_NUM_SPECIAL = 256
_TIKTOKEN_LINE = re.compile(rb"^[A-Za-z0-9+/=]+ [0-9]+$")


class Tokenizer(Protocol):
  """What the text pipeline needs from a tokenizer."""

  @property
  def vocab_size(self) -> int: ...

  @property
  def bos_id(self) -> int: ...

  @property
  def eos_id(self) -> int: ...

  def encode(self, text: str | bytes) -> np.ndarray:
    """Returns int32 [n] token ids, without BOS/EOS."""
    ...

  def decode(self, ids: np.ndarray) -> str:
    """Inverts `encode`; special ids are skipped."""
    ...


class ByteTokenizer:
  """UTF-8 bytes offset by 3: byte `b` is id `b + 3`; vocabulary 259."""

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


class _FileTokenizer:
  """A tokenizer loaded from a file's bytes (path, URL or the bytes themselves); picklable
  for data workers: it carries the bytes and reloads from them. Subclasses define
  `_load(blob)`."""

  def __init__(self, source: str | os.PathLike[str] | bytes):
    self._load(source if isinstance(source, bytes) else epath.Path(source).read_bytes())

  def _load(self, blob: bytes) -> None:
    raise NotImplementedError

  def __getstate__(self) -> dict[str, Any]:
    return {"blob": self._blob}

  def __setstate__(self, state: dict[str, Any]) -> None:
    self._load(state["blob"])


def _as_text(text: str | bytes) -> str:
  return text.decode("utf-8") if isinstance(text, bytes) else text


class SentencePieceTokenizer(_FileTokenizer):
  """A SentencePiece model."""

  def _load(self, blob: bytes) -> None:
    self._blob = blob
    self._processor = spm.SentencePieceProcessor(model_proto=blob)

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
    return np.asarray(self._processor.encode(_as_text(text)), np.int32)

  def decode(self, ids: np.ndarray) -> str:
    return self._processor.decode(np.asarray(ids).tolist())


class HuggingFaceTokenizer(_FileTokenizer):
  """A Hugging Face `tokenizer.json` (e.g. Llama 3's).

  BOS and EOS are its special tokens named in `BOS_TOKENS` / `EOS_TOKENS`; the project
  adds them itself, so the file's own post-processor is not applied.
  """

  def _load(self, blob: bytes) -> None:
    import tokenizers as hf_tokenizers  # pylint: disable=import-outside-toplevel

    self._blob = blob
    self._tokenizer = hf_tokenizers.Tokenizer.from_str(blob.decode("utf-8"))
    vocab = self._tokenizer.get_vocab(with_added_tokens=True)
    self._vocab_size = max(vocab.values()) + 1
    self._bos_id = _special_id(vocab, BOS_TOKENS, "BOS")
    self._eos_id = _special_id(vocab, EOS_TOKENS, "EOS")

  @property
  def vocab_size(self) -> int:
    return self._vocab_size

  @property
  def bos_id(self) -> int:
    return self._bos_id

  @property
  def eos_id(self) -> int:
    return self._eos_id

  def encode(self, text: str | bytes) -> np.ndarray:
    ids = self._tokenizer.encode(_as_text(text), add_special_tokens=False).ids
    return np.asarray(ids, np.int32)

  def decode(self, ids: np.ndarray) -> str:
    return self._tokenizer.decode(np.asarray(ids).tolist(), skip_special_tokens=True)


def _special_id(vocab: dict[str, int], names: tuple[str, ...], role: str) -> int:
  for name in names:
    if name in vocab:
      return vocab[name]
  raise DataError(
    f"data.tokenizer: the tokenizer.json has no {role} token (looked for"
    f" {', '.join(names)}); add one as a special token, e.g."
    f" tokenizer.add_special_tokens([{names[0]!r}]) with the tokenizers package."
  )


class TiktokenTokenizer(_FileTokenizer):
  """A tiktoken BPE ranks file with Llama 3's split pattern and special tokens.

  Ids `0 .. R-1` are the file's R ranks; `R` is `<|begin_of_text|>` (BOS), `R + 1`
  `<|end_of_text|>` (EOS), then reserved special tokens up to `R + 256`.
  """

  def _load(self, blob: bytes) -> None:
    import tiktoken  # pylint: disable=import-outside-toplevel

    self._blob = blob
    ranks = {}
    for line in blob.splitlines():
      if line.strip():
        token, rank = line.split()
        ranks[base64.b64decode(token)] = int(rank)
    self._num_ranks = len(ranks)
    names = ["<|begin_of_text|>", "<|end_of_text|>"] + [
      f"<|reserved_special_token_{i}|>" for i in range(LLAMA3_NUM_SPECIAL - 2)
    ]
    self._encoding = tiktoken.Encoding(
      name="iha_jax_tiktoken",
      pat_str=LLAMA3_PATTERN,
      mergeable_ranks=ranks,
      special_tokens={name: self._num_ranks + i for i, name in enumerate(names)},
    )

  @property
  def vocab_size(self) -> int:
    return self._num_ranks + LLAMA3_NUM_SPECIAL

  @property
  def bos_id(self) -> int:
    return self._num_ranks

  @property
  def eos_id(self) -> int:
    return self._num_ranks + 1

  def encode(self, text: str | bytes) -> np.ndarray:
    # Special-token text in a document is ordinary text, never a control token.
    return np.asarray(self._encoding.encode_ordinary(_as_text(text)), np.int32)

  def decode(self, ids: np.ndarray) -> str:
    ids = np.asarray(ids)
    return self._encoding.decode(ids[ids < self._num_ranks].tolist())


def tokenizer_format(blob: bytes) -> str:
  """`"tokenizer.json"`, `"tiktoken"` or `"sentencepiece"` from a file's bytes."""
  if blob.lstrip()[:1] == b"{":
    return "tokenizer.json"
  first = blob.split(b"\n", 1)[0].strip()
  if _TIKTOKEN_LINE.match(first):
    return "tiktoken"
  return "sentencepiece"


_CLASSES = {
  "tokenizer.json": HuggingFaceTokenizer,
  "tiktoken": TiktokenTokenizer,
  "sentencepiece": SentencePieceTokenizer,
}


def load_tokenizer(spec: str) -> Tokenizer:
  """Returns the tokenizer named by `spec` (`data.tokenizer`).

  Args:
    spec: `"byte"`, or the path or URL of a Hugging Face `tokenizer.json`, a tiktoken BPE
      file (Llama 3's `tokenizer.model`) or a SentencePiece `.model`; the format is read
      from the content.

  Raises:
    DataError: if `spec` is none of these, naming how to get one.
  """
  if spec == "byte":
    return ByteTokenizer()
  try:
    path = epath.Path(spec)
    blob = path.read_bytes() if path.is_file() else None
  except (OSError, KeyError, ValueError):
    blob = None
  if blob is None:
    raise DataError(
      f"data.tokenizer: {spec!r} is neither 'byte' nor an existing tokenizer file"
      " (a tokenizer.json, a tiktoken BPE file, or a SentencePiece .model). Pass"
      " --config.data.tokenizer=PATH; docs/training.md's pod section shows how to get"
      " Llama 3's, and python -m iha_jax.data.train_tokenizer --name=DATASET"
      " --data_dir=DATA_DIR --output=PREFIX trains one."
    )
  kind = tokenizer_format(blob)
  try:
    return _CLASSES[kind](blob)
  except DataError:
    raise
  except Exception as e:  # pylint: disable=broad-except
    raise DataError(
      f"data.tokenizer: {spec!r} looks like a {kind} file but does not load"
      f" ({type(e).__name__}: {e}); pass a tokenizer.json, a tiktoken BPE file"
      " or a SentencePiece .model."
    ) from e
