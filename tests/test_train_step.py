"""The train step: gradient accumulation, remat policies and scan-over-layers change
nothing but memory; sharded steps equal the single-device step."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from iha_jax import parallel
from iha_jax.models import TransformerConfig
from iha_jax.train.model import LanguageModel
from iha_jax.train.optimizer import learning_rate_schedule, make_optimizer
from iha_jax.train.state import create_state
from iha_jax.train.step import make_train_step

MODEL = TransformerConfig(vocab_size=40, num_layers=4, model_dim=32, num_heads=4, head_dim=8,
                          mlp_dim=64, num_pseudo=2, attention_schedule="LIM", iha_window=12,
                          implementation="xla")
TRAIN = ml_collections.ConfigDict(dict(
    learning_rate=1e-2, final_learning_rate=1e-4, warmup_steps=1, total_steps=10,
    weight_decay=0.1, b1=0.9, b2=0.95, eps=1e-8, grad_clip=1.0))


def _batch(b: int = 8, n: int = 16) -> dict[str, jax.Array]:
  keys = jax.random.split(jax.random.key(7), 3)
  tokens = jax.random.randint(keys[0], (b, n + 1), 1, MODEL.vocab_size)
  weights = (jax.random.uniform(keys[1], (b, n)) < 0.7).astype(jnp.float32)
  segment_ids = jnp.where(jnp.arange(n) < n - 2 * (jnp.arange(b)[:, None] % 2), 1, 0)
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "weights": weights * segment_ids,
          "segment_ids": segment_ids.astype(jnp.int32),
          "positions": jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n))}


def _run(mesh_sizes=None, *, accum: int = 1, remat: str = "none", scan: bool = False,
         steps: int = 2) -> list[float]:
  """Losses of `steps` train steps on the same batch, starting from seed 0."""
  mesh = parallel.create_mesh(mesh_sizes or dict(data=1, fsdp=1, tensor=1))
  model = LanguageModel(MODEL, remat=remat, scan_layers=scan)
  tx = make_optimizer(TRAIN)
  state, shardings = create_state(model, tx, mesh, seed=0)
  batch_sharding = parallel.batch_sharding(mesh)
  with parallel.activate(mesh):
    step = jax.jit(make_train_step(model, tx, learning_rate_schedule(TRAIN), accum),
                   in_shardings=(shardings, batch_sharding), donate_argnums=0)
    batch = jax.device_put(_batch(), batch_sharding)
    out = []
    for _ in range(steps):
      state, metrics = step(state, batch)
      out.append(float(metrics["loss"]))
  return out


@pytest.fixture(scope="module")
def baseline() -> list[float]:
  return _run()


@pytest.mark.parametrize("options", [
    dict(accum=4), dict(remat="full"), dict(scan=True, remat="save_projections"),
    dict(mesh_sizes=dict(data=2, fsdp=2, tensor=2), accum=2),
    dict(mesh_sizes=dict(data=1, fsdp=2, tensor=4), scan=True),
])
def test_step_matches_baseline(baseline, options):
  np.testing.assert_allclose(_run(**options), baseline, rtol=2e-5)


def test_scan_layout_stacks_schedule_periods():
  model = LanguageModel(MODEL, scan_layers=True)
  params = jax.eval_shape(model.init, jnp.uint32(0))
  # 4 layers of "LIM": one scanned period of 3, then layer 3 unscanned.
  assert sorted(params["scanned"]) == ["0", "1", "2"]
  assert sorted(params["layers"]) == ["3"]
  assert params["scanned"]["0"]["attn"]["alpha_q"].shape == (1, 4, 4, 2)
