"""Attention pictures: maps are the layer's real probabilities; PNG heat-maps are written."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from iha_jax.eval.attention_maps import (
  MIN_GRID_PIXELS,
  PANEL_PIXELS,
  attention_maps,
  grid_step,
  plot_attention_maps,
)
from iha_jax.models import TransformerConfig, TransformerLM
from iha_jax.ops import collapse_heads, deinterleave, interleave, pseudo_mix
from tests.utils import decode_png

N, V, H, HEAD_DIM, P = 7, 37, 3, 8, 2


@pytest.fixture(scope="module")
def model() -> TransformerLM:
  config = TransformerConfig(
    vocab_size=V,
    num_layers=3,
    model_dim=24,
    num_heads=H,
    head_dim=HEAD_DIM,
    mlp_dim=32,
    num_pseudo=P,
    attention_schedule="LIM",
    iha_window=5,
    implementation="reference",
  )
  return TransformerLM(config, rngs=nnx.Rngs(0))


def _tokens() -> jax.Array:
  return jax.random.randint(jax.random.key(1), (N,), 0, V, jnp.int32)


@pytest.mark.parametrize("layer_number,t,window", [(1, N * P, 5), (2, N * P, None), (3, N, None)])
def test_maps_are_causal_windowed_distributions(model, layer_number, t, window):
  probs = attention_maps(model, _tokens(), layer_number=layer_number)
  assert probs.shape == (H, t, t)
  np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-5)
  query, key = np.arange(t)[:, None], np.arange(t)[None, :]
  hidden = key > query if window is None else (key > query) | (query - key >= window)
  assert np.all(probs[:, hidden] == 0.0)
  assert np.all(probs[:, ~hidden] > 0.0)


def test_padding_rows_are_zero_and_segments_do_not_mix(model):
  segment_ids = jnp.asarray([1, 1, 1, 2, 2, 0, 0], jnp.int32)
  positions = jnp.asarray([0, 1, 2, 0, 1, 0, 0], jnp.int32)
  probs = attention_maps(
    model, _tokens(), layer_number=2, segment_ids=segment_ids, positions=positions
  )
  virtual_segments = np.repeat(np.asarray(segment_ids), P)
  rows = probs.sum(-1)
  np.testing.assert_allclose(rows[:, virtual_segments != 0], 1.0, rtol=1e-5)
  assert np.all(rows[:, virtual_segments == 0] == 0.0)
  cross = virtual_segments[:, None] != virtual_segments[None, :]
  assert np.all(probs[:, cross] == 0.0)


def test_maps_reproduce_the_layer_output(model):
  # The probabilities applied to the pseudo-values, collapsed and projected, must give
  # the attention module's own output: the pictures show what the layer computes.
  block = model.layers[0]
  x = block.attn_norm(model.embed(_tokens()[None]))
  attn = block.attn
  y, probs = attn(x, return_probabilities=True)  # the layer's own call
  np.testing.assert_array_equal(np.asarray(y), np.asarray(attn(x)))
  v = jnp.einsum("bnD,Dhd->bnhd", x, attn.wv[...])
  values = interleave(pseudo_mix(v, attn.alpha_v[...]))
  out = jnp.einsum("bhts,bshd->bthd", probs, values)
  out = collapse_heads(deinterleave(out, P), attn.collapse[...])
  np.testing.assert_allclose(
    np.asarray(jnp.einsum("bnhd,hdD->bnD", out, attn.wo[...])),
    np.asarray(attn(x)),
    rtol=1e-5,
    atol=1e-5,
  )


def test_plot_writes_png(model, tmp_path):
  probs = attention_maps(model, _tokens(), layer_number=1)
  path = tmp_path / "layer1.png"
  fig = plot_attention_maps(probs, P, path, title="layer 1 (L)")
  decode_png(path, dpi=120, figure=fig)
  panels = [ax for ax in fig.axes if ax.images]  # (the colour bar has none)
  assert len(panels) == H
  for head, ax in enumerate(panels):  # each panel shows its head's map, causal and banded
    shown = np.asarray(ax.images[0].get_array())
    np.testing.assert_array_equal(shown, probs[head])
    assert np.all(np.triu(shown, 1) == 0.0) and np.all(np.diag(shown) > 0.0)


def test_token_lines_never_crowd_out_the_band():
  """A line every P virtual tokens is ~5 px apart at the demo's T = 128, P = 2: lines then
  go every k tokens, at least MIN_GRID_PIXELS apart; large blocks keep one per token."""
  step = grid_step(128, 2)
  assert step % 2 == 0 and step * PANEL_PIXELS / 128 >= MIN_GRID_PIXELS
  assert (step - 2) * PANEL_PIXELS / 128 < MIN_GRID_PIXELS  # the densest that is readable
  assert grid_step(16, 2) == 2 and grid_step(8, 1) == 1
  assert grid_step(20, 20) is None  # one token: nothing to outline


def test_bad_arguments(model, tmp_path):
  with pytest.raises(ValueError, match=r"layer_number must be an integer in 1\.\.3"):
    attention_maps(model, _tokens(), layer_number=0)
  with pytest.raises(ValueError, match="tokens must be one sequence"):
    attention_maps(model, jnp.zeros((2, N), jnp.int32), layer_number=1)
  with pytest.raises(ValueError, match="num_pseudo"):
    plot_attention_maps(np.zeros((H, 5, 5)), 2, tmp_path / "x.png")
  with pytest.raises(ValueError, match="probs"):
    plot_attention_maps(np.zeros((5, 5)), 1, tmp_path / "x.png")
