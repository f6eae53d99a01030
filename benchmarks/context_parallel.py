"""Context parallelism: attention work per sequence shard, contiguous vs balanced layout,
the source key/value traffic per layer, and the step time on fake CPU devices.

    python benchmarks/context_parallel.py [--seq_len 65536] [--shards 8] [--num_pseudo 4]
        [--time_seq_len 512] [--time_shards 8]

Work per shard counts the query-key pairs of one head that the shard's queries see (a
layer's attention FLOPs are `4d` times that, per head), for a causal global IHA layer
(virtual tokens, P per token), a window layer (the paper's `N / (2P)` virtual tokens) and
a global MHA layer; "visited tiles" is what the XLA path actually computes per shard (its
key tiles per query tile from the index vectors). The timing runs one small model's
train-step forward+backward on `--time_shards` fake CPU devices, which share this
machine's cores: the time reflects the total work, not the slowest shard, so only the
per-shard counts show the balance a real pod would see.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.timing import call_times  # noqa: E402
from iha_jax import parallel  # noqa: E402
from iha_jax.core import xla_attention  # noqa: E402
from iha_jax.models import FunctionalTransformerLM, TransformerConfig  # noqa: E402
from iha_jax.parallel import context  # noqa: E402
from iha_jax.train.losses import loss_terms  # noqa: E402


def shard_pairs(n: int, shards: int, window: int | None, num_pseudo: int, balanced: bool):
  """Visible causal (query, key) pairs of one head per shard, over `n * num_pseudo` virtual
  positions; `window` in virtual tokens."""
  chunks = 2 if balanced else 1
  order = context.chunk_order(shards, chunks).reshape(shards, chunks)
  length = n * num_pseudo // (shards * chunks)  # virtual positions per chunk
  out = []
  for s in range(shards):
    total = 0
    for chunk in order[s]:
      t = np.arange(chunk * length, (chunk + 1) * length, dtype=np.int64)
      keys = t + 1 if window is None else np.minimum(t + 1, window)
      total += int(keys.sum())
    out.append(total)
  return np.asarray(out)


def shard_tiles(n: int, shards: int, window: int | None, num_pseudo: int, balanced: bool):
  """Key tiles the XLA path visits per shard (sum over its query tiles): a causal layer
  against the whole sequence (global) or its halo (window)."""
  chunks = 2 if balanced else 1
  order = context.chunk_order(shards, chunks).reshape(shards, chunks)
  c = n * num_pseudo // (shards * chunks)
  reach = None if window is None else window - 1
  out = []
  for s in range(shards):
    total = 0
    for chunk in order[s]:
      start = chunk * c
      if reach is None:
        k_index = np.arange(n * num_pseudo)
      else:
        k_index = np.arange(max(0, start - reach), start + c)
      q_index = np.arange(start, start + c)
      block = xla_attention.default_block_size(len(q_index), window)
      bk = xla_attention.default_block_size(len(k_index), window)
      pad_q = -len(q_index) % block
      pad_k = -len(k_index) % bk
      qi = np.pad(q_index, (0, pad_q), mode="edge")
      ki = np.pad(k_index, (0, pad_k), constant_values=2**30)
      lo, hi, _, _ = xla_attention.block_ranges(qi, ki, block, bk, window, True)
      total += int(np.sum(np.asarray(hi) - np.asarray(lo)))
    out.append(total)
  return np.asarray(out)


def _row(name: str, counts: np.ndarray) -> str:
  return f"| {name} | {counts.min():,} | {counts.max():,} | {counts.max() / counts.mean():.2f} |"


def work_tables(n: int, shards: int, p: int) -> None:
  window = n // (2 * p) * 1  # the paper's window: N / (2P) virtual tokens
  cases = [
    ("global IHA (I), causal", None, p),
    (f"window IHA (L), {window} virtual", window, p),
    ("global MHA (M), causal", None, 1),
  ]
  print(f"\nN = {n} tokens, {shards} context shards, P = {p}")
  for title, fn in (
    ("visible pairs per head", shard_pairs),
    ("XLA key tiles visited", shard_tiles),
  ):
    print(f"\n{title} per shard (min, max, max / mean):\n")
    print("| layer, layout | min | max | max/mean |\n| --- | --- | --- | --- |")
    for name, w, per in cases:
      for balanced in (False, True):
        counts = fn(n, shards, w, per, balanced)
        print(_row(f"{name}, {'balanced' if balanced else 'contiguous'}", counts))
  print("\nsource k/v tokens received per device per layer (contiguous layout):\n")
  print("| layer | tokens | of N |\n| --- | --- | --- |")
  for name, w, per in cases:
    got = context.received_tokens(n, w, per, shards)
    print(f"| {name} | {got:,} | {got / n:.3f} |")


def time_steps(n: int, shards: int, repeats: int) -> None:
  config = TransformerConfig(
    vocab_size=256,
    num_layers=5,
    model_dim=64,
    num_heads=4,
    head_dim=16,
    mlp_dim=128,
    num_pseudo=2,
    attention_schedule="LLLLI",
    iha_window=n // 4,
    implementation="xla",
  )
  model = FunctionalTransformerLM(config)
  params = model.init(0)
  rng = np.random.default_rng(0)
  tokens = rng.integers(1, 256, (2, n + 1))
  batch = {
    "inputs": tokens[:, :-1].astype(np.int32),
    "targets": tokens[:, 1:].astype(np.int32),
    "weights": np.ones((2, n), np.float32),
    "segment_ids": np.ones((2, n), np.int32),
    "positions": np.broadcast_to(np.arange(n, dtype=np.int32), (2, n)).copy(),
  }
  step = jax.value_and_grad(lambda p, b: loss_terms(model, p, b, chunk_tokens=None)[0])
  print(
    f"\ntrain step fwd+bwd, 5 layers LLLLI, N = {n}, B = 2, fake CPU devices "
    "(shared cores: total work, not the slowest shard):\n"
  )
  print("| mesh | layout | ms per step |\n| --- | --- | --- |")
  for sizes, layout in (
    (dict(data=1, fsdp=1, tensor=1), "contiguous"),
    (dict(data=1, fsdp=1, context=shards, tensor=1), "contiguous"),
    (dict(data=1, fsdp=1, context=shards, tensor=1), "balanced"),
  ):
    mesh = parallel.create_mesh(sizes)
    local = batch
    if layout == "balanced":
      local = {k: context.balance_tokens(v, shards) for k, v in batch.items()}
    with parallel.activate(mesh), context.layout(layout):
      placed = jax.device_put(local, parallel.batch_sharding(mesh))
      fn = jax.jit(step)
      times = call_times(lambda: fn(params, placed), repeats)
    name = ", ".join(f"{k}={v}" for k, v in sizes.items() if v > 1) or "one device"
    print(f"| {name} | {layout} | {1e3 * float(np.median(times)):.1f} |")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--seq_len", type=int, default=65536)
  parser.add_argument("--shards", type=int, default=8)
  parser.add_argument("--num_pseudo", type=int, default=4)
  parser.add_argument("--time_seq_len", type=int, default=512)
  parser.add_argument("--time_shards", type=int, default=8)
  parser.add_argument("--repeats", type=int, default=5)
  args = parser.parse_args()
  work_tables(args.seq_len, args.shards, args.num_pseudo)
  if args.time_seq_len:
    time_steps(args.time_seq_len, args.time_shards, args.repeats)


if __name__ == "__main__":
  main()
