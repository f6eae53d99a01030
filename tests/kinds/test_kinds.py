"""A new attention kind is one record plus one `register` call: a toy kind, defined in this
test alone, builds in NNX and Linen, trains a step through `TransformerLM`'s trainer,
counts in the budget and is refused by decoding, naming itself. Its layer core makes the
one checked call every kind makes (`kinds.attend`), with its own array check."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from iha_jax import kinds, parallel
from iha_jax.core.validation import check_options
from iha_jax.kinds import AttentionConfig, AttentionKind, Letter, ParamSpec, project_qkv
from iha_jax.models import FunctionalTransformerLM, TransformerConfig, TransformerLM
from iha_jax.models.generate import prefill
from iha_jax.nn import Attention, AttentionLinen
from iha_jax.ops import mha_attention
from iha_jax.parallel.axes import HEADS
from iha_jax.train import flops
from iha_jax.train.optimizer import decay_mask, learning_rate_schedule, make_optimizer
from iha_jax.train.state import create_state
from iha_jax.train.step import make_train_step
from tests.fixtures import train_settings


def _gated(q, k, v, gain, options, *, inner: str):
  """MHA with a learned per-head output gain: `gain[h] * attention_h`."""
  out = mha_attention(q, k, v, options.replace(implementation=inner))
  return out * gain.astype(out.dtype)[:, None]


class GatedHeads(AttentionKind):
  """The toy kind: letters G (global) and W (window, tokens), one extra parameter."""

  name = "gated_toy"
  letters = (Letter("G", False, "toy gated heads"), Letter("W", True, "toy gated, windowed"))
  implementations = {
    "reference": functools.partial(_gated, inner="reference"),
    "xla": functools.partial(_gated, inner="xla"),
  }
  mixing_params = ("head_gain",)

  def check_arrays(self, q, k, v, gain):
    if gain.shape != q.shape[2:3]:
      raise ValueError(f"gain must have shape [H] = {list(q.shape[2:3])}, got {gain.shape}")

  def param_specs(self, cfg, kernel_init, mixing_noise_std):
    gain = ParamSpec((cfg.num_heads,), (HEADS,), jax.nn.initializers.ones)
    return {**super().param_specs(cfg, kernel_init, mixing_noise_std), "head_gain": gain}

  def core(self, params, x, cfg, options, layer):
    q, k, v = project_qkv(params, x)
    return kinds.attend(self, q, k, v, params["head_gain"], options=options)


@pytest.fixture
def toy():
  record = kinds.register(GatedHeads())
  yield record
  kinds.unregister(record.name)
  assert "G" not in kinds.LETTER_DESCRIPTIONS and record.name not in kinds.names()


CONFIG = dict(
  vocab_size=32,
  num_layers=3,
  model_dim=16,
  num_heads=2,
  head_dim=8,
  mlp_dim=32,
  attention_schedule="GWM",
  mha_window=3,
  implementation="xla",
)


def test_toy_kind_builds_in_nnx_and_linen_alike(toy):
  cfg = AttentionConfig(16, 2, 8, kind=toy.name, window=3)
  layer = Attention.from_config(cfg, rngs=nnx.Rngs(0))
  assert sorted(layer.param_values()) == ["head_gain", "wk", "wo", "wq", "wv"]
  x = jax.random.normal(jax.random.key(1), (2, 6, 16))
  linen = AttentionLinen(cfg)
  variables = linen.init(jax.random.key(0), x)
  params = {name: box.unbox() for name, box in variables["params"].items()}
  nnx.update(layer, nnx.State({name: nnx.Param(value) for name, value in params.items()}))
  np.testing.assert_allclose(linen.apply(variables, x), layer(x), rtol=1e-6, atol=1e-6)
  # The gain does what the record says: zero gain on head 1 removes its output.
  gain = jnp.asarray([1.0, 0.0])
  expected = layer(x) - jnp.einsum(
    "bnd,dD->bnD",
    _gated(
      *(jnp.einsum("bnD,Dhd->bnhd", x, layer.param_values()[w]) for w in ("wq", "wk", "wv")),
      jnp.ones(2),
      check_options(jnp.zeros((2, 6, 2, 8)), cfg.options()),
      inner="xla",
    )[:, :, 1],
    layer.param_values()["wo"][1],
  )
  layer.head_gain[...] = gain
  np.testing.assert_allclose(layer(x), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.full
def test_toy_kind_trains_through_the_trainer(toy):
  config = TransformerConfig(**CONFIG)
  model_nnx = TransformerLM(config, rngs=nnx.Rngs(0))
  assert [type(b.attn).__name__ for b in model_nnx.layers] == [
    "Attention",
    "Attention",
    "MultiHeadAttention",
  ]
  assert model_nnx.layers[1].attn.config.window == 3  # 'W' reads mha_window (tokens)
  model = FunctionalTransformerLM(config)
  train = train_settings(final_learning_rate=1e-3, total_steps=4)
  tx = make_optimizer(train)
  mesh = parallel.create_mesh(dict(data=1, fsdp=1, tensor=1))
  state, _ = create_state(model, tx, mesh, seed=0)
  mask = decay_mask(state.params)
  assert not mask["layers"]["0"]["attn"]["head_gain"]  # a mixing param: not decayed
  tokens = jax.random.randint(jax.random.key(3), (4, 9), 1, 32)
  batch = {
    "inputs": tokens[:, :-1],
    "targets": tokens[:, 1:],
    "weights": jnp.ones((4, 8)),
    "segment_ids": jnp.ones((4, 8), jnp.int32),
    "positions": jnp.broadcast_to(jnp.arange(8, dtype=jnp.int32), (4, 8)),
  }
  step = jax.jit(make_train_step(model, tx, learning_rate_schedule(train), 1))
  gain_before = state.params["layers"]["0"]["attn"]["head_gain"]
  for _ in range(2):  # the first step's rate is 0 (warm-up from 0)
    state, metrics = step(state, batch)
    assert bool(metrics["finite"]) and np.isfinite(float(metrics["loss"]))
  assert not np.allclose(state.params["layers"]["0"]["attn"]["head_gain"], gain_before)
  # The budget counts it (MHA-like core by default) and decoding refuses it by name.
  table = flops.budget_table(config, seq_len=8)
  assert "gated_toy" in table and "3 tokens" in table
  with pytest.raises(ValueError, match="gated_toy attention, which does not decode"):
    prefill(model_nnx, tokens[:1], max_len=12)


def test_a_kind_defining_the_old_attend_hook_is_told_entry_arrays(monkeypatch):
  """The record's layer hook `attend(params, q, k, v, cfg, options)` became `entry_arrays`
  (`attend` names the registry's checked call alone): a kind still defining it is told
  when it is defined, since the layers no longer call it."""
  from iha_jax import checks

  monkeypatch.setattr(checks, "_DEPRECATIONS_WARNED", set())
  with pytest.deprecated_call(match="OldStyle.attend is deprecated; use entry_arrays"):

    class OldStyle(GatedHeads):
      def attend(self, params, q, k, v, cfg, options):
        return q


def test_registration_refuses_taken_names_and_letters(toy):
  class Clash(GatedHeads):
    name = "clash_toy"
    letters = (Letter("M", False, "steals MHA's letter"),)

  with pytest.raises(ValueError, match="letter 'M' belongs to kind 'mha'"):
    kinds.register(Clash())
  with pytest.raises(ValueError, match="already registered"):
    kinds.register(GatedHeads())
  with pytest.raises(ValueError, match=r"kind must be one of .*gated_toy"):
    AttentionConfig(16, 2, 8, kind="nope")

  class ByName(GatedHeads):  # implementations named as "module:function" strings
    name = "by_name_toy"
    letters = ()
    implementations = {**GatedHeads.implementations, "xla": "tests.test_kinds:_gated"}

  with pytest.raises(TypeError, match="implementation 'xla' must be a callable"):
    kinds.register(ByName())
  # The toy's own array check runs in the one checked call.
  q = jnp.zeros((1, 4, 2, 8))
  with pytest.raises(ValueError, match=r"gain must have shape \[H\] = \[2\]"):
    kinds.attend(toy, q, q, q, jnp.ones(3))
  assert kinds.implementations(toy.name) == ("reference", "xla")
