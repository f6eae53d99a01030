"""Mesh construction, logical-axis rules, and IHA's tensor-parallel communication pattern."""

from __future__ import annotations

import re

import flax.linen as nn
import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from iha_jax import parallel
from iha_jax.nn import InterleavedHeadAttention


def test_rules_map_logical_names_to_mesh_axes():
  assert parallel.logical_to_mesh_spec(P("embed", "heads", "head_dim")) == P("fsdp", "tensor", None)
  assert parallel.logical_to_mesh_spec(P("heads_src", "heads", "pseudo")) == P(None, "tensor", None)
  assert parallel.logical_to_mesh_spec(P("activation_batch", None)) == P(("data", "fsdp"), None)
  # A mesh axis shards at most one dimension of an array.
  assert parallel.logical_to_mesh_spec(P("heads", "mlp")) == P("tensor", None)
  with pytest.raises(ValueError, match="'bogus' has no rule"):
    parallel.logical_to_mesh_spec(P("bogus"))


@pytest.mark.parametrize(
  "sizes, devices, expected",
  [
    (dict(data=1, fsdp=-1, tensor=1), 8, (1, 8, 1, 1)),  # context left out: 1
    (dict(data=2, fsdp=-1, tensor=2), 8, (2, 2, 1, 2)),
    (dict(data=-1, fsdp=1, tensor=4), 8, (2, 1, 1, 4)),
    (dict(data=1, fsdp=2, tensor=1), 8, (1, 2, 1, 1)),
    (dict(data=1, fsdp=1, context=-1, tensor=2), 8, (1, 1, 4, 2)),
    (dict(data=2, tensor=2), 8, (2, 1, 1, 2)),  # every axis left out: size one
  ],
)
def test_resolve_mesh_shape(sizes, devices, expected):
  assert parallel.resolve_mesh_shape(sizes, devices) == expected


@pytest.mark.parametrize(
  "sizes, message",
  [
    (dict(data=4, fsdp=4, tensor=1), "needs 16 devices, only 8"),
    (dict(data=-1, fsdp=-1, tensor=1), "at most one mesh axis may be -1"),
    (dict(data=1, fsdp=-1, tensor=3), "mesh.fsdp=-1: 8 devices are not divisible"),
    (dict(data=0, fsdp=1, tensor=1), "mesh.data must be"),
  ],
)
def test_resolve_mesh_shape_errors(sizes, message):
  with pytest.raises(ValueError, match=re.escape(message)):
    parallel.resolve_mesh_shape(sizes, 8)


def test_create_mesh_axes():
  mesh = parallel.create_mesh(dict(data=2, fsdp=2, tensor=2))
  assert mesh.axis_names == ("data", "fsdp", "context", "tensor")
  assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "context": 1, "tensor": 2}


def _collective_sizes(hlo: str) -> list[int]:
  """Element counts of the results of every collective in optimized HLO text."""
  sizes = []
  for line in hlo.splitlines():
    match = re.search(
      r"= (\w+)\[([\d,]*)\][^ ]* (all-gather|all-reduce|reduce-scatter|"
      r"all-to-all|collective-permute)(-start)?\(",
      line,
    )
    if match:
      dims = [int(x) for x in match.group(2).split(",") if x]
      sizes.append(int(np.prod(dims)) if dims else 1)
  return sizes


def test_iha_tensor_parallel_communicates_source_heads_not_pseudo_heads():
  """Under tensor=2, one IHA layer moves at most [B, N, H, d]-sized q/k/v tensors: the
  P-times larger pseudo-heads [B, N, H, P, d] never cross devices, and the output matches
  the unsharded layer."""
  b, n, d_model, h, d, p = 2, 16, 32, 4, 8, 4
  layer = InterleavedHeadAttention(
    d_model, h, d, num_pseudo=p, implementation="xla", mixing_noise_std=0.1, rngs=nnx.Rngs(0)
  )
  params = nnx.to_pure_dict(nnx.state(layer, nnx.Param))
  specs = nnx.to_pure_dict(nnx.get_partition_spec(nnx.state(layer, nnx.Param)))
  graphdef = nnx.split(layer)[0]
  x = jax.random.normal(jax.random.key(1), (b, n, d_model))
  mesh = parallel.create_mesh(dict(data=1, fsdp=1, tensor=2))
  shardings = parallel.named_shardings(mesh, specs)
  forward = lambda params, x: nnx.merge(graphdef, params)(x)  # noqa: E731
  with parallel.activate(mesh):
    sharded = jax.jit(forward, in_shardings=(shardings, None))
    hlo = sharded.lower(params, x).compile().as_text()
    out = sharded(params, x)
  np.testing.assert_allclose(np.asarray(out), np.asarray(forward(params, x)), rtol=1e-5, atol=1e-5)
  sizes = _collective_sizes(hlo)
  assert sizes, "expected q/k/v all-gathers over the tensor axis"
  # Gathered q/k/v are [B, N, H, d]; the only larger tensor is the output all-reduce
  # [B, N, D] of the row-parallel output projection (D = 32 = H*d here).
  assert max(sizes) <= b * n * max(h * d, d_model) < b * n * h * p * d, sizes


