"""Every attention kind's XLA path against its dense "reference" through the shared
harness (tests/conformance.py), forward and every gradient, causal and bidirectional,
with windows, packed segments and padding; plus the registry, the special cases that
tie the kinds together, causality probes and argument errors.

The Pallas kernels go through the same harness in tests/kernels/test_kernels.py; differential
attention through the kernels is checked here because it runs both maps as one MHA
call. The references themselves are checked against float64 loops in
tests/core/test_reference.py.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from iha_jax import ops
from iha_jax.core.grouped import grouped_attention_heads_major
from iha_jax.core.masking import Mask
from iha_jax.kinds import registry
from tests import conformance as cf
from tests.utils import assert_close, packed_segments, random_iha_inputs

B, N, H, D = 2, 7, 2, 8  # N = 7 divides none of the blocks below


# (kind, block sizes: several tiles even at N = 7)
KINDS = {
  "iha": (cf.iha(H, D, 2), ops.BlockSizes(4, 4)),
  # Other head counts, P and the block-diagonal collapse (fewer masks: same code paths).
  "iha_p3_h4_per_head": (cf.iha(4, D, 3, per_head=True), ops.BlockSizes(6, 3)),
  "iha_p1_h1": (cf.iha(1, D, 1), ops.BlockSizes(4, 4)),
  # v twice as wide as q and k (as differential attention uses MHA).
  "mha": (cf.mha(H, D, 2 * D), ops.BlockSizes(4, 4)),
  "talking_heads": (cf.talking_heads(H, D), ops.BlockSizes(3)),
  "diff": (cf.diff(H, D), ops.BlockSizes(4, 4)),
  "simplicial": (cf.simplicial(H, D), ops.BlockSizes(3)),
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


def _make(name: str, seed: int) -> tuple[jax.Array, ...]:
  return KINDS[name][0].make(jax.random.key(seed), B, N)


def _case(kind: str, mask: str, dtype=jnp.float32, *, full: bool = False):
  marks = (pytest.mark.full,) if full else ()
  return pytest.param(kind, mask, dtype, id=f"{kind}-{mask}-{jnp.dtype(dtype).name}", marks=marks)


BASIC_MASKS = ("causal", "causal_window_packed", "bidirectional", "bidirectional_window_packed")
# `make test`: every mask for IHA, a causal window for the other kinds (their bidirectional
# class in bfloat16 below); every pair in test-all.
CASES = [
  _case(k, m, full=k != "iha" and m != "causal_window_packed")
  for k in ("iha", "mha", "talking_heads", "diff", "simplicial")
  for m in BASIC_MASKS
]
CASES += [
  _case("iha", "window_longer_than_sequence"),
  _case("iha_p3_h4_per_head", "random_positions"),
  _case("iha_p3_h4_per_head", "causal_window_packed"),
  _case("iha_p1_h1", "causal_window_packed"),
  _case("iha_p1_h1", "bidirectional", full=True),
]
CASES += [
  _case(k, "bidirectional_window_packed", jnp.bfloat16)
  for k in ("iha", "iha_p3_h4_per_head", "mha", "talking_heads", "diff", "simplicial")
]
CASES += [_case("iha", "causal_window_packed", jnp.bfloat16)]


@pytest.mark.parametrize("name, mask, dtype", CASES)
def test_xla_matches_reference(name, mask, dtype):
  kind, blocks = KINDS[name]
  seed = list(KINDS).index(name) * 10 + list(MASKS).index(mask)
  cf.check(kind, "xla", b=B, n=N, mask=MASKS[mask], dtype=dtype, blocks=blocks, seed=seed)


@pytest.mark.parametrize(
  "blocks, window",
  [
    pytest.param(ops.BlockSizes(8, 4), None, marks=pytest.mark.full),
    pytest.param(ops.BlockSizes(4, 16), 4, marks=pytest.mark.full),
    (None, 4),
  ],
  ids=["bq8_bk4", "bq4_bk16", "default"],
)
def test_xla_block_shapes_agree(blocks, window):
  """Unequal, default and larger-than-T tiles all give the reference answer."""
  args = random_iha_inputs(jax.random.key(1), B, 11, 2, D, 3)
  cotangent = jax.random.normal(jax.random.key(2), (B, 11, 2, D))
  run = lambda implementation, block_sizes=None: cf.value_and_grads(
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
  2d, over three 16-token tiles (GPU tiles are at least 16 rows). The MHA kernels
  themselves, both backends, are checked in tests/kernels/test_kernels.py."""
  mask = MASKS["bidirectional_window_packed"]
  blocks = ops.BlockSizes(16, 16)
  cf.check(cf.diff(H, D), "pallas_gpu", b=B, n=40, mask=mask, blocks=blocks, seed=5)


