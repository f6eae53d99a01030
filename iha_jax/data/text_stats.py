"""What the tokens of a text split stand for in bytes: bits per byte from a loss in nats.

A loss per token depends on the tokenizer; bits per byte do not: `loss / ln 2` bits per
token divided by the UTF-8 bytes each scored token covers. The pipeline scores, per
document, the targets of `[BOS] tokens [EOS]` cut to `seq_len`; `scored_bytes` counts
the same positions: the document's bytes plus one for EOS when it fits, else the bytes of
the kept tokens (decoded; a cut inside a multi-byte character counts the replacement
character). With the byte tokenizer every scored token is one byte and bits per byte equal
bits per token.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Any

import ml_collections
import numpy as np

from iha_jax.data import registry, tokenizers
from iha_jax.data.errors import DataError
from iha_jax.data.pipeline import DataConfig


@dataclasses.dataclass(frozen=True)
class ScoredText:
  """One pass over a split as the pipeline scores it."""

  documents: int
  tokens: int  # scored target positions (EOS included)
  bytes: int  # UTF-8 bytes those positions cover (EOS counted as one)

  @property
  def bytes_per_token(self) -> float:
    return self.bytes / max(self.tokens, 1)

  def bits_per_byte(self, loss: float) -> float:
    """Bits per byte of a mean loss in nats per scored token over this split."""
    return loss / math.log(2) / self.bytes_per_token


def _scored(tokenizer: tokenizers.Tokenizer, text: str, seq_len: int) -> tuple[int, int]:
  """(scored tokens, their bytes) of one document."""
  ids = np.asarray(tokenizer.encode(text))
  with_bos = tokenizer.bos_id >= 0
  with_eos = tokenizer.eos_id >= 0
  targets = len(ids) + int(with_eos) - int(not with_bos)
  kept = min(targets, seq_len)
  if kept == targets and with_bos:
    return kept, len(text.encode("utf-8")) + int(with_eos)
  first = 0 if with_bos else 1
  text_tokens = min(kept, len(ids) - first)
  decoded = tokenizer.decode(ids[first : first + text_tokens]).encode("utf-8")
  return kept, len(decoded) + (kept - text_tokens)


@functools.lru_cache(maxsize=32)
def _scored_split(
  name: str, data_dir: str, options: str, tokenizer: str, text_key: str, seq_len: int, split: str
) -> ScoredText:
  _, source = registry.open_split(name, split, data_dir, ast.literal_eval(options))
  tok = tokenizers.load_tokenizer(tokenizer)
  tokens = num_bytes = 0
  for index in range(len(source)):
    text = source[index][text_key]
    text = text.decode("utf-8") if isinstance(text, bytes) else text
    scored, covered = _scored(tok, text, seq_len)
    tokens += scored
    num_bytes += covered
  return ScoredText(documents=len(source), tokens=tokens, bytes=num_bytes)


def scored_text(
  config: DataConfig | ml_collections.ConfigDict | Mapping[str, Any], split: str
) -> ScoredText:
  """Scored tokens and bytes of one pass over `split` of a text dataset (cached).

  Raises:
    DataError: if the dataset is not a text corpus, or not prepared.
  """
  config = DataConfig.from_config(config)
  if not registry.is_text(config.name):
    raise DataError(f"{config.name!r} is not a text corpus: it has no bytes per token.")
  options = repr(dict(sorted(config.options.items())))
  return _scored_split(
    config.name,
    str(config.data_dir),
    options,
    config.tokenizer,
    config.text_key,
    config.seq_len,
    split,
  )
