"""Trains a tokenizer on a prepared text dataset: SentencePiece, or a byte-level BPE
saved as a Hugging Face `tokenizer.json`.

Usage::

  python -m iha_jax.data.train_tokenizer --name=tfds:lm1b --data_dir=DIR \
      --vocab_size=32000 --output=/path/lm1b_sp32k

writes `/path/lm1b_sp32k.model` (and `.vocab`); with `--format=tokenizer.json` it writes
`/path/lm1b_sp32k.json`. Use either with `data.tokenizer=PATH`. Special
ids match the byte tokenizer: 0 PAD, 1 BOS, 2 EOS (SentencePiece: 3 UNK; the BPE
needs none, every byte is a token).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import sentencepiece as spm

from iha_jax.data import build, registry, tokenizers


def iterate_texts(
  name: str,
  data_dir: str | os.PathLike[str],
  *,
  split: str = "train",
  text_key: str = "text",
  max_documents: int | None = None,
  options: Mapping[str, Any] | None = None,
) -> Iterator[str]:
  """Yields the first `max_documents` texts of a prepared text dataset (with builder
  `options`, e.g. `python_stdlib`'s `chunk_bytes`)."""
  if not registry.is_text(name):
    raise ValueError(f"{name!r} is not a text dataset.")
  _, source = registry.open_split(name, split, data_dir, options)
  count = len(source) if max_documents is None else min(max_documents, len(source))
  for index in range(count):
    text = source[index][text_key]
    yield text.decode("utf-8") if isinstance(text, bytes) else text


def _make_parent(output: str | os.PathLike[str]) -> None:
  os.makedirs(os.path.dirname(os.fspath(output)) or ".", exist_ok=True)


def train(
  texts: Iterator[str], output: str | os.PathLike[str], *, vocab_size: int, model_type: str = "bpe"
) -> str:
  """Trains a model on `texts`; returns the path of the `.model` file."""
  _make_parent(output)
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


def train_bpe_json(texts: Iterator[str], output: str | os.PathLike[str], *, vocab_size: int) -> str:
  """Trains a byte-level BPE (GPT-2/Llama 3 style) on `texts` with the `tokenizers`
  package; writes `<output>.json` and returns its path. Ids 0, 1, 2 are `<|pad|>`,
  `<|begin_of_text|>` (BOS) and `<|end_of_text|>` (EOS)."""
  # pylint: disable-next=import-outside-toplevel
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

  tokenizer = Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
    vocab_size=vocab_size,
    special_tokens=["<|pad|>", tokenizers.BOS_TOKENS[0], tokenizers.EOS_TOKENS[0]],
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    show_progress=False,
  )
  tokenizer.train_from_iterator(texts, trainer)
  _make_parent(output)
  path = f"{os.fspath(output)}.json"
  tokenizer.save(path)
  return path


def main(argv: Sequence[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--name", required=True, help="text dataset name")
  parser.add_argument("--data_dir", required=True, help="TFDS data directory")
  parser.add_argument("--output", required=True, help="model path prefix")
  parser.add_argument("--vocab_size", type=int, default=32000)
  parser.add_argument(
    "--model_type", default="bpe", choices=["bpe", "unigram"], help="SentencePiece model type"
  )
  parser.add_argument(
    "--format",
    default="sentencepiece",
    choices=["sentencepiece", "tokenizer.json"],
    help="tokenizer.json: a byte-level BPE for the tokenizers package",
  )
  parser.add_argument("--split", default="train")
  parser.add_argument("--text_key", default="text")
  parser.add_argument("--max_documents", type=int, default=1_000_000)
  parser.add_argument(
    "--option",
    type=build.parse_option,
    action="append",
    default=[],
    help="builder-config override KEY=VALUE of the dataset (repeatable)",
  )
  args = parser.parse_args(argv)
  texts = iterate_texts(
    args.name,
    args.data_dir,
    split=args.split,
    text_key=args.text_key,
    max_documents=args.max_documents,
    options=dict(args.option),
  )
  if args.format == "tokenizer.json":
    path = train_bpe_json(texts, args.output, vocab_size=args.vocab_size)
  else:
    path = train(texts, args.output, vocab_size=args.vocab_size, model_type=args.model_type)
  print(f"Wrote {path}")


if __name__ == "__main__":
  main()