@pytest.mark.parametrize("name", ["talking_heads", "diff"])
def test_memory_efficient_paths_hold_no_dense_score_map(name):
  """Neither the forward nor the backward of the xla path has a `[.., N, N]` array; the
  reference does (so the check can fail)."""
  n = 24  # no other axis is 24 long
  kind = KINDS[name][0]
  args = jax.eval_shape(lambda: kind.make(jax.random.key(0), B, n))

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
  for kind in registry.names():
    for implementation in registry.implementations(kind):
      assert callable(registry.lookup(kind, implementation))
    if jax.default_backend() == "cpu":
      assert registry.resolve(kind, "auto") == "xla"
  assert set(registry.implementations("talking_heads")) == {"reference", "xla"}
  # Differential attention runs through MHA with values 2d wide, which cuDNN's path lacks.
  assert set(registry.implementations("diff")) == set(registry.implementations("mha")) - {"cudnn"}


def test_resolve_keeps_a_cached_call_of_one_token_on_xla():
  """The layer never picks an implementation: a cached call hands its new tokens, and
  "auto" runs one token on the XLA core (no kernel tiles for its P query rows), more on
  the platform's kernels; a named implementation stays as named."""
  q = jnp.ones((1, 1, 2, 8))
  for backend, kernel in (("tpu", "pallas_tpu"), ("gpu", "pallas_gpu")):
    with registry.auto_backend(backend):
      assert registry.resolve("mha", "auto", q, q, ops.AttentionOptions(), new_tokens=1) == "xla"
      assert registry.resolve("iha", "auto", new_tokens=1) == "xla"
      assert registry.resolve("iha", "auto", new_tokens=2) == kernel
      assert registry.resolve("iha", kernel, new_tokens=1) == kernel


def test_probabilities_come_through_the_registry_on_xla():
  """`attend(..., probabilities=True)`: every implementation name resolves to the kind's
  XLA probabilities; rows sum to one; kinds without them, and sliced calls, are refused."""
  q, k, v, *mixing = random_iha_inputs(jax.random.key(0), 2, 6, 2, 8, 3)
  for implementation in ("auto", "reference", "pallas_tpu"):
    assert registry.resolve("iha", implementation, probabilities=True) == "xla"
  probs = registry.attend("iha", q, k, v, *mixing, probabilities=True, implementation="reference")
  assert probs.shape == (2, 2, 18, 18) and probs.dtype == jnp.float32
  np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-5)
  assert float(jnp.triu(probs[0, 0], 1).max()) == 0.0  # causal
  with pytest.raises(ValueError, match="talking_heads attention has no attention probabilities"):
    registry.resolve("talking_heads", "auto", probabilities=True)
  with pytest.raises(ValueError, match="iha attention probabilities take the keys of its"):
    registry.attend("iha", q, k, v, *mixing, probabilities=True, query_offset=1)


# --- special cases tying the kinds together -------------------------------------------------


@pytest.mark.parametrize("causal", [True, False])
def test_identity_mixings_reduce_to_mha(causal):
  """P = 1 IHA with identity mixing, identity Talking-Heads and lam = 0 differential
  attention (its first map) all equal plain MHA, causal or bidirectional."""
  q, k, v = cf.normal(jax.random.key(7), *[(B, N, H, D)] * 3)
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
  q, k1, k2, v1, v2 = cf.normal(jax.random.key(8), *[(B, N, H, D)] * 5)
  out = ops.simplicial_attention(q, k1, k2, v1, v2, window=1, implementation="xla")
  assert_close(out, v1 * v2, jnp.float32)


# --- causality probes ------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("name", ["iha", "mha", "talking_heads", "diff", "simplicial"])
def test_causality_probe(name, causal):
  """Changing token n's inputs leaves outputs before n unchanged iff causal."""
  kind = KINDS[name][0]
  args = _make(name, 9)
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
  q, k, v, tl, tw = _make("talking_heads", 0)
  with pytest.raises(ValueError, match="talk_logits"):
    ops.talking_heads_attention(q, k, v, tl[:1], tw)
  with pytest.raises(ValueError, match="causal must be a bool"):
    ops.mha_attention(q, k, v, causal="no")
  with pytest.raises(ValueError, match="talking_heads attention has no 'pallas_gpu'"):
    ops.talking_heads_attention(q, k, v, tl, tw, implementation="pallas_gpu")
  with pytest.raises(ValueError, match="implementation must be one of"):
    ops.mha_attention(q, k, v, implementation="cuda")
  dq, dk, dv, lam = _make("diff", 0)
  with pytest.raises(ValueError, match=r"\[B, N, H, 2, d\]"):
    ops.diff_attention(q, k, dv, lam)
  with pytest.raises(ValueError, match="lam must be a scalar or"):
    ops.diff_attention(dq, dk, dv, jnp.ones(H + 1))
  with pytest.raises(ValueError, match="v must have shape"):
    ops.diff_attention(dq, dk, dv[:, :3], lam)
  with pytest.raises(ValueError, match="q, k1, k2, v1 and v2 must have the same shape"):
    ops.simplicial_attention(q, k, v, q, k[..., :4])
  with pytest.raises(ValueError, match=r"k and v must have the same shape \[B, N, G, d\]"):
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


