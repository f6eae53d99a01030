"""Trains a SentencePiece tokenizer on a prepared text dataset.

Usage::

  python -m iha_jax.data.train_tokenizer --name=tfds:lm1b --data_dir=DIR \
      --vocab_size=32000 --output=/path/lm1b_sp32k

writes ``/path/lm1b_sp32k.model`` (and ``.vocab``); use it with
``data.tokenizer=/path/lm1b_sp32k.model``. Special ids match the byte
tokenizer: 0 PAD, 1 BOS, 2 EOS, 3 UNK.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator, Sequence

import sentencepiece as spm

from iha_jax.data import registry
from iha_jax.data import tokenizers


def iterate_texts(
    name: str,
    data_dir: str | os.PathLike[str],
    *,
    split: str = "train",
    text_key: str = "text",
    max_documents: int | None = None,
) -> Iterator[str]:
  """Yields the first ``max_documents`` texts of a prepared text dataset."""
  if not registry.is_text(name):
    raise ValueError(f"{name!r} is not a text dataset.")
  _, source = registry.open_split(name, split, data_dir)
  count = len(source) if max_documents is None else min(max_documents, len(source))
  for index in range(count):
    text = source[index][text_key]
    yield text.decode("utf-8") if isinstance(text, bytes) else text


def train(
    texts: Iterator[str],
    output: str | os.PathLike[str],
    *,
    vocab_size: int,
    model_type: str = "bpe",
) -> str:
  """Trains a model on ``texts``; returns the path of the ``.model`` file."""
  spm.SentencePieceTrainer.train(
      sentence_iterator=texts,
      model_prefix=os.fspath(output),
      vocab_size=vocab_size,
      model_type=model_type,
      pad_id=tokenizers.PAD_ID,
      bos_id=tokenizers.BOS_ID,
      eos_id=tokenizers.EOS_ID,
      unk_id=tokenizers.UNK_ID,
      byte_fallback=True,
      character_coverage=0.9995,
      max_sentence_length=1 << 16,
      minloglevel=2,
  )
  return f"{os.fspath(output)}.model"


def main(argv: Sequence[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--name", required=True, help="text dataset name")
  parser.add_argument("--data_dir", required=True, help="TFDS data directory")
  parser.add_argument("--output", required=True, help="model path prefix")
  parser.add_argument("--vocab_size", type=int, default=32000)
  parser.add_argument("--model_type", default="bpe", choices=["bpe", "unigram"])
  parser.add_argument("--split", default="train")
  parser.add_argument("--text_key", default="text")
  parser.add_argument("--max_documents", type=int, default=1_000_000)
  args = parser.parse_args(argv)
  texts = iterate_texts(
      args.name,
      args.data_dir,
      split=args.split,
      text_key=args.text_key,
      max_documents=args.max_documents,
  )
  path = train(
      texts, args.output, vocab_size=args.vocab_size, model_type=args.model_type
  )
  print(f"Wrote {path}")


if __name__ == "__main__":
  main()
