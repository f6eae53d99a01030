"""Flax layers (`iha_jax.nn`): parameter tree, init, MHA special case, Linen <-> NNX."""

from __future__ import annotations

import warnings

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from iha_jax import checks
from iha_jax import nn as iha_nn
from iha_jax.models import count_params
from iha_jax.nn import (
  AttentionConfig,
  AttentionLinen,
  DifferentialAttention,
  InterleavedHeadAttention,
  MultiHeadAttention,
  SimplicialAttention,
  TalkingHeadsAttention,
  identity_collapse_init,
  identity_mixing_init,
)
from iha_jax.nn.config import layer_config
from iha_jax.ops import diff_attention, iha_attention
from iha_jax.parallel.rules import logical_to_mesh_spec

B, N, D, H, HEAD_DIM = 2, 6, 16, 3, 4
PROJ = ("wq", "wk", "wv", "wo")
MIXING = ("alpha_q", "alpha_k", "alpha_v", "collapse")


def _x(seed: int = 1, shape=(B, N, D)) -> jax.Array:
  return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def _iha(**kw) -> InterleavedHeadAttention:
  kw.setdefault("implementation", "reference")
  return InterleavedHeadAttention(D, H, HEAD_DIM, rngs=nnx.Rngs(kw.pop("seed", 0)), **kw)


def _mha(**kw) -> MultiHeadAttention:
  kw.setdefault("implementation", "reference")
  return MultiHeadAttention(D, H, HEAD_DIM, rngs=nnx.Rngs(kw.pop("seed", 0)), **kw)


def _params(module: nnx.Module) -> dict[str, jax.Array]:
  return {k: v[...] for k, v in nnx.state(module, nnx.Param).items()}


def _axes(module: nnx.Module) -> dict[str, tuple[str, ...]]:
  return {k: v.get_metadata()["out_sharding"] for k, v in nnx.state(module, nnx.Param).items()}


# --- parameter tree ----------------------------------------------------------------------


@pytest.mark.parametrize("collapse_mode", ["full", "per_head"])
@pytest.mark.parametrize("num_pseudo", [None, 2])
def test_iha_param_tree(collapse_mode, num_pseudo):
  m = _iha(num_pseudo=num_pseudo, collapse_mode=collapse_mode)
  p = H if num_pseudo is None else num_pseudo
  shapes = jax.tree.map(jnp.shape, _params(m))
  collapse_shape = (H, H, p) if collapse_mode == "full" else (H, p)
  assert shapes == {
    "wq": (D, H, HEAD_DIM),
    "wk": (D, H, HEAD_DIM),
    "wv": (D, H, HEAD_DIM),
    "wo": (H, HEAD_DIM, D),
    "alpha_q": (H, H, p),
    "alpha_k": (H, H, p),
    "alpha_v": (H, H, p),
    "collapse": collapse_shape,
  }
  in_proj, mixing = ("embed", "heads", "head_dim"), ("heads_src", "heads", "pseudo")
  # Key/value heads have their own axis (split only where the tensor axis divides G).
  kv_proj, kv_mixing = ("embed", "kv_heads", "head_dim"), ("heads_src", "kv_heads", "pseudo")
  collapse_axes = (
    ("heads_dst", "heads", "pseudo") if collapse_mode == "full" else ("heads", "pseudo")
  )
  assert _axes(m) == {
    "wq": in_proj,
    "wk": kv_proj,
    "wv": kv_proj,
    "wo": ("heads", "head_dim", "embed"),
    "alpha_q": mixing,
    "alpha_k": kv_mixing,
    "alpha_v": kv_mixing,
    "collapse": collapse_axes,
  }
  assert all(v.dtype == jnp.float32 for v in _params(m).values())


def test_mha_param_tree():
  m = _mha(param_dtype=jnp.bfloat16)
  assert jax.tree.map(jnp.shape, _params(m)) == {
    "wq": (D, H, HEAD_DIM),
    "wk": (D, H, HEAD_DIM),
    "wv": (D, H, HEAD_DIM),
    "wo": (H, HEAD_DIM, D),
  }
  assert _axes(m)["wo"] == ("heads", "head_dim", "embed")
  assert all(v.dtype == jnp.bfloat16 for v in _params(m).values())


