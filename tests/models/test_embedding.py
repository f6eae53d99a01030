"""The token lookup's two gradient forms: the one-hot matmul equals XLA's scatter-add."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from iha_jax.kinds import registry
from iha_jax.models import embedding


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_matmul_gradient_is_the_scatter_adds(dtype):
  keys = jax.random.split(jax.random.key(0), 3)
  table = jax.random.normal(keys[0], (37, 16))
  tokens = jax.random.randint(keys[1], (3, 11), 0, 37)  # repeats: rows summed
  tokens = tokens.at[0, :4].set(5)
  cotangent = jax.random.normal(keys[2], (3, 11, 16)).astype(dtype)
  found = {}
  for form in ("scatter", "matmul"):
    out, vjp = jax.vjp(lambda t, form=form: embedding.lookup(t, tokens, dtype, form), table)
    found[form] = out, vjp(cotangent)[0]
  np.testing.assert_array_equal(found["scatter"][0], found["matmul"][0])
  assert found["matmul"][1].dtype == table.dtype
  np.testing.assert_allclose(found["matmul"][1], found["scatter"][1], rtol=1e-6, atol=1e-6)
  assert np.abs(np.asarray(found["matmul"][1][5])).sum() > 0


def test_auto_takes_the_matmul_on_tpu_where_libtpu_would_scatter_slowly():
  assert embedding.gradient_form(128256, 2560, 16384) == "scatter"  # this CPU
  with registry.auto_backend("tpu"):
    assert embedding.gradient_form(128256, 2560, 16384) == "matmul"  # the 2.4B step
    assert embedding.gradient_form(32768, 1024, 8192) == "matmul"  # the 350M step
    assert embedding.gradient_form(131072, 2560, 16384) == "scatter"  # fused scatter
    assert embedding.gradient_form(2**20, 2**12, 2**18) == "scatter"  # past the MXU's gain
    grad = jax.grad(lambda t: embedding.lookup(t, jnp.array([1, 2, 3]), jnp.bfloat16).sum())
    text = str(jax.make_jaxpr(grad)(jnp.ones((8, 4))))
  assert "scatter" not in text and "dot_general" in text
  with registry.auto_backend("gpu"):
    assert embedding.gradient_form(128256, 2560, 16384) == "scatter"


def test_a_devices_tokens_are_split_over_the_batch_and_length_axes():
  mesh = jax.sharding.AbstractMesh(
    (2, 2, 2, 1), ("data", "fsdp", "context", "tensor"),
    axis_types=(jax.sharding.AxisType.Explicit,) * 4,
  )  # fmt: skip
  tokens = jax.ShapeDtypeStruct((8, 64), jnp.int32)
  assert embedding.tokens_per_device(tokens) == 512
  with jax.sharding.use_abstract_mesh(mesh):
    assert embedding.tokens_per_device(tokens) == 64


def test_an_unknown_form_is_refused_by_name():
  with pytest.raises(ValueError, match="gradient must be 'auto', 'scatter' or 'matmul'"):
    embedding.lookup(jnp.ones((4, 2)), jnp.array([0]), jnp.float32, "onehot")


def test_the_config_names_the_form_and_refuses_others():
  from configs import default
  from iha_jax.train import config as config_lib

  config = default.get_config()
  config.model.vocab_size = 64
  config.model.embedding_gradient = "matmul"
  assert config_lib.validate(config, 1).embedding_gradient == "matmul"
  config.model.embedding_gradient = "onehot"
  with pytest.raises(config_lib.ConfigError, match="embedding_gradient must be one of"):
    config_lib.validate(config, 1)
