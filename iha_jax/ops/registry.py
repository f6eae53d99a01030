"""Resolution and lookup of attention implementations.

Every attention kind's record (`iha_jax.kinds`, one file per kind) declares its
implementations, `{name: ("module:function" or callable, bound keyword arguments)}`, and
registers them here (`register`). The built-in kinds register when `iha_jax.kinds` is
imported; this module imports it on the first lookup of an unknown kind, so
`iha_jax.ops`' entry points work without it having been imported (the kinds sit above
ops and kernels in the layering; the table names kernels as strings, imported on first
use). Every entry of one kind takes the same arguments (the kind's arrays, then the
`AttentionOptions` already checked and defaulted by its public entry point) and computes
the same function. Kernel entries run inside `shard_map` when a mesh is current
(`iha_jax.kernels.sharded`), so callers never choose between the kernels and their
sharded wrappers.

| kind | entry point | implementations |
| --- | --- | --- |
| iha | `iha_attention` | reference, xla, pallas_tpu, pallas_gpu, pallas_gpu_mha, cudnn |
| mha | `mha_attention` | reference, xla, pallas_tpu, pallas_gpu (= pallas_gpu_mha), cudnn |
| talking_heads | `talking_heads_attention` | reference, xla |
| diff | `diff_attention` | reference, xla, pallas_tpu, pallas_gpu, pallas_gpu_mha (through mha) |
| simplicial | `simplicial_attention` | reference, xla |

On a mesh with a `context` axis (sequence sharding, `iha_jax.parallel.context`) each shard
runs one of the `SLICED` implementations (queries at an offset into longer keys): every
one above but cuDNN.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax

from iha_jax.ops import cudnn_attention
from iha_jax.ops.options import IMPLEMENTATIONS
from iha_jax.parallel import context

# The built-in kinds (registered by `iha_jax.kinds`).
KINDS = ("iha", "mha", "talking_heads", "diff", "simplicial")
Entry = tuple[Any, dict[str, Any]]  # ("module:function" or callable, bound keyword arguments)

_TABLE: dict[str, dict[str, Entry]] = {}
_ROLES: dict[str, tuple[str, ...]] = {}
# Implementations that take queries sliced from a longer key sequence
# (`AttentionOptions.query_offset`, `kv_segment_ids`, `kv_positions`): the ones a
# context-parallel call (`iha_jax.parallel.context`) can run on each shard. The Pallas
# kernels take the offset as a scalar operand (one compiled kernel for every shard) and
# visit only the key tiles a shard's queries see; cuDNN's attention does not (its packed
# layout is private to jax), so "auto" skips it under a context axis.
SLICED = frozenset({"reference", "xla", "pallas_tpu", "pallas_gpu", "pallas_gpu_mha"})


def register(kind: str, table: Mapping[str, Entry], roles: tuple[str, ...] | None = None) -> None:
  """Declares `kind`'s implementations (`iha_jax.kinds.register` calls this) and the roles
  of their array arguments under sequence sharding ("q", "kv" or "-" each; None: the
  kind cannot run on a `context` mesh axis)."""
  unknown = sorted(set(table) - set(IMPLEMENTATIONS) - {"auto"})
  if unknown or "auto" in table:
    raise ValueError(
      f"{kind}: implementation names must be among {IMPLEMENTATIONS[:-1]}, got {sorted(table)}"
    )
  _TABLE[kind] = dict(table)
  if roles is None:
    _ROLES.pop(kind, None)
  else:
    _ROLES[kind] = tuple(roles)
  _load.cache_clear()


def unregister(kind: str) -> None:
  """Forgets `kind`'s implementations (`iha_jax.kinds.unregister` calls this)."""
  _TABLE.pop(kind, None)
  _ROLES.pop(kind, None)
  _load.cache_clear()


def _table(kind: str) -> dict[str, Entry]:
  if kind not in _TABLE:
    importlib.import_module("iha_jax.kinds")  # registers the built-in kinds
  if kind not in _TABLE:
    raise ValueError(f"attention kind must be one of {tuple(_TABLE)}, got {kind!r}")
  return _TABLE[kind]


