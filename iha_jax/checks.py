"""Argument checks every layer of the package shares (the bottom layer: it imports nothing
of iha_jax), so a bad number fails in one line naming the argument, wherever it is read."""

from __future__ import annotations

import warnings
from typing import Any

import jax


def is_int(value: Any, minimum: int | None = None) -> bool:
  """Whether `value` is a Python int (not a bool) and, if `minimum` is given, >= it (the
  check behind every "must be a positive integer" message of the project)."""
  return (
    isinstance(value, int) and not isinstance(value, bool) and (minimum is None or value >= minimum)
  )


def is_traced(value: Any) -> bool:
  """Whether `value` is a JAX tracer (an argument of a function being traced by `jit`,
  `grad`, ...): a value that cannot be static, so Python cannot branch on it."""
  return isinstance(value, jax.core.Tracer)


def check_positive(name: str, value: Any, *, optional: bool = False) -> None:
  """Raises ValueError naming `name` unless `value` is a positive int (or None when
  `optional`); a traced value is refused as such (it must be static)."""
  if optional and value is None:
    return
  if is_traced(value):
    raise ValueError(
      f"{name} must be a static Python int, got a traced value ({value!r}): it sets shapes "
      f"at trace time; pass it as a static argument (e.g. jax.jit(..., static_argnames="
      f"{name!r})) or close over it"
    )
  if not is_int(value, 1):
    raise ValueError(
      f"{name} must be a positive integer{' or None' if optional else ''}, got {value!r}"
    )


_DEPRECATIONS_WARNED: set[str] = set()


def warn_deprecated(old: str, new: str) -> None:
  """Warns once per process (DeprecationWarning) that `old`, a name kept so that callers
  can move, is replaced by `new`."""
  if old in _DEPRECATIONS_WARNED:
    return
  _DEPRECATIONS_WARNED.add(old)
  warnings.warn(f"{old} is deprecated; use {new}", DeprecationWarning, stacklevel=3)
