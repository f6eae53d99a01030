"""Every attention kind's forward+backward cost, side by side with causal MHA in one run.

Rows (same B, N, d; H heads, or H/2 differential heads of value width 2d, as the model
builds them): IHA with the paper's FLOP-matched window N/(2P) virtual tokens (`L`) and
global (`I`); MHA global (`M`) and with a window (`S`, Global+Local); Talking-Heads
(`T`); differential (`D`); 2-simplicial with a window (`X`: global 2-simplicial is
O(N^3) and is timed only when `--simplicial_window 0`); bidirectional IHA-window
and MHA (encoders); and grouped-query IHA-window and MHA (`--kv_heads` G key/value heads,
default H/4: Llama 3 8B's ratio of 32 query heads over 8). Each row: fwd+bwd ms (best of
`--repeats`), the compiled program's peak temporary memory, model GFLOP/s (the project's
FLOP counting of the core and the head mixings, training = 3x forward) and the time ratio
to causal global MHA.

  python benchmarks/attention.py                     # B=2 N=1024 H=4 d=64 P=4, xla
  python benchmarks/attention.py --seq_len 2048 --only iha_window,mha
  python benchmarks/attention.py --heads 32 --kv_heads 8 --head_dim 16 \
    --only iha_window,iha_window_gqa,mha_gqa
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
from timing import call_times

from iha_jax import kinds, ops
from iha_jax.nn import AttentionConfig
from iha_jax.train.flops import core_flops_per_sequence, mixing_flops_per_token


def _fwd_bwd(fn):
  """Loss of a random projection of the output, differentiated w.r.t. every float input."""

  def loss(args, cotangent):
    return jnp.sum(fn(*args).astype(jnp.float32) * cotangent)

  return jax.jit(jax.value_and_grad(loss))


def _rows(a: argparse.Namespace) -> dict[str, tuple]:
  """name -> (AttentionConfig for the FLOP count, function, args)."""
  b, n, h, d, p = a.batch, a.seq_len, a.heads, a.head_dim, a.num_pseudo
  dtype = jnp.dtype(a.dtype)
  keys = iter(jax.random.split(jax.random.key(0), 32))
  normal = lambda *shape, scale=1.0: (scale * jax.random.normal(next(keys), shape)).astype(dtype)
  src = lambda: normal(b, n, h, d)
  eye = jnp.broadcast_to(jnp.eye(h)[:, :, None], (h, h, p))
  mixing = lambda scale: (eye * scale + 0.1 * normal(h, h, p)).astype(dtype)
  iha_args = (src(), src(), src(), mixing(1.0), mixing(1.0), mixing(1.0), mixing(1.0 / p))
  mha_args = (src(), src(), src())
  g = a.kv_heads or max(1, h // 4)
  kv = lambda: normal(b, n, g, d)
  kv_mixing = (jnp.broadcast_to(jnp.eye(g)[:, :, None], (g, g, p)) + 0.1 * normal(g, g, p)).astype(
    dtype
  )
  gqa_args = (src(), kv(), kv(), mixing(1.0), kv_mixing, kv_mixing, mixing(1.0 / p))
  iha_window = max(1, n // (2 * p))  # virtual tokens: N / (2 P^2) tokens
  mha_window = a.mha_window or max(1, n // 16)  # the paper: 512 at N = 8192
  x_window = a.simplicial_window or None
  talk = jnp.eye(h, dtype=dtype) + 0.1 * normal(h, h)
  hd = max(1, h // 2)
  # A kind without the asked implementation (e.g. no kernel for talking_heads) runs xla.
  impl_of = lambda kind: a.impl if a.impl in kinds.implementations(kind) else "xla"
  impl, th_impl, x_impl = (
    {"implementation": impl_of(kind)} for kind in ("mha", "talking_heads", "simplicial")
  )
  cfg = lambda kind, heads=h, **kw: AttentionConfig(d * h, heads, d, kind=kind, **kw)
  return {
    "iha_window": (
      cfg("iha", num_pseudo=p, window=iha_window),
      lambda *x: ops.iha_attention(*x, window=iha_window, **impl),
      iha_args,
    ),
    "iha_global": (cfg("iha", num_pseudo=p), lambda *x: ops.iha_attention(*x, **impl), iha_args),
    "mha": (cfg("mha"), lambda *x: ops.mha_attention(*x, **impl), mha_args),
    "mha_window": (
      cfg("mha", window=mha_window),
      lambda *x: ops.mha_attention(*x, window=mha_window, **impl),
      mha_args,
    ),
    "talking_heads": (
      cfg("talking_heads"),
      lambda *x: ops.talking_heads_attention(*x, **th_impl),
      (*mha_args, talk, talk.T),
    ),
    "diff": (
      cfg("diff", heads=hd),
      lambda *x: ops.diff_attention(*x, **impl),
      (
        normal(b, n, hd, 2, d),
        normal(b, n, hd, 2, d),
        normal(b, n, hd, 2 * d),
        jnp.full((hd,), 0.5, dtype),
      ),
    ),
    "simplicial": (
      cfg("simplicial", window=x_window),
      lambda *x: ops.simplicial_attention(*x, window=x_window, **x_impl),
      tuple(normal(b, n, h, d, scale=0.5) for _ in range(5)),
    ),
    "iha_window_bidirectional": (
      cfg("iha", num_pseudo=p, window=iha_window, causal=False),
      lambda *x: ops.iha_attention(*x, window=iha_window, causal=False, **impl),
      iha_args,
    ),
    "mha_bidirectional": (
      cfg("mha", causal=False),
      lambda *x: ops.mha_attention(*x, causal=False, **impl),
      mha_args,
    ),
    "iha_window_gqa": (
      cfg("iha", num_pseudo=p, window=iha_window, num_kv_heads=g),
      lambda *x: ops.iha_attention(*x, window=iha_window, **impl),
      gqa_args,
    ),
    "mha_gqa": (
      cfg("mha", num_kv_heads=g),
      lambda *x: ops.mha_attention(*x, **impl),
      (src(), kv(), kv()),
    ),
  }


def _label(name: str, acfg: AttentionConfig) -> str:
  window = "" if acfg.window is None else f" w={acfg.window}"
  groups = f" G={acfg.kv_heads}" if acfg.kv_heads != acfg.num_heads else ""
  return name + (f" P={acfg.num_pseudo}" if acfg.record.virtual_tokens else "") + groups + window


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batch", type=int, default=2)
  parser.add_argument("--seq_len", type=int, default=1024)
  parser.add_argument("--heads", type=int, default=4)
  parser.add_argument("--head_dim", type=int, default=64)
  parser.add_argument("--num_pseudo", type=int, default=4)
  parser.add_argument("--kv_heads", type=int, default=0, help="G of the *_gqa rows; 0: H/4")
  parser.add_argument("--mha_window", type=int, default=0, help="0: N / 16")
  parser.add_argument("--simplicial_window", type=int, default=64, help="0: global")
  parser.add_argument("--impl", default="xla", help="implementation (kinds without it: xla)")
  parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--only", default="", help="comma-separated row names (default: all)")
  args = parser.parse_args()

  rows = _rows(args)
  names = [r for r in args.only.split(",") if r] or list(rows)
  if "mha" not in names:
    names.insert(0, "mha")  # the reference row of every ratio
  results = {}
  for name in names:
    acfg, fn, fargs = rows[name]
    out = jax.eval_shape(fn, *fargs)
    cotangent = jax.random.normal(jax.random.key(1), out.shape, out.dtype)
    compiled = _fwd_bwd(fn).lower(fargs, cotangent).compile()
    memory = compiled.memory_analysis()
    temp = getattr(memory, "temp_size_in_bytes", float("nan")) if memory else float("nan")
    seconds = min(call_times(lambda: compiled(fargs, cotangent), args.repeats))
    n = args.seq_len
    flops = 3 * args.batch * (core_flops_per_sequence(acfg, n) + n * mixing_flops_per_token(acfg))
    results[name] = (_label(name, acfg), seconds, temp, flops / seconds / 1e9)

  print(
    f"backend={jax.default_backend()} impl={args.impl} dtype={args.dtype} "
    f"B={args.batch} N={args.seq_len} H={args.heads} d={args.head_dim}"
  )
  print(
    f"{'attention':<36}{'fwd+bwd ms':>12}{'peak temp MiB':>15}{'GFLOP/s':>10}{'time / mha':>12}"
  )
  base = results["mha"][1]
  for label, seconds, temp, gflops in results.values():
    print(
      f"{label:<36}{seconds * 1e3:>12.2f}{temp / 2**20:>15.1f}{gflops:>10.1f}"
      f"{seconds / base:>12.2f}"
    )


if __name__ == "__main__":
  main()
