"""Context (sequence) parallelism: the loss and every gradient of the model on meshes with
a `context` axis equal the unsharded computation, for every attention kind, causal and
bidirectional, with windows crossing shard boundaries, packed segments and the balanced
layout; only source-head keys and values cross devices."""

from __future__ import annotations

import contextlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from iha_jax import parallel
from iha_jax.models import FunctionalTransformerLM, TransformerConfig
from iha_jax.parallel import context
from iha_jax.train.losses import loss_terms
from tests.fixtures import tiny_model

B, N = 2, 32
# Every letter; 'L' reaches ceil((12 - 1) / 2) = 6 tokens back (more than a shard of 4
# at context 8: a two-hop halo), 'S' 4 tokens.
MODEL = tiny_model("LSIMTDX", mlp_dim=32, mha_window=5)


def _batch() -> dict[str, np.ndarray]:
  """Two packed rows: documents of 13 + 19 and 20 + 9 tokens, then 3 of padding."""
  keys = jax.random.split(jax.random.key(3), 2)
  tokens = np.asarray(jax.random.randint(keys[0], (B, N + 1), 1, MODEL.vocab_size))
  lengths = [(13, 19, 0), (20, 9, 3)]
  segment_ids = np.stack([np.repeat([1, 2, 0], row) for row in lengths]).astype(np.int32)
  positions = np.stack([np.concatenate([np.arange(n) for n in row]) for row in lengths]).astype(
    np.int32
  )
  weights = np.asarray(jax.random.uniform(keys[1], (B, N)) < 0.8) * (segment_ids > 0)
  return {
    "inputs": tokens[:, :-1],
    "targets": tokens[:, 1:],
    "weights": weights.astype(np.float32),
    "segment_ids": segment_ids,
    "positions": positions,
  }


def _loss_and_grads(config, sizes, layout="contiguous", lowered=False):
  model = FunctionalTransformerLM(config)
  params = model.init(0)
  batch = _batch()
  mesh = parallel.create_mesh(sizes)
  shards = dict(zip(mesh.axis_names, mesh.axis_sizes))["context"]
  if layout == "balanced":
    batch = {k: context.balance_tokens(v, shards) for k, v in batch.items()}
  step = jax.value_and_grad(lambda p, b: loss_terms(model, p, b, chunk_tokens=None)[0])
  with parallel.activate(mesh), context.layout(layout):
    batch = jax.device_put(batch, parallel.batch_sharding(mesh))
    fn = jax.jit(step)
    if lowered:
      return fn.lower(params, batch).compile().as_text()
    return fn(params, batch)


# The window layers alone (halo paths), cheaper to compile than every letter.
WINDOWS = MODEL.__class__(**{**MODEL.__dict__, "attention_schedule": "LSM", "num_layers": 3})


@pytest.fixture(scope="module")
def baselines():
  """One device's loss and gradients per (model, causal), computed once each."""
  cache = {}

  def get(model: TransformerConfig, causal: bool):
    key = (model.attention_schedule, causal)
    if key not in cache:
      config = model if causal else model.__class__(**{**model.__dict__, "causal": False})
      cache[key] = config, _loss_and_grads(config, dict(data=1, fsdp=1, tensor=1))
    return cache[key]

  return get


@pytest.mark.parametrize(
  "model, sizes, layout, causal",
  [
    pytest.param(
      MODEL, dict(data=1, fsdp=1, context=8, tensor=1), "contiguous", True, marks=pytest.mark.full
    ),
    (MODEL, dict(data=2, fsdp=1, context=2, tensor=2), "balanced", False),
    pytest.param(
      WINDOWS, dict(data=1, fsdp=1, context=4, tensor=1), "balanced", True, marks=pytest.mark.full
    ),
  ],
  ids=[
    "every-kind-context8-causal",
    "every-kind-data2-context2-tensor2-balanced-bidirectional",
    "windows-context4-balanced-causal",
  ],
)
def test_sharded_sequence_equals_one_device(baselines, model, sizes, layout, causal):
  config, (loss, grads) = baselines(model, causal)
  sharded_loss, sharded_grads = _loss_and_grads(config, sizes, layout)
  np.testing.assert_allclose(float(sharded_loss), float(loss), rtol=1e-5)
  flat, _ = jax.tree_util.tree_flatten_with_path(grads)
  sharded_flat = jax.tree.leaves(sharded_grads)
  for (path, g), s in zip(flat, sharded_flat):
    scale = float(jnp.abs(g).max()) + 1e-6
    np.testing.assert_allclose(
      np.asarray(s), np.asarray(g), atol=2e-5 * scale, rtol=1e-4, err_msg=jax.tree_util.keystr(path)
    )


