"""What every TPU (Pallas Mosaic) kernel here shares: the vreg's shape, the MXU's
products, RoPE's rotate-half in VMEM, and running a kernel compiled on TPU or interpreted
elsewhere. Each family's own layouts stay with it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import tpu as pltpu

LANES = 128  # a vreg's lanes: the last dimension of every block
SUBLANES = 8  # float32 rows per vreg (a sublane tile)
PACKED_SUBLANES = 16  # bf16 packs 16 rows per vreg: bf16 tiles are multiples of it

# `lax.dot_general` dimension numbers of the products the kernels take.
NT = (((1,), (1,)), ((), ()))  # a @ b.T
NN = (((1,), (0,)), ((), ()))  # a @ b
TN = (((0,), (0,)), ((), ()))  # a.T @ b


def dot(a: jax.Array, b: jax.Array, dims, exact: bool) -> jax.Array:
  """A float32-accumulated matmul on the MXU; `exact`: true float32 products (float32
  inputs: the MXU's default precision rounds them to bf16)."""
  precision = lax.Precision.HIGHEST if exact else None
  return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32, precision=precision)


def scalar_div(a, b: int):
  """Division of non-negative int32 scalars (grid indices) by a constant; Mosaic lowers
  `lax.div`, not jnp's floor division."""
  return a if b == 1 else lax.div(a, jnp.int32(b))


def scalar_rem(a, b: int):
  """The remainder of `scalar_div`."""
  return jnp.zeros_like(a) if b == 1 else lax.rem(a, jnp.int32(b))


def rotate(x: jax.Array, cos: jax.Array, sin: jax.Array, inverse: bool = False) -> jax.Array:
  """RoPE of the rows of `x: [rows, d]` (float32): `x cos + swap(x) sin` with the tables'
  `cos = [c, c]`, `sin = [-s, s]` and `swap([x1, x2]) = [x2, x1]` (a lane rotation by
  d/2); `inverse`: the transpose, `x cos - swap(x) sin` (gradients back to unrotated)."""
  swapped = pltpu.roll(x, x.shape[1] // 2, 1) * sin
  return x * cos - swapped if inverse else x * cos + swapped


def on_tpu(call: Callable[..., jax.Array], *args):
  """`call(*args, interpret=...)`: compiled by Mosaic when lowering for TPU, Pallas' TPU
  interpreter anywhere else (CPU tests)."""
  compiled = functools.partial(call, interpret=False)
  return lax.platform_dependent(
    *args, default=functools.partial(call, interpret=True), tpu=compiled
  )
