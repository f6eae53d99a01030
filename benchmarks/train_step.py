"""Train-step throughput of configs/default.py (IHA) and its MHA twin, side by side.

    python benchmarks/train_step.py [--steps 30]
        [--configs configs/default.py,configs/mha_default.py]

Times the compiled, sharded train step (synthetic tokens, so no input pipeline) on the
current backend and prints tokens/s, model TFLOP/s per device (docs/design.md §2 FLOPs),
MFU and the IHA / MHA step-time ratio (target: at most 1.3).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from iha_jax import parallel  # noqa: E402
from iha_jax.models import FunctionalTransformerLM  # noqa: E402
from iha_jax.train import config as config_lib  # noqa: E402
from iha_jax.train import flops  # noqa: E402
from iha_jax.train.optimizer import learning_rate_schedule, make_optimizer  # noqa: E402
from iha_jax.train.state import create_state  # noqa: E402
from iha_jax.train.step import make_train_step  # noqa: E402


def load_config(path: str):
  spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def benchmark(
  path: str, steps: int, peak: float, segments: bool = True, implementation: str | None = None
) -> dict[str, float]:
  """Median step time of `steps` timed steps after 3 warm-up steps; `segments`: the batch
  carries segment ids and positions as packed data does (else one document per row, the
  case GPU attention can hand to cuDNN); `implementation`: every attention layer's, in
  place of the config's `model.implementation`."""
  config = load_config(path)
  if implementation:
    config.model.implementation = implementation
  model_cfg = config_lib.validate(config, jax.device_count())
  model = FunctionalTransformerLM(
    model_cfg, remat=config.model.remat_policy, scan_layers=config.model.scan_layers
  )
  tx = make_optimizer(config.train)
  mesh = parallel.create_mesh(dict(config.mesh))
  state, shardings = create_state(model, tx, mesh, seed=0)
  b, n = config.train.batch_size, config.data.seq_len
  tokens = jax.random.randint(jax.random.key(0), (b, n + 1), 1, model_cfg.vocab_size)
  batch = {
    "inputs": tokens[:, :-1],
    "targets": tokens[:, 1:],
    "weights": jnp.ones((b, n), jnp.float32),
  }
  if segments:
    batch["segment_ids"] = jnp.ones((b, n), jnp.int32)
    batch["positions"] = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n))
  batch = jax.device_put(batch, parallel.batch_sharding(mesh))
  with parallel.activate(mesh):
    step = jax.jit(
      make_train_step(
        model, tx, learning_rate_schedule(config.train), config.train.grad_accum_steps
      ),
      in_shardings=(shardings, parallel.batch_sharding(mesh)),
      out_shardings=(shardings, parallel.replicated(mesh)),
      donate_argnums=0,
    )
    times = []
    for i in range(steps + 3):
      start = time.perf_counter()
      state, metrics = step(state, batch)
      jax.block_until_ready(metrics)
      if i >= 3:
        times.append(time.perf_counter() - start)
  step_time = float(np.median(times))
  tflops = flops.train_flops_per_step(model_cfg, b, n) / step_time / mesh.size / 1e12
  return {
    "config": path + (f" ({implementation})" if implementation else ""),
    "schedule": model_cfg.attention_schedule,
    "step_time_ms": 1e3 * step_time,
    "tokens_per_sec": b * n / step_time,
    "tflops_per_sec_per_device": tflops,
    "mfu": tflops / peak,
    "segments": segments,
    "gflop_per_step": flops.train_flops_per_step(model_cfg, b, n) / 1e9,
  }


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--configs", default="configs/default.py,configs/mha_default.py")
  parser.add_argument("--steps", type=int, default=30)
  parser.add_argument(
    "--no_segments",
    action="store_true",
    help="batches without segment ids (one document per row): GPU attention may use cuDNN",
  )
  parser.add_argument(
    "--implementation",
    default=None,
    help="attention implementation of every layer (default: each config's, e.g. auto)",
  )
  args = parser.parse_args()
  peak, source = flops.peak_tflops_per_device()
  if jax.default_backend() in ("gpu", "tpu"):
    rate = flops.measured_matmul_tflops(size=8192, dtype=jnp.bfloat16, repeats=10)
    peak, source = rate, "measured: 8192^3 bf16 matmul, best of 10"
  print(
    f"backend {jax.default_backend()}, {jax.device_count()} device(s), "
    f"peak {peak:.4g} TFLOP/s per device ({source}); MFU is against it"
  )
  keys = (
    "schedule",
    "segments",
    "step_time_ms",
    "tokens_per_sec",
    "tflops_per_sec_per_device",
    "mfu",
    "gflop_per_step",
  )
  print(f"{'config':28s}" + "".join(f"{k:>28s}" for k in keys))
  rows = []
  for path in args.configs.split(","):
    # Each row as soon as it is measured: a run cut short keeps what it finished.
    row = benchmark(
      path, args.steps, peak, segments=not args.no_segments, implementation=args.implementation
    )
    rows.append(row)
    cells = (
      f"{row[k]:>28.4g}" if isinstance(row[k], float) else f"{str(row[k]):>28s}" for k in keys
    )
    print(f"{row['config']:28s}" + "".join(cells), flush=True)
  if len(rows) == 2:
    ratio = rows[0]["step_time_ms"] / rows[1]["step_time_ms"]
    print(f"step-time ratio {rows[0]['config']} / {rows[1]['config']}: {ratio:.3f} (target <= 1.3)")
  print(json.dumps(rows))


if __name__ == "__main__":
  main()