def _collectives(hlo: str) -> list[tuple[str, list[int]]]:
  found = []
  for line in hlo.splitlines():
    match = re.search(r"= \w+\[([\d,]*)\][^ ]* (all-gather|collective-permute)(-start)?\(", line)
    if match:
      found.append((match.group(2), [int(x) for x in match.group(1).split(",") if x]))
  return found


def test_only_source_keys_and_values_cross_devices():
  """The forward+backward of an IHA-only model at context 4: every all-gather and
  collective-permute moves at most one layer's source k or v `[B, N, H, d]` (or `[B, N]`
  ids), never a pseudo-head tensor `[B, N * P, H, d]`."""
  config = MODEL.__class__(**{**MODEL.__dict__, "attention_schedule": "LI", "num_layers": 2})
  hlo = _loss_and_grads(config, dict(data=1, fsdp=1, context=4, tensor=1), lowered=True)
  moved = _collectives(hlo)
  assert any(op == "collective-permute" for op, _ in moved), "expected the window halo"
  assert any(op == "all-gather" for op, _ in moved), "expected the global layer's gather"
  source = B * N * config.num_heads * config.head_dim
  for op, dims in moved:
    size = int(np.prod(dims)) if dims else 1
    assert size <= source < source * config.num_pseudo, (op, dims)


def test_halo_and_traffic_arithmetic():
  assert context.reach_tokens(None, 4) is None
  assert context.reach_tokens(12, 2) == 6 and context.reach_tokens(13, 4) == 3
  assert context.received_tokens(64, None, 1, 4) == 48  # global: N - N/S
  assert context.received_tokens(64, 9, 2, 4) == 4  # window: the halo only
  x = np.arange(16)[None]
  np.testing.assert_array_equal(
    context.balance_tokens(x, 2)[0], np.concatenate([x[0, :4], x[0, 12:], x[0, 4:8], x[0, 8:12]])
  )


@pytest.mark.full
def test_decoding_on_a_context_mesh():
  """Generation under a context-parallel mesh (the prompt's forward split over 2 shards,
  the one-token steps not) gives the tokens of one device."""
  from flax import nnx  # pylint: disable=import-outside-toplevel

  from iha_jax.models import TransformerLM  # pylint: disable=import-outside-toplevel
  from iha_jax.models.generate import generate  # pylint: disable=import-outside-toplevel

  config = MODEL.__class__(**{**MODEL.__dict__, "attention_schedule": "LM", "num_layers": 2})
  model = TransformerLM(config, rngs=nnx.Rngs(0))
  prompt = jnp.asarray(_batch()["inputs"][:, :16])
  expected = generate(model, prompt, max_new_tokens=6)
  with parallel.activate(parallel.create_mesh(dict(data=1, fsdp=1, context=2, tensor=1))):
    np.testing.assert_array_equal(generate(model, prompt, max_new_tokens=6), expected)


def test_auto_takes_the_kernels_per_shard():
  """On a kernel backend (resolved as on TPU) "auto" runs the TPU kernel on each shard,
  down to the MHA call inside differential attention (interpreted here), and equals the
  XLA path; cuDNN, which takes no query offset, is refused by name."""
  from iha_jax import ops  # pylint: disable=import-outside-toplevel
  from iha_jax.kinds import registry  # pylint: disable=import-outside-toplevel

  keys = jax.random.split(jax.random.key(0), 3)
  q, k = (jax.random.normal(key, (B, N, 2, 2, 8)) for key in keys[:2])
  v = jax.random.normal(keys[2], (B, N, 2, 16))
  expected = ops.diff_attention(q, k, v, 0.3, implementation="xla")
  mesh = parallel.create_mesh(dict(data=1, fsdp=1, context=4, tensor=1))
  with parallel.activate(mesh), registry.auto_backend("tpu"):
    fn = jax.jit(lambda q, k, v: ops.diff_attention(q, k, v, 0.3))
    assert "pallas_call" in str(jax.make_jaxpr(fn)(q, k, v))
    got = fn(q, k, v)
    with pytest.raises(ValueError, match="'cudnn' cannot run sequence-sharded"):
      ops.mha_attention(q[:, :, :, 0], k[:, :, :, 0], v[..., :8], implementation="cudnn")
  np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-5, atol=1e-5)


