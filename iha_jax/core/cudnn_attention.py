"""IHA and MHA through cuDNN's fused attention: the fastest GPU path where cuDNN applies.

MHA hands its rotated q/k/v to `jax.nn.dot_product_attention(implementation="cudnn")`; IHA
materialises its pseudo q/k/v (`[B, N * P, H, d]`, one XLA einsum each) and runs this over
the virtual sequence (`iha_jax.core.attention.iha_via_mha`). Grouped-query k and v go to
cuDNN as they are (jax's attention has the same head convention). It is the fastest
measured GPU path at the paper's shapes (docs/performance.md §12), at the price of the
P-times larger activations the kernels avoid: the pseudo q/k/v (and cuDNN's own
residuals) live until the backward pass unless the model's remat policy drops them.

cuDNN covers bfloat16/float16 causal attention (global or a left window) and global
bidirectional attention, without packed segments, with the value as wide as q/k and a head
width that is a multiple of 8 up to 128. `unsupported` names what falls outside; "auto"
(`iha_jax.kinds.registry.resolve`) picks this path on GPU only when it returns None.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from iha_jax.core.options import AttentionOptions
from iha_jax.core.rope import apply_rope

DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
MAX_HEAD_DIM = 128
# jax's attention implementation behind this path. Off-GPU, tests set "xla" to run the
# same pipeline (mixing, virtual RoPE, window, collapse) with jax's dense attention.
BACKEND = "cudnn"


def unsupported(q: jax.Array, v: jax.Array, options: AttentionOptions) -> str | None:
  """Why cuDNN cannot run this call (one line), or None when it can.

  q, v: `[B, N, H, d]` / `[B, N, G, dv]` source arrays; options as the entry point gives.
  """
  if jnp.dtype(q.dtype) not in DTYPES:
    return f"cuDNN attention takes bfloat16 or float16, got {q.dtype}"
  if options.segment_ids is not None:
    return "cuDNN attention has no packed-segment mask (segment_ids given)"
  if options.window is not None and not options.causal:
    return "cuDNN attention has no bidirectional window"
  d, dv = q.shape[-1], v.shape[-1]
  if dv != d:
    return f"cuDNN attention needs the value as wide as q/k ({dv} != {d})"
  if d % 8 or d > MAX_HEAD_DIM:
    return f"cuDNN attention needs a head width that is a multiple of 8 up to 128, got {d}"
  return None


def _check(q, v, options: AttentionOptions) -> None:
  reason = unsupported(q, v, options)
  if reason:
    raise ValueError(f"implementation='cudnn': {reason}; use 'auto', 'pallas_gpu' or 'xla'")


def _attend(q, k, v, options: AttentionOptions, positions) -> jax.Array:
  """Rotate and attend `[B, T, H, d]` sequences; positions `[B, T]`."""
  if options.rope_theta is not None:
    q, k = (apply_rope(x, positions, options.rope_theta) for x in (q, k))
  # Ours is `t - s < window`: the query sees itself and window - 1 keys before it.
  window = None if options.window is None else (options.window - 1, 0)
  return jax.nn.dot_product_attention(
    q, k, v, is_causal=options.causal, local_window_size=window, implementation=BACKEND
  )


def mha_cudnn(q, k, v, options: AttentionOptions):
  """MHA through cuDNN's attention."""
  _check(q, v, options)
  return _attend(q, k, v, options, options.positions)
