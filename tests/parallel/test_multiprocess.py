"""2 processes x 2 CPU devices (gloo, 127.0.0.1) train exactly like 1 process x 4 devices."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

from configs import tiny
from iha_jax import data as data_lib
from iha_jax import parallel
from iha_jax.models import FunctionalTransformerLM
from iha_jax.train import config as config_lib
from iha_jax.train.inputs import prepare
from iha_jax.train.optimizer import learning_rate_schedule, make_optimizer
from iha_jax.train.state import create_state
from iha_jax.train.step import make_train_step
from tests.fixtures import REPO_ROOT

ROOT = str(REPO_ROOT)
STEPS = 4


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _reference_losses(config) -> list[float]:
  """One process, 4 devices, fed the concatenation of the two processes' shards."""
  model = FunctionalTransformerLM(config_lib.validate(config, 4))
  tx = make_optimizer(config.train)
  mesh = parallel.create_mesh(dict(data=1, fsdp=4, tensor=1), jax.devices()[:4])
  state, shardings = create_state(model, tx, mesh, config.train.seed)
  shards = [
    data_lib.make_dataset(
      config.data,
      "train",
      global_batch_size=config.train.batch_size,
      seed=config.train.seed,
      shard_index=i,
      shard_count=2,
    )
    for i in range(2)
  ]
  batch_sharding = parallel.batch_sharding(mesh)
  losses = []
  with parallel.activate(mesh):
    step = jax.jit(
      make_train_step(model, tx, learning_rate_schedule(config.train), 1),
      in_shardings=(shardings, batch_sharding),
      donate_argnums=0,
    )
    for _ in range(STEPS):
      parts = [next(it) for it in shards]
      batch = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
      state, metrics = step(state, jax.device_put(batch, batch_sharding))
      losses.append(float(metrics["loss"]))
  return losses


@pytest.mark.full
def test_two_processes_match_one_process(tmp_path):
  data_dir, workdir = str(tmp_path / "data"), str(tmp_path / "run")
  config = tiny.get_config()
  config.data.data_dir = data_dir
  config.train.total_steps = STEPS
  config.mesh.update(data=1, fsdp=4, tensor=1)
  config.checkpoint.every = STEPS
  prepare(config)  # once, before the processes start

  port = _free_port()
  env = {
    **os.environ,
    "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
    "JAX_PLATFORMS": "cpu",
    "JAX_DEFAULT_MATMUL_PRECISION": "highest",
  }
  args = [
    sys.executable,
    os.path.join(ROOT, "train.py"),
    "--config",
    os.path.join(ROOT, "configs", "tiny.py"),
    "--workdir",
    workdir,
    f"--config.data.data_dir={data_dir}",
    f"--config.train.total_steps={STEPS}",
    "--config.mesh.fsdp=4",
    f"--config.checkpoint.every={STEPS}",
    f"--coordinator_address=127.0.0.1:{port}",
    "--num_processes=2",
  ]
  procs = [
    subprocess.Popen(
      args + [f"--process_id={i}"],
      cwd=ROOT,
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    for i in range(2)
  ]
  outputs = [p.communicate(timeout=300)[0] for p in procs]
  for p, out in zip(procs, outputs):
    assert p.returncode == 0, out[-3000:]

  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    records = [json.loads(line) for line in f]
  assert [r["step"] for r in records] == list(range(1, STEPS + 1))
  assert os.path.isdir(os.path.join(workdir, "checkpoints", str(STEPS), "data"))
  np.testing.assert_allclose([r["loss"] for r in records], _reference_losses(config), rtol=2e-5)
