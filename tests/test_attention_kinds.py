"""One conformance harness for every attention kind: each memory-efficient implementation
against the kind's dense "reference", forward and every gradient, causal and
bidirectional, with windows, packed segments and padding; plus the registry, the
special cases that tie the kinds together, causality probes and argument errors.

The Pallas kernels of IHA and MHA have their own interpret-mode harness in
tests/test_kernels.py (they need a platform context); differential attention through
the kernels is checked here because it runs both maps as one MHA call. The references
themselves are checked against float64 loops in tests/test_ops_reference.py.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from iha_jax import ops
from iha_jax.ops import registry
from tests.utils import assert_close, packed_positions, packed_segments, random_iha_inputs

B, N, H, D = 2, 7, 2, 8  # N = 7 divides none of the blocks below


@dataclasses.dataclass(frozen=True)
class Kind:
  """How to build random inputs for one kind and call its entry point."""

  make: Callable[[jax.Array], tuple[jax.Array, ...]]  # key -> differentiable float32 args
  call: Callable[..., jax.Array]  # (*args, **options) -> output
  blocks: ops.BlockSizes  # several tiles even at N = 7
  rope: bool = True


def _normal(key, *shapes):
  return tuple(jax.random.normal(k, s) for k, s in zip(jax.random.split(key, len(shapes)), shapes))


KINDS = {
  "iha": Kind(
    lambda key: random_iha_inputs(key, B, N, H, D, 2), ops.iha_attention, ops.BlockSizes(4, 4)
  ),
  # Other head counts, P and the block-diagonal collapse (fewer masks: same code paths).
  "iha_p3_h4_per_head": Kind(
    lambda key: random_iha_inputs(key, B, N, 4, D, 3, per_head=True),
    ops.iha_attention,
    ops.BlockSizes(6, 3),
  ),
  "iha_p1_h1": Kind(
    lambda key: random_iha_inputs(key, B, N, 1, D, 1), ops.iha_attention, ops.BlockSizes(4, 4)
  ),
  # v twice as wide as q and k (as differential attention uses MHA).
  "mha": Kind(
    lambda key: _normal(key, (B, N, H, D), (B, N, H, D), (B, N, H, 2 * D)),
    ops.mha_attention,
    ops.BlockSizes(4, 4),
  ),
  "talking_heads": Kind(
    lambda key: _normal(key, (B, N, H, D), (B, N, H, D), (B, N, H, D), (H, H), (H, H)),
    ops.talking_heads_attention,
    ops.BlockSizes(3),
  ),
  "diff": Kind(
    lambda key: _normal(key, (B, N, H, 2, D), (B, N, H, 2, D), (B, N, H, 2 * D), (H,)),
    ops.diff_attention,
    ops.BlockSizes(4, 4),
  ),
  "simplicial": Kind(
    lambda key: tuple(x * 0.7 for x in _normal(key, *[(B, N, H, D)] * 5)),
    ops.simplicial_attention,
    ops.BlockSizes(3),
    rope=False,
  ),
}

MASKS = {
  "causal": dict(causal=True, window=None),
  "causal_window_packed": dict(causal=True, window=3, packed=True),
  "bidirectional": dict(causal=False, window=None),
  "bidirectional_window_packed": dict(causal=False, window=3, packed=True),
  # A window at least T long must take the global path; RoPE at arbitrary positions.
  "window_longer_than_sequence": dict(causal=True, window=1000),
  "random_positions": dict(causal=False, window=None, random_positions=True),
}


def _options(kind: Kind, mask: str) -> dict:
  spec = MASKS[mask]
  options = dict(causal=spec["causal"], window=spec["window"])
  if spec.get("packed"):
    options["segment_ids"] = packed_segments(B, N)
    if kind.rope:
      options["positions"] = packed_positions(options["segment_ids"])
  if spec.get("random_positions"):
    options["positions"] = jnp.asarray(
      np.random.default_rng(0).integers(0, 4 * N, (B, N)), jnp.int32
    )
  return options


def _value_and_grads(fn, args, cotangent):
  out, vjp = jax.vjp(fn, *args)
  return out, vjp(cotangent.astype(out.dtype))


BASIC_MASKS = ("causal", "causal_window_packed", "bidirectional", "bidirectional_window_packed")
CASES = [
  (k, m, jnp.float32)
  for k in ("iha", "mha", "talking_heads", "diff", "simplicial")
  for m in BASIC_MASKS
]
CASES += [
  ("iha", "window_longer_than_sequence", jnp.float32),
  ("iha_p3_h4_per_head", "random_positions", jnp.float32),
  ("iha_p3_h4_per_head", "causal_window_packed", jnp.float32),
  ("iha_p1_h1", "causal_window_packed", jnp.float32),
  ("iha_p1_h1", "bidirectional", jnp.float32),
]
CASES += [
  (k, "bidirectional_window_packed", jnp.bfloat16)
  for k in ("iha", "iha_p3_h4_per_head", "mha", "talking_heads", "diff", "simplicial")
]
CASES += [("iha", "causal_window_packed", jnp.bfloat16)]


@pytest.mark.parametrize(
  "name, mask, dtype", CASES, ids=[f"{k}-{m}-{jnp.dtype(t).name}" for k, m, t in CASES]
)
def test_xla_matches_reference(name, mask, dtype):
  kind = KINDS[name]
  seed = list(KINDS).index(name) * 10 + list(MASKS).index(mask)
  key, ct_key = jax.random.split(jax.random.key(seed))
  low = tuple(x.astype(dtype) for x in kind.make(key))
  exact = tuple(x.astype(jnp.float32) for x in low)  # the oracle sees the rounded values
  options = _options(kind, mask)
  ref = jax.jit(lambda *a: kind.call(*a, implementation="reference", **options))
  xla = jax.jit(lambda *a: kind.call(*a, implementation="xla", block_sizes=kind.blocks, **options))
  cotangent = jax.random.normal(ct_key, jax.eval_shape(ref, *exact).shape)
  want = _value_and_grads(ref, exact, cotangent)
  got = _value_and_grads(xla, low, cotangent)
  assert got[0].dtype == dtype
  assert_close(got[0], want[0], dtype, "out")
  assert_close(got[1], want[1], dtype, "grads")


@pytest.mark.parametrize(
  "blocks, window",
  [(ops.BlockSizes(8, 4), None), (ops.BlockSizes(4, 16), 4), (None, 4)],
  ids=["bq8_bk4", "bq4_bk16", "default"],
)
def test_xla_block_shapes_agree(blocks, window):
  """Unequal, default and larger-than-T tiles all give the reference answer."""
  args = random_iha_inputs(jax.random.key(1), B, 11, 2, D, 3)
  cotangent = jax.random.normal(jax.random.key(2), (B, 11, 2, D))
  run = lambda implementation, block_sizes=None: _value_and_grads(
    jax.jit(
      lambda *a: ops.iha_attention(
        *a, window=window, implementation=implementation, block_sizes=block_sizes
      )
    ),
    args,
    cotangent,
  )
  assert_close(run("xla", blocks), run("reference"), jnp.float32)


def test_jit_and_eager_agree():
  args = random_iha_inputs(jax.random.key(9), B, N, 2, D, 2)
  fn = lambda *a: ops.iha_attention(
    *a,
    window=4,
    segment_ids=packed_segments(B, N),
    implementation="xla",
    block_sizes=ops.BlockSizes(4, 4),
  )
  assert_close(fn(*args), jax.jit(fn)(*args), jnp.float32)


def test_diff_through_mha_kernels():
  """Both differential maps as one Pallas MHA call (Triton, interpret mode), value width
  2d. The MHA kernels themselves, both backends, are checked in tests/test_kernels.py."""
  kind = KINDS["diff"]
  args = kind.make(jax.random.key(5))
  options = _options(kind, "bidirectional_window_packed")
  cotangent = jax.random.normal(jax.random.key(6), (B, N, H, 2 * D))
  got = _value_and_grads(
    lambda *a: ops.diff_attention(
      *a, implementation="pallas_gpu", block_sizes=ops.BlockSizes(8, 8), **options
    ),
    args,
    cotangent,
  )
  want = _value_and_grads(
    lambda *a: ops.diff_attention(*a, implementation="reference", **options), args, cotangent
  )
  assert_close(got, want, jnp.float32)


@pytest.mark.parametrize("name", ["talking_heads", "diff"])
def test_memory_efficient_paths_hold_no_dense_score_map(name):
  """Neither the forward nor the backward of the xla path has a `[.., N, N]` array; the
  reference does (so the check can fail)."""
  n = 24  # no other axis is 24 long
  kind = KINDS[name]
  args = tuple(
    jax.ShapeDtypeStruct((B, n, *x.shape[2:]) if x.ndim >= 4 else x.shape, x.dtype)
    for x in kind.make(jax.random.key(0))
  )

  def program(implementation):
    loss = lambda *a: jnp.sum(
      kind.call(*a, implementation=implementation, causal=False, block_sizes=ops.BlockSizes(8, 8))
      ** 2
    )
    grad = jax.grad(loss, argnums=tuple(range(len(args))))
    return jax.jit(grad).lower(*args).as_text()

  dense = re.compile(rf"tensor<(?:\d+x)*{n}x{n}x(?:f32|bf16)>")
  assert not dense.search(program("xla"))
  assert dense.search(program("reference"))


# --- registry ------------------------------------------------------------------------------


def test_registry_entries_resolve_and_auto_falls_back_to_xla():
  for kind in registry.KINDS:
    for implementation in registry.implementations(kind):
      assert callable(registry.lookup(kind, implementation))
    if jax.default_backend() == "cpu":
      assert registry.resolve(kind, "auto") == "xla"
  assert set(registry.implementations("talking_heads")) == {"reference", "xla"}
  assert set(registry.implementations("diff")) == set(registry.implementations("mha"))


def test_ops_does_not_import_the_kernels():
  """`iha_jax.ops` sits below `iha_jax.kernels`: importing it must not load them."""
  code = "import sys, iha_jax.ops; assert 'iha_jax.kernels' not in sys.modules"
  subprocess.run([sys.executable, "-c", code], check=True)


# --- special cases tying the kinds together -------------------------------------------------


@pytest.mark.parametrize("causal", [True, False])
def test_identity_mixings_reduce_to_mha(causal):
  """P = 1 IHA with identity mixing, identity Talking-Heads and lam = 0 differential
  attention (its first map) all equal plain MHA, causal or bidirectional."""
  q, k, v = _normal(jax.random.key(7), *[(B, N, H, D)] * 3)
  options = dict(causal=causal, window=3, segment_ids=packed_segments(B, N), implementation="xla")
  mha = ops.mha_attention(q, k, v, **options)
  eye = jnp.eye(H)
  iha = ops.iha_attention(q, k, v, *([eye[:, :, None]] * 4), **options)
  talking = ops.talking_heads_attention(q, k, v, eye, eye, **options)
  diff = ops.diff_attention(jnp.stack([q, k], 3), jnp.stack([k, q], 3), v, 0.0, **options)
  for name, out in (("iha", iha), ("talking_heads", talking), ("diff", diff)):
    assert_close(out, mha, jnp.float32, name)


def test_simplicial_with_one_visible_pair_is_the_value_product():
  """A query seeing only itself attends to the single pair (i, i): out = v1 * v2."""
  q, k1, k2, v1, v2 = _normal(jax.random.key(8), *[(B, N, H, D)] * 5)
  out = ops.simplicial_attention(q, k1, k2, v1, v2, window=1, implementation="xla")
  assert_close(out, v1 * v2, jnp.float32)


# --- causality probes ------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("name", ["iha", "mha", "talking_heads", "diff", "simplicial"])
def test_causality_probe(name, causal):
  """Changing token n's inputs leaves outputs before n unchanged iff causal."""
  kind = KINDS[name]
  args = kind.make(jax.random.key(9))
  fn = jax.jit(lambda *a: kind.call(*a, causal=causal, implementation="xla"))
  base = fn(*args)
  n = 4
  tokens = [x.ndim >= 4 for x in args]  # per-token inputs (not the mixing matrices / lam)
  changed = fn(*(x.at[:, n].add(1.0) if is_token else x for x, is_token in zip(args, tokens)))
  before = np.abs(np.asarray(changed[:, :n] - base[:, :n])).max()
  after = np.abs(np.asarray(changed[:, n:] - base[:, n:])).max()
  assert after > 1e-3
  if causal:
    assert before <= 1e-6, before
  else:
    assert before > 1e-3, before


