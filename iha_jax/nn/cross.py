"""Cross-attention: queries from the layer's input, keys and values from a context.

IHA's paper defines self-attention only; this is the extension (docs/design.md):
BOTH sides interleave. The queries' tokens become P pseudo-queries each (`alpha_q`), the
context's tokens P pseudo-keys and pseudo-values each (`alpha_k`, `alpha_v`); every
pseudo-query attends over all `M * P` virtual tokens of the context, bidirectionally, and
the collapse folds each token's P outputs back into its H heads. The layer's parameters
are exactly its self-attention ones, so one IHA layer may serve both; MHA is the P = 1
case. No RoPE and no window: queries and keys are on two different sequences, with no
shared axis of positions (as the cross-attention of encoder-decoder models).

The call is the kind's own entry point (`AttentionKind.entry_arrays`, `registry.attend`)
with keys of another length, as a cached call makes it (`iha_jax.nn.call.run_layer`): the
registry picks the implementation, so the Pallas kernels run on TPU and GPU under "auto".

A decoder attends over one context at every step: `cache_context` projects the context's
keys and values once (`ContextCache`, in the self-attention cache's layouts: "source",
the source heads, which the kind's entry point mixes at each call; "pseudo", the
pseudo-keys and pseudo-values, P times larger, mixed once, attended by MHA's entry point
over the virtual rows before the kind's collapse), and a call with `context=` that cache
equals the call with the context itself.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
from flax import struct

from iha_jax.core.attention import virtual_options
from iha_jax.core.validation import default_positions
from iha_jax.kinds import project_qkv
from iha_jax.kinds.config import AttentionConfig
from iha_jax.nn.cache import CacheSpec, check_cache_mode, spec_for
from iha_jax.nn.functional import Handed, key_validity, to_compute_dtype


class ContextCache(struct.PyTreeNode):
  """A cross-attention context's keys and values, projected once (`cache_context`).

  Attributes:
    k, v: "source": the context's source-head keys and values `[B, M, G, d]`;
      "pseudo": its pseudo-keys and pseudo-values `[B, M*P, G, d]` (P = 1 for MHA).
    valid: `[B, M]` int32, 1 for a valid context token, 0 for padding.
    spec: what it was made for (static; `CacheSpec` with M context tokens as capacity).
  """

  k: jax.Array
  v: jax.Array
  valid: jax.Array
  spec: CacheSpec = struct.field(pytree_node=False)


def check_cross(cfg: AttentionConfig) -> None:
  """Raises ValueError, naming the field and the fix, unless a layer of `cfg` can attend
  over a context: a kind that reads as pseudo-head attention, bidirectional, global, no
  RoPE."""
  if not cfg.record.decodes:
    raise ValueError(
      f"context=: {cfg.kind} attention has no cross-attention (its kind does not read as "
      "pseudo-head attention: AttentionKind.decodes); IHA, MHA and PHA layers take a context"
    )
  wrong = [
    (name, value, fix)
    for name, value, fix in (
      ("causal", cfg.causal, "causal=False"),
      ("window", cfg.window, "window=None"),
      ("rope_theta", cfg.rope_theta, "rope_theta=None"),
    )
    if value not in (False, None)
  ]
  if wrong:
    got = ", ".join(f"{name}={value!r}" for name, value, _ in wrong)
    fix = ", ".join(fix for _, _, fix in wrong)
    raise ValueError(
      f"context= (cross-attention) attends bidirectionally over a second sequence, with "
      f"no positions shared with the queries; this layer has {got}: build it with {fix}"
    )


def check_context(
  context: jax.Array | ContextCache, x: jax.Array | None, cfg: AttentionConfig
) -> None:
  """Raises ValueError, naming the field or `context`, unless a layer of `cfg` can attend
  over `context` (`check_cross`): a floating `[B, M, model_dim]` with x's B (any B
  without x), or a `ContextCache` this layer made."""
  check_cross(cfg)
  batch = "B" if x is None else x.shape[0]
  if isinstance(context, ContextCache):
    differ = context.spec.differences(spec_for(cfg, context.spec.capacity, context.spec.mode))
    if differ:
      raise ValueError(
        f"this context cache was made for another layer: its {'; '.join(differ)}. Make "
        "one with this layer's cache_context"
      )
    if x is not None and context.valid.shape[0] != batch:
      raise ValueError(
        f"the context cache holds {context.valid.shape[0]} rows, x has B = {batch}: one "
        "context per row of x"
      )
    return
  shape = tuple(jnp.shape(context))
  batch_ok = len(shape) == 3 and (x is None or shape[0] == batch)
  if not batch_ok or shape[2] != cfg.model_dim or shape[1] < 1:
    raise ValueError(
      f"context must have shape [B, M, model_dim] = [{batch}, M >= 1, {cfg.model_dim}] "
      f"(B of x), got {shape}"
    )
  if not jnp.issubdtype(jnp.result_type(context), jnp.floating):
    raise ValueError(f"context must be a floating array, got dtype {jnp.result_type(context)}")


def _context_validity(mask: jax.Array | None, b: int, m: int) -> jax.Array:
  """`[B, M]` int32 validity of the context tokens from flax's `mask: [B, 1, 1, M]`."""
  if mask is None:
    return jnp.ones((b, m), jnp.int32)
  meaning = (
    f"with context=, mask says which context tokens are valid, [B, 1, 1, M] = [{b}, 1, 1, "
    f"{m}] (valid[:, None, None, :])"
  )
  return key_validity(mask, b, m, meaning).astype(jnp.int32)