BASELINES = {  # kind -> (NNX class, extra constructor arguments)
  "talking_heads": (TalkingHeadsAttention, {}),
  "diff": (DifferentialAttention, {"layer": 3}),
  "simplicial": (SimplicialAttention, {}),
}


def test_baseline_param_trees():
  """Names, shapes and logical axes of the baselines; every axis has a sharding rule."""
  in_proj, out_proj = ("embed", "heads", "head_dim"), ("heads", "head_dim", "embed")
  kv_proj = ("embed", "kv_heads", "head_dim")
  expected = {
    "talking_heads": {
      "wq": ((D, H, HEAD_DIM), in_proj),
      "wk": ((D, H, HEAD_DIM), kv_proj),
      "wv": ((D, H, HEAD_DIM), kv_proj),
      "wo": ((H, HEAD_DIM, D), out_proj),
      "talk_logits": ((H, H), ("heads_src", "heads")),
      "talk_weights": ((H, H), ("heads_src", "heads")),
    },
    "diff": {
      "wq": ((D, H, 2, HEAD_DIM), ("embed", "heads", "qk_pair", "head_dim")),
      "wk": ((D, H, 2, HEAD_DIM), ("embed", "kv_heads", "qk_pair", "head_dim")),
      "wv": ((D, H, 2 * HEAD_DIM), kv_proj),
      "wo": ((H, 2 * HEAD_DIM, D), out_proj),
      **{f"lambda_{n}": ((HEAD_DIM,), ("head_dim",)) for n in ("q1", "k1", "q2", "k2")},
      "norm_scale": ((2 * HEAD_DIM,), ("head_dim",)),
    },
    "simplicial": {
      **{w: ((D, H, HEAD_DIM), in_proj) for w in ("wq", "wk1", "wk2", "wv1", "wv2")},
      "wo": ((H, HEAD_DIM, D), out_proj),
    },
  }
  for kind, (cls, extra) in BASELINES.items():
    m = cls(D, H, HEAD_DIM, rngs=nnx.Rngs(0), **extra)
    got = {k: (v.shape, _axes(m)[k]) for k, v in _params(m).items()}
    assert got == expected[kind], kind
    for axes in _axes(m).values():
      logical_to_mesh_spec(jax.sharding.PartitionSpec(*axes))  # raises for a missing rule
  talking = _params(TalkingHeadsAttention(D, H, HEAD_DIM, rngs=nnx.Rngs(0)))
  np.testing.assert_array_equal(talking["talk_logits"], np.eye(H))
  # H differential heads of value width 2d: the parameters of MHA with 2H heads of width d,
  # plus the four lambdas and the norm scale.
  diff = count_params(DifferentialAttention(D, H, HEAD_DIM, rngs=nnx.Rngs(0)))
  mha = count_params(MultiHeadAttention(D, 2 * H, HEAD_DIM, rngs=nnx.Rngs(0)))
  assert diff == mha + 6 * HEAD_DIM


def test_logical_axes_map_to_mesh_axes_with_rules():
  rules = (
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("head_dim", None),
    ("heads_src", None),
    ("pseudo", None),
  )
  with nn.logical_axis_rules(rules):
    specs = nnx.get_partition_spec(nnx.state(_iha(), nnx.Param))
  assert specs["wq"].get_value() == jax.sharding.PartitionSpec("fsdp", "tensor", None)
  assert specs["alpha_q"].get_value() == jax.sharding.PartitionSpec(None, "tensor", None)


@pytest.mark.parametrize("num_pseudo", [1, 2, None])
def test_extra_param_count(num_pseudo):
  p = H if num_pseudo is None else num_pseudo
  mha = count_params(_mha())
  full = count_params(_iha(num_pseudo=num_pseudo))
  per_head = count_params(_iha(num_pseudo=num_pseudo, collapse_mode="per_head"))
  assert full - mha == 4 * H * H * p
  assert per_head - mha == 3 * H * H * p + H * p


# --- initialisation ----------------------------------------------------------------------


@pytest.mark.parametrize("collapse_mode", ["full", "per_head"])
def test_identity_init_values(collapse_mode):
  p = 2
  params = _params(_iha(num_pseudo=p, collapse_mode=collapse_mode))
  eye = np.broadcast_to(np.eye(H)[:, :, None], (H, H, p))
  for name in ("alpha_q", "alpha_k", "alpha_v"):
    np.testing.assert_array_equal(params[name], eye)
  expected = eye / p if collapse_mode == "full" else np.full((H, p), 1.0 / p)
  np.testing.assert_array_equal(params["collapse"], expected)