def test_kernel_axes_follow_the_rules_and_skip_manual_axes():
  """The axes the Pallas kernels' shard_map splits over: the rules' batch and head axes,
  minus axes already manual (a caller's own shard_map); none left: call directly."""
  from jax.sharding import AbstractMesh, AxisType  # pylint: disable=import-outside-toplevel

  from iha_jax.parallel.sharding import kernel_axes  # pylint: disable=import-outside-toplevel

  names = ("data", "fsdp", "tensor")
  mesh = lambda *types: AbstractMesh((2, 2, 2), names, axis_types=types)
  auto, manual = AxisType.Auto, AxisType.Manual
  assert kernel_axes(mesh(auto, auto, auto)) == dict(
    batch_axes=("data", "fsdp"), head_axis="tensor"
  )
  assert kernel_axes(mesh(manual, auto, manual)) == dict(batch_axes=("fsdp",), head_axis=None)
  assert kernel_axes(mesh(manual, manual, manual)) is None
  assert kernel_axes(AbstractMesh((), ())) is None


def test_rules_for_a_mesh_of_your_own():
  """Roles map a user's own axis names; roles left out stay unsharded; an axis the mesh
  lacks fails in one line naming it; the project's rules drop the axes a mesh lacks."""
  mesh = jax.make_mesh((4, 2), ("dp", "tp"))
  rules = dict(parallel.logical_rules({"batch": "dp", "heads": "tp", "mlp": None}, mesh))
  assert rules["activation_batch"] == ("dp",) and rules["activation_heads"] == ("tp",)
  assert rules["heads"] == ("tp",) and rules["mlp"] is None and rules["embed"] is None
  assert rules["activation_length"] is None
  with pytest.raises(ValueError, match=r"'heads' -> 'model': the mesh has no axis 'model' "):
    parallel.logical_rules({"heads": "model"}, mesh)
  with pytest.raises(ValueError, match="'head' is neither a role"):
    parallel.logical_rules({"head": "tp"})
  with pytest.raises(ValueError, match="'embed' -> 'fsdp': the mesh has no axis 'fsdp'"):
    with parallel.activate(mesh, parallel.LOGICAL_AXIS_RULES):
      pass
  only_data = jax.make_mesh((8,), ("data",))
  with parallel.activate(only_data):  # the project's rules: fsdp, context, tensor size one
    active = dict(nn.get_logical_axis_rules())
  assert active["activation_batch"] == ("data",) and active["heads"] is None


def test_meshes_of_your_own_names_are_refused_without_rules():
  """`create_mesh` takes the project's axis names only (others would have been dropped,
  leaving a one-device mesh); a mesh of your own names needs rules for `activate` and
  `named_shardings`: each refusal is one line naming the axes and the fix."""
  with pytest.raises(ValueError) as error:
    parallel.create_mesh({"dp": 4, "tp": 2})
  message = str(error.value)
  assert "\n" not in message and "['dp', 'tp']" in message and "logical_rules" in message
  mesh = jax.make_mesh((4, 2), ("dp", "tp"))
  specs = {"w": jax.sharding.PartitionSpec("embed", "heads")}
  for call in (
    lambda: parallel.named_shardings(mesh, specs, None),
    lambda: parallel.activate(mesh).__enter__(),
  ):
    with pytest.raises(ValueError, match=r"mesh axes \('dp', 'tp'\) are not the project's"):
      call()
  rules = parallel.logical_rules({"batch": "dp", "heads": "tp"}, mesh)
  sharded = parallel.named_shardings(mesh, specs, rules)
  assert sharded["w"].spec == jax.sharding.PartitionSpec(None, "tp")


def test_named_shardings_without_shapes_keeps_kv_heads_whole():
  """Without `shapes=`, G = 2 key/value heads under a tensor split of 4 stay whole (the
  specs do not say G; split, device_put fails in JAX); with shapes (`param_shardings`)
  they stay whole here too and split where the axis divides G. The placed layer runs."""
  from iha_jax.nn import logical_specs, param_shardings  # pylint: disable=import-outside-toplevel

  layer = InterleavedHeadAttention(32, 4, 8, num_kv_heads=2, num_pseudo=2, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(layer)
  mesh = jax.make_mesh((2, 4), ("dp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  rules = {"batch": "dp", "heads": "tp"}
  shardings = parallel.named_shardings(mesh, logical_specs(state), rules)
  assert shardings["wk"].spec == jax.sharding.PartitionSpec(None, None, None)
  assert shardings["alpha_k"].spec == jax.sharding.PartitionSpec(None, None, None)
  assert shardings["wq"].spec == jax.sharding.PartitionSpec(None, "tp", None)
  assert param_shardings(mesh, state, rules)["wk"].spec == shardings["wk"].spec
  x = jax.random.normal(jax.random.key(1), (2, 8, 32))
  with parallel.activate(mesh, rules):
    placed = jax.device_put(state, shardings)
    y = jax.jit(lambda state, x: nnx.merge(graphdef, state)(x))(placed, x)
  np.testing.assert_allclose(np.asarray(y), np.asarray(layer(x)), atol=1e-5)
  split = jax.make_mesh((4, 2), ("dp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  assert param_shardings(split, state, rules)["wk"].spec == jax.sharding.PartitionSpec(
    None, "tp", None
  )
