"""Grouped-query and multi-query attention (docs/design.md §9):
k and v with G heads dividing the H query heads; query head h reads key/value head
`h // (H // G)`; IHA mixes key/value heads among themselves (`alpha_k, alpha_v: [G, G, P]`).

Every implementation against an independent float64 loop reference written from the
contract (numpy, `loop_attention` below): the output in full and every gradient as
directional derivatives (central differences of the loop reference along one random
direction per argument, against `<gradient, direction>`), plus every gradient in full
against the project's "reference" through the shared harness (tests/conformance.py).
Then the refusals, layers (NNX = Linen), decoding from G-head caches, budgets and one
training step. Shapes are tiny: the Pallas kernels run interpreted on CPU.
"""

from __future__ import annotations

import contextlib
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.experimental.pallas import tpu as pltpu

from iha_jax import ops, parallel
from iha_jax.core import cudnn_attention, reference
from iha_jax.kernels.sharded import sharded_mha_attention
from iha_jax.kinds import AttentionConfig
from iha_jax.models import FunctionalTransformerLM, TransformerConfig, TransformerLM, count_params
from iha_jax.models.generate import decode_step, prefill
from iha_jax.nn import AttentionLinen, InterleavedHeadAttention, MultiHeadAttention
from iha_jax.train import flops
from iha_jax.train.optimizer import learning_rate_schedule, make_optimizer
from iha_jax.train.state import create_state
from iha_jax.train.step import make_train_step
from tests import conformance as cf
from tests.fixtures import TRAIN, tiny_model
from tests.utils import assert_close, packed_positions, packed_segments

B, N, H, D, P = 2, 12, 4, 16, 2
THETA = 10000.0

# --- The loop reference: docs/design.md §1 and §9, in float64. -------------------------


def _rope(x: np.ndarray, position: float) -> np.ndarray:
  """Rotate-half RoPE of one vector `[d]`: dims i and i + d/2 turn by `pos * theta^(-2i/d)`."""
  half = x.shape[0] // 2
  angle = position * THETA ** (-2.0 * np.arange(half) / x.shape[0])
  x1, x2 = x[:half], x[half:]
  return np.concatenate(
    [x1 * np.cos(angle) - x2 * np.sin(angle), x2 * np.cos(angle) + x1 * np.sin(angle)]
  )