def test_mixing_noise_perturbs_identity():
  params = _params(_iha(num_pseudo=2, mixing_noise_std=1e-2))
  eye = np.broadcast_to(np.eye(H)[:, :, None], (H, H, 2))
  for name in ("alpha_q", "alpha_k", "alpha_v"):
    delta = np.asarray(params[name]) - eye
    assert 0 < np.abs(delta).max() < 0.1
  assert not np.array_equal(params["alpha_q"], params["alpha_k"])  # independent draws


def test_initializers_reject_bad_shapes():
  key = jax.random.key(0)
  with pytest.raises(ValueError, match="shape"):
    identity_mixing_init()(key, (2, 3, 4))
  with pytest.raises(ValueError, match="shape"):
    identity_collapse_init()(key, (2,))
  chex.assert_trees_all_equal(
    identity_collapse_init()(key, (2, 4), jnp.bfloat16), jnp.full((2, 4), 0.25, jnp.bfloat16)
  )


def test_projection_init_uses_true_fan_in():
  params = _params(_iha(seed=3))
  # lecun_normal: variance 1/fan_in with fan_in = D for wq and H*d for wo.
  assert abs(float(jnp.std(params["wq"])) * np.sqrt(D) - 1) < 0.3
  assert abs(float(jnp.std(params["wo"])) * np.sqrt(H * HEAD_DIM) - 1) < 0.3


# --- forward -----------------------------------------------------------------------------


class ForwardTest(chex.TestCase):
  @chex.variants(with_jit=True, without_jit=True)
  def test_functional_forward(self):
    graphdef, state = nnx.split(_iha(num_pseudo=2, window=5))
    seg = jnp.array([[1, 1, 1, 2, 2, 0]] * B, jnp.int32)
    pos = jnp.array([[0, 1, 2, 0, 1, 0]] * B, jnp.int32)
    apply = self.variant(
      lambda s, x, seg, pos: nnx.merge(graphdef, s)(x, segment_ids=seg, positions=pos)
    )
    y = apply(state, _x(), seg, pos)
    chex.assert_shape(y, (B, N, D))
    chex.assert_tree_all_finite(y)
    np.testing.assert_array_equal(y[:, -1], 0.0)  # padding query (segment 0)

  @chex.variants(with_jit=True, without_jit=True)
  def test_compute_dtype(self):
    m = _iha(dtype=jnp.dtype("bfloat16"))  # a dtype instance, not the scalar type
    y = self.variant(lambda x: m(x))(_x())
    chex.assert_type(y, jnp.bfloat16)
    chex.assert_trees_all_close(y.astype(jnp.float32), _iha()(_x()), atol=0.1, rtol=0.1)


@pytest.mark.parametrize("implementation", ["reference", "xla"])
@pytest.mark.parametrize("window,rope_theta", [(None, 10000.0), (3, 500000.0), (2, None)])
def test_single_pseudo_head_with_identity_init_is_mha(implementation, window, rope_theta):
  """docs/design.md §1: P = 1 with identity mixing/collapse is exactly MHA (same window, RoPE)."""
  opts = dict(window=window, rope_theta=rope_theta, implementation=implementation)
  mha = _mha(seed=5, **opts)
  iha = _iha(seed=7, num_pseudo=1, **opts)
  nnx.update(iha, nnx.state(mha, nnx.Param))  # copy wq, wk, wv, wo
  chex.assert_trees_all_equal(_params(iha)["wq"], _params(mha)["wq"])
  x = _x(2)
  chex.assert_trees_all_close(iha(x), mha(x), atol=1e-6, rtol=1e-6)


def test_matches_from_scratch_computation():
  # A RoPE base other than the default: the layer must hand its own to the kind.
  m = _iha(num_pseudo=2, window=5, rope_theta=100.0, mixing_noise_std=0.1)
  p, x = _params(m), _x(3)
  # Projections as flat matmuls, independent of the module's einsum specs.
  q, k, v = (
    (x @ p[w].reshape(D, H * HEAD_DIM)).reshape(B, N, H, HEAD_DIM) for w in ("wq", "wk", "wv")
  )
  y = iha_attention(
    q,
    k,
    v,
    p["alpha_q"],
    p["alpha_k"],
    p["alpha_v"],
    p["collapse"],
    window=5,
    rope_theta=100.0,
    implementation="reference",
  )
  expected = y.reshape(B, N, H * HEAD_DIM) @ p["wo"].reshape(H * HEAD_DIM, D)
  chex.assert_trees_all_close(m(x), expected, atol=1e-5, rtol=1e-5)


