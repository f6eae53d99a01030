"""The registered attention kinds and their schedule letters.

`register(record)` adds a kind: its record, its letters (`TransformerConfig`'s schedule)
and its implementations (the ops registry's table, so `implementation=` resolves for it).
The built-in kinds register when `iha_jax.kinds` is imported.
"""

from __future__ import annotations

import types

from iha_jax.kinds.base import AttentionKind, Letter
from iha_jax.ops import registry as ops_registry

_KINDS: dict[str, AttentionKind] = {}
_LETTERS: dict[str, tuple[str, Letter]] = {}  # letter -> (kind name, Letter)
_DESCRIPTIONS: dict[str, str] = {}

# Letter -> description, live (kinds registered later appear too).
LETTER_DESCRIPTIONS = types.MappingProxyType(_DESCRIPTIONS)


def register(record: AttentionKind) -> AttentionKind:
  """Adds `record` (an `AttentionKind` instance) and returns it.

  Raises ValueError when its name or one of its letters is taken by another kind, or a
  letter is not a single upper-case character.
  """
  if not isinstance(record, AttentionKind):
    raise TypeError(f"register takes an AttentionKind instance, got {record!r}")
  name = record.name
  if name in _KINDS and _KINDS[name] is not record:
    raise ValueError(f"attention kind {name!r} is already registered ({_KINDS[name]!r})")
  for letter in record.letters:
    if len(letter.letter) != 1 or not letter.letter.isupper():
      raise ValueError(f"{name}: a schedule letter is one upper-case character, got {letter!r}")
    owner = _LETTERS.get(letter.letter, (name,))[0]
    if owner != name:
      raise ValueError(f"{name}: schedule letter {letter.letter!r} belongs to kind {owner!r}")
  if "reference" not in record.implementations or "xla" not in record.implementations:
    raise ValueError(f"{name}: implementations must include 'reference' and 'xla'")
  _KINDS[name] = record
  for letter in record.letters:
    _LETTERS[letter.letter] = (name, letter)
    _DESCRIPTIONS[letter.letter] = letter.description
  ops_registry.register(name, dict(record.implementations), record.sequence_roles)
  return record


def unregister(name: str) -> None:
  """Removes kind `name` and its letters (a kind a test or an experiment registered)."""
  record = get(name)
  for letter in record.letters:
    _LETTERS.pop(letter.letter, None)
    _DESCRIPTIONS.pop(letter.letter, None)
  del _KINDS[name]
  ops_registry.unregister(name)


def names() -> tuple[str, ...]:
  """The registered kinds, in registration order."""
  return tuple(_KINDS)


def get(name: str) -> AttentionKind:
  """The record of kind `name`; ValueError naming the registered kinds otherwise."""
  try:
    return _KINDS[name]
  except (KeyError, TypeError):
    raise ValueError(f"kind must be one of {names()}, got {name!r}") from None


def for_letter(letter: str) -> tuple[AttentionKind, Letter]:
  """(record, Letter) of schedule letter `letter`; ValueError listing the letters."""
  if letter not in _LETTERS:
    raise ValueError(f"letter must be one of {tuple(_LETTERS)}, got {letter!r}")
  name, spec = _LETTERS[letter]
  return _KINDS[name], spec


def mixing_params() -> tuple[str, ...]:
  """Names of every registered kind's identity-initialised head mixings."""
  return tuple(dict.fromkeys(n for record in _KINDS.values() for n in record.mixing_params))


def kind_fields() -> tuple[str, ...]:
  """`AttentionConfig` fields that only some kinds read (each kind's `config_fields`)."""
  return tuple(dict.fromkeys(n for record in _KINDS.values() for n in record.config_fields))