def loop_attention(
  q, k, v, alpha_q=None, alpha_k=None, alpha_v=None, collapse=None, *, window, causal, seg, pos
):
  """IHA (with the mixing tensors) or MHA (without: P = 1, no mixing) over q `[B, N, H, d]`,
  k, v `[B, N, G, d]`, one query at a time; seg, pos `[B, N]`. Returns `[B, N, H, d]`."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  b_size, n_size, h_size, d = q.shape
  r = h_size // k.shape[2]
  if alpha_q is None:  # MHA: one pseudo-head, the head itself
    p_size, qm, km, vm = 1, q[:, :, :, None], k[:, :, :, None], v[:, :, :, None]
  else:
    alpha_q, alpha_k, alpha_v = (np.asarray(a, np.float64) for a in (alpha_q, alpha_k, alpha_v))
    p_size = alpha_q.shape[2]
    # q~[b,n,h,p] = sum_m alpha_q[m,h,p] q[b,n,m]; k~[b,n,g,p] = sum_m alpha_k[m,g,p] k[b,n,m].
    qm = np.einsum("bnmd,mhp->bnhpd", q, alpha_q)
    km = np.einsum("bnmd,mgp->bngpd", k, alpha_k)
    vm = np.einsum("bnmd,mgp->bngpd", v, alpha_v)
  # RoPE after mixing, at virtual position pos * P + p.
  qr, kr = np.zeros_like(qm), np.zeros_like(km)
  for b, n, p in np.ndindex(b_size, n_size, p_size):
    for h in range(qm.shape[2]):
      qr[b, n, h, p] = _rope(qm[b, n, h, p], pos[b, n] * p_size + p)
    for g in range(km.shape[2]):
      kr[b, n, g, p] = _rope(km[b, n, g, p], pos[b, n] * p_size + p)
  out = np.zeros((b_size, n_size, h_size, p_size, d))
  for b, h, n, p in np.ndindex(b_size, h_size, n_size, p_size):
    if seg[b, n] == 0:
      continue  # padding queries output zeros
    g = h // r  # consecutive query heads share a key/value head
    t = n * p_size + p
    scores, values = [], []
    for m, s_p in np.ndindex(n_size, p_size):  # every pseudo-key of key/value head g
      s = m * p_size + s_p
      seen = (s <= t) if causal else True
      if window is not None:
        seen &= (t - s if causal else abs(t - s)) < window
      if seen and seg[b, m] == seg[b, n]:
        scores.append(qr[b, n, h, p] @ kr[b, m, g, s_p] / math.sqrt(d))
        values.append(vm[b, m, g, s_p])
    weights = np.exp(np.asarray(scores) - max(scores))
    out[b, n, h, p] = weights @ np.asarray(values) / weights.sum()
  if collapse is None:
    return out[:, :, :, 0]
  collapse = np.asarray(collapse, np.float64)
  if collapse.ndim == 2:
    return np.einsum("bnhpd,hp->bnhd", out, collapse)
  return np.einsum("bngpd,hgp->bnhd", out, collapse)


MASKS = {
  "causal-window": dict(causal=True, window=9),
  "causal-window-packed": dict(causal=True, window=9, packed=True),
  "bidirectional-packed": dict(causal=False, window=None, packed=True),
  "bidirectional-window": dict(causal=False, window=5, packed=True),
}


def _mask_arrays(mask: dict, b: int, n: int):
  seg = packed_segments(b, n) if mask.get("packed") else jnp.ones((b, n), jnp.int32)
  return seg, packed_positions(seg)


def _loop_value_and_directional(args, mask, cotangent, directions, eps=1e-5):
  """Loop reference output, and `d/de <cotangent, f(args + e u_i)>` per argument i."""
  seg, pos = (np.asarray(x) for x in _mask_arrays(mask, args[0].shape[0], args[0].shape[1]))
  window, causal = mask["window"], mask["causal"]
  f = lambda a: loop_attention(*a, window=window, causal=causal, seg=seg, pos=pos)
  exact = [np.asarray(x, np.float64) for x in args]
  ct = np.asarray(cotangent, np.float64)
  slopes = []
  for i, u in enumerate(directions):
    plus, minus = list(exact), list(exact)
    plus[i], minus[i] = exact[i] + eps * u, exact[i] - eps * u
    slopes.append(float(np.sum(ct * (f(plus) - f(minus))) / (2 * eps)))
  return f(exact), slopes


def _options(mask: dict, b: int, n: int) -> dict:
  out = dict(causal=mask["causal"], window=mask["window"])
  if mask.get("packed"):
    out["segment_ids"], out["positions"] = _mask_arrays(mask, b, n)
  return out


# (implementation, kind, G, mask, dtype, block sizes). The kernels' grouped-query cases
# against the project's reference, more masks and dtypes, are in tests/kernels/test_kernels.py.
GPU_TILES = ops.BlockSizes(16, 16)
CASES = [
  ("reference", "iha", 2, "causal-window-packed", jnp.float32, None),
  ("reference", "mha", 1, "bidirectional-window", jnp.float32, None),
  ("xla", "iha", 2, "causal-window-packed", jnp.float32, None),
  ("xla", "iha", 1, "bidirectional-packed", jnp.bfloat16, None),
  ("xla", "mha", 2, "bidirectional-window", jnp.float32, None),
  ("pallas_gpu", "iha", 2, "causal-window-packed", jnp.float32, GPU_TILES),
  ("pallas_tpu", "iha", 2, "bidirectional-packed", jnp.float32, None),
  ("pallas_gpu_mha", "iha", 2, "causal-window-packed", jnp.float32, GPU_TILES),
  ("cudnn", "iha", 2, "causal-window", jnp.bfloat16, None),
  ("cudnn", "mha", 1, "causal-window", jnp.bfloat16, None),
]


def _id(case) -> str:
  impl, kind, g, mask, dtype, _ = case
  return f"{impl}-{kind}-g{g}-{mask}-{jnp.dtype(dtype).name}"


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_every_implementation_matches_the_loop_reference(case, monkeypatch):
  implementation, kind_name, g, mask_name, dtype, blocks = case
  mask = MASKS[mask_name]
  if implementation == "cudnn":
    # Off-GPU the cuDNN pipeline runs with jax's XLA attention behind it, which takes
    # grouped-query keys the same way (tests/kernels/test_gpu_paths.py).
    if jax.default_backend() != "gpu":
      monkeypatch.setattr(cudnn_attention, "BACKEND", "xla")
  kind = cf.iha(H, D, P, kv_heads=g) if kind_name == "iha" else cf.mha(H, D, D, kv_heads=g)
  seed = CASES.index(case)
  key, ct_key, dir_key = jax.random.split(jax.random.key(seed), 3)
  low = tuple(x.astype(dtype) for x in kind.make(key, B, N))
  exact = tuple(x.astype(jnp.float32) for x in low)
  cotangent = jax.random.normal(ct_key, (B, N, H, D))
  directions = [
    np.asarray(jax.random.normal(k, x.shape), np.float64)
    for k, x in zip(jax.random.split(dir_key, len(low)), low)
  ]
  want, slopes = _loop_value_and_directional(exact, mask, cotangent, directions)
  opts = _options(mask, B, N)
  fast = jax.jit(
    lambda *a: kind.call(*a, implementation=implementation, block_sizes=blocks, **opts)
  )
  interpret = pltpu.force_tpu_interpret_mode() if implementation.startswith("pallas_tpu") else None
  with interpret or contextlib.nullcontext():
    out, grads = cf.value_and_grads(fast, low, cotangent)
  assert out.dtype == dtype and out.shape == (B, N, H, D)
  assert_close(out, want, dtype, f"{implementation} out vs loop")
  # Every gradient along its direction, against the loop reference's central difference.
  tol = {jnp.dtype(jnp.float32): 1e-4, jnp.dtype(jnp.bfloat16): 3e-2}[jnp.dtype(dtype)]
  for i, (grad, u, slope) in enumerate(zip(grads, directions, slopes)):
    got = float(np.sum(np.asarray(grad, np.float64) * u))
    scale = max(1.0, float(np.linalg.norm(np.asarray(grad, np.float64))))
    assert abs(got - slope) <= tol * scale, (i, got, slope)
  # And every gradient in full against the project's reference (same rounded inputs).
  ref = jax.jit(lambda *a: kind.call(*a, implementation="reference", **opts))
  assert_close(grads, cf.value_and_grads(ref, exact, cotangent)[1], dtype, implementation)


# --- Refusals: one line naming both numbers, before anything is traced. -----------------


def test_groups_that_do_not_divide_the_heads_are_refused():
  q = jnp.ones((B, N, 4, D))
  k = jnp.ones((B, N, 3, D))
  with pytest.raises(ValueError, match=r"G = 3 key/value heads, which does not divide the H = 4"):
    ops.mha_attention(q, k, k)
  args = list(cf.iha(4, D, P, kv_heads=2).make(jax.random.key(0), B, N))
  args[4] = jnp.ones((4, 4, P))  # alpha_k over H heads, k has G = 2
  with pytest.raises(ValueError, match=r"alpha_k must have shape \[G, G, P\] = \[2, 2, P\]"):
    ops.iha_attention(*args)
  with pytest.raises(ValueError, match="num_kv_heads=3 must divide num_heads=4"):
    AttentionConfig(32, 4, 8, num_kv_heads=3)
  with pytest.raises(ValueError, match="num_kv_heads must be .* dividing num_heads=4, got 3"):
    _model_config(num_kv_heads=3)
  with pytest.raises(ValueError, match="num_kv_heads must be even for 'D'"):
    _model_config(attention_schedule="D", num_kv_heads=1)


@pytest.mark.parametrize("kind", ["talking_heads", "simplicial"])
def test_kinds_without_a_grouped_form_refuse_it(kind):
  with pytest.raises(ValueError, match=f"{kind} attention has no grouped-query form"):
    AttentionConfig(32, 4, 8, kind=kind, num_kv_heads=2)
  AttentionConfig(32, 4, 8, kind=kind, num_kv_heads=4)  # G = H is the kind itself
  q, k = jnp.ones((B, N, 4, D)), jnp.ones((B, N, 2, D))
  with pytest.raises(ValueError, match="no grouped-query form"):
    ops.talking_heads_attention(q, k, k, jnp.eye(4), jnp.eye(4))


@pytest.mark.full
def test_sharded_kernel_splits_key_value_heads_over_the_tensor_axis():
  """MHA's kernel under shard_map on a data x fsdp x tensor mesh: q's H = 4 heads and the
  G = 2 key/value heads split over 'tensor' (one group per shard); G = 1 is kept whole on
  both shards; G = 3 of H = 6 (neither size divides the other) is refused in one line."""
  mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"))
  q, k, v = cf.mha(4, D, D, kv_heads=2).make(jax.random.key(6), 4, 8)
  cotangent = jax.random.normal(jax.random.key(7), q.shape)
  opts = dict(window=5, segment_ids=packed_segments(4, 8))

  def loss(sharded, *a):
    if sharded:
      out = sharded_mha_attention(*a, mesh=mesh, batch_axes=("data", "fsdp"), **opts)
    else:
      out = ops.mha_attention(*a, implementation="reference", **opts)
    return jnp.sum(out * cotangent)

  grad = lambda sharded: jax.value_and_grad(lambda *a: loss(sharded, *a), argnums=(0, 1, 2))
  assert_close(jax.jit(grad(True))(q, k, v), grad(False)(q, k, v), jnp.float32)
  k, v = k[:, :, :1], v[:, :, :1]  # multi-query: one key/value head on every shard
  assert_close(jax.jit(grad(True))(q, k, v), grad(False)(q, k, v), jnp.float32)
  q6, k3, _ = cf.mha(6, D, D, kv_heads=3).make(jax.random.key(8), 4, 8)
  with pytest.raises(ValueError, match=r"num_kv_heads G=3 and mesh axis 'tensor' \(size 2\)"):
    sharded_mha_attention(q6, k3, k3, mesh=mesh, platform="gpu")


# --- G = H is multi-head attention, bit for bit; MQA and differential attention. ----------


@pytest.mark.parametrize("cls", [InterleavedHeadAttention, MultiHeadAttention])
def test_num_kv_heads_equal_to_num_heads_changes_nothing(cls):
  x = jax.random.normal(jax.random.key(1), (B, N, 32))
  make = lambda **kw: cls(32, 4, 8, rngs=nnx.Rngs(0), implementation="reference", **kw)
  plain, grouped = make(), make(num_kv_heads=4)
  chex.assert_trees_all_equal(plain.param_values(), grouped.param_values())
  chex.assert_trees_all_equal(plain(x), grouped(x))
  # The oracle repeats no key/value head at G = H (the very arrays it was given).
  k = jnp.ones((B, N, 4, D))
  assert reference.repeat_kv_heads(k, 4) is k


@pytest.mark.full
def test_differential_attention_reads_each_groups_keys_in_both_maps():
  """Grouped differential attention = the ungrouped one with k, v repeated per group."""
  h, g, d = 4, 2, 8
  keys = jax.random.split(jax.random.key(3), 4)
  q, k = (jax.random.normal(key, (B, N, x, 2, d)) for key, x in zip(keys, (h, g)))
  v = jax.random.normal(keys[2], (B, N, g, 2 * d))
  lam = jax.random.uniform(keys[3], (h,))
  repeat = lambda x: jnp.repeat(x, h // g, axis=2)
  want = ops.diff_attention(q, repeat(k), repeat(v), lam, window=5, implementation="reference")
  assert_close(ops.diff_attention(q, k, v, lam, window=5, implementation="xla"), want, jnp.float32)


# --- Layers: parameter tree, NNX = Linen, decoding, budgets, training. --------------------

MODEL = dict(vocab_size=32, mlp_dim=48, iha_window=5, mha_window=3)


def _model_config(**kw) -> TransformerConfig:
  return tiny_model("LMS", **{**MODEL, **kw})


def test_layer_parameters_and_nnx_equals_linen():
  kw = dict(num_kv_heads=2, num_pseudo=P, window=5, mixing_noise_std=0.1)
  layer = InterleavedHeadAttention(32, 4, 8, rngs=nnx.Rngs(0), **kw)
  params = layer.param_values()
  assert {k: v.shape for k, v in params.items()} == {
    "wq": (32, 4, 8),
    "wk": (32, 2, 8),
    "wv": (32, 2, 8),
    "wo": (4, 8, 32),
    "alpha_q": (4, 4, P),
    "alpha_k": (2, 2, P),
    "alpha_v": (2, 2, P),
    "collapse": (4, 4, P),
  }
  eye = np.eye(2)[:, :, None] + 0 * np.asarray(params["alpha_k"])  # identity per axis
  assert np.abs(np.asarray(params["alpha_k"]) - eye).max() > 0  # (noise on)
  x = jax.random.normal(jax.random.key(2), (B, N, 32))
  linen = AttentionLinen(layer.config, mixing_noise_std=0.1)
  boxed = linen.init(jax.random.key(1), x)["params"]
  assert {k: v.value.shape for k, v in boxed.items()} == {k: v.shape for k, v in params.items()}
  chex.assert_trees_all_equal(linen.apply({"params": params}, x), layer(x))
  # Identity init per axis: alpha_k, alpha_v are [G, G, P] identities.
  plain = InterleavedHeadAttention(32, 4, 8, rngs=nnx.Rngs(0), num_kv_heads=2, num_pseudo=3)
  np.testing.assert_array_equal(
    plain.alpha_k[...], np.broadcast_to(np.eye(2)[:, :, None], (2, 2, 3))
  )


@pytest.mark.full
def test_decoding_from_key_value_head_caches_equals_the_full_forward():
  model = TransformerLM(_model_config(num_kv_heads=2), rngs=nnx.Rngs(0))
  tokens = jax.random.randint(jax.random.key(4), (B, 10), 0, MODEL["vocab_size"])
  want = model(tokens)
  _, mha_cache = prefill(
    TransformerLM(_model_config(), rngs=nnx.Rngs(0)), tokens[:, :4], max_len=10
  )
  for cache_mode in ("source", "pseudo"):
    logits, cache = prefill(model, tokens[:, :4], max_len=10, cache_mode=cache_mode)
    got = [logits]
    for n in range(4, 10):
      step, cache = decode_step(model, tokens[:, n], cache)
      got.append(step[:, None])
    np.testing.assert_allclose(jnp.concatenate(got, 1), want, rtol=1e-5, atol=1e-5)
    # G = 2 heads per cache: L ring 3 slots (x P in pseudo mode), M 10, S 3.
    slots = (3 * (P if cache_mode == "pseudo" else 1), 10, 3)
    assert [c.k.shape for c in cache.layers] == [(B, 2, s, 8) for s in slots]
    # k and v of G = 2 heads, float32: G / H of a multi-head cache.
    assert cache.nbytes == 2 * 4 * B * 2 * 8 * sum(slots)


def test_budgets_count_the_key_value_heads():
  config = _model_config(num_kv_heads=1)
  h, g, d, p, width = 4, 1, 8, P, 32
  iha, mha, _ = flops.layer_budgets(config, 12)
  assert iha.params == width * (h + 2 * g) * d + h * d * width + 2 * h * h * p + 2 * g * g * p
  assert iha.mixing_flops == 2 * (h * h + 2 * g * g) * p * d + 2 * h * h * p * d
  assert mha.params == width * (h + 2 * g) * d + h * d * width
  assert iha.core_flops == flops.layer_budgets(_model_config(), 12)[0].core_flops  # unchanged
  model = TransformerLM(config, rngs=nnx.Rngs(0))
  assert count_params(config) == sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def _train(mesh_sizes: dict, steps: int = 3) -> list[float]:
  """Losses of `steps` trainer steps on one batch: IHA and MHA layers with G = 2 of H = 4."""
  mesh = parallel.create_mesh(mesh_sizes)
  model = FunctionalTransformerLM(_model_config(num_kv_heads=2, attention_schedule="LM"))
  tx = make_optimizer(TRAIN)
  state, shardings = create_state(model, tx, mesh, seed=0)
  tokens = jax.random.randint(jax.random.key(5), (4, 13), 1, MODEL["vocab_size"])
  batch = {
    "inputs": tokens[:, :-1],
    "targets": tokens[:, 1:],
    "weights": jnp.ones((4, 12), jnp.float32),
    "segment_ids": jnp.ones((4, 12), jnp.int32),
    "positions": jnp.broadcast_to(jnp.arange(12, dtype=jnp.int32), (4, 12)),
  }
  with parallel.activate(mesh):
    step = jax.jit(
      make_train_step(model, tx, learning_rate_schedule(TRAIN), 1),
      in_shardings=(shardings, parallel.batch_sharding(mesh)),
    )
    batch = jax.device_put(batch, parallel.batch_sharding(mesh))
    losses = []
    for _ in range(steps):
      state, metrics = step(state, batch)
      losses.append(float(metrics["loss"]))
  return losses


@pytest.mark.full
def test_training_steps_with_grouped_heads_on_a_sharded_mesh():
  """The trainer's step with num_kv_heads: the loss falls, and an fsdp x context x tensor
  mesh (the G = 2 key/value heads split over a tensor axis of 2, the sequence over a
  context axis of 2: only source keys and values cross it) changes nothing."""
  single = _train(dict(data=1, fsdp=1, tensor=1))
  assert np.isfinite(single).all() and single[-1] < single[0]  # (step 0's rate is 0: warm-up)
  sharded = _train(dict(data=1, fsdp=2, context=2, tensor=2))
  np.testing.assert_allclose(sharded, single, rtol=2e-5)


# --- key/value heads on any tensor split (8 fake CPU devices). -----------------------------
@pytest.mark.parametrize(
  "kv_heads, tp",
  [
    # `make test`: G = 2 under tp = 4 (kept whole) and G = 1 under tp = 8.
    pytest.param(
      g, tp, id=f"{g}-{tp}", marks=() if (g, tp) in {(2, 4), (1, 8)} else pytest.mark.full
    )
    for g in (1, 2, 8)
    for tp in (1, 2, 4, 8)
  ],
)
def test_grouped_heads_under_any_tensor_split(kv_heads, tp):
  """H = 8 query heads split over a tensor axis of 1-8 devices, G key/value heads with
  their own logical axis: split where the axis divides G, kept whole on every device
  where G divides it (never an IndivisibleError). The sharded layer's output and
  gradients equal the unsharded ones."""
  from iha_jax import parallel
  from iha_jax.nn import param_shardings

  mesh = jax.make_mesh((8 // tp, tp), ("dp", "tp"))
  rules = parallel.logical_rules({"batch": "dp", "heads": "tp"}, mesh)
  layer = InterleavedHeadAttention(
    16, 8, 4, num_kv_heads=kv_heads, num_pseudo=2, window=6, rngs=nnx.Rngs(0)
  )
  graphdef, state = nnx.split(layer)
  x = jax.random.normal(jax.random.key(9), (8, 6, 16))

  def loss(state, x):
    return jnp.sum(nnx.merge(graphdef, state)(x) ** 2)

  want = jax.value_and_grad(loss)(state, x)
  with parallel.activate(mesh, rules):
    shardings = param_shardings(mesh, state, rules)
    kv_spec = shardings["wk"].spec
    assert kv_spec[1] == ("tp" if kv_heads % tp == 0 else None), kv_spec
    sharded = jax.device_put(state, shardings)
    batch = jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("dp")))
    got = jax.jit(jax.value_and_grad(loss))(sharded, batch)
  assert_close(got, want, jnp.float32)
