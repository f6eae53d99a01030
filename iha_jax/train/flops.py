"""IHA-aware FLOP count (IHA_SPEC 2), per-device peak table and MFU.

Per token and layer (D width, H heads, d head width, P pseudo-heads, F MLP width):
- projections q, k, v, o: `4 * 2*D*H*d`;
- IHA mixing `2*3*H*H*P*d` and collapse `2*H*H*P*d` (full) or `2*H*P*d` (per_head);
- MLP: `3 * 2*D*F` (SwiGLU) or `2 * 2*D*F` (GELU);
per sequence and layer, the attention core: unmasked query-key pairs per head times
`4*d` (QK and PV), over `T = N*P` virtual tokens (IHA) or `N` tokens (MHA); causal
`T(T+1)/2` pairs, a window `w` layer `sum_t min(t+1, w)`. Plus the output head
`2*D*V` per token. Training = 3x forward. Packing/padding is ignored: every one of the
`B*N` positions counts.
"""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp

from iha_jax.models import TransformerConfig

# Dense bf16 peak TFLOP/s per device (per chip for TPU), by device_kind substring.
PEAK_TFLOPS = (
    ("TPU v6", 918.0),        # v6e (Trillium)
    ("TPU v5p", 459.0),
    ("TPU v5 lite", 197.0),   # v5e
    ("TPU v5e", 197.0),
    ("TPU v5", 459.0),        # v5p reports "TPU v5"
    ("TPU v4", 275.0),
    ("H200", 989.0),          # SXM, dense (no sparsity)
    ("H100", 989.0),          # SXM, dense (no sparsity)
    ("A100", 312.0),
)


def causal_pairs(length: int, window: int | None) -> int:
  """Unmasked (query, key) pairs of one head over `length` positions."""
  if window is None or window >= length:
    return length * (length + 1) // 2
  # Queries t < window see t+1 keys, the rest see `window`.
  return window * (window + 1) // 2 + (length - window) * window


def forward_flops_per_sequence(config: TransformerConfig, seq_len: int) -> float:
  """Forward FLOPs of one `[seq_len]` sequence through `TransformerLM(config)`."""
  c = config
  h, d, big_d = c.num_heads, c.head_dim, c.model_dim
  per_token = 2 * big_d * c.vocab_size  # output head
  per_sequence = 0
  for letter in c.schedule:
    acfg = c.attention_config(letter)
    mlp_matrices = 3 if c.mlp_type == "swiglu" else 2
    per_token += 4 * 2 * big_d * h * d + mlp_matrices * 2 * big_d * c.mlp_dim
    if acfg.interleaved:
      p = acfg.num_pseudo or h
      collapse = h * h * p if acfg.collapse_mode == "full" else h * p
      per_token += 2 * 3 * h * h * p * d + 2 * collapse * d
      length = seq_len * p
    else:
      length = seq_len
    per_sequence += h * causal_pairs(length, acfg.window) * 4 * d
  return float(per_token * seq_len + per_sequence)


def train_flops_per_step(config: TransformerConfig, batch_size: int, seq_len: int) -> float:
  """Model FLOPs of one training step (forward + backward = 3x forward); remat excluded."""
  return 3.0 * batch_size * forward_flops_per_sequence(config, seq_len)


def measured_matmul_tflops(device: jax.Device | None = None, size: int = 1024,
                           dtype=jnp.float32, repeats: int = 5) -> float:
  """Best-of-`repeats` rate of a `size`^3 matmul on `device`, in TFLOP/s (CPU peak proxy)."""
  device = device or jax.devices()[0]
  a = jax.device_put(jnp.ones((size, size), dtype), device)
  matmul = jax.jit(lambda x: x @ x)
  matmul(a).block_until_ready()
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    matmul(a).block_until_ready()
    best = min(best, time.perf_counter() - start)
  return 2 * size ** 3 / best / 1e12


def peak_tflops_per_device(device: jax.Device | None = None) -> tuple[float, str]:
  """(peak TFLOP/s, source): the table's bf16 dense peak, else a measured matmul rate."""
  device = device or jax.devices()[0]
  kind = getattr(device, "device_kind", "")
  for pattern, peak in PEAK_TFLOPS:
    if pattern.lower() in kind.lower():
      return peak, f"table ({kind}, bf16 dense)"
  return measured_matmul_tflops(device), f"measured matmul ({kind or device.platform})"
