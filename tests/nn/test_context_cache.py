"""Cross-attention over a cached context: its keys and values projected once equal the
call with the context itself, in both layouts, NNX and Linen."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from iha_jax.nn import Attention, AttentionConfig, AttentionLinen

B, N, M, D, H, HEAD_DIM, P = 2, 3, 5, 16, 2, 8, 3


def _config(kind: str, **kw) -> AttentionConfig:
  return AttentionConfig(
    kind=kind,
    model_dim=D,
    num_heads=H,
    head_dim=HEAD_DIM,
    num_pseudo=P if kind == "iha" else None,
    causal=False,
    rope_theta=None,
    implementation="reference",
    **kw,
  )


def _inputs():
  x = jax.random.normal(jax.random.key(1), (B, N, D))
  context = jax.random.normal(jax.random.key(2), (B, M, D))
  valid = jnp.array([[True] * M, [True] * 2 + [False] * (M - 2)])[:, None, None, :]
  return x, context, valid


@pytest.mark.parametrize("mode", ["source", "pseudo"])
@pytest.mark.parametrize("kind,kv_heads", [("iha", None), ("iha", 1), ("mha", None)])
def test_a_cached_context_equals_the_context(kind, kv_heads, mode):
  layer = Attention(config=_config(kind, num_kv_heads=kv_heads), rngs=nnx.Rngs(0))
  x, context, valid = _inputs()
  expected = layer(x, context=context, mask=valid)
  cache = layer.cache_context(context, mask=valid, mode=mode)
  slots = M * P if (mode == "pseudo" and kind == "iha") else M
  assert cache.k.shape == (B, slots, kv_heads or H, HEAD_DIM)
  for step in range(2):  # the same cache serves every call
    got = layer(x[:, step:], context=cache)
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected[:, step:]), atol=2e-6)


def test_linen_caches_the_context_too():
  layer = AttentionLinen(_config("iha"))
  x, context, valid = _inputs()
  variables = layer.init(jax.random.key(0), x, context=context)
  expected = layer.apply(variables, x, context=context, mask=valid)
  cache = layer.apply(variables, context, mask=valid, mode="pseudo", method="cache_context")
  got = layer.apply(variables, x, context=cache)
  np.testing.assert_allclose(np.asarray(got), np.asarray(expected), atol=2e-6)


def test_a_context_cache_refuses_a_mask_and_another_layer():
  layer = Attention(config=_config("iha"), rngs=nnx.Rngs(0))
  x, context, valid = _inputs()
  cache = layer.cache_context(context)
  with pytest.raises(ValueError, match="a context cache holds its context's validity; mask"):
    layer(x, context=cache, mask=valid)
  other = Attention(config=_config("iha", num_kv_heads=1), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="made for another layer: its kv_heads 2"):
    other(x, context=cache)