# --- argument errors (before anything is traced) ---------------------------------------------


def test_bad_arguments_name_the_argument():
  q, k, v, tl, tw = KINDS["talking_heads"].make(jax.random.key(0))
  with pytest.raises(ValueError, match="talk_logits"):
    ops.talking_heads_attention(q, k, v, tl[:1], tw)
  with pytest.raises(ValueError, match="causal must be a bool"):
    ops.mha_attention(q, k, v, causal="no")
  with pytest.raises(ValueError, match="talking_heads attention has no 'pallas_gpu'"):
    ops.talking_heads_attention(q, k, v, tl, tw, implementation="pallas_gpu")
  with pytest.raises(ValueError, match="implementation must be one of"):
    ops.mha_attention(q, k, v, implementation="cuda")
  dq, dk, dv, lam = KINDS["diff"].make(jax.random.key(0))
  with pytest.raises(ValueError, match=r"\[B, N, H, 2, d\]"):
    ops.diff_attention(q, k, dv, lam)
  with pytest.raises(ValueError, match="lam must be a scalar or"):
    ops.diff_attention(dq, dk, dv, jnp.ones(H + 1))
  with pytest.raises(ValueError, match="v must have shape"):
    ops.diff_attention(dq, dk, dv[:, :3], lam)
  with pytest.raises(ValueError, match="q, k1, k2, v1 and v2 must have the same shape"):
    ops.simplicial_attention(q, k, v, q, k[..., :4])
  with pytest.raises(ValueError, match="q, k and v must have the same shape"):
    ops.iha_attention(q, k, dv, *([jnp.eye(H)[:, :, None]] * 4))


def test_simplicial_refuses_oversized_scores():
  big = jax.ShapeDtypeStruct((1, 600, 2, 8), jnp.float32)
  with pytest.raises(ValueError, match="MAX_SCORES"):
    jax.eval_shape(lambda *a: ops.simplicial_attention(*a, implementation="reference"), *[big] * 5)
  # The XLA path holds one block of queries: the same shape fits.
  out = jax.eval_shape(lambda *a: ops.simplicial_attention(*a, implementation="xla"), *[big] * 5)
  assert out.shape == big.shape
  huge = jax.ShapeDtypeStruct((8, 8192, 4, 8), jnp.float32)
  with pytest.raises(ValueError, match="use a window"):
    jax.eval_shape(lambda *a: ops.simplicial_attention(*a, implementation="xla"), *[huge] * 5)
