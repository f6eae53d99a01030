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
| iha | `iha_attention` | reference, xla, pallas_tpu, pallas_gpu, pallas_gpu_mha, cudnn |
| mha | `mha_attention` | reference, xla, pallas_tpu, pallas_gpu (= pallas_gpu_mha), cudnn |
| talking_heads | `talking_heads_attention` | reference, xla |
| diff | `diff_attention` | reference, xla, pallas_tpu, pallas_gpu, pallas_gpu_mha (through mha) |
| simplicial | `simplicial_attention` | reference, xla |
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import math
from collections.abc import Callable, Iterator

import jax

from iha_jax.ops import cudnn_attention
from iha_jax.ops.options import IMPLEMENTATIONS

_OPS = "iha_jax.ops"
_KERNELS = "iha_jax.kernels.sharded"  # the kernels, under shard_map when a mesh is current
Entry = tuple[str, dict[str, str]]  # ("module:function", keyword arguments bound to it)


def _local(module: str, function: str) -> Entry:
  return f"{_OPS}.{module}:{function}", {}


def _via_mha(mha: str) -> Entry:
  return f"{_OPS}.attention:iha_via_mha", {"mha": mha}


def _kernel(function: str, platform: str) -> Entry:
  return f"{_KERNELS}:{function}", {"platform": platform}


_TABLE: dict[str, dict[str, Entry]] = {
  "iha": {
    "reference": _local("attention", "iha_reference"),
    "xla": _local("attention", "iha_xla"),
    "pallas_tpu": _kernel("iha_on_current_mesh", "tpu"),
    "pallas_gpu": _kernel("iha_on_current_mesh", "gpu"),
    # Materialised pseudo q/k/v + an MHA implementation over the virtual sequence.
    "pallas_gpu_mha": _via_mha("pallas_gpu"),
    "cudnn": _via_mha("cudnn"),
  },
  "mha": {
    "reference": _local("attention", "mha_reference"),
    "xla": _local("attention", "mha_xla"),
    "pallas_tpu": _kernel("mha_on_current_mesh", "tpu"),
    "pallas_gpu": _kernel("mha_on_current_mesh", "gpu"),
    # MHA has nothing to materialise: the same kernel, so that a model-wide
    # implementation="pallas_gpu_mha" also serves its MHA and differential layers.
    "pallas_gpu_mha": _kernel("mha_on_current_mesh", "gpu"),
    "cudnn": _local("cudnn_attention", "mha_cudnn"),
  },
  "talking_heads": {
    "reference": _local("talking_heads", "talking_heads_reference"),
    "xla": _local("talking_heads", "talking_heads_xla"),
  },
  # Differential attention runs its two maps as one MHA call over 2H heads, so every
  # MHA implementation, the kernels included, serves it.
  "diff": {
    name: _local("differential", "diff_via_mha")
    for name in ("reference", "xla", "pallas_tpu", "pallas_gpu", "pallas_gpu_mha")
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


# "auto" materialises IHA's pseudo q/k/v (P times q, k and v) only below this many bytes
# per device for one call: a model saves them per layer for its backward pass, and the
# paper's 2.4B step at P = 20 would need 508 GiB per H100 that way (the fused kernels
# need 43). The ~350M benchmark model (configs/iha_350m.py) uses 0.75 GiB.
MATERIALISE_LIMIT_BYTES = 2**30


def _devices_sharing() -> int:
  """Devices the arrays being traced are split over: the current mesh's axes that are not
  manual (inside `shard_map` the arrays are already per-device)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return 1
  free = [
    size
    for size, axis_type in zip(mesh.axis_sizes, mesh.axis_types)
    if axis_type != jax.sharding.AxisType.Manual
  ]
  return math.prod(free)


def materialised_bytes(q, v, expansion: int) -> int:
  """Bytes per device of the q, k and v a call materialises `expansion` (P) times."""
  return expansion * (2 * q.size + v.size) * q.dtype.itemsize // _devices_sharing()


def resolve(
  kind: str, implementation: str, q=None, v=None, options=None, expansion: int = 1
) -> str:
  """ "auto" -> the fastest path measured on the current backend (or `auto_backend`'s):
  - GPU, given the call's `q`, `v`, `options` (and IHA's P as `expansion`): cuDNN's
    attention where the call allows it (`cudnn_attention.unsupported` finds nothing);
    else, for IHA, materialised pseudo q/k/v + the Pallas MHA kernel ("pallas_gpu_mha");
    IHA takes either only while `materialised_bytes` stays within
    `MATERIALISE_LIMIT_BYTES`; else the fused Pallas kernels;
  - TPU: the fused Pallas kernels;
  - elsewhere, or where a kind has none of these: "xla".
  On an H100 the fused IHA kernels ran 4 to 9 times slower than "pallas_gpu_mha" and 6
  to 41 times slower than "cudnn" (docs/performance.md §12): they stay for the memory
  they save ("pallas_gpu" by name).

  Any other name is returned as is after checking that `kind` has it.
  """
  _check_kind(kind)
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
  if implementation == "auto":
    backend = _AUTO_BACKEND.get() or jax.default_backend()
    if backend == "gpu" and q is not None:
      small = expansion == 1 or materialised_bytes(q, v, expansion) <= MATERIALISE_LIMIT_BYTES
      if small and "cudnn" in _TABLE[kind] and cudnn_attention.unsupported(q, v, options) is None:
        return "cudnn"
      if small and kind == "iha":
        return "pallas_gpu_mha"
    kernel = {"tpu": "pallas_tpu", "gpu": "pallas_gpu"}.get(backend)
    return kernel if kernel in _TABLE[kind] else "xla"
  if implementation not in _TABLE[kind]:
    raise ValueError(
      f"{kind} attention has no {implementation!r} implementation; "
      f"choose one of {implementations(kind)} or 'auto'"
    )
  return implementation


def lookup(
  kind: str, implementation: str, q=None, v=None, options=None, expansion: int = 1
) -> Callable[..., jax.Array]:
  """The callable of `kind`'s `implementation` ("auto" resolved first, from the call's
  `q`, `v`, `options` and `expansion` where given), imported lazily.

  It takes the kind's arrays and keyword options; what the table binds (a kernel's
  `platform`, the MHA implementation behind "diff") is already applied.
  """
  return _load(kind, resolve(kind, implementation, q, v, options, expansion))


@functools.cache
def _load(kind: str, implementation: str) -> Callable[..., jax.Array]:
  reference, bound = _TABLE[kind][implementation]
  module_name, function_name = reference.split(":")
  fn = getattr(importlib.import_module(module_name), function_name)
  return functools.partial(fn, **bound) if bound else fn
