"""The one table of attention kinds and their implementations.

Each kind maps implementation names to `"module:function"` references (with keyword
arguments to bind), imported on first use. The table names the Pallas kernels without
importing them, so `iha_jax.ops` sits below `iha_jax.kernels` in the layering and this
is the only place that reaches up into it. Every entry of one kind takes the same
arguments (the kind's arrays, then the `AttentionOptions` already checked and defaulted
by the kind's public entry point) and computes the same function. The kernel entries
run inside `shard_map` when a mesh is current (`iha_jax.kernels.sharded`), so callers
never choose between the kernels and their sharded wrappers.

| kind | entry point | implementations |
| --- | --- | --- |
| iha | `iha_attention` | reference, xla, pallas_tpu, pallas_gpu |
| mha | `mha_attention` | reference, xla, pallas_tpu, pallas_gpu |
| talking_heads | `talking_heads_attention` | reference, xla |
| diff | `diff_attention` | reference, xla, pallas_tpu, pallas_gpu (through mha) |
| simplicial | `simplicial_attention` | reference, xla |
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
from collections.abc import Callable, Iterator

import jax

from iha_jax.ops.options import IMPLEMENTATIONS

_OPS = "iha_jax.ops"
_KERNELS = "iha_jax.kernels.sharded"  # the kernels, under shard_map when a mesh is current
Entry = tuple[str, dict[str, str]]  # ("module:function", keyword arguments bound to it)


def _local(module: str, function: str) -> Entry:
  return f"{_OPS}.{module}:{function}", {}


def _kernel(function: str, platform: str) -> Entry:
  return f"{_KERNELS}:{function}", {"platform": platform}


_TABLE: dict[str, dict[str, Entry]] = {
  "iha": {
    "reference": _local("attention", "iha_reference"),
    "xla": _local("attention", "iha_xla"),
    "pallas_tpu": _kernel("iha_on_current_mesh", "tpu"),
    "pallas_gpu": _kernel("iha_on_current_mesh", "gpu"),
  },
  "mha": {
    "reference": _local("attention", "mha_reference"),
    "xla": _local("attention", "mha_xla"),
    "pallas_tpu": _kernel("mha_on_current_mesh", "tpu"),
    "pallas_gpu": _kernel("mha_on_current_mesh", "gpu"),
  },
  "talking_heads": {
    "reference": _local("talking_heads", "talking_heads_reference"),
    "xla": _local("talking_heads", "talking_heads_xla"),
  },
  # Differential attention runs its two maps as one MHA call over 2H heads, so every
  # MHA implementation, the kernels included, serves it.
  "diff": {
    name: _local("differential", "diff_via_mha")
    for name in ("reference", "xla", "pallas_tpu", "pallas_gpu")
  },
  "simplicial": {
    "reference": _local("simplicial", "simplicial_reference"),
    "xla": _local("simplicial", "simplicial_xla"),
  },
}

KINDS = tuple(_TABLE)


def implementations(kind: str) -> tuple[str, ...]:
  """The concrete implementations of `kind` (without "auto")."""
  _check_kind(kind)
  return tuple(_TABLE[kind])


def _check_kind(kind: str) -> None:
  if kind not in _TABLE:
    raise ValueError(f"attention kind must be one of {KINDS}, got {kind!r}")


_AUTO_BACKEND: contextvars.ContextVar[str | None] = contextvars.ContextVar(
  "iha_auto_backend", default=None
)


@contextlib.contextmanager
def auto_backend(backend: str) -> Iterator[None]:
  """Resolves "auto" as on `backend` ("tpu", "gpu", "cpu") inside the block: for programs
  lowered on this host for another platform (compile-only targets)."""
  token = _AUTO_BACKEND.set(backend)
  try:
    yield
  finally:
    _AUTO_BACKEND.reset(token)


def resolve(kind: str, implementation: str) -> str:
  """ "auto" -> the Pallas kernels of the current backend (or `auto_backend`'s) where
  `kind` has them, else "xla".

  Any other name is returned as is after checking that `kind` has it.
  """
  _check_kind(kind)
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
  if implementation == "auto":
    backend = _AUTO_BACKEND.get() or jax.default_backend()
    kernel = {"tpu": "pallas_tpu", "gpu": "pallas_gpu"}.get(backend)
    return kernel if kernel in _TABLE[kind] else "xla"
  if implementation not in _TABLE[kind]:
    raise ValueError(
      f"{kind} attention has no {implementation!r} implementation; "
      f"choose one of {implementations(kind)} or 'auto'"
    )
  return implementation


def lookup(kind: str, implementation: str) -> Callable[..., jax.Array]:
  """The callable of `kind`'s `implementation` ("auto" resolved first), imported lazily.

  It takes the kind's arrays and keyword options; what the table binds (a kernel's
  `platform`, the MHA implementation behind "diff") is already applied.
  """
  return _load(kind, resolve(kind, implementation))


@functools.cache
def _load(kind: str, implementation: str) -> Callable[..., jax.Array]:
  reference, bound = _TABLE[kind][implementation]
  module_name, function_name = reference.split(":")
  fn = getattr(importlib.import_module(module_name), function_name)
  return functools.partial(fn, **bound) if bound else fn
