"""Checksums of what a checkpoint holds, computed from the values in memory at save time and
compared with the values read back on restore.

Orbax 0.12 / TensorStore checksum only the index of a zarr3 shard (crc32c), not the array
chunks: bytes overwritten inside an array file restore silently as wrong numbers. So every
checkpoint carries a `checksums` item (JSON, written in the same atomic Orbax commit):
- `state`: for every array of the train state, a 64-bit digest of its values, keyed by its
  path (`params/layers/0/attn/wq`). The digest is two sums modulo 2^32 over the array's
  bits seen as uint32 words w_i at flat index i: `sum(w_i * o_i)` with o_i an odd
  index-dependent multiplier, so any single changed word changes it, and
  `sum(fmix(w_i + m_i))` with murmur3's bijective finaliser. Integer sums do not depend on
  the order of addition, so the digest is the same whatever the mesh (a checkpoint
  restored onto another mesh verifies) and is computed on the devices, sharded, in one
  pass: nothing is gathered to the host.
- `data`: per process, the SHA-256 (first 16 hex digits) of the data iterator's state.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

FORMAT = "iha_jax checksums 1"
_M1, _M2, _F1, _F2 = (np.uint32(c) for c in (0x9E3779B1, 0x7F4A7C15, 0x85EBCA6B, 0xC2B2AE35))


class ChecksumMismatch(RuntimeError):
  """A checkpoint's values differ from the checksums saved with them: the files were
  damaged after the save. Not a `UserError`: callers treat it as an unreadable step."""


def _fmix(h: jax.Array) -> jax.Array:
  """murmur3's 32-bit finaliser: a bijection of uint32 that mixes every bit."""
  h = h ^ (h >> 16)
  h = h * _F1
  h = h ^ (h >> 13)
  h = h * _F2
  return h ^ (h >> 16)


def _words(x: jax.Array) -> jax.Array:
  """The bits of `x` as uint32 words (one per element; 8-byte types: `[..., 2]`)."""
  if jnp.issubdtype(x.dtype, jax.dtypes.extended):  # typed PRNG keys
    x = jax.random.key_data(x)
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint32)
  size = x.dtype.itemsize
  if size == 4:
    return jax.lax.bitcast_convert_type(x, jnp.uint32)
  if size in (1, 2):
    unsigned = jnp.uint8 if size == 1 else jnp.uint16
    return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)
  return jax.lax.bitcast_convert_type(x, jnp.uint32)  # 8 bytes -> [..., 2]


def _digest(x: jax.Array) -> jax.Array:
  """uint32 `[2]`: the two sums of the module docstring over all of `x`."""
  words = _words(x)
  index = jnp.zeros(words.shape, jnp.uint32)
  stride = 1
  for axis in reversed(range(words.ndim)):
    index = index + jax.lax.broadcasted_iota(jnp.uint32, words.shape, axis) * np.uint32(stride)
    stride = (stride * words.shape[axis]) % 2**32
  multiplier = _fmix(index * _M1 + _M2) | np.uint32(1)
  return jnp.stack(
    [
      jnp.sum(words * multiplier, dtype=jnp.uint32),
      jnp.sum(_fmix(words + multiplier), dtype=jnp.uint32),
    ]
  )


@functools.lru_cache(maxsize=8)
def _digests_fn(mesh: Mesh | None):
  """The jitted `[leaves] -> uint32 [L, 2]`, its output replicated over `mesh` (so every
  process of a multi-process run reads it)."""
  fn = lambda leaves: jnp.stack([_digest(x) for x in leaves])
  if mesh is None:
    return jax.jit(fn)
  return jax.jit(fn, out_shardings=NamedSharding(mesh, PartitionSpec()))


def leaf_name(path: tuple) -> str:
  """`params/layers/0/attn/wq` for a key path."""
  return jax.tree_util.keystr(path, simple=True, separator="/")


def tree_digests(tree: Any) -> dict[str, str]:
  """`{leaf name: 16 hex digits}` for every array leaf of `tree` (other leaves, such as
  Orbax's placeholders for arrays that were not restored, are skipped)."""
  named = [
    (leaf_name(path), x)
    for path, x in jax.tree_util.tree_leaves_with_path(tree)
    if isinstance(x, jax.Array)
  ]
  if not named:
    return {}
  meshes = {x.sharding.mesh for _, x in named if isinstance(x.sharding, NamedSharding)}
  mesh = meshes.pop() if len(meshes) == 1 else None
  values = np.asarray(jax.device_get(_digests_fn(mesh)([x for _, x in named])))
  return {name: f"{int(a):08x}{int(b):08x}" for (name, _), (a, b) in zip(named, values)}


def json_digest(value: Any) -> str:
  """SHA-256 (16 hex digits) of `value` as canonical JSON (the form a checkpoint stores)."""
  text = json.dumps(json.loads(json.dumps(value)), sort_keys=True)
  return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def record(state: Any, data_digests: Sequence[str]) -> dict[str, Any]:
  """The `checksums` item of a checkpoint of `state` and the processes' data states."""
  return {"format": FORMAT, "state": tree_digests(state), "data": list(data_digests)}


def verify_tree(saved: Mapping[str, Any], tree: Any, what: str = "arrays") -> None:
  """Compares `tree`'s digests with `saved["state"]` (leaves `tree` has; a leaf the record
  lacks counts as a mismatch).

  Raises:
    ChecksumMismatch: naming the first differing leaves and how many differ.
  """
  if saved.get("format") != FORMAT:
    raise ChecksumMismatch(f"unknown checksum format {saved.get('format')!r}")
  expected = saved.get("state", {})
  actual = tree_digests(tree)
  bad = [name for name, digest in actual.items() if expected.get(name) != digest]
  if bad:
    shown = ", ".join(bad[:3]) + (", ..." if len(bad) > 3 else "")
    raise ChecksumMismatch(
      f"{len(bad)} of {len(actual)} {what} differ from the checksums saved with them ({shown})"
    )
