"""Fused IHA kernels vs the XLA path vs materialised pseudo q/k/v + MHA kernels / cuDNN.

Rows: layer kind (window IHA, global IHA, global MHA) x implementation x pass
(forward, forward+backward). Reports median milliseconds, TFLOP/s with the
docs/design.md §2 count (attention core only: visible query-key pairs per head
x 4d FLOPs forward, x3 for training) and the compiled peak memory
(arguments + outputs + temporaries - aliases, from `memory_analysis()`).

Implementations:
- pallas_gpu / pallas_tpu: the Pallas kernels (pseudo q/k/v by einsums in HBM, flash
  attention over the virtual rows, the backward remaking pseudo q/k/v rather than saving
  them).
- xla: the pure-JAX blockwise path (materialises pseudo q/k/v).
- pallas_gpu_mha: materialised pseudo q/k/v + the Pallas MHA kernel over the virtual
  sequence, given segment ids (the packed-data case, which cuDNN's path does not take).
- pallas_gpu_window (window layers; by `--impls` only): IHA's on-chip GPU window path
  (`iha_jax.kernels.window.gpu`: pseudo-heads mixed, attended and collapsed on chip,
  forward and backward).
- cudnn: materialised pseudo q/k/v + `jax.nn.dot_product_attention(
  implementation="cudnn", is_causal=True, local_window_size=...)` (the library's
  `implementation="cudnn"`, iha_jax/core/cudnn_attention.py).
Rows that cannot run here print one "skip" line saying why. `--small` runs a
tiny shape on any backend (Pallas rows in interpret mode off their platform).

  python benchmarks/kernels.py            # paper shape: B=1, N=8192, H=20, d=128, P=4
  python benchmarks/kernels.py --small    # CPU smoke test
  python benchmarks/kernels.py --num_pseudo 20  # the paper's default P = H = 20
  python benchmarks/kernels.py --kv_heads 5  # grouped-query: 20 query heads over 5 key/value
  python benchmarks/kernels.py --num_pseudo 20 --layers window_iha \
    --impls pallas_gpu_window,pallas_gpu,cudnn  # the on-chip window path against both

The first line is the device's measured dense matmul rate (a square matmul in the
run's dtype); the "% mm" column is each row's TFLOP/s as a share of it.
"""

from __future__ import annotations

import argparse
import statistics

import jax
import jax.numpy as jnp
from timing import call_times

from iha_jax.ops import iha_attention, mha_attention
from iha_jax.train.flops import causal_pairs

IMPLEMENTATIONS = ("pallas_gpu", "pallas_gpu_mha", "pallas_tpu", "xla", "cudnn")


def attention_flops(
  b: int, n: int, h: int, d: int, p: int, window: int | None, train: bool
) -> float:
  """docs/design.md §2: 4d FLOPs per visible pair, x3 for forward + backward."""
  return b * h * causal_pairs(n * p, window) * 4 * d * (3 if train else 1)


def _one_document(q):
  return jnp.ones(q.shape[:2], jnp.int32)


def layer_fn(kind: str, implementation: str, window: int | None):
  """f(q, k, v, alphas..., collapse) -> [B, N, H, d] for one layer kind."""
  if implementation == "pallas_gpu_mha" and kind == "iha":
    # With segment ids (one document per row): the packed-data case "auto" picks it for.
    return lambda *a: iha_attention(
      *a, window=window, implementation=implementation, segment_ids=_one_document(a[0])
    )
  if kind == "mha":
    return lambda q, k, v, *_: mha_attention(q, k, v, implementation=implementation)
  return lambda *a: iha_attention(*a, window=window, implementation=implementation)


def skip_reason(implementation: str, small: bool, window: int | None = None) -> str | None:
  backend = jax.default_backend()
  if implementation == "cudnn" and backend != "gpu":
    return "cuDNN attention needs a CUDA GPU"
  if implementation == "pallas_gpu_window" and window is None:
    return "the on-chip window path takes window layers only"
  native = {
    "pallas_gpu": "gpu",
    "pallas_gpu_mha": "gpu",
    "pallas_gpu_window": "gpu",
    "pallas_tpu": "tpu",
  }.get(implementation)
  if native and backend != native and not small:
    return f"{implementation} off its platform runs interpreted (use --small)"
  return None


def peak_bytes(compiled) -> int | None:
  stats = compiled.memory_analysis()
  if stats is None:
    return None
  return (
    stats.argument_size_in_bytes
    + stats.output_size_in_bytes
    + stats.temp_size_in_bytes
    - stats.alias_size_in_bytes
  )