def test_differential_layer_from_scratch():
  """lam from the lambdas and lambda_init(layer), per-head RMSNorm, scale 1 - lambda_init."""
  layer = 4
  m = DifferentialAttention(
    D, H, HEAD_DIM, layer=layer, implementation="reference", rngs=nnx.Rngs(2)
  )
  p, x = _params(m), _x(5)
  q, k = (jnp.einsum("bnD,Dhcd->bnhcd", x, p[w]) for w in ("wq", "wk"))
  v = jnp.einsum("bnD,Dhe->bnhe", x, p["wv"])
  lambda_init = 0.8 - 0.6 * np.exp(-0.3 * (layer - 1))
  lam = (
    jnp.exp(p["lambda_q1"] @ p["lambda_k1"])
    - jnp.exp(p["lambda_q2"] @ p["lambda_k2"])
    + lambda_init
  )
  y = diff_attention(q, k, v, lam, implementation="reference")
  y = y / jnp.sqrt(jnp.mean(y**2, axis=-1, keepdims=True) + 1e-5) * p["norm_scale"]
  expected = jnp.einsum("bnhe,heD->bnD", y * (1 - lambda_init), p["wo"])
  chex.assert_trees_all_close(m(x), expected, atol=1e-5, rtol=1e-5)
  # A traced depth (scan over layers) gives the same layer.
  chex.assert_trees_all_close(jax.jit(lambda l: m(x, layer=l))(layer), m(x), atol=1e-6)


def test_projection_outputs_are_named_for_remat():
  jaxpr = str(jax.make_jaxpr(lambda x: _iha()(x))(_x()))
  for name in ("query_proj", "key_proj", "value_proj", "attention_out"):
    assert f"name={name}" in jaxpr


# --- Linen <-> NNX -----------------------------------------------------------------------


NNX_CLASSES = {
  "iha": InterleavedHeadAttention,
  "mha": MultiHeadAttention,
  **{kind: classes[0] for kind, classes in BASELINES.items()},
}


@pytest.mark.parametrize(
  "kind,kwargs",
  [
    ("iha", dict(num_pseudo=2, window=4)),
    ("iha", dict(collapse_mode="per_head", rope_theta=None, causal=False, num_kv_heads=1)),
    ("mha", dict(window=3, num_kv_heads=1)),
    ("talking_heads", dict(window=3, causal=False)),
    ("diff", dict(layer=3, num_kv_heads=1)),
    ("simplicial", dict(causal=False)),
  ],
)
def test_linen_nnx_transplant(kind, kwargs):
  kwargs = dict(kwargs, implementation="reference")
  noise = 0.1 if kind in ("iha", "talking_heads") else 0.0  # a transposed axis would show
  nnx_model = NNX_CLASSES[kind](D, H, HEAD_DIM, rngs=nnx.Rngs(0), mixing_noise_std=noise, **kwargs)
  linen_model = AttentionLinen(nnx_model.config, mixing_noise_std=noise)
  x = _x(4)
  boxed = linen_model.init(jax.random.key(1), x)["params"]
  # Same names, shapes and logical axes in both trees.
  assert {k: (v.value.shape, v.names) for k, v in boxed.items()} == {
    k: (v.shape, _axes(nnx_model)[k]) for k, v in _params(nnx_model).items()
  }

  # NNX -> Linen.
  y_linen = linen_model.apply({"params": _params(nnx_model)}, x)
  chex.assert_trees_all_equal(y_linen, nnx_model(x))
  # Linen -> NNX.
  linen_params = nn.meta.unbox(boxed)
  nnx.update(nnx_model, {k: nnx.Param(v) for k, v in linen_params.items()})
  chex.assert_trees_all_equal(nnx_model(x), linen_model.apply({"params": linen_params}, x))


# --- validation --------------------------------------------------------------------------


