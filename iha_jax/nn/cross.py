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
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp

from iha_jax.kinds import project_qkv
from iha_jax.kinds.config import AttentionConfig
from iha_jax.nn.functional import Handed, key_validity


def check_cross(cfg: AttentionConfig) -> None:
  """Raises ValueError, naming the field and the fix, unless a layer of `cfg` can attend
  over a context: a kind that reads as pseudo-head attention, bidirectional, global, no
  RoPE."""
  if not cfg.record.decodes:
    raise ValueError(
      f"context=: {cfg.kind} attention has no cross-attention (its kind does not read as "
      "pseudo-head attention: AttentionKind.decodes); IHA and MHA layers take a context"
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


def check_context(context: jax.Array, x: jax.Array, cfg: AttentionConfig) -> None:
  """Raises ValueError, naming the field or `context`, unless a layer of `cfg` can attend
  over `context` (`check_cross`), a floating `[B, M, model_dim]` with x's B."""
  check_cross(cfg)
  shape = tuple(jnp.shape(context))
  if len(shape) != 3 or shape[0] != x.shape[0] or shape[2] != cfg.model_dim or shape[1] < 1:
    raise ValueError(
      f"context must have shape [B, M, model_dim] = [{x.shape[0]}, M >= 1, {cfg.model_dim}] "
      f"(B of x), got {shape}"
    )
  if not jnp.issubdtype(jnp.result_type(context), jnp.floating):
    raise ValueError(f"context must be a floating array, got dtype {jnp.result_type(context)}")


def cross_heads(
  params: Mapping[str, jax.Array],
  x: jax.Array,
  context: jax.Array,
  cfg: AttentionConfig,
  mask: jax.Array | None,
) -> Handed:
  """What cross-attention hands the kind (module docstring): queries projected from
  `x: [B, N, D]`, keys and values from `context: [B, M, D]` (both in the computation
  dtype), the context's padding as the keys' segment ids.

  `mask`: which context tokens are valid, flax's `[B, 1, 1, M]` (True = attend); a row
  with no valid context token gets zero attention outputs (then `bo` alone).
  """
  b, n = x.shape[:2]
  m = context.shape[1]
  kv_valid = jnp.ones((b, m), jnp.int32)
  if mask is not None:
    meaning = (
      f"with context=, mask says which context tokens are valid, [B, 1, 1, M] = [{b}, 1, 1, "
      f"{m}] (valid[:, None, None, :])"
    )
    kv_valid = key_validity(mask, b, m, meaning).astype(jnp.int32)
  q, _, _ = project_qkv(params, x)  # the unused k, v of x are dead code to XLA
  _, k, v = project_qkv(params, context)
  # A row whose context is all padding: its queries are padding too (zero outputs).
  query_ids = jnp.broadcast_to(kv_valid.max(axis=1, keepdims=True), (b, n))
  options = cfg.options(segment_ids=query_ids).replace(kv_segment_ids=kv_valid)
  return Handed(options, (q, k, v))
