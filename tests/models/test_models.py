"""`TransformerLM`: schedule, config errors, parameter trees, causality, packing, gradients."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from iha_jax.models import TransformerConfig, TransformerLM, count_params, expand_schedule
from iha_jax.nn import InterleavedHeadAttention, MultiHeadAttention

B, N, V, D, H, HEAD_DIM, F = 2, 6, 32, 16, 2, 4, 24


def _config(**kw) -> TransformerConfig:
  base = dict(
    vocab_size=V,
    num_layers=2,
    model_dim=D,
    num_heads=H,
    head_dim=HEAD_DIM,
    mlp_dim=F,
    iha_window=3,
    mha_window=2,
    implementation="reference",
  )
  return TransformerConfig(**{**base, **kw})


def _tokens(seed: int = 0, shape=(B, N)) -> jax.Array:
  return jax.random.randint(jax.random.key(seed), shape, 0, V, jnp.int32)


# --- schedule and config -----------------------------------------------------------------


@pytest.mark.parametrize(
  "schedule,num_layers,expected",
  [("LLLLM", 10, "LLLLMLLLLM"), ("LLLLM", 3, "LLL"), ("M", 4, "MMMM"), ("ILMS", 6, "ILMSIL")],
)
def test_expand_schedule(schedule, num_layers, expected):
  assert expand_schedule(schedule, num_layers) == expected


@pytest.mark.parametrize(
  "schedule,num_layers,match",
  [
    ("", 2, "non-empty"),
    ("LQM", 2, r"unknown letter 'Q'.*allowed letters: I .*L .*M .*S .*T .*D .*X "),
    ("l", 2, "unknown letter 'l'"),
    ("M", 0, "num_layers"),
  ],
)
def test_expand_schedule_errors(schedule, num_layers, match):
  with pytest.raises(ValueError, match=match):
    expand_schedule(schedule, num_layers)


@pytest.mark.parametrize(
  "kwargs,match",
  [
    (dict(attention_schedule="LLQ"), "attention_schedule.*'Q'"),
    (dict(attention_schedule=""), "attention_schedule"),
    (dict(attention_schedule="LM", iha_window=None), "iha_window"),
    (dict(attention_schedule="SM", mha_window=None), "mha_window"),
    (dict(iha_window=0, attention_schedule="L"), "window"),
    (dict(vocab_size=0), "vocab_size"),
    (dict(num_layers=0), "num_layers"),
    (dict(mlp_dim=-1), "mlp_dim"),
    (dict(head_dim=3), "head_dim"),
    (dict(num_pseudo=0), "num_pseudo"),
    (dict(collapse_mode="diag"), "collapse_mode"),
    (dict(norm_eps=0.0), "norm_eps"),
    (dict(mlp_type="relu"), "mlp_type"),
    (dict(attention_schedule="D", num_heads=3), "num_heads must be even for 'D'"),
    (dict(num_outputs=0), "num_outputs"),
    (dict(mixing_noise_std=-0.5), "mixing_noise_std"),
    (dict(causal="yes"), "causal must be a bool"),
    (dict(attention_schedule="T", implementation="pallas_gpu"), "no 'pallas_gpu'"),
  ],
)
def test_config_errors(kwargs, match):
  with pytest.raises(ValueError, match=match):
    _config(**kwargs)


def test_windows_not_needed_without_window_layers():
  assert _config(attention_schedule="IM", iha_window=None, mha_window=None).schedule == "IM"


def test_layers_follow_schedule():
  model = TransformerLM(
    _config(attention_schedule="ILMS", num_layers=5, num_pseudo=3, rope_theta=500.0),
    rngs=nnx.Rngs(0),
  )
  kinds = [(type(b.attn), b.attn.config.window, b.attn.config.rope_theta) for b in model.layers]
  assert kinds == [
    (InterleavedHeadAttention, None, 500.0),
    (InterleavedHeadAttention, 3, 500.0),
    (MultiHeadAttention, None, 500.0),
    (MultiHeadAttention, 2, 500.0),
    (InterleavedHeadAttention, None, 500.0),
  ]
  assert model.layers[0].attn.config.num_pseudo == 3
  assert [b.letter for b in model.layers] == list("ILMSI")
  model = TransformerLM(
    _config(attention_schedule="TDX", num_layers=3, causal=False), rngs=nnx.Rngs(0)
  )
  assert [
    (b.attn.config.kind, b.attn.config.num_heads, b.attn.config.causal) for b in model.layers
  ] == [("talking_heads", H, False), ("diff", H // 2, False), ("simplicial", H, False)]
  assert model.layers[1].attn.config.layer == 2  # differential lambda_init depth
  assert model.layers[2].attn.config.rope_theta is None  # 2-simplicial: no RoPE


# --- parameter trees ---------------------------------------------------------------------


@pytest.mark.parametrize("tie_embeddings", [True, False])
def test_param_tree_and_count(tie_embeddings):
  cfg = _config(attention_schedule="LM", tie_embeddings=tie_embeddings)
  model = TransformerLM(cfg, rngs=nnx.Rngs(0))
  params = nnx.state(model, nnx.Param)
  shapes = jax.tree.map(jnp.shape, nnx.to_pure_dict(params))
  axes = {
    k: v.get_metadata()["out_sharding"] for k, v in params.items() if isinstance(v, nnx.Param)
  }
  assert shapes["embedding"] == (V, D) and axes["embedding"] == ("vocab", "embed")
  assert set(shapes["layers"][0]) == {"attn_norm", "attn", "mlp_norm", "mlp"}
  assert set(shapes["layers"][0]["attn"]) == {
    "wq",
    "wk",
    "wv",
    "wo",
    "alpha_q",
    "alpha_k",
    "alpha_v",
    "collapse",
  }
  assert set(shapes["layers"][1]["attn"]) == {"wq", "wk", "wv", "wo"}
  assert shapes["layers"][1]["mlp"] == {"w_gate": (D, F), "w_up": (D, F), "w_down": (F, D)}
  mlp_axes = {k: v.get_metadata()["out_sharding"] for k, v in params["layers"][1]["mlp"].items()}
  assert mlp_axes == {
    "w_gate": ("embed", "mlp"),
    "w_up": ("embed", "mlp"),
    "w_down": ("mlp", "embed"),
  }
  assert params["final_norm"]["scale"].get_metadata()["out_sharding"] == ("embed",)
  if tie_embeddings:
    assert "lm_head" not in shapes
  else:
    assert shapes["lm_head"] == (D, V) and axes["lm_head"] == ("embed", "vocab")

  per_layer = 2 * D + 4 * D * H * HEAD_DIM + 3 * D * F
  expected = V * D + 2 * per_layer + 4 * H * H * H + D + (0 if tie_embeddings else D * V)
  assert count_params(model) == expected == count_params(params)


# --- forward -----------------------------------------------------------------------------


class ForwardTest(chex.TestCase):
  @chex.variants(with_jit=True, without_jit=True)
  def test_logits_shape_and_dtype(self):
    model = TransformerLM(_config(attention_schedule="LS", dtype=jnp.bfloat16), rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    logits = self.variant(lambda s, t: nnx.merge(graphdef, s)(t))(state, _tokens())
    chex.assert_shape(logits, (B, N, V))
    chex.assert_type(logits, jnp.float32)
    chex.assert_tree_all_finite(logits)


@pytest.mark.parametrize("schedule", ["I", "L", "M", "S", "LLLLM", "TDX"])
def test_causality(schedule):
  """Changing token n leaves logits at positions < n unchanged."""
  model = TransformerLM(
    _config(attention_schedule=schedule, num_layers=len(schedule) + 1), rngs=nnx.Rngs(1)
  )
  forward = jax.jit(lambda t: model(t))
  tokens = _tokens(1)
  base = forward(tokens)
  for n in (0, 3, N - 1):
    changed = forward(tokens.at[:, n].set((tokens[:, n] + 1) % V))
    chex.assert_trees_all_close(changed[:, :n], base[:, :n], atol=1e-6, rtol=1e-6)
    assert np.abs(np.asarray(changed[:, n:] - base[:, n:])).max() > 1e-4


@pytest.mark.full
def test_encoder_sees_later_tokens_and_has_a_per_token_head():
  """causal=False: changing the last token changes every position's outputs."""
  model = TransformerLM(
    _config(attention_schedule="LMT", num_layers=3, causal=False, num_outputs=5), rngs=nnx.Rngs(1)
  )
  tokens = _tokens(1)
  base = model(tokens)
  chex.assert_shape(base, (B, N, 5))
  changed = model(tokens.at[:, -1].set((tokens[:, -1] + 1) % V))
  assert np.abs(np.asarray(changed - base)).max(axis=(0, 2)).min() > 1e-4


