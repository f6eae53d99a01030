"""Prepares a dataset offline into a TFDS data directory (array_record).

Usage::

  python -m iha_jax.data.build --name=relation_composition/binary \
      --data_dir=~/tensorflow_datasets
  python -m iha_jax.data.build --name=mqar/kv16_len256 --data_dir=DIR \
      --option=num_train=1000 --option=seed=3
  python -m iha_jax.data.build --name=local_text/lines --data_dir=DIR \
      --manual_dir=DIR_WITH_TRAIN_TXT
  python -m iha_jax.data.build --name=python_stdlib --data_dir=DIR
  python -m iha_jax.data.build --list
"""

from __future__ import annotations

import argparse
import ast
from collections.abc import Sequence
from typing import Any

from iha_jax.data import registry
from iha_jax.errors import UserError


def parse_option(text: str) -> tuple[str, Any]:
  """Parses `KEY=VALUE`; VALUE is a Python literal, else a string."""
  key, sep, value = text.partition("=")
  if not sep or not key:
    raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
  try:
    return key, ast.literal_eval(value)
  except (ValueError, SyntaxError):
    return key, value


def main(argv: Sequence[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--name", help="dataset name, see --list")
  parser.add_argument("--data_dir", help="TFDS data directory")
  parser.add_argument("--manual_dir", help="source files (local_text)")
  parser.add_argument(
    "--option",
    type=parse_option,
    action="append",
    default=[],
    help="builder-config override KEY=VALUE (repeatable)",
  )
  parser.add_argument("--list", action="store_true", help="list dataset names")
  args = parser.parse_args(argv)
  if args.list:
    print("\n".join(registry.list_datasets()))
    return
  if not args.name or not args.data_dir:
    parser.error("--name and --data_dir are required")
  try:
    builder = registry.prepare(
      args.name, args.data_dir, options=dict(args.option), manual_dir=args.manual_dir
    )
  except UserError as e:  # a missing directory, an unknown name: one line, no traceback
    parser.exit(2, f"{parser.prog}: error: {e}\n")
  print(f"Prepared {args.name} in {builder.data_path}: {builder.info.splits}")


if __name__ == "__main__":
  main()
