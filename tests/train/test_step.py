"""The train step: gradient accumulation, remat policies and scan-over-layers change
nothing but memory; sharded steps equal the single-device step."""

from __future__ import annotations

import contextlib
import dataclasses
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.experimental.pallas import tpu as pltpu

from iha_jax import parallel
from iha_jax.models import FunctionalTransformerLM, TransformerConfig
from iha_jax.train import export
from iha_jax.train.evaluator import Evaluator
from iha_jax.train.losses import loss_terms
from iha_jax.train.optimizer import learning_rate_schedule, make_optimizer
from iha_jax.train.state import create_state
from iha_jax.train.step import make_train_step
from tests.fixtures import TRAIN, tiny_model

MODEL = tiny_model("LIM", num_layers=4)  # LIML


def _batch(b: int = 8, n: int = 16) -> dict[str, jax.Array]:
  keys = jax.random.split(jax.random.key(7), 3)
  tokens = jax.random.randint(keys[0], (b, n + 1), 1, MODEL.vocab_size)
  weights = (jax.random.uniform(keys[1], (b, n)) < 0.7).astype(jnp.float32)
  segment_ids = jnp.where(jnp.arange(n) < n - 2 * (jnp.arange(b)[:, None] % 2), 1, 0)
  return {
    "inputs": tokens[:, :-1],
    "targets": tokens[:, 1:],
    "weights": weights * segment_ids,
    "segment_ids": segment_ids.astype(jnp.int32),
    "positions": jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n)),
  }


def _run(
  mesh_sizes=None, *, accum: int = 1, remat: str = "none", scan: bool = False, steps: int = 2
) -> list[float]:
  """Losses of `steps` train steps on the same batch, starting from seed 0."""
  mesh = parallel.create_mesh(mesh_sizes or dict(data=1, fsdp=1, tensor=1))
  model = FunctionalTransformerLM(MODEL, remat=remat, scan_layers=scan)
  tx = make_optimizer(TRAIN)
  state, shardings = create_state(model, tx, mesh, seed=0)
  batch_sharding = parallel.batch_sharding(mesh)
  with parallel.activate(mesh):
    step = jax.jit(
      make_train_step(model, tx, learning_rate_schedule(TRAIN), accum),
      in_shardings=(shardings, batch_sharding),
      donate_argnums=0,
    )
    batch = jax.device_put(_batch(), batch_sharding)
    out = []
    for _ in range(steps):
      state, metrics = step(state, batch)
      out.append(float(metrics["loss"]))
  return out


@pytest.fixture(scope="module")
def baseline() -> list[float]:
  return _run()


@pytest.mark.parametrize(
  "options",
  [
    # Three steps, each several options at once (one compile each, not five).
    pytest.param(dict(accum=4, remat="full"), marks=pytest.mark.full),
    pytest.param(
      dict(mesh_sizes=dict(data=1, fsdp=2, tensor=4), scan=True, remat="save_projections"),
      marks=pytest.mark.full,
    ),
    dict(mesh_sizes=dict(data=2, fsdp=2, tensor=2), accum=2),
  ],
)
def test_step_matches_baseline(baseline, options):
  np.testing.assert_allclose(_run(**options), baseline, rtol=2e-5)


def test_scan_layout_stacks_schedule_periods():
  model = FunctionalTransformerLM(MODEL, scan_layers=True)
  params = jax.eval_shape(model.init, jnp.uint32(0))
  # 4 layers of "LIM": one scanned period of 3, then layer 3 unscanned.
  assert sorted(params["scanned"]) == ["0", "1", "2"]
  assert sorted(params["layers"]) == ["3"]
  assert params["scanned"]["0"]["attn"]["alpha_q"].shape == (1, 4, 4, 2)


# --- every attention kind through the real trainer -----------------------------------------

ALL_LETTERS = tiny_model("ILMSTDX", mha_window=5)


def _train(
  config: TransformerConfig,
  mesh_sizes=None,
  *,
  scan: bool = False,
  steps: int = 2,
  batch=None,
  loss: str = "cross_entropy",
) -> tuple[list[float], dict, dict]:
  """(losses, initial params, final params) of `steps` real train steps."""
  mesh = parallel.create_mesh(mesh_sizes or dict(data=1, fsdp=1, tensor=1))
  model = FunctionalTransformerLM(config, scan_layers=scan)
  tx = make_optimizer(TRAIN)
  state, shardings = create_state(model, tx, mesh, seed=0)
  initial = jax.tree.map(np.asarray, state.params)
  batch_sharding = parallel.batch_sharding(mesh)
  with parallel.activate(mesh):
    step = jax.jit(
      make_train_step(model, tx, learning_rate_schedule(TRAIN), 1, loss),
      in_shardings=(shardings, batch_sharding),
      donate_argnums=0,
    )
    batch = jax.device_put(batch or _batch(), batch_sharding)
    losses = []
    for _ in range(steps):
      state, metrics = step(state, batch)
      losses.append(float(metrics["loss"]))
  return losses, initial, jax.tree.map(np.asarray, state.params)


