"""What every GPU (Pallas Triton) kernel here shares: Triton's block shapes, the tensor
cores' products, the online softmax over key tiles, a program's launch, and running a
kernel compiled on cuda/rocm or interpreted elsewhere. Each family's own layouts stay
with it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import triton as plgpu

from iha_jax.core.masking import MASK_VALUE

MIN_BLOCK = 16  # Triton dots need every dimension >= 16

# `lax.dot_general` dimension numbers of the products the kernels take.
NT = (((1,), (1,)), ((), ()))  # a @ b.T
NN = (((1,), (0,)), ((), ()))  # a @ b
TN = (((0,), (0,)), ((), ()))  # a.T @ b


def block_pow2(x: int) -> int:
  """`x` rows or lanes as a Triton block: a power of two >= `MIN_BLOCK`."""
  return max(MIN_BLOCK, 1 << max(0, x - 1).bit_length())


def dot(a: jax.Array, b: jax.Array, dims) -> jax.Array:
  """A float32-accumulated matmul: tensor cores for 16-bit inputs; float32 inputs get true
  float32 products (on the CUDA cores)."""
  precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
  return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32, precision=precision)


@dataclasses.dataclass(frozen=True)
class Launch:
  """Warps and software-pipeline stages of one kernel."""

  num_warps: int
  num_stages: int

  def compiler_params(self) -> plgpu.CompilerParams:
    return plgpu.CompilerParams(num_warps=self.num_warps, num_stages=self.num_stages)


def barrier(interpret: bool) -> None:
  """Stores of an output block by other threads visible (a read-modify-write of the
  program's own block); nothing to wait for in Pallas' interpreter."""
  if not interpret:
    plgpu.debug_barrier()


def on_gpu(call: Callable[..., jax.Array], *args):
  """`call(*args, interpret=...)`: compiled by Triton when lowering for cuda/rocm, Pallas'
  interpreter anywhere else (CPU tests)."""
  compiled = functools.partial(call, interpret=False)
  return lax.platform_dependent(
    *args, default=functools.partial(call, interpret=True), cuda=compiled, rocm=compiled
  )


def softmax_init(rows: int, width: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(running max, running sum `[rows]`, output accumulator `[rows, width]`) before the
  first key tile."""
  return (
    jnp.full((rows,), MASK_VALUE, jnp.float32),
    jnp.zeros((rows,), jnp.float32),
    jnp.zeros((rows, width), jnp.float32),
  )


def softmax_step(s, visible, m, l, *, transposed: bool = False):
  """One key tile of the online softmax: scores `s [queries, keys]` (`[keys, queries]`
  if `transposed`), their mask, the running max `m` and sum `l` -> (m, l, the tile's
  probabilities relative to the new max (float32, 0 where masked), the factor that
  rescales what was accumulated before: `acc = rescale * acc + probs @ v`)."""
  keys = 0 if transposed else 1
  per_query = (lambda x: x[None, :]) if transposed else (lambda x: x[:, None])
  s = jnp.where(visible, s, MASK_VALUE)
  m_next = jnp.maximum(m, jnp.max(s, axis=keys))
  probs = jnp.where(visible, jnp.exp(s - per_query(m_next)), 0.0)
  rescale = jnp.exp(m - m_next)
  l = rescale * l + jnp.sum(probs, axis=keys)
  return m_next, l, probs, rescale


def softmax_output(acc: jax.Array, l: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(output `acc / l`, the sums with 1 for rows that saw no key: their output is 0)."""
  l_safe = jnp.where(l == 0.0, 1.0, l)
  return acc / l_safe[:, None], l_safe


def probabilities(s, visible, lse, *, transposed: bool = False) -> jax.Array:
  """The softmax's probabilities of scores `s` again (the backward), from each query's
  log-sum-exp `lse`: 0 where masked."""
  per_query = lse[None, :] if transposed else lse[:, None]
  return jnp.where(visible, jnp.exp(s - per_query), 0.0)