def implementations(kind: str) -> tuple[str, ...]:
  """The concrete implementations of `kind` (without "auto")."""
  return tuple(_table(kind))


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
  """Bytes per device of the q, k and v a call materialises `expansion` (P) times: q
  `[B, N, H, d]`, k `[B, N, G, d]` and v `[B, N, G, dv]` (G key/value heads, from v)."""
  k_size = v.size // v.shape[-1] * q.shape[-1]
  return expansion * (q.size + k_size + v.size) * q.dtype.itemsize // _devices_sharing()


def resolve(
  kind: str,
  implementation: str,
  q=None,
  v=None,
  options=None,
  expansion: int = 1,
  *,
  sliced: bool = False,
) -> str:
  """ "auto" -> the fastest path measured on the current backend (or `auto_backend`'s):
  - GPU, given the call's `q`, `v`, `options` (and IHA's P as `expansion`): cuDNN's
    attention where the call allows it (`cudnn_attention.unsupported` finds nothing; not
    for `sliced` calls: sequence shards, which only the `SLICED` implementations take);
    else, where a kind's "pallas_gpu_mha" is its own path (IHA: materialised pseudo
    q/k/v + the Pallas MHA kernel), that;
    IHA takes either only while `materialised_bytes` stays within
    `MATERIALISE_LIMIT_BYTES`; else the fused Pallas kernels;
  - TPU: the fused Pallas kernels;
  - elsewhere, or where a kind has none of these: "xla".
  On an H100 the fused IHA kernels ran 4 to 9 times slower than "pallas_gpu_mha" and 6
  to 41 times slower than "cudnn" (docs/performance.md §12): they stay for the memory
  they save ("pallas_gpu" by name).

  Any other name is returned as is after checking that `kind` has it.
  """
  table = _table(kind)
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
  if implementation == "auto":
    backend = _AUTO_BACKEND.get() or jax.default_backend()
    if backend == "gpu" and q is not None:
      small = expansion == 1 or materialised_bytes(q, v, expansion) <= MATERIALISE_LIMIT_BYTES
      cudnn = "cudnn" in table and not sliced
      if small and cudnn and cudnn_attention.unsupported(q, v, options) is None:
        return "cudnn"
      materialises = table.get("pallas_gpu_mha", table.get("pallas_gpu")) != table.get("pallas_gpu")
      if small and materialises:
        return "pallas_gpu_mha"
    kernel = {"tpu": "pallas_tpu", "gpu": "pallas_gpu"}.get(backend)
    return kernel if kernel in table else "xla"
  if implementation not in table:
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
  `platform`, the MHA implementation behind "diff") is already applied. On a mesh with a
  `context` axis (given `q`, whose length it divides), the callable runs the
  implementation context-parallel (`iha_jax.parallel.context.attend`); "auto" then takes
  the fastest implementation that can (`SLICED`: the Pallas kernels on TPU and GPU, never
  cuDNN; "xla" for kinds without kernels).
  """
  sharded = q is not None and context.applies(q.shape[1])
  name = resolve(kind, implementation, q, v, options, expansion, sliced=sharded)
  if not sharded:
    return _load(kind, name)
  if kind not in _ROLES:
    raise ValueError(
      f"{kind} attention declares no sequence roles (AttentionKind.sequence_roles), so it "
      f"cannot run on a mesh with a 'context' axis; use context=1 for its layers"
    )
  if name not in SLICED:  # only an explicit name: "auto" resolved among SLICED
    raise ValueError(
      f"implementation {implementation!r} cannot run sequence-sharded (mesh axis "
      f"'context' > 1); use one of {sorted(SLICED & set(_table(kind)))} or 'auto'"
    )
  inner = _load(kind, name)

  def per_shard(*args: Any) -> jax.Array:  # inner calls (diff's MHA) take `name` too
    *arrays, options = args
    return inner(*arrays, options.replace(implementation=name))

  return functools.partial(context.attend, per_shard, _ROLES[kind], per_token=expansion)


@functools.cache
def _load(kind: str, implementation: str) -> Callable[..., jax.Array]:
  reference, bound = _table(kind)[implementation]
  if isinstance(reference, str):
    module_name, function_name = reference.split(":")
    reference = getattr(importlib.import_module(module_name), function_name)
  return functools.partial(reference, **bound) if bound else reference