@pytest.mark.full
def test_every_schedule_letter_trains():
  """One model with a layer of every letter (I L M S T D X): every parameter of every layer
  moves in training (all get gradients) and the loss falls."""
  losses, initial, final = _train(ALL_LETTERS, steps=3)  # step 0 runs at warm-up LR 0
  assert np.all(np.isfinite(losses)) and losses[2] < losses[0]
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(initial), jax.tree.leaves(final)):
    assert np.abs(a - b).max() > 0, jax.tree_util.keystr(path)


@pytest.mark.full
def test_scanned_differential_layers_keep_their_depth():
  """Scan over layers shares one graphdef per schedule position; differential attention's
  lambda_init still follows each layer's own depth (passed traced into the scan)."""
  config = dataclasses.replace(ALL_LETTERS, num_layers=4, attention_schedule="DM")
  tokens = _batch()["inputs"]
  logits = [
    jax.jit(model.apply)(model.init(0), tokens)
    for model in (
      FunctionalTransformerLM(config, scan_layers=True),
      FunctionalTransformerLM(config),
    )
  ]
  np.testing.assert_allclose(logits[0], logits[1], atol=2e-5)


@pytest.mark.full
def test_encoder_with_per_token_head_trains():
  """causal=False and a 3-way per-token head: targets are the positions' own labels."""
  config = dataclasses.replace(
    ALL_LETTERS, num_layers=2, attention_schedule="LT", causal=False, num_outputs=3
  )
  batch = _batch()
  batch["targets"] = batch["inputs"] % 3
  losses, _, final = _train(config, batch=batch, steps=3)
  assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]
  assert final["output_head"].shape == (32, 3)


@pytest.mark.full
def test_regression_on_continuous_features():
  """`input_features` and the mean_squared_error loss (e.g. polynomial filters): the
  features reach the model through `input_proj`, the loss falls the same on one device
  and on a 2 x 2 x 2 mesh, and the evaluator's R^2 is that of the model's outputs."""
  config = dataclasses.replace(
    ALL_LETTERS,
    num_layers=2,
    attention_schedule="IM",
    causal=False,
    num_outputs=4,
    input_features=3,
  )
  batch = _batch()
  keys = jax.random.split(jax.random.key(3), 2)
  batch["features"] = jax.random.normal(keys[0], (8, 16, 3))
  batch["values"] = batch["features"] @ jax.random.normal(keys[1], (3, 4)) + 0.5
  batch = {k: np.asarray(v) for k, v in batch.items()}
  losses, initial, final = _train(config, batch=batch, steps=3, loss="mean_squared_error")
  assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]
  assert final["input_proj"].shape == (3, 32)
  assert np.abs(final["input_proj"] - initial["input_proj"]).max() > 0
  sharded = _train(
    config, dict(data=2, fsdp=2, tensor=2), batch=batch, steps=3, loss="mean_squared_error"
  )
  np.testing.assert_allclose(sharded[0], losses, rtol=2e-5)

  model = FunctionalTransformerLM(config)
  inputs = {k: batch[k] for k in ("features", "segment_ids", "positions")}
  outputs = np.asarray(jax.jit(model.apply)(final, batch["inputs"], **inputs))
  module_outputs = nnx.jit(lambda m, *a, **k: m(*a, **k))(
    model.module(final), batch["inputs"], **inputs
  )
  np.testing.assert_allclose(module_outputs, outputs, atol=2e-5)
  mesh = parallel.create_mesh(dict(data=1, fsdp=1, tensor=1))
  shardings = create_state(model, make_optimizer(TRAIN), mesh, seed=0)[1]
  evaluator = Evaluator(model, mesh, shardings.params, "mean_squared_error")
  results = evaluator.evaluate(final, iter([batch, batch]))
  w = batch["weights"] > 0
  y, y_hat = batch["values"][w], outputs[w]  # [positions, 4]
  r2 = 1 - ((y - y_hat) ** 2).sum(0) / ((y - y.mean(0)) ** 2).sum(0)
  np.testing.assert_allclose(results["r_squared"], r2.mean(), rtol=1e-4)
  np.testing.assert_allclose(results["loss"], ((y - y_hat) ** 2).mean(), rtol=1e-4)
  with pytest.raises(ValueError, match=r"features must be \[B, N, 3\]"):
    model.apply(final, batch["inputs"])
  with pytest.raises(ValueError, match="model has no input_features"):
    FunctionalTransformerLM(ALL_LETTERS).apply(initial, batch["inputs"], features=batch["features"])


# --- the Pallas kernels inside the sharded step ---------------------------------------------

KERNEL_MODEL = dataclasses.replace(
  ALL_LETTERS, num_layers=2, attention_schedule="LD", mha_window=None
)