@pytest.mark.parametrize(
  "kwargs,match",
  [
    (dict(num_pseudo=0), "num_pseudo"),
    (dict(window=0), "window"),
    (dict(window=2.5), "window"),
    (dict(collapse_mode="diagonal"), "collapse_mode"),
    (dict(implementation="cuda"), "implementation"),
    (dict(rope_theta=-1.0), "rope_theta"),
    (dict(mixing_noise_std=-0.1), "mixing_noise_std"),
  ],
)
def test_iha_rejects_bad_options(kwargs, match):
  with pytest.raises(ValueError, match=match):
    _iha(**kwargs)
  if not {"num_pseudo", "collapse_mode", "mixing_noise_std"} & set(kwargs):
    with pytest.raises(ValueError, match=match):
      _mha(**kwargs)


@pytest.mark.parametrize(
  "dims,match",
  [
    ((0, H, HEAD_DIM), "model_dim"),
    ((D, 0, HEAD_DIM), "num_heads"),
    ((D, H, 0), "head_dim"),
    ((D, H, 5), "head_dim"),  # odd d with RoPE on
  ],
)
def test_rejects_bad_dims(dims, match):
  for cls in (InterleavedHeadAttention, MultiHeadAttention):
    with pytest.raises(ValueError, match=match):
      cls(*dims, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=match):
    AttentionLinen(AttentionConfig(*dims)).init(
      jax.random.key(0), _x(shape=(B, N, max(dims[0], 1)))
    )


def test_odd_head_dim_allowed_without_rope():
  m = InterleavedHeadAttention(
    D, H, 5, rope_theta=None, implementation="reference", rngs=nnx.Rngs(0)
  )
  chex.assert_shape(m(_x()), (B, N, D))


@pytest.mark.parametrize("shape", [(N, D), (B, N, D + 1), (B, 1, N, D)])
def test_rejects_bad_input(shape):
  for m in (_iha(), _mha()):
    with pytest.raises(ValueError, match="x must have shape"):
      m(_x(shape=shape))


def test_rejects_an_empty_sequence_and_a_traced_window():
  with pytest.raises(ValueError, match="x has N = 0 tokens"):
    _iha()(_x(shape=(B, 0, D)))
  with pytest.raises(ValueError, match="window must be a static Python int"):
    jax.jit(lambda w: _iha(window=w)(_x()))(4)


# --- a layer to drop in: mask=, window units, dropout, Linen checks, unboxing ----------


def test_mask_is_key_validity_and_other_masks_are_refused():
  m = _iha(num_pseudo=2, window=5)
  valid = jnp.array([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]], bool)
  x = _x()
  y = m(x, mask=valid[:, None, None, :])
  chex.assert_trees_all_equal(y, m(x, segment_ids=valid.astype(jnp.int32)))
  np.testing.assert_array_equal(y[0, 4:], 0.0)  # padding positions
  with pytest.raises(ValueError, match=r"mask of shape \(2, 1, 6, 6\).*window=.*segment_ids"):
    m(x, mask=nnx.make_causal_mask(jnp.ones((B, N))))


def test_window_in_tokens_at_the_layer():
  # window_tokens=w takes w * P virtual tokens; window keeps the kind's unit.
  assert _iha(num_pseudo=2, window_tokens=3).config.window == 6
  assert _iha(window_tokens=2).config.window == 2 * H  # P = H when num_pseudo is None
  assert _mha(window_tokens=3).config.window == 3
  assert layer_config(model_dim=D, num_heads=H, head_dim=HEAD_DIM, window_tokens=2).window == 2 * H
  with pytest.raises(ValueError, match="window.*or window_tokens.*not both"):
    _iha(window=4, window_tokens=2)
  with pytest.raises(ValueError, match="window_tokens must be a positive integer"):
    _iha(window_tokens=0)


def _reach(layer, x: jax.Array) -> np.ndarray:
  """`[N, N]` bool: whether the output at token n (row) depends on the input at token m
  (column), read off the Jacobian of a one-row batch."""
  jacobian = jax.jacobian(lambda x: layer(x))(x)[0, :, :, 0]  # [N, D, N, D]
  return np.abs(np.asarray(jacobian)).max(axis=(1, 3)) > 0


