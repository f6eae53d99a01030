"""IHA (window, FLOP-matched) vs MHA (global causal) attention cost, side by side.

Times forward+backward of `iha_attention` at P pseudo-heads with the paper's
FLOP-matched window of N/(2P) virtual tokens against `mha_attention` global
causal at the same B, N, H, d, in one process, and reads both peak temporary
memories from the compiled executables' memory analysis.

  python benchmarks/attention.py                     # B=2 N=1024 H=4 d=64 P=4, xla
  python benchmarks/attention.py --seq_len 4096 --impl reference
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from iha_jax.ops import iha_attention, mha_attention
from iha_jax.train.flops import causal_pairs
from timing import call_times


def attention_flops(num_tokens: int, num_heads: int, head_dim: int, window: int | None) -> float:
  """Training FLOPs of one attention core (IHA_SPEC section 2): 3 x (4 d per unmasked pair)."""
  return 3 * 4 * head_dim * causal_pairs(num_tokens, window) * num_heads


def _fwd_bwd(fn):
  """Loss of a random projection of the output, differentiated w.r.t. every float input."""
  def loss(args, cotangent):
    return jnp.sum(fn(*args).astype(jnp.float32) * cotangent)
  return jax.jit(jax.value_and_grad(loss))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batch", type=int, default=2)
  parser.add_argument("--seq_len", type=int, default=1024)
  parser.add_argument("--heads", type=int, default=4)
  parser.add_argument("--head_dim", type=int, default=64)
  parser.add_argument("--pseudo", type=int, default=4)
  parser.add_argument("--impl", default="xla")
  parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  parser.add_argument("--repeats", type=int, default=5)
  args = parser.parse_args()

  b, n, h, d, p = args.batch, args.seq_len, args.heads, args.head_dim, args.pseudo
  dtype = jnp.dtype(args.dtype)
  window = max(1, n // (2 * p))  # virtual tokens: N / (2 P^2) tokens
  keys = jax.random.split(jax.random.PRNGKey(0), 8)
  q, k, v = (jax.random.normal(keys[i], (b, n, h, d), dtype) for i in range(3))
  eye = jnp.broadcast_to(jnp.eye(h)[:, :, None], (h, h, p))
  alphas = tuple(eye + 0.1 * jax.random.normal(keys[3 + i], (h, h, p)) for i in range(3))
  collapse = eye / p + 0.1 * jax.random.normal(keys[6], (h, h, p))
  cotangent = jax.random.normal(keys[7], (b, n, h, d))

  iha = _fwd_bwd(lambda *a: iha_attention(*a, window=window, implementation=args.impl))
  mha = _fwd_bwd(lambda *a: mha_attention(*a, implementation=args.impl))
  iha_args = ((q, k, v) + alphas + (collapse,), cotangent)
  mha_args = ((q, k, v), cotangent)
  rows = []
  for name, fn, fargs, flops in (
      (f"iha P={p} window={window}", iha, iha_args, attention_flops(n * p, h, d, window)),
      ("mha global causal", mha, mha_args, attention_flops(n, h, d, None))):
    compiled = fn.lower(*fargs).compile()
    memory = compiled.memory_analysis()
    temp = getattr(memory, "temp_size_in_bytes", float("nan")) if memory else float("nan")
    seconds = min(call_times(lambda: compiled(*fargs), args.repeats))
    rows.append((name, seconds, temp, flops * b / seconds / 1e9))

  print(f"backend={jax.default_backend()} impl={args.impl} dtype={args.dtype} "
        f"B={b} N={n} H={h} d={d}")
  print(f"{'attention':<28}{'fwd+bwd ms':>12}{'peak temp MiB':>15}{'GFLOP/s':>10}")
  for name, seconds, temp, gflops in rows:
    print(f"{name:<28}{seconds * 1e3:>12.2f}{temp / 2**20:>15.1f}{gflops:>10.1f}")
  print(f"time ratio iha/mha = {rows[0][1] / rows[1][1]:.2f}  "
        f"memory ratio iha/mha = {rows[0][2] / rows[1][2]:.2f}")


if __name__ == "__main__":
  main()
