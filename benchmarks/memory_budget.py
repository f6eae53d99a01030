"""Per-device memory budget of the paper-scale model on a pod, computed from shapes.

    python benchmarks/memory_budget.py [--config configs/iha_2p4b.py] [--seq_len 8192]

Nothing is allocated: parameter shapes come from `jax.eval_shape` of the model, and the
activations saved for backward are *traced*, not guessed: `saved_residuals` of one block of
each attention kind under each remat policy, with the implementation the target would run
(`pallas_tpu` on TPU, `pallas_gpu` on H100), so the kernels' own residuals are counted.

Per device, on an FSDP mesh (parameters, gradients and AdamW moments split over all
devices; batch split over devices; sequence unsharded):
- params, grads, adam: float32, 1x, 1x and 2x the parameter bytes / devices;
- gathered: one layer's float32 weights gathered by FSDP, twice (the next layer's
  all-gather overlaps the current layer);
- activations: per layer, what the remat policy saves (the block input included), times
  layers and the per-device microbatch;
- logits: float32 logits and their gradient, live together at the loss: one chunk
  `[b, c, V]` of `c = train.loss_chunk_tokens` positions and the chunked loss's float32
  sum of the head gradient `[V, D]` (`--loss_chunk_tokens`, default the config's; 0: the
  whole `[b, N, V]`, the plain loss).
XLA's own temporaries (fusion buffers, the recomputation inside one layer's backward)
come on top: read the "total" column as a lower bound and the headroom as what those
may use. Nothing here was run on a TPU or an H100.
"""

from __future__ import annotations

import argparse
import dataclasses
import runpy
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from jax._src.ad_checkpoint import saved_residuals  # pylint: disable=wrong-import-position

from iha_jax.kinds import effective_num_pseudo  # pylint: disable=wrong-import-position
from iha_jax.models import (
  FunctionalTransformerLM,  # pylint: disable=wrong-import-position
  count_params,  # pylint: disable=wrong-import-position
)
from iha_jax.train import config as config_lib  # pylint: disable=wrong-import-position
from iha_jax.train.losses import loss_chunk_tokens  # pylint: disable=wrong-import-position

GiB = 2**30
POLICIES = ("none", "save_projections", "full")


@dataclasses.dataclass(frozen=True)
class Target:
  name: str
  devices: int
  hbm_gib: float
  implementation: str


# v5p-128 is 64 chips (128 TensorCores) of 95 GiB HBM; an H100 SXM has 80 GB (74.5 GiB).
TARGETS = (
  Target("v5p-128", 64, 95.0, "pallas_tpu"),
  Target("8 x H100", 8, 80e9 / GiB, "pallas_gpu"),
)


def layer_activation_bytes(
  model: FunctionalTransformerLM, params: dict, index: int, seq_len: int
) -> int:
  """Bytes one sequence leaves saved for backward in block `index` (parameters and the
  shared segment ids / positions excluded; the block input included)."""
  config = model.config
  x = jax.ShapeDtypeStruct((1, seq_len, config.model_dim), config.dtype)
  ids = jax.ShapeDtypeStruct((1, seq_len), jnp.int32)
  block = model._block(index)  # pylint: disable=protected-access
  residuals = saved_residuals(
    lambda p, x, s, q: block(p, x, s, q), params["layers"][str(index)], x, ids, ids
  )
  return sum(
    aval.size * aval.dtype.itemsize
    for aval, source in residuals
    if not source.startswith(("from the argument p", "from the argument s", "from the argument q"))
  )


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--config", default="configs/iha_2p4b.py")
  parser.add_argument("--seq_len", type=int, default=None, help="default: the config's")
  parser.add_argument(
    "--vocab_size",
    type=int,
    default=128256,
    help="when the config reads it from a tokenizer file (Llama 3's)",
  )
  parser.add_argument(
    "--microbatch",
    type=int,
    nargs="+",
    default=[1, 2],
    help="sequences per device per forward/backward",
  )
  parser.add_argument(
    "--loss_chunk_tokens",
    type=int,
    default=None,
    help="positions per loss chunk (default: the config's; 0: whole logits)",
  )
  args = parser.parse_args()

  config = runpy.run_path(args.config)["get_config"]()
  if config.model.vocab_size == -1:
    config.model.vocab_size = args.vocab_size
  if args.seq_len:
    config.data.seq_len = args.seq_len
  seq_len = config.data.seq_len
  if args.loss_chunk_tokens is not None:
    config.train.loss_chunk_tokens = args.loss_chunk_tokens
  chunk = min(loss_chunk_tokens(config.train) or seq_len, seq_len)
  base = config_lib.model_config(config)
  n_params = count_params(base)
  schedule = base.attention_schedule
  print(
    f"{args.config}: {n_params / 1e9:.3f} B parameters, {base.num_layers} layers "
    f"'{schedule}', D={base.model_dim}, H={base.num_heads}, d={base.head_dim}, "
    f"P={effective_num_pseudo(base.num_pseudo, base.num_heads)}, V={base.vocab_size}, N={seq_len}, "
    f"loss chunk {chunk}, compute {jnp.dtype(base.dtype).name}, params float32\n"
  )

  # Traced once per (implementation, policy): one block per letter of the schedule.
  layer_bytes: dict[tuple[str, str], int] = {}
  for implementation in sorted({t.implementation for t in TARGETS}):
    cfg = dataclasses.replace(base, implementation=implementation, num_layers=len(schedule))
    for policy in POLICIES:
      model = FunctionalTransformerLM(cfg, remat=policy)
      params = jax.eval_shape(model.init, 0)
      start = time.perf_counter()
      per_letter = {
        letter: layer_activation_bytes(model, params, schedule.index(letter), seq_len)
        for letter in set(schedule)
      }
      counts = [per_letter[letter] for letter in (schedule * base.num_layers)[: base.num_layers]]
      layer_bytes[implementation, policy] = sum(counts)
      print(
        f"traced {implementation:10s} remat={policy:16s}: "
        + ", ".join(f"{k} {v / 2**20:.0f} MiB/layer/seq" for k, v in sorted(per_letter.items()))
        + f"  ({time.perf_counter() - start:.0f} s)"
      )

  per_layer_params = (n_params - base.vocab_size * base.model_dim) / base.num_layers
  header = (
    "\n| target | devices | HBM GiB | remat | microbatch | params | grads | adam "
    "| gathered | activations | logits | total GiB | headroom |"
  )
  print(header)
  print("|" + "---|" * 13)
  for target in TARGETS:
    shard = n_params * 4 / target.devices
    gathered = 2 * per_layer_params * 4
    for policy in POLICIES:
      for micro in args.microbatch:
        activations = layer_bytes[target.implementation, policy] * micro
        logits = 2 * micro * chunk * base.vocab_size * 4
        if chunk < seq_len:  # the chunked loss's float32 head-gradient sum
          logits += base.vocab_size * base.model_dim * 4
        parts = [shard, shard, 2 * shard, gathered, activations, logits]
        total = sum(parts) / GiB
        print(
          f"| {target.name} | {target.devices} | {target.hbm_gib:.1f} | {policy} | {micro} | "
          + " | ".join(f"{p / GiB:.2f}" for p in parts)
          + f" | {total:.1f} | {target.hbm_gib - total:+.1f} |"
        )
  print(
    "\nGlobal batch 128 x 8192 tokens (the paper's): on v5p-128 that is 2 sequences per "
    "chip per step; on 8 x H100, 16 per GPU, i.e. train.grad_accum_steps = 16 / microbatch."
  )


if __name__ == "__main__":
  main()