def test_window_tokens_reach_one_token_further_through_iha_than_mha():
  """`window_tokens=w`: an MHA output at token n depends on tokens n-w+1..n; an IHA one
  (w * P virtual tokens, P >= 2) on tokens n-w..n, token n-w only through the pseudo-
  queries p < P-1 (query p of token n sees virtual keys from (n-w)*P + p + 1 on).
  `window=(w-1)*P + 1` gives IHA MHA's reach."""
  n, w, p = 9, 3, 2
  x = _x(shape=(1, n, D))
  tokens = np.arange(n)
  offset = tokens[:, None] - tokens[None, :]  # n - m
  iha = _iha(num_pseudo=p, window_tokens=w, mixing_noise_std=0.3)
  mha = _mha(window_tokens=w)
  np.testing.assert_array_equal(_reach(iha, x), (offset >= 0) & (offset <= w))
  np.testing.assert_array_equal(_reach(mha, x), (offset >= 0) & (offset < w))
  narrow = _iha(num_pseudo=p, window=(w - 1) * p + 1, mixing_noise_std=0.3)
  np.testing.assert_array_equal(_reach(narrow, x), (offset >= 0) & (offset < w))
  # Which pseudo-queries of the last token reach token n-1-w: p = 0 does, p = P-1 does not.
  _, probabilities = iha(x, return_probabilities=True)  # [1, H, N*P, N*P]
  last, oldest = n - 1, n - 1 - w
  to_oldest = probabilities[0, :, :, oldest * p : (oldest + 1) * p].sum(axis=(0, 2))
  assert to_oldest[last * p] > 0 and to_oldest[last * p + p - 1] == 0


def test_linen_validates_at_construction():
  with pytest.raises(TypeError, match="config must be an AttentionConfig"):
    AttentionLinen(dict(model_dim=D, num_heads=H, head_dim=HEAD_DIM))
  with pytest.raises(ValueError, match="deterministic must be None or a bool"):
    AttentionLinen(_iha().config, deterministic="yes")
  with pytest.raises(TypeError, match="unexpected keyword"):  # explicit keywords, NNX too
    InterleavedHeadAttention(D, H, HEAD_DIM, num_pseudos=2, rngs=nnx.Rngs(0))


def test_an_nnx_layer_takes_its_config_as_it_is():
  config = AttentionConfig(D, H, HEAD_DIM, num_pseudo=2, window=4)
  layer = InterleavedHeadAttention(config=config, rngs=nnx.Rngs(0))
  assert layer.config is config  # no keyword round trip
  assert type(iha_nn.Attention.from_config(config, rngs=nnx.Rngs(0))) is InterleavedHeadAttention
  with pytest.raises(ValueError, match="config= holds every field of the layer; got num_pseudo"):
    iha_nn.Attention(config=config, num_pseudo=3, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="MultiHeadAttention is kind 'mha', got kind='iha'"):
    MultiHeadAttention(config=config, rngs=nnx.Rngs(0))


# Each deprecated Linen name, its kind and a kind-specific field of its old constructor.
DEPRECATED_LINEN = {
  "InterleavedHeadAttentionLinen": ("iha", dict(num_pseudo=2, collapse_mode="per_head")),
  "MultiHeadAttentionLinen": ("mha", dict(rope_theta=None)),
  "TalkingHeadsAttentionLinen": ("talking_heads", dict(mixing_noise_std=0.1)),
  "DifferentialAttentionLinen": ("diff", dict(layer=3)),
  "SimplicialAttentionLinen": ("simplicial", {}),
}


@pytest.mark.parametrize("name", sorted(DEPRECATED_LINEN))
def test_deprecated_linen_names_warn_once_and_build_the_one_linen_class(name, monkeypatch):
  monkeypatch.setattr(checks, "_DEPRECATIONS_WARNED", set())
  kind, own = DEPRECATED_LINEN[name]
  own = dict(own)
  build = getattr(iha_nn, name)
  with pytest.deprecated_call(match=f"{name} is deprecated; use AttentionLinen"):
    old = build(D, H, HEAD_DIM, None, 4, **own)  # positional fields in the old order
  noise = own.pop("mixing_noise_std", 0.0)
  config = AttentionConfig(D, H, HEAD_DIM, kind=kind, window=4, **own)
  assert isinstance(old, AttentionLinen) and old.config == config
  assert old.mixing_noise_std == noise
  x = _x()
  new = AttentionLinen(config, mixing_noise_std=noise)
  chex.assert_trees_all_equal(old.init(jax.random.key(0), x), new.init(jax.random.key(0), x))
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    build(D, H, HEAD_DIM)  # once per process


