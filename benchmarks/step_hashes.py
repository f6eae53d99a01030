"""Every shipped config's train step, lowered for CPU, TPU and H100: one hash per program.

    python benchmarks/step_hashes.py --commits e50b8ca,HEAD [--platforms cpu,tpu,cuda]
        [--configs iha_2p4b,default]

For each commit (a temporary git worktree, one subprocess per platform against that
tree's `iha_jax`) and each `configs/*.py`, builds the step as `train.py` does (model,
optimizer, shardings, remat, scan, gradient accumulation) on 8 devices: 8 CPU devices,
the 8 chips of a v5p-16 or an h100x8 host (compile-only), "auto" picking that platform's
kernels; lowers it (not compiled) and prints the sha256 of its
StableHLO with source locations stripped, the Pallas kernels' bodies (Mosaic bytecode,
Triton IR) included. Equal hashes mean the same programs, kernels included: a refactor
that keeps every hash changes no step's numbers or speed. Needs `make targets` for the
TPU and H100 columns. `model.vocab_size = -1` configs (a tokenizer's) lower at 32000.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLATFORMS = {"cpu": None, "tpu": "v5p-16", "cuda": "h100x8"}

_CHILD = r"""
import glob, hashlib, importlib, json, os, sys, warnings
warnings.simplefilter("ignore")
from jax._src import source_info_util
source_info_util.register_exclusion("/")  # no file or line in any location: code may move
import jax
platform, names, target = sys.argv[1], sys.argv[2].split(","), sys.argv[3] or None
from iha_jax import parallel
from iha_jax.kinds import registry
from iha_jax.models import FunctionalTransformerLM
from iha_jax.parallel import targets
from iha_jax.train import config as config_lib, lowering
from iha_jax.train.optimizer import make_optimizer
from iha_jax.train.state import abstract_state
devices = jax.devices("cpu") if target is None else targets.devices(targets.parse(target))
kernels = {"cpu": "cpu", "tpu": "tpu", "cuda": "gpu"}[platform]
out = {}
for name in names:
  try:
    config = importlib.import_module("configs." + name).get_config()
    if config.model.vocab_size == -1:
      config.model.vocab_size = 32000
    model_cfg = config_lib.validate(config, len(devices))
    mesh = parallel.create_mesh(dict(config.mesh), devices)
    model = FunctionalTransformerLM(
      model_cfg, remat=config.model.remat_policy, scan_layers=config.model.scan_layers
    )
    tx = make_optimizer(config.train)
    state, shardings = abstract_state(model, tx, mesh)
    with registry.auto_backend(kernels), targets.lowering_for(platform):
      lowered = lowering.lower_train_step(
        model, tx, config.train, config.train.get("loss", "cross_entropy"), mesh, state,
        shardings, config.data.seq_len,
      )
    text = lowered.as_text(debug_info=False)
    out[name] = hashlib.sha256(text.encode()).hexdigest()[:12]
  except Exception as error:  # a config this platform cannot lower: say which
    out[name] = "error: " + (str(error).strip().splitlines() or [type(error).__name__])[0][:80]
  print(json.dumps({name: out[name]}), flush=True)
"""

# The attention entry points alone, per Pallas implementation, forward and gradient:
# paths no shipped config's "auto" picks (the GPU window twin, splash) and shapes the
# configs lack (bidirectional, segments, GQA, d = 64, float32).
_KERNELS = r"""
import hashlib, json, sys, warnings
warnings.simplefilter("ignore")
from jax._src import source_info_util
source_info_util.register_exclusion("/")
import jax, jax.numpy as jnp
from iha_jax.ops import AttentionOptions, iha_attention, mha_attention
from iha_jax.parallel import targets
platform = sys.argv[1]
IMPLEMENTATIONS = {
  "tpu": ("pallas_tpu", "pallas_tpu_window", "splash"),
  "cuda": ("pallas_gpu", "pallas_gpu_mha", "pallas_gpu_window"),
}[platform]
# name: (kind, B, N, H, G, d, P, window, causal, segments, dtype)
CASES = {
  "window_p4": ("iha", 1, 8192, 20, 20, 128, 4, 1024, True, False, jnp.bfloat16),
  "window_p20": ("iha", 1, 8192, 20, 20, 128, 20, 204, True, False, jnp.bfloat16),
  "global_p4": ("iha", 1, 8192, 20, 20, 128, 4, None, True, False, jnp.bfloat16),
  "gqa_segments": ("iha", 2, 512, 8, 2, 64, 2, 256, True, True, jnp.bfloat16),
  "bidirectional": ("iha", 2, 200, 4, 4, 64, 2, 96, False, True, jnp.float32),
  "one_token_groups": ("iha", 1, 256, 9, 9, 64, 9, 96, True, False, jnp.bfloat16),
  "mha": ("mha", 1, 8192, 20, 20, 128, 1, None, True, False, jnp.bfloat16),
  "mha_window_gqa": ("mha", 2, 1024, 8, 2, 128, 1, 256, True, True, jnp.bfloat16),
}
for case, (kind, b, n, h, g, d, p, window, causal, segments, dtype) in CASES.items():
  for implementation in IMPLEMENTATIONS:
    for grad in (False, True):
      name = f"{case} {implementation} {'grad' if grad else 'fwd'}"
      try:
        q = jax.ShapeDtypeStruct((b, n, h, d), dtype)
        kv = jax.ShapeDtypeStruct((b, n, g, d), dtype)
        ids = jax.ShapeDtypeStruct((b, n), jnp.int32)
        shapes = ((h, h, p), (g, g, p), (g, g, p), (h, h, p))
        mixing = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]
        arrays = [q, kv, kv] + (mixing if kind == "iha" else [])
        entry = iha_attention if kind == "iha" else mha_attention
        def forward(*a):
          *a, seg = a
          options = AttentionOptions(window=window, causal=causal, implementation=implementation,
                                     segment_ids=seg if segments else None)
          return entry(*a, options)
        fn = forward
        if grad:
          fn = jax.grad(lambda *a: jnp.sum(forward(*a).astype(jnp.float32) ** 2),
                        argnums=tuple(range(len(arrays))))
        with targets.lowering_for(platform):
          lowered = jax.jit(fn).trace(*arrays, ids).lower(lowering_platforms=(platform,))
        text = lowered.as_text(debug_info=False)
        found = hashlib.sha256(text.encode()).hexdigest()[:12]
      except Exception as error:  # a shape the implementation refuses: the same before and after
        found = "error: " + (str(error).strip().splitlines() or [type(error).__name__])[0][:60]
      print(json.dumps({name: found}), flush=True)