def test_xla_attention_dropout_is_dense_attention_with_the_tile_masks():
  """Dropout in the XLA core, forward and gradients, equals dense attention whose weights
  take the same per-tile masks (drawn from the key folded with the tile numbers) and the
  undropped normaliser; a window and grouped-query keys exercise the tile skipping."""
  b, h, g, t, d, block, window, rate = 2, 4, 2, 12, 8, 4, 7, 0.4
  r = h // g
  key = jax.random.key(5)
  q, k, v, ct = (
    jax.random.normal(jax.random.key(i), (b, x, t, d)) for i, x in enumerate((h, g, g, h))
  )
  mask, blocks = Mask(window=window), dict(block_q=block, block_k=block)

  def core(q, k, v):
    return grouped_attention_heads_major(
      q, k, v, mask, **blocks, dropout_rate=rate, dropout_rng=key
    )

  def dense(q, k, v):
    # The grouped fold: row `t * r + m` of group g's query axis is query t of member m, so
    # query tile i holds the `block` positions of every member (`block * r` rows).
    qg = jnp.swapaxes(q.reshape(b, g, r, t, d), 2, 3).reshape(b, g, t * r, d)
    s = jnp.einsum("bgqd,bgkd->bgqk", qg, k, precision="highest") * d**-0.5
    qi, ki = jnp.repeat(jnp.arange(t), r)[:, None], jnp.arange(t)[None, :]
    p = jax.nn.softmax(jnp.where((ki <= qi) & (qi - ki < window), s, -1e30), axis=-1)
    tile = lambda i, j: jax.random.bernoulli(
      jax.random.fold_in(jax.random.fold_in(key, i), j), 1 - rate, (b, g, block * r, block)
    )
    keep = jnp.block([[tile(i, j) for j in range(t // block)] for i in range(t // block)])
    dropped = jnp.where(keep, p / (1 - rate), 0.0)
    out = jnp.einsum("bgqk,bgkd->bgqd", dropped, v, precision="highest")
    return jnp.swapaxes(out.reshape(b, g, t, r, d), 2, 3).reshape(b, h, t, d)

  assert_close(jax.jit(core)(q, k, v), jax.jit(dense)(q, k, v), jnp.float32, "dropout forward")
  loss = lambda f: lambda *a: jnp.sum(f(*a) * ct)
  got = jax.jit(jax.grad(loss(core), argnums=(0, 1, 2)))(q, k, v)
  want = jax.jit(jax.grad(loss(dense), argnums=(0, 1, 2)))(q, k, v)
  for name, a, e in zip("qkv", got, want):
    assert_close(a, e, jnp.float32, f"dropout d{name}")
  plain = grouped_attention_heads_major(q, k, v, mask, **blocks)
  np.testing.assert_array_equal(
    plain, grouped_attention_heads_major(q, k, v, mask, **blocks, dropout_rng=key)
  )


# --- the XLA band's edge ------------------------------------------------------------------
def _dense_window_attention(q, k, v, window: int, causal: bool) -> np.ndarray:
  """Softmax attention of `[B, N, H, d]` arrays under the window rule, from scratch in
  float64: key s is visible to query t when `0 <= t - s < window` (causal) or
  `|t - s| < window`."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  delta = np.arange(q.shape[1])[:, None] - np.arange(k.shape[1])[None, :]
  seen = (delta >= 0) & (delta < window) if causal else np.abs(delta) < window
  scores = np.einsum("bthd,bshd->bhts", q, k) / np.sqrt(q.shape[-1])
  scores = np.where(seen, scores, -np.inf)
  weights = np.exp(scores - scores.max(-1, keepdims=True))
  weights /= weights.sum(-1, keepdims=True)
  return np.einsum("bhts,bshd->bthd", weights, v)


@pytest.mark.parametrize(
  "causal, windows", [(True, range(1, 8)), (False, range(2, 6))], ids=["causal", "bidirectional"]
)
def test_xla_band_reaches_the_window_edge_at_every_width(causal, windows):
  """The XLA core's key band (`xla_attention.block_ranges`) includes the tile holding
  the window's first key for every width: with 4-query and 3-key tiles the window's edge
  falls on a key tile's last key for most widths (tests/mutants.py:
  `band_edge`)."""
  n = 13
  q, k, v = (jax.random.normal(key, (2, n, 2, 8)) for key in jax.random.split(jax.random.key(4), 3))
  for window in windows:
    got = ops.mha_attention(
      q,
      k,
      v,
      window=window,
      causal=causal,
      rope_theta=None,
      implementation="xla",
      block_sizes=ops.BlockSizes(4, 3),
    )
    want = _dense_window_attention(q, k, v, window, causal)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=f"window={window}")
