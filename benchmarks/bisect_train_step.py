"""The CPU train step of IHA `LLLLM` and MHA `M` at several commits: program hashes and times.

    python benchmarks/bisect_train_step.py --commits 580c3a9,0bef34c,HEAD [--rounds 8]
        [--no_time]

For each commit (checked out into a temporary git worktree, run in a subprocess against
that tree's `iha_jax`), builds the 5-layer model of `configs/default.py` at D = 256, H = 4,
d = 64, MLP 1024, vocabulary 512, P = 4, window "auto" (N / 2P virtual tokens), N = 1024,
B = 4 on one CPU device, and prints the sha256 of each lowered train step (StableHLO
without locations: equal hashes mean the same program, so a commit between them cannot
have changed the step's speed) and, unless `--no_time`, the median step time of
`--rounds` alternating IHA / MHA steps after 2 warm-up steps, with their ratio. Times
are this machine's and vary between days: compare rows of one run. Works back to the
first training commit (the model class was `train.model.LanguageModel` there).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

_CHILD = r"""
import hashlib, importlib.util, json, os, sys, time
import jax, jax.numpy as jnp, numpy as np
from iha_jax import parallel
from iha_jax.train import config as config_lib
from iha_jax.train.optimizer import learning_rate_schedule, make_optimizer
from iha_jax.train.state import create_state
from iha_jax.train.step import make_train_step
try:
  from iha_jax.models import FunctionalTransformerLM as Model
except ImportError:
  try:
    from iha_jax.models import LanguageModel as Model
  except ImportError:
    from iha_jax.train.model import LanguageModel as Model

def build(schedule):
  spec = importlib.util.spec_from_file_location("default", "configs/default.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config()
  m = config.model
  m.num_layers, m.model_dim, m.num_heads, m.head_dim = 5, 256, 4, 64
  m.mlp_dim, m.vocab_size = 1024, 512
  m.attention_schedule = schedule
  m.num_pseudo = None if schedule == "M" else 4
  if schedule == "M":
    for key in ("window", "iha_window"):
      if key in m:
        setattr(m, key, None)
  config.data.seq_len, config.train.batch_size = 1024, 4
  model_cfg = config_lib.validate(config, jax.device_count())
  model = Model(model_cfg, remat=m.remat_policy, scan_layers=m.scan_layers)
  tx = make_optimizer(config.train)
  mesh = parallel.create_mesh(dict(config.mesh))
  state, shardings = create_state(model, tx, mesh, seed=0)
  b, n = 4, 1024
  tokens = jax.random.randint(jax.random.key(0), (b, n + 1), 1, 512)
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
           "weights": jnp.ones((b, n), jnp.float32), "segment_ids": jnp.ones((b, n), jnp.int32),
           "positions": jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n))}
  batch = jax.device_put(batch, parallel.batch_sharding(mesh))
  with parallel.activate(mesh):
    step = jax.jit(make_train_step(model, tx, learning_rate_schedule(config.train),
                                   config.train.grad_accum_steps),
                   in_shardings=(shardings, parallel.batch_sharding(mesh)),
                   out_shardings=(shardings, parallel.replicated(mesh)), donate_argnums=0)
    lowered = step.lower(state, batch)
  text = lowered.as_text(debug_info=False)
  return hashlib.sha256(text.encode()).hexdigest()[:12], [lowered.compile(), state, batch]

rounds = int(sys.argv[1])
out, built = {}, {}
for schedule in ("LLLLM", "M"):
  out[schedule + "_hlo"], built[schedule] = build(schedule)
times = {s: [] for s in built}
for i in range(2 + rounds if rounds else 0):
  for s, entry in built.items():
    start = time.perf_counter()
    entry[1], metrics = entry[0](entry[1], entry[2])
    jax.block_until_ready(metrics)
    if i >= 2:
      times[s].append(time.perf_counter() - start)
if rounds:
  for s in built:
    out[s + "_ms"] = round(1e3 * float(np.median(times[s])), 1)
  out["ratio"] = round(out["LLLLM_ms"] / out["M_ms"], 3)
print(json.dumps(out))
"""


def measure(repo: str, commit: str, rounds: int) -> dict:
  """Runs the child program in a worktree of `commit`; returns its JSON line."""
  with tempfile.TemporaryDirectory() as tmp:
    tree = os.path.join(tmp, "tree")
    subprocess.run(
      ["git", "-C", repo, "worktree", "add", "-q", "--detach", tree, commit], check=True
    )
    try:
      env = dict(os.environ, PYTHONPATH=tree, JAX_PLATFORMS="cpu")
      proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(rounds)],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
      )
    finally:
      subprocess.run(["git", "-C", repo, "worktree", "remove", "--force", tree], check=True)
  if proc.returncode:
    return {"error": proc.stderr.strip().splitlines()[-1]}
  return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--commits", required=True, help="comma-separated commits (any git rev)")
  parser.add_argument("--rounds", type=int, default=8, help="timed steps per model")
  parser.add_argument("--no_time", action="store_true", help="hashes only")
  args = parser.parse_args()
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  rounds = 0 if args.no_time else args.rounds
  print("CPU train step, 5 layers, D=256, N=1024, B=4, P=4 (times: this machine, this run)")
  print("| commit | LLLLM program | M program | LLLLM ms | M ms | ratio |")
  print("| --- | --- | --- | --- | --- | --- |")
  for commit in args.commits.split(","):
    r = measure(repo, commit, rounds)
    if "error" in r:
      print(f"| {commit} | {r['error']} | | | | |")
      continue
    row = [r["LLLLM_hlo"], r["M_hlo"]] + [str(r.get(k, "-")) for k in ("LLLLM_ms", "M_ms", "ratio")]
    print(f"| {commit} | " + " | ".join(row) + " |", flush=True)


if __name__ == "__main__":
  main()