"""


def shipped_configs(tree: str) -> list[str]:
  names = sorted(f[:-3] for f in os.listdir(os.path.join(tree, "configs")) if f.endswith(".py"))
  return [n for n in names if n not in ("__init__", "long_context")]  # long_context: a helper


def hashes(tree: str, platform: str, configs: list[str]) -> dict[str, str]:
  """`{config: hash}` of `configs` lowered for `platform` by the code in `tree`, and for
  "tpu-kernels" / "cuda-kernels" `{case: hash}` of the attention entry points."""
  env = dict(os.environ, PYTHONPATH=tree, JAX_PLATFORMS="cpu")
  env.setdefault("IHA_TARGETS_DIR", os.path.join(REPO, ".targets"))  # not in the worktree
  env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
  if platform.endswith("-kernels"):
    command = ["-c", _KERNELS, platform.split("-")[0]]
  else:
    command = ["-c", _CHILD, platform, ",".join(configs), PLATFORMS[platform] or ""]
  proc = subprocess.run(
    [sys.executable, *command], cwd=tree, env=env, capture_output=True, text=True
  )
  found = {}
  for line in proc.stdout.splitlines():
    if line.startswith("{"):
      found.update(json.loads(line))
  if proc.returncode and not found:
    tail = proc.stderr.strip().splitlines()
    return {name: "error: " + (tail[-1] if tail else f"exit {proc.returncode}") for name in configs}
  return found


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--commits", required=True, help="comma-separated commits (any git rev)")
  parser.add_argument(
    "--platforms",
    default="cpu,tpu,cuda,tpu-kernels,cuda-kernels",
    help="of cpu, tpu, cuda (the configs' steps), tpu-kernels, cuda-kernels (entry points)",
  )
  parser.add_argument("--configs", default="", help="comma-separated names (default: all)")
  parser.add_argument("--json", help="also write {commit: {platform: {config: hash}}} here")
  args = parser.parse_args()
  platforms = args.platforms.split(",")
  results: dict[str, dict[str, dict[str, str]]] = {}
  for commit in args.commits.split(","):
    with tempfile.TemporaryDirectory() as tmp:
      tree = os.path.join(tmp, "tree")
      subprocess.run(
        ["git", "-C", REPO, "worktree", "add", "-q", "--detach", tree, commit], check=True
      )
      try:
        configs = args.configs.split(",") if args.configs else shipped_configs(tree)
        results[commit] = {p: hashes(tree, p, configs) for p in platforms}
      finally:
        subprocess.run(["git", "-C", REPO, "worktree", "remove", "--force", tree], check=True)
  commits = list(results)
  print("Lowered train steps (StableHLO without locations, kernels included): sha256[:12]")
  print("| config | platform | " + " | ".join(commits) + " | equal |")
  print("| --- | --- | " + " | ".join("---" for _ in commits) + " | --- |")
  for platform in platforms:
    for config in sorted(results[commits[0]][platform]):
      row = [results[c][platform].get(config, "-") for c in commits]
      same = "NO" if len(set(row)) > 1 else "refused alike" if row[0].startswith("error") else "yes"
      print(f"| {config} | {platform} | " + " | ".join(row) + f" | {same} |")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(results, f, indent=1)


if __name__ == "__main__":
  main()