def bench(fn, args, iters: int) -> tuple[float, int | None]:
  """(median ms, peak bytes) of a jitted fn."""
  compiled = jax.jit(fn).lower(*args).compile()
  times = call_times(lambda: compiled(*args), iters)
  return 1e3 * statistics.median(times), peak_bytes(compiled)


def matmul_tflops(dtype, size: int, iters: int) -> float:
  """Measured dense matmul rate of this device: a `[size, size] @ [size, size]` product."""
  a, b = (jax.random.normal(jax.random.key(i), (size, size), dtype) for i in range(2))
  ms, _ = bench(jnp.matmul, [a, b], iters)
  return 2 * size**3 / (ms * 1e-3) / 1e12


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--small", action="store_true", help="tiny shape (CPU smoke test)")
  parser.add_argument("--iters", type=int, default=10)
  parser.add_argument("--dtype", default="bfloat16")
  parser.add_argument(
    "--num_pseudo", type=int, default=4, help="P (docs/design.md §4: 4 or H = 20)"
  )
  parser.add_argument("--kv_heads", type=int, default=0, help="G key/value heads (0: G = H)")
  parser.add_argument("--layers", default="window_iha,global_iha,global_mha")
  parser.add_argument("--impls", default=",".join(IMPLEMENTATIONS))
  cli = parser.parse_args()
  b, n, h, d, p = (
    (1, 64, 2, 32, min(cli.num_pseudo, 4)) if cli.small else (1, 8192, 20, 128, cli.num_pseudo)
  )
  iters = 2 if cli.small else cli.iters
  dtype = jnp.dtype(cli.dtype)
  g = cli.kv_heads or h
  keys = jax.random.split(jax.random.key(0), 7)
  qkv = [jax.random.normal(keys[i], (b, n, x, d), dtype) for i, x in enumerate((h, g, g))]
  mixing = [
    jax.random.normal(keys[3 + i], (x, x, p), dtype) / x for i, x in enumerate((h, g, g, h))
  ]
  # docs/design.md §2: window layers use N/(2P) virtual tokens.
  layers = {"window_iha": (p, n // (2 * p)), "global_iha": (p, None), "global_mha": (1, None)}
  peak = matmul_tflops(dtype, 512 if cli.small else 8192, iters)
  print(
    f"backend={jax.default_backend()} B={b} N={n} H={h} G={g} d={d} P={p} dtype={dtype.name} "
    f"matmul={peak:.2f} TFLOP/s"
  )
  print(
    f"{'layer':<11} {'impl':<18} {'pass':<9} {'ms':>9} {'TFLOP/s':>8} {'% mm':>5} {'peak MiB':>9}"
  )
  layers = {name: layers[name] for name in cli.layers.split(",")}
  for layer, (pseudo, window) in layers.items():
    kind = "mha" if layer.endswith("mha") else "iha"
    args = qkv + ([m[..., :pseudo] for m in mixing] if kind == "iha" else [])
    for implementation in cli.impls.split(","):
      reason = skip_reason(implementation, cli.small, window if kind == "iha" else None)
      for train in (False, True):
        name = "fwd+bwd" if train else "fwd"
        if reason:
          print(f"{layer:<11} {implementation:<18} {name:<9} skip: {reason}")
          continue
        f = layer_fn(kind, implementation, window)
        if train:
          loss = lambda *a, f=f: jnp.sum(f(*a).astype(jnp.float32))
          f = jax.grad(loss, argnums=tuple(range(len(args))))
        try:
          ms, memory = bench(f, args, iters)
        except Exception as error:  # pylint: disable=broad-except
          # One row failing to compile or run (e.g. out of memory) must not hide the rest.
          print(
            f"{layer:<11} {implementation:<18} {name:<9} failed: "
            f"{type(error).__name__}: {str(error).splitlines()[0][:120]}"
          )
          continue
        tflops = attention_flops(b, n, h, d, pseudo, window, train) / (ms * 1e-3) / 1e12
        mib = "n/a" if memory is None else f"{memory / 2**20:.1f}"
        print(
          f"{layer:<11} {implementation:<18} {name:<9} {ms:9.3f} {tflops:8.2f} "
          f"{100 * tflops / peak:5.1f} {mib:>9}"
        )


if __name__ == "__main__":
  main()