def test_packed_segments_match_separate_sequences():
  """Segment 2 of a packed row (positions restarting at 0) equals it run on its own."""
  model = TransformerLM(_config(attention_schedule="ILMS", num_layers=4), rngs=nnx.Rngs(2))
  tokens = _tokens(2, (1, N))
  segment_ids = jnp.array([[1, 1, 2, 2, 2, 2]], jnp.int32)
  positions = jnp.array([[0, 1, 0, 1, 2, 3]], jnp.int32)
  forward = jax.jit(lambda t, seg, pos: model(t, segment_ids=seg, positions=pos))
  packed = forward(tokens, segment_ids, positions)
  alone = forward(tokens[:, 2:], None, None)
  chex.assert_trees_all_close(packed[:, 2:], alone, atol=1e-5, rtol=1e-5)


def test_rejects_bad_tokens():
  model = TransformerLM(_config(attention_schedule="M", num_layers=1), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="tokens"):
    model(_tokens()[0])
  with pytest.raises(ValueError, match="tokens"):
    model(_tokens().astype(jnp.float32))


@pytest.mark.parametrize("collapse_mode", ["full", "per_head"])
def test_jit_grad_step(collapse_mode):
  model = TransformerLM(
    _config(
      attention_schedule="LM",
      collapse_mode=collapse_mode,
      tie_embeddings=False,
      implementation="xla",
    ),
    rngs=nnx.Rngs(3),
  )
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  tokens = _tokens(3)

  @jax.jit
  def loss_and_grad(params):
    def loss_fn(params):
      logits = nnx.merge(graphdef, params, rest)(tokens[:, :-1])
      return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    return jax.value_and_grad(loss_fn)(params)

  loss, grads = loss_and_grad(params)
  assert np.isfinite(loss)
  chex.assert_trees_all_equal_shapes(grads, params)
  chex.assert_tree_all_finite(grads)
  for name in ("alpha_q", "alpha_k", "alpha_v", "collapse"):
    assert np.abs(np.asarray(grads["layers"][0]["attn"][name][...])).max() > 0, name
  for path, g in jax.tree_util.tree_leaves_with_path(grads):
    assert np.abs(np.asarray(g)).max() > 0, jax.tree_util.keystr(path)


@pytest.mark.full
def test_gelu_mlp_has_two_matrices_with_gradients():
  cfg = _config(attention_schedule="LM", mlp_type="gelu", implementation="xla")
  model = TransformerLM(cfg, rngs=nnx.Rngs(0))
  shapes = jax.tree.map(jnp.shape, nnx.to_pure_dict(nnx.state(model, nnx.Param)))
  assert shapes["layers"][0]["mlp"] == {"w_up": (D, F), "w_down": (F, D)}
  tokens = jax.random.randint(jax.random.PRNGKey(0), (2, 6), 0, V)
  grads = nnx.grad(lambda m: jnp.mean(m(tokens) ** 2))(model)
  for leaf in jax.tree.leaves(nnx.to_pure_dict(grads["layers"][0]["mlp"])):
    assert jnp.all(jnp.isfinite(leaf)) and jnp.any(leaf != 0)