def test_deprecated_linen_names_keep_flax_names_window_tokens_and_automatic_names():
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    linen = iha_nn.InterleavedHeadAttentionLinen(
      D, H, qkv_features=H * HEAD_DIM, num_pseudo=2, window_tokens=3, kernel_init=jnp.ones
    )
    with pytest.raises(ValueError, match="num_pseudo"):
      iha_nn.InterleavedHeadAttentionLinen(D, H, HEAD_DIM, num_pseudo=0)
    with pytest.raises(ValueError, match="dropout_rate"):
      iha_nn.MultiHeadAttentionLinen(D, H, HEAD_DIM, dropout_rate=1.5)
    with pytest.raises(TypeError, match="num_pseudo"):  # not a field of the old MHA class
      iha_nn.MultiHeadAttentionLinen(D, H, HEAD_DIM, num_pseudo=2)

    class Block(nn.Module):  # an unnamed submodule: Linen names it after its class
      @nn.compact
      def __call__(self, x):
        return iha_nn.MultiHeadAttentionLinen(D, H, HEAD_DIM)(x)

  assert linen.config == AttentionConfig(D, H, HEAD_DIM, num_pseudo=2, window=6)
  assert linen.kernel_init is jnp.ones
  params = Block().init(jax.random.key(0), _x())["params"]
  assert list(params) == ["MultiHeadAttentionLinen_0"]


@pytest.mark.full
def test_attention_dropout_nnx_and_linen():
  x = _x()
  kw = dict(num_pseudo=2, window=5, implementation="xla")
  plain = _iha(**kw)
  drop = _iha(**kw, dropout_rate=0.5)
  chex.assert_trees_all_equal(drop(x, deterministic=True), plain(x))
  with pytest.raises(ValueError, match="pass deterministic"):
    drop(x)
  y1, y2 = drop(x, deterministic=False), drop(x, deterministic=False)
  assert not np.allclose(y1, plain(x)) and not np.allclose(y1, y2)  # a fresh mask per call
  grads = nnx.grad(lambda m: jnp.sum(m(x, deterministic=False) ** 2))(drop)
  assert all(np.isfinite(g).all() for g in jax.tree.leaves(grads))
  linen = AttentionLinen(drop.config)
  params = linen.init(jax.random.key(0), x, deterministic=True)
  rngs = {"dropout": jax.random.key(3)}
  a = linen.apply(params, x, deterministic=False, rngs=rngs)
  chex.assert_trees_all_equal(a, linen.apply(params, x, deterministic=False, rngs=rngs))
  assert not np.allclose(a, linen.apply(params, x, deterministic=True))
  # Implementations without dropout refuse in one line.
  with pytest.raises(ValueError, match="'reference' implementation has no attention dropout"):
    _iha(num_pseudo=2, implementation="reference", dropout_rate=0.1)
  with pytest.raises(ValueError, match="no attention dropout in any implementation"):
    TalkingHeadsAttention(D, H, HEAD_DIM, dropout_rate=0.1, rngs=nnx.Rngs(0))
  from iha_jax.kinds import auto_backend  # pylint: disable=import-outside-toplevel

  auto = _iha(num_pseudo=2, implementation="auto", dropout_rate=0.1)
  with auto_backend("tpu"), pytest.raises(ValueError, match="'auto' chose 'pallas_tpu'"):
    auto(x, deterministic=False)


def test_unbox_and_logical_specs():
  from iha_jax.nn import logical_specs, unbox  # pylint: disable=import-outside-toplevel

  linen = AttentionLinen(_iha(num_pseudo=2).config)
  variables = linen.init(jax.random.key(0), _x())
  params = unbox(variables)["params"]
  assert params["wq"].shape == (D, H, HEAD_DIM)
  specs = logical_specs(variables)["params"]
  assert specs["wq"] == jax.sharding.PartitionSpec("embed", "heads", "head_dim")
  nnx_specs = logical_specs(_iha(num_pseudo=2))
  assert nnx_specs["alpha_q"].get_value() == jax.sharding.PartitionSpec(
    "heads_src", "heads", "pseudo"
  )