def cache_context(
  params: Mapping[str, jax.Array],
  context: jax.Array,
  cfg: AttentionConfig,
  mask: jax.Array | None = None,
  mode: str = "source",
) -> ContextCache:
  """The keys and values of `context: [B, M, D]` for every cross-attention call of the
  layer of `cfg` with `params` over it (module docstring); `mask`: which context tokens
  are valid, flax's `[B, 1, 1, M]`; `mode`: "source" or "pseudo"."""
  check_context(context, None, cfg)
  check_cache_mode(mode)
  params, context = to_compute_dtype(params, context, cfg)
  b, m = context.shape[:2]
  _, k, v = project_qkv(params, context)  # [B, M, G, d]; the unused q is dead code to XLA
  if mode == "pseudo":
    k, v = (cfg.record.pseudo_heads(params, cfg, w, t) for w, t in (("k", k), ("v", v)))
  valid = _context_validity(mask, b, m)
  return ContextCache(k=k, v=v, valid=valid, spec=spec_for(cfg, m, mode))


def cross_heads(
  params: Mapping[str, jax.Array],
  x: jax.Array,
  context: jax.Array | ContextCache,
  cfg: AttentionConfig,
  mask: jax.Array | None,
) -> Handed:
  """What cross-attention hands the kind (module docstring): queries projected from
  `x: [B, N, D]`, keys and values from `context: [B, M, D]` (both in the computation
  dtype) or a `ContextCache`, the context's padding as the keys' segment ids.

  `mask`: which context tokens are valid, flax's `[B, 1, 1, M]` (True = attend; a cache
  holds its own); a row with no valid context token gets zero attention outputs (then
  `bo` alone).
  """
  b, n = x.shape[:2]
  q, _, _ = project_qkv(params, x)  # the unused k, v of x are dead code to XLA
  if isinstance(context, ContextCache):
    k, v, kv_valid = context.k.astype(x.dtype), context.v.astype(x.dtype), context.valid
  else:
    _, k, v = project_qkv(params, context)
    kv_valid = _context_validity(mask, b, context.shape[1])
  # A row whose context is all padding: its queries are padding too (zero outputs).
  query_ids = jnp.broadcast_to(kv_valid.max(axis=1, keepdims=True), (b, n))
  options = cfg.options(segment_ids=query_ids).replace(kv_segment_ids=kv_valid)
  if not (isinstance(context, ContextCache) and context.spec.mode == "pseudo"):
    return Handed(options, (q, k, v))
  # MHA's entry point over the virtual rows: the same call in virtual units (no RoPE).
  options = virtual_options(
    options.replace(
      positions=default_positions(query_ids, None), kv_positions=default_positions(kv_valid, None)
    ),
    context.spec.num_pseudo,
  )
  q = cfg.record.pseudo_heads(params, cfg, "q", q)  # [B, N*P, H, d]
  return Handed(options, (q, k, v), pseudo=True)