def _loss_and_grads(config: TransformerConfig, mesh_sizes=None) -> tuple[float, dict]:
  """The train step's loss and gradients at the initial parameters, under the mesh."""
  mesh = parallel.create_mesh(mesh_sizes or dict(data=1, fsdp=1, tensor=1))
  model = FunctionalTransformerLM(config)
  state, shardings = create_state(model, make_optimizer(TRAIN), mesh, seed=0)
  batch_sharding = parallel.batch_sharding(mesh)
  with parallel.activate(mesh):
    grad_fn = jax.jit(
      jax.value_and_grad(lambda p, b: loss_terms(model, p, b)[0]),
      in_shardings=(shardings.params, batch_sharding),
    )
    loss, grads = grad_fn(state.params, jax.device_put(_batch(), batch_sharding))
  return float(loss), jax.tree.map(np.asarray, grads)


@pytest.fixture(scope="module")
def xla_one_device():
  return _loss_and_grads(KERNEL_MODEL)


# One 2 x 2 x 2 mesh per platform: both batch axes split the kernels' batch (fsdp also the
# parameters), and tensor parallelism, where IHA gathers source heads and psums its
# collapse.
@pytest.mark.parametrize(
  "platform,mesh_sizes",
  [
    pytest.param("gpu", dict(data=2, fsdp=2, tensor=2), marks=pytest.mark.full),
    ("tpu", dict(data=2, fsdp=2, tensor=2)),
  ],
  ids=["gpu-2x2x2", "tpu-2x2x2"],
)
def test_kernels_in_sharded_step_match_one_device_xla(xla_one_device, platform, mesh_sizes):
  """IHA (L) and differential (D, through the MHA kernel) layers on the Pallas kernels
  (interpret mode), run by the layers inside shard_map under the mesh: the train step's
  loss and every parameter's gradient equal the one-device XLA run's."""
  config = dataclasses.replace(KERNEL_MODEL, implementation=f"pallas_{platform}")
  mode = pltpu.force_tpu_interpret_mode() if platform == "tpu" else contextlib.nullcontext()
  with mode:
    loss, grads = _loss_and_grads(config, mesh_sizes)
  want_loss, want_grads = xla_one_device
  np.testing.assert_allclose(loss, want_loss, rtol=2e-6)
  for (path, got), want in zip(
    jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(want_grads)
  ):
    scale = np.abs(want).max()
    assert scale > 0, jax.tree_util.keystr(path)  # every parameter gets a gradient
    np.testing.assert_allclose(
      got, want, rtol=1e-4, atol=1e-5 * scale, err_msg=jax.tree_util.keystr(path)
    )


def test_exported_step_runs_every_kernel_inside_shard_map(monkeypatch):
  """The train step exported for TPU and for CUDA on a 2 x 2 x 2 mesh: every kernel call
  (Mosaic, Triton) sits in a manual-sharding region that takes q/k/v split over the batch
  axes, so no device gathers the global batch. Control: with the layers' mesh routing
  switched off, the CUDA export has its kernel calls outside any region (the check can
  fail), and JAX refuses to lower the TPU one at all."""
  mesh = parallel.create_mesh(dict(data=2, fsdp=2, tensor=2))

  def placement(platform):
    config = dataclasses.replace(KERNEL_MODEL, implementation=f"pallas_{platform}")
    exported = export.export_train_step(
      config, TRAIN, mesh, batch_size=8, seq_len=16, platform="cuda" if platform == "gpu" else "tpu"
    )
    return export.kernel_placement(exported.mlir_module())

  # L and D (two maps as one MHA call): forward + 2 backward kernels each, but on TPU
  # the L layer's causal window has dQ inside its dK/dV kernel.
  for platform, kernels in (("tpu", 5), ("gpu", 6)):
    routed = placement(platform)
    assert (routed.inside, routed.outside) == (kernels, 0), (platform, routed)
    assert len(routed.regions) == 4, routed.regions  # L and D, forward and backward
    for region in routed.regions:
      operands = re.findall(r"<@mesh, \[(.*?)\]>", region)
      assert any(o.startswith('{"data", "fsdp"') for o in operands), (platform, region)
      # No [B, N, H, d]-like operand (rank >= 4) taken whole over the batch axes; the
      # whole operands are mixing weights and constants.
      assert not [o for o in operands if o.count("{") >= 4 and o.startswith("{}")], region
  monkeypatch.setattr(parallel.sharding, "kernel_axes", lambda mesh: None)
  unrouted = placement("gpu")
  assert (unrouted.inside, unrouted.outside) == (0, 6), unrouted
  with pytest.raises(NotImplementedError, match="shard_map"):
    placement("tpu")


def test_train_step_traces_once():
  """The state a step returns has the structure, dtypes and weak types of the one it took:
  feeding it back never retraces (a second trace is a recompilation per step)."""
  model = FunctionalTransformerLM(MODEL)
  tx = make_optimizer(TRAIN)
  mesh = parallel.create_mesh(dict(data=1, fsdp=1, tensor=1))
  state, _ = create_state(model, tx, mesh, seed=0)
  step = jax.jit(
    chex.assert_max_traces(make_train_step(model, tx, learning_rate_schedule(TRAIN), 1), n=1)
  )
  batch = _batch()
  with parallel.activate(mesh):
    for _ in range(3):
      state, metrics = step(state, batch)
  assert int(state.step) == 3 and bool(metrics["finite"])
