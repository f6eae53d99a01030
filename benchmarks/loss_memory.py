"""Temporaries of the compiled train step, plain loss vs chunked loss, on this CPU.

    python benchmarks/loss_memory.py [--config configs/global_2p4b.py] [--layers 1]
        [--seq_len 8192 65536] [--chunks 0 2048 1024 512] [--rows 1]

Compiles (never runs) the real train step (`make_train_step`: loss, gradients, AdamW) of
the config's model cut to `--layers` layers, so the output head and the loss dominate:
the paper's width and Llama 3's vocabulary (V = 128256) at the config's remat. One
device, `--rows` sequences per step (a device's microbatch). Prints, per sequence
length and `train.loss_chunk_tokens` (0: the plain loss), XLA's temporary bytes
(`compiled.memory_analysis()`), the largest float32 buffer of the optimized HLO, and
the size of the whole float32 logits `[rows, N, V]` for reference. XLA:CPU's buffer
assignment is not a TPU's or GPU's; `train.py --compile_only` gives the targets' own.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import runpy
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from iha_jax.models import FunctionalTransformerLM  # noqa: E402
from iha_jax.train import config as config_lib  # noqa: E402
from iha_jax.train.optimizer import learning_rate_schedule, make_optimizer  # noqa: E402
from iha_jax.train.state import TrainState  # noqa: E402
from iha_jax.train.step import make_train_step  # noqa: E402

GiB = 2**30


def largest_f32(hlo: str) -> int:
  """Bytes of the largest float32 array in HLO text."""
  sizes = [np.prod([int(x) for x in d.split(",")]) for d in re.findall(r"\bf32\[([\d,]+)\]", hlo)]
  return int(max(sizes)) * 4


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--config", default="configs/global_2p4b.py")
  parser.add_argument("--layers", type=int, default=1)
  parser.add_argument("--seq_len", type=int, nargs="+", default=[8192])
  parser.add_argument("--chunks", type=int, nargs="+", default=[0, 2048, 1024, 512])
  parser.add_argument("--rows", type=int, default=1)
  parser.add_argument("--vocab_size", type=int, default=128256)
  args = parser.parse_args()

  config = runpy.run_path(args.config)["get_config"]()
  if config.model.vocab_size == -1:
    config.model.vocab_size = args.vocab_size
  schedule = config.model.attention_schedule
  model_cfg = dataclasses.replace(
    config_lib.model_config(config),
    num_layers=args.layers,
    attention_schedule=schedule[-args.layers :] if args.layers < len(schedule) else schedule,
    implementation="xla",
  )
  model = FunctionalTransformerLM(model_cfg, remat=config.model.remat_policy)
  tx = make_optimizer(config.train)
  params = jax.eval_shape(model.init, 0)
  state = TrainState(
    step=jax.ShapeDtypeStruct((), jnp.int32),
    params=params,
    opt_state=jax.eval_shape(tx.init, params),
  )
  print(
    f"{args.config} cut to {args.layers} layer(s) '{model_cfg.attention_schedule}': "
    f"D={model_cfg.model_dim}, V={model_cfg.vocab_size}, remat {config.model.remat_policy}, "
    f"{args.rows} row(s), compute {jnp.dtype(model_cfg.dtype).name}; XLA:CPU, jax {jax.__version__}"
  )
  print(
    "\n| N | loss_chunk_tokens | temporaries GiB | largest f32 buffer GiB | f32 logits GiB "
    "| compile s |"
  )
  print("|---|---|---|---|---|---|")
  for n in args.seq_len:
    spec = lambda dtype, n=n: jax.ShapeDtypeStruct((args.rows, n), dtype)  # noqa: E731
    batch = {k: spec(jnp.int32) for k in ("inputs", "targets", "segment_ids", "positions")}
    batch["weights"] = spec(jnp.float32)
    logits = args.rows * n * model_cfg.vocab_size * 4
    for chunk in args.chunks:
      start = time.perf_counter()
      step = make_train_step(
        model, tx, learning_rate_schedule(config.train), 1, loss_chunk_tokens=chunk
      )
      compiled = jax.jit(step, donate_argnums=0).lower(state, batch).compile()
      temp = compiled.memory_analysis().temp_size_in_bytes
      print(
        f"| {n} | {chunk or 'plain'} | {temp / GiB:.2f} | "
        f"{largest_f32(compiled.as_text()) / GiB:.2f} | {logits / GiB:.2f} | "
        f"{time.perf_counter() - start:.0f} |",
        flush=True,
      )


if __name__ == "__main__":
  main()
