"""Data for iha-jax: offline TFDS builders, tokenizers and Grain pipelines.

Importing this package registers the TFDS builders `relation_composition`,
`multikey_retrieval`, `mqar`, `cpm3`, `polynomial_filter`, `local_text` and
`python_stdlib`.
"""

from iha_jax.extras import require

require("data", "iha_jax.data")

from iha_jax.data.errors import DataError
from iha_jax.data.pipeline import DataConfig, default_config, make_dataset, vocab_size
from iha_jax.data.registry import builder_config, is_text, list_datasets, prepare
from iha_jax.data.tokenizers import (
  BUILTIN_TOKENIZERS,
  ByteTokenizer,
  HuggingFaceTokenizer,
  SentencePieceTokenizer,
  TiktokenTokenizer,
  load_tokenizer,
)
from iha_jax.data.transforms import BatchIterator

__all__ = [
  "BUILTIN_TOKENIZERS",
  "BatchIterator",
  "ByteTokenizer",
  "DataConfig",
  "DataError",
  "HuggingFaceTokenizer",
  "SentencePieceTokenizer",
  "TiktokenTokenizer",
  "builder_config",
  "default_config",
  "is_text",
  "list_datasets",
  "load_tokenizer",
  "make_dataset",
  "prepare",
  "vocab_size",
]