def test_a_batch_the_data_axes_cannot_split():
  """One sequence on a data 2 x context 4 mesh: attention's shard_map leaves the batch
  automatic instead of refusing it, and equals one device."""
  from iha_jax import ops  # pylint: disable=import-outside-toplevel

  q, k, v = (jax.random.normal(key, (1, N, 2, 8)) for key in jax.random.split(jax.random.key(1), 3))
  expected = ops.mha_attention(q, k, v, window=5, implementation="xla")
  mesh = parallel.create_mesh(dict(data=2, fsdp=1, context=4, tensor=1))
  with parallel.activate(mesh):
    got = jax.jit(lambda q, k, v: ops.mha_attention(q, k, v, window=5))(q, k, v)
  np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-5, atol=1e-5)


@pytest.mark.full
def test_grouped_query_iha_on_a_context_and_tensor_mesh():
  """IHA with G = 2 key/value heads for H = 4 query heads, a window crossing shards and
  packed segments: output and the q/k/v gradients at context 4 x tensor 2 equal one
  device's."""
  from iha_jax import ops  # pylint: disable=import-outside-toplevel

  h, g, d, p = 4, 2, 8, 2
  keys = jax.random.split(jax.random.key(5), 7)
  q = jax.random.normal(keys[0], (B, N, h, d))
  k, v = (jax.random.normal(key, (B, N, g, d)) for key in keys[1:3])
  mixing = (
    jax.random.normal(keys[3], (h, h, p)) / h,
    *(jax.random.normal(key, (g, g, p)) / g for key in keys[4:6]),
    jax.random.normal(keys[6], (h, h, p)) / h,
  )
  batch = _batch()
  options = dict(window=7, segment_ids=batch["segment_ids"], positions=batch["positions"])

  def loss(q, k, v):
    out = ops.iha_attention(q, k, v, *mixing, implementation="xla", **options)
    return jnp.sum(out * jnp.cos(q)), out

  expected = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
  with parallel.activate(parallel.create_mesh(dict(data=1, fsdp=1, context=4, tensor=2))):
    got = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


# The Pallas kernels per shard (interpret mode): IHA window and global layers and global
# MHA, the global layers at a traced query offset, the window layer at a static one (its
# halo). Mosaic's interpreter aborts XLA:CPU inside a shard_map nested in another over a
# mesh axis > 1 (with or without sequence sharding), so the TPU case splits the context
# only; the GPU case nests the kernels' batch/head shard_map in the context one.
KERNELS = MODEL.__class__(**{**MODEL.__dict__, "attention_schedule": "LIM", "num_layers": 3})


@pytest.mark.parametrize(
  "platform, sizes, layout",
  [
    pytest.param(
      "tpu", dict(data=1, fsdp=1, context=2, tensor=1), "contiguous", marks=pytest.mark.full
    ),
    pytest.param(
      "gpu", dict(data=2, fsdp=1, context=2, tensor=2), "balanced", marks=pytest.mark.full
    ),
  ],
  ids=["pallas_tpu-context2", "pallas_gpu-data2-context2-tensor2-balanced"],
)
def test_kernels_per_shard_equal_one_device(baselines, platform, sizes, layout):
  """The model's loss and every gradient with the Pallas kernels on a context mesh equal
  one device's XLA run."""
  from jax.experimental.pallas import tpu as pltpu  # pylint: disable=import-outside-toplevel

  config, (loss, grads) = baselines(KERNELS, True)
  config = config.__class__(**{**config.__dict__, "implementation": f"pallas_{platform}"})
  mode = pltpu.force_tpu_interpret_mode() if platform == "tpu" else contextlib.nullcontext()
  with mode:
    sharded_loss, sharded_grads = _loss_and_grads(config, sizes, layout)
  np.testing.assert_allclose(float(sharded_loss), float(loss), rtol=1e-5)
  flat, _ = jax.tree_util.tree_flatten_with_path(grads)
  for (path, g), s in zip(flat, jax.tree.leaves(sharded_grads)):
    scale = float(jnp.abs(g).max())
    assert scale > 0, jax.tree_util.keystr(path)  # every parameter gets a gradient
    np.testing.assert_allclose(
      np.asarray(s), np.asarray(g), atol=2e-5 * scale, rtol=1e-4, err_msg=jax.tree_util.keystr(path)
    )
