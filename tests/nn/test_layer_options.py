"""What modern decoders ask of an attention layer: qk_norm, biases, an output width, flax's
argument names and cross-attention, each against a from-scratch computation."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from iha_jax.nn import (
  Attention,
  AttentionLinen,
  DifferentialAttention,
  InterleavedHeadAttention,
  MultiHeadAttention,
  SimplicialAttention,
)

B, N, M, D, H, G, d, P = 2, 5, 3, 12, 4, 2, 6, 2


def _normal(seed: int, shape) -> jax.Array:
  return jax.random.normal(jax.random.key(seed), shape)


def _randomised(layer: nnx.Module, seed: int = 7) -> dict[str, jax.Array]:
  """Every parameter drawn at random (biases, norm scales and mixings away from their
  zeros, ones and identities), set in the layer and returned."""
  state = nnx.state(layer, nnx.Param)
  keys = jax.random.split(jax.random.key(seed), len(state))
  new = {
    name: 0.5 * jax.random.normal(key, value[...].shape) + (name.endswith("_norm"))
    for key, (name, value) in zip(keys, sorted(state.items()), strict=True)
  }
  nnx.update(layer, {name: nnx.Param(value) for name, value in new.items()})
  return new


def _rms(t: jax.Array, scale: jax.Array) -> jax.Array:
  return t / jnp.sqrt(jnp.mean(t**2, axis=-1, keepdims=True) + 1e-6) * scale


def _from_scratch(p, x, context=None, *, causal, num_pseudo, kv_valid=None):
  """IHA (MHA: `num_pseudo=None` and no mixing) without RoPE, written out with its own
  loops over heads: biases, RMSNorm of source q and k, mixing, attention over virtual
  tokens, collapse, output projection and bias. `context`: keys and values from it."""
  context = x if context is None else context
  heads = lambda t, w: jnp.einsum("bnD,Dhd->bnhd", t, p[w]) + p.get("b" + w[1], 0.0)
  q, k, v = heads(x, "wq"), heads(context, "wk"), heads(context, "wv")
  if "q_norm" in p:
    q, k = _rms(q, p["q_norm"]), _rms(k, p["k_norm"])
  pp = num_pseudo or 1
  mix = lambda t, a: t[:, :, :, None] if a is None else jnp.einsum("bnsd,shp->bnhpd", t, p[a])
  qv, kv, vv = mix(q, "alpha_q" if num_pseudo else None), None, None
  kv = mix(k, "alpha_k" if num_pseudo else None)
  vv = mix(v, "alpha_v" if num_pseudo else None)
  flat = lambda t: t.transpose(0, 2, 1, 3, 4).reshape(t.shape[0], t.shape[2], -1, d)
  qv, kv, vv = flat(qv), flat(kv), flat(vv)  # [B, heads, tokens * P, d]
  tq, tk = qv.shape[2], kv.shape[2]
  outs = []
  for h in range(H):
    g = h // (H // kv.shape[1])
    s = np.einsum("btd,bsd->bts", qv[:, h], kv[:, g]) / np.sqrt(d)
    visible = np.ones((B, tq, tk), bool)
    if causal:
      visible &= np.tril(np.ones((tq, tk), bool))[None]
    if kv_valid is not None:
      visible &= np.repeat(kv_valid, pp, axis=1)[:, None, :]
    s = np.where(visible, s, -1e30)
    w = np.where(visible, np.exp(s - s.max(-1, keepdims=True)), 0.0)
    w = w / np.maximum(w.sum(-1, keepdims=True), 1e-30)  # a row seeing nothing: zeros
    outs.append(np.einsum("bts,bsd->btd", w, vv[:, g]))
  o = np.stack(outs, 2).reshape(B, -1, pp, H, d)  # [B, N, P, H, d]
  if num_pseudo:
    y = np.einsum("bnphd,khp->bnkd", o, p["collapse"])
  else:
    y = o[:, :, 0]
  return np.einsum("bnhd,hdD->bnD", y, p["wo"]) + np.asarray(p.get("bo", 0.0))


@pytest.fixture(autouse=True)
def _highest_precision():
  with jax.default_matmul_precision("highest"):
    yield


@pytest.mark.parametrize("kind", ["iha", "mha"])
@pytest.mark.parametrize("qk_norm,use_bias", [(True, False), (False, True), (True, True)])
def test_qk_norm_biases_and_output_width_match_a_from_scratch_layer(kind, qk_norm, use_bias):
  extra = dict(num_pseudo=P, mixing_noise_std=0.3) if kind == "iha" else {}
  layer = Attention(
    D, H, d, kind=kind, num_kv_heads=G, rope_theta=None, qk_norm=qk_norm, use_bias=use_bias,
    out_features=7, implementation="reference", rngs=nnx.Rngs(0), **extra,
  )  # fmt: skip
  p = _randomised(layer)
  options = ["q_norm", "k_norm"] * qk_norm + ["bq", "bk", "bv", "bo"] * use_bias
  assert set(p) - set(options) == {"wq", "wk", "wv", "wo"} | set(layer.config.record.mixing_params)
  assert set(options) <= set(p)
  assert p["wo"].shape == (H, d, 7) and (not use_bias or p["bo"].shape == (7,))
  x = _normal(1, (B, N, D))
  expected = _from_scratch(p, x, causal=True, num_pseudo=extra.get("num_pseudo"))
  chex.assert_trees_all_close(layer(x), expected, atol=2e-5, rtol=2e-5)


def test_qk_norm_makes_the_layer_blind_to_the_scale_of_wq_and_wk():
  layer = InterleavedHeadAttention(D, H, d, num_pseudo=P, qk_norm=True, rngs=nnx.Rngs(0))
  _randomised(layer)
  x = _normal(1, (B, N, D))
  call = nnx.jit(lambda layer, x: layer(x))
  y = call(layer, x)
  layer.wq[...] *= 8.0  # powers of two, far above eps (1e-6) in mean square
  layer.wk[...] *= 0.25
  chex.assert_trees_all_close(call(layer, x), y, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("mode", ["source", "pseudo"])
def test_decoding_with_qk_norm_and_biases_matches_the_full_forward(mode):
  layer = InterleavedHeadAttention(
    D, H, d, num_pseudo=P, num_kv_heads=G, qk_norm=True, use_bias=True, out_features=9,
    rngs=nnx.Rngs(0),
  )  # fmt: skip
  _randomised(layer)
  x = _normal(2, (B, N, D))

  @nnx.jit
  def decoded_and_full(layer, x):
    cache = layer.init_cache(B, N, mode=mode)
    y0, cache = layer(x[:, :3], cache=cache)  # a prompt, then one token at a time
    y1, cache = layer(x[:, 3:4], cache=cache)
    y2, _ = layer(x[:, 4:], cache=cache)
    return jnp.concatenate([y0, y1, y2], 1), layer(x)

  chex.assert_trees_all_close(*decoded_and_full(layer, x), atol=2e-5, rtol=2e-5)


def test_linen_and_nnx_share_the_options_parameter_tree():
  kw = dict(num_pseudo=P, num_kv_heads=G, qk_norm=True, use_bias=True, out_features=9)
  nnx_layer = InterleavedHeadAttention(D, H, d, rngs=nnx.Rngs(0), **kw)
  p = _randomised(nnx_layer)
  linen_layer = AttentionLinen(nnx_layer.config)
  x = _normal(3, (B, N, D))
  boxed = linen_layer.init(jax.random.key(0), x)["params"]
  assert {k: v.value.shape for k, v in boxed.items()} == {k: v.shape for k, v in p.items()}
  assert boxed["bk"].names == ("kv_heads", "head_dim") and boxed["q_norm"].names == ("head_dim",)
  chex.assert_trees_all_equal(linen_layer.apply({"params": p}, x), nnx_layer(x))


def test_flax_names_stand_for_model_dim_and_head_dim():
  ours = MultiHeadAttention(D, H, d, out_features=5, rngs=nnx.Rngs(0))
  flax_named = MultiHeadAttention(
    in_features=D, num_heads=H, qkv_features=H * d, out_features=5, rngs=nnx.Rngs(0)
  )
  assert ours.config == flax_named.config
  chex.assert_trees_all_equal(nnx.state(ours, nnx.Param), nnx.state(flax_named, nnx.Param))
  # qkv_features defaults to in_features, as in flax's layer; normalize_qk=False is no norm.
  flax_default = InterleavedHeadAttention(
    num_heads=H // 2, in_features=D, normalize_qk=False, rngs=nnx.Rngs(0)
  )
  assert flax_default.config.head_dim == 2 * D // H and not flax_default.config.qk_norm
  assert flax_default.wq[...].shape == (D, H // 2, 2 * D // H)


@pytest.mark.parametrize(
  "kwargs,match",
  [
    (dict(model_dim=D, in_features=D, num_heads=H, head_dim=d), "model_dim or in_features"),
    (dict(in_features=D, num_heads=H, head_dim=d, qkv_features=H * d), "head_dim or qkv_f"),
    (dict(in_features=D, num_heads=H, qkv_features=H * d + 1), "multiple of num_heads"),
    (dict(model_dim=D, num_heads=H), r"head_dim \(or qkv_features\) is required"),
    (dict(model_dim=D, num_heads=H, head_dim=d, normalize_qk=True), r"qk_norm=True \(an RMS"),
    (dict(num_heads=H, head_dim=d), r"model_dim \(or in_features\) is required"),
    (dict(model_dim=D, num_heads=H, head_dim=d, out_features=0), "out_features"),
    (dict(model_dim=D, num_heads=H, head_dim=d, qk_norm="yes"), "qk_norm must be a bool"),
    (dict(model_dim=D, num_heads=H, head_dim=d, use_bias=1), "use_bias must be a bool"),
  ],
)
def test_bad_dims_and_options_are_refused_naming_them(kwargs, match):
  with pytest.raises(ValueError, match=match):
    MultiHeadAttention(rngs=nnx.Rngs(0), **kwargs)


@pytest.mark.parametrize("cls", [DifferentialAttention, SimplicialAttention])
@pytest.mark.parametrize("option", ["qk_norm", "use_bias"])
def test_kinds_with_their_own_projections_refuse_the_projection_options(cls, option):
  with pytest.raises(ValueError, match=f"{option} is not an option of"):
    cls(D, H, d, **{option: True}, rngs=nnx.Rngs(0))


# --- cross-attention ---------------------------------------------------------------------


def _cross_layer(kind: str, **kw) -> Attention:
  extra = dict(num_pseudo=P, mixing_noise_std=0.3) if kind == "iha" else {}
  kw = dict(num_kv_heads=G, causal=False, rope_theta=None, **extra) | kw
  return Attention(D, H, d, kind=kind, rngs=nnx.Rngs(0), **kw)


@pytest.mark.parametrize("kind", ["iha", "mha"])
def test_cross_attention_matches_a_from_scratch_layer_with_a_context_mask(kind):
  layer = _cross_layer(kind, qk_norm=True, use_bias=True)
  p = _randomised(layer)
  x, context = _normal(1, (B, N, D)), _normal(2, (B, M, D))
  valid = np.array([[True, False, True], [False, False, False]])  # row 2: no context
  mask = jnp.asarray(valid)[:, None, None, :]
  y = nnx.jit(lambda layer, x, c, m: layer(x, context=c, mask=m))(layer, x, context, mask)
  num_pseudo = P if kind == "iha" else None
  expected = _from_scratch(p, x, context, causal=False, num_pseudo=num_pseudo, kv_valid=valid)
  # A row without a valid context token: zero attention outputs, then the output bias.
  expected[1] = np.broadcast_to(p["bo"], expected[1].shape)
  chex.assert_trees_all_close(y, expected, atol=2e-5, rtol=2e-5)


def test_cross_attention_gradients_match_the_from_scratch_layer():
  layer = _cross_layer("iha", use_bias=True)
  p = _randomised(layer)
  x, context = _normal(1, (B, N, D)), _normal(2, (B, M, D))
  cotangent = _normal(3, (B, N, D))
  graphdef = nnx.graphdef(layer)

  def ours(params, x, context):
    merged = nnx.merge(graphdef, nnx.State({k: nnx.Param(v) for k, v in params.items()}))
    return jnp.vdot(merged(x, context=context), cotangent)

  def scratch(params, x, context):
    return jnp.vdot(_scratch_jnp(params, x, context), cotangent)

  got = jax.grad(ours, argnums=(0, 1, 2))(p, x, context)
  want = jax.grad(scratch, argnums=(0, 1, 2))(p, x, context)
  chex.assert_trees_all_close(got, want, atol=5e-5, rtol=5e-5)


def _scratch_jnp(p, x, context):
  """`_from_scratch`'s cross-attention (IHA, no mask) in jnp, for gradients."""
  heads = lambda t, w: jnp.einsum("bnD,Dhd->bnhd", t, p[w]) + p["b" + w[1]]
  q, k, v = heads(x, "wq"), heads(context, "wk"), heads(context, "wv")
  mix = lambda t, a: jnp.einsum("bnsd,shp->bhnpd", t, p[a]).reshape(B, t.shape[2], -1, d)
  qv, kv, vv = mix(q, "alpha_q"), mix(k, "alpha_k"), mix(v, "alpha_v")
  kv, vv = (jnp.repeat(t, H // G, axis=1) for t in (kv, vv))
  w = jax.nn.softmax(jnp.einsum("bhtd,bhsd->bhts", qv, kv) / np.sqrt(d), axis=-1)
  o = jnp.einsum("bhts,bhsd->bhtd", w, vv).reshape(B, H, N, P, d)
  y = jnp.einsum("bhnpd,khp->bnkd", o, p["collapse"])
  return jnp.einsum("bnhd,hdD->bnD", y, p["wo"]) + p["bo"]


def test_cross_attention_over_the_input_itself_is_bidirectional_self_attention():
  layer = _cross_layer("iha", qk_norm=True)
  _randomised(layer)
  x = _normal(4, (B, N, D))
  chex.assert_trees_all_close(layer(x, context=x), layer(x), atol=1e-5, rtol=1e-5)


def test_cross_attention_under_jit_and_on_the_linen_layer():
  kw = dict(num_pseudo=P, num_kv_heads=G, causal=False, rope_theta=None, use_bias=True)
  nnx_layer = InterleavedHeadAttention(D, H, d, rngs=nnx.Rngs(0), **kw)
  p = _randomised(nnx_layer)
  x, context = _normal(1, (B, N, D)), _normal(2, (B, M, D))
  linen = AttentionLinen(nnx_layer.config)
  y_linen = jax.jit(lambda p, x, c: linen.apply({"params": p}, x, context=c))(p, x, context)
  y_nnx = nnx.jit(lambda m, x, c: m(x, context=c))(nnx_layer, x, context)
  chex.assert_trees_all_close(y_linen, y_nnx, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(
  "layer_kw,call_kw,match",
  [
    (dict(causal=True), {}, "build it with causal=False"),
    (dict(rope_theta=10000.0), {}, "rope_theta=None"),
    (dict(window=4), {}, "window=None"),
    ({}, dict(segment_ids=jnp.ones((B, N), jnp.int32)), "segment_ids belongs to self-att"),
    ({}, dict(return_probabilities=True), "return_probabilities belongs"),
    ({}, dict(context=jnp.ones((B + 1, M, D))), r"context must have shape \[B, M, model_dim\]"),
    ({}, dict(context=jnp.ones((B, M, D + 1))), "context must have shape"),
    ({}, dict(context=jnp.ones((B, M, D), jnp.int32)), "context must be a floating array"),
    ({}, dict(mask=jnp.ones((B, 1, N, M), bool)), r"mask of shape \(2, 1, 5, 3\): with context"),
  ],
)
def test_cross_attention_refuses_what_it_cannot_mean(layer_kw, call_kw, match):
  layer = _cross_layer("iha", **layer_kw)
  call_kw = {"context": _normal(2, (B, M, D)), **call_kw}
  with pytest.raises(ValueError, match=match):
    layer(_normal(1, (B, N, D)), **call_kw)


def test_cross_attention_refuses_kinds_without_a_pseudo_head_form_and_dropout():
  layer = Attention(D, H, d, kind="talking_heads", causal=False, rope_theta=None, rngs=nnx.Rngs(0))
  x, context = _normal(1, (B, N, D)), _normal(2, (B, M, D))
  with pytest.raises(ValueError, match="talking_heads attention has no cross-attention"):
    layer(x, context=context)
  dropping = _cross_layer("iha", dropout_rate=0.1, implementation="xla")
  with pytest.raises(ValueError, match="no attention dropout"):
    dropping(x, context=context, deterministic=False)
  chex.assert_shape(dropping(x, context=context, deterministic=True), (B, N, D))
