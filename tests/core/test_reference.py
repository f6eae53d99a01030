"""The "reference" implementation against an independent naive loop, and spec facts."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from iha_jax import ops
from tests.utils import assert_close, packed_positions, packed_segments, random_iha_inputs


def _naive_rope(x: np.ndarray, position: float, theta: float) -> np.ndarray:
  """Rotate-half RoPE of one vector `[d]` written from the spec's formula."""
  half = x.shape[0] // 2
  out = np.empty_like(x)
  for i in range(half):
    angle = position * theta ** (-2.0 * i / x.shape[0])
    out[i] = x[i] * np.cos(angle) - x[i + half] * np.sin(angle)
    out[i + half] = x[i + half] * np.cos(angle) + x[i] * np.sin(angle)
  return out


def _sees(t: int, s: int, window: int | None, causal: bool) -> bool:
  """The causal / bidirectional window rule on flat indices (segments checked apart)."""
  if causal:
    return s <= t and (window is None or t - s < window)
  return window is None or abs(t - s) < window


def naive_iha(
  q,
  k,
  v,
  alpha_q,
  alpha_k,
  alpha_v,
  collapse,
  *,
  window,
  segment_ids,
  positions,
  rope_theta,
  causal=True,
):
  """The IHA math as loops over virtual tokens t = n*P + p, in float64."""
  q, k, v, alpha_q, alpha_k, alpha_v, collapse = (
    np.asarray(x, np.float64) for x in (q, k, v, alpha_q, alpha_k, alpha_v, collapse)
  )
  seg, pos = np.asarray(segment_ids), np.asarray(positions)
  b_size, n_size, h_size, d = q.shape
  p_size = alpha_q.shape[2]
  t_size = n_size * p_size
  o = np.zeros((b_size, n_size, h_size, p_size, d))
  for b in range(b_size):
    for h in range(h_size):

      def pseudo(x, alpha, t, rotate):
        n, p = divmod(t, p_size)
        vec = sum(alpha[m, h, p] * x[b, n, m] for m in range(h_size))
        if rotate and rope_theta is not None:
          vec = _naive_rope(vec, pos[b, n] * p_size + p, rope_theta)
        return vec

      keys = [pseudo(k, alpha_k, s, True) for s in range(t_size)]
      values = [pseudo(v, alpha_v, s, False) for s in range(t_size)]
      for t in range(t_size):
        n_t, p_t = divmod(t, p_size)
        if seg[b, n_t] == 0:
          continue  # padding query: output stays zero
        query = pseudo(q, alpha_q, t, True)
        seen = [
          s
          for s in range(t_size)
          if _sees(t, s, window, causal) and seg[b, s // p_size] == seg[b, n_t]
        ]
        logits = np.array([query @ keys[s] / np.sqrt(d) for s in seen])
        weights = np.exp(logits - logits.max())
        weights /= weights.sum()
        o[b, n_t, h, p_t] = sum(w * values[s] for w, s in zip(weights, seen))
  if collapse.ndim == 3:
    return np.einsum("bngpd,hgp->bnhd", o, collapse)
  return np.einsum("bnhpd,hp->bnhd", o, collapse)


@pytest.mark.parametrize("p", [1, 2, 3])
@pytest.mark.parametrize(
  "case", ["global", "window", "packed", "per_head", "no_rope", "bidirectional_packed_window"]
)
def test_reference_matches_naive_loop(p, case):
  b, n, h, d = 2, 5, 2, 4
  args = random_iha_inputs(jax.random.PRNGKey(p), b, n, h, d, p, per_head=case == "per_head")
  window = 4 if "window" in case else None
  packed = "packed" in case
  causal = not case.startswith("bidirectional")
  segment_ids = packed_segments(b, n) if packed else jnp.ones((b, n), jnp.int32)
  positions = (
    packed_positions(segment_ids)
    if packed
    else jnp.asarray(np.random.default_rng(p).integers(0, 50, (b, n)), jnp.int32)
  )
  rope_theta = None if case == "no_rope" else 100.0
  got = ops.iha_attention(
    *args,
    window=window,
    segment_ids=segment_ids,
    positions=positions,
    rope_theta=rope_theta,
    causal=causal,
    implementation="reference",
  )
  want = naive_iha(
    *args,
    window=window,
    segment_ids=segment_ids,
    positions=positions,
    rope_theta=rope_theta,
    causal=causal,
  )
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def _naive_rows(q, segment_ids, window, causal):
  """For every (b, i): the visible keys j (same nonzero segment, window rule), or None
  for a padding query."""
  seg = np.asarray(segment_ids)
  rows = {}
  for b in range(q.shape[0]):
    for i in range(q.shape[1]):
      rows[b, i] = (
        None
        if seg[b, i] == 0
        else [
          j for j in range(q.shape[1]) if seg[b, j] == seg[b, i] and _sees(i, j, window, causal)
        ]
      )
  return rows


def _softmax(logits):
  w = np.exp(logits - logits.max())
  return w / w.sum()


def naive_talking_heads(
  q, k, v, talk_logits, talk_weights, *, window, segment_ids, positions, rope_theta, causal
):
  """Talking-Heads (Shazeer et al.) as loops over queries, in float64."""
  q, k, v, tl, tw = (np.asarray(x, np.float64) for x in (q, k, v, talk_logits, talk_weights))
  pos = np.asarray(positions)
  bsz, n, h, d = q.shape
  rot = lambda x, b, i: _naive_rope(x, pos[b, i], rope_theta)
  out = np.zeros(v.shape)
  for (b, i), seen in _naive_rows(q, segment_ids, window, causal).items():
    if seen is None:
      continue
    scores = np.array(
      [[rot(q[b, i, m], b, i) @ rot(k[b, j, m], b, j) / np.sqrt(d) for j in seen] for m in range(h)]
    )  # J [h, keys]
    weights = np.array([_softmax(tl[:, g] @ scores) for g in range(h)])  # W [h', keys]
    for g in range(h):
      mixed = tw[:, g] @ weights  # U [keys]
      out[b, i, g] = sum(u * v[b, j, g] for u, j in zip(mixed, seen))
  return out


def naive_diff(q, k, v, lam, *, window, segment_ids, positions, rope_theta, causal):
  """Differential attention A1 v - lam A2 v as loops, in float64."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  lam = np.broadcast_to(np.asarray(lam, np.float64), (q.shape[2],))
  pos = np.asarray(positions)
  d = q.shape[-1]
  out = np.zeros(v.shape)
  for (b, i), seen in _naive_rows(q, segment_ids, window, causal).items():
    if seen is None:
      continue
    for h in range(q.shape[2]):
      maps = []
      for c in range(2):
        qi = _naive_rope(q[b, i, h, c], pos[b, i], rope_theta)
        w = _softmax(
          np.array([qi @ _naive_rope(k[b, j, h, c], pos[b, j], rope_theta) for j in seen])
          / np.sqrt(d)
        )
        maps.append(sum(wj * v[b, j, h] for wj, j in zip(w, seen)))
      out[b, i, h] = maps[0] - lam[h] * maps[1]
  return out


def naive_simplicial(q, k1, k2, v1, v2, *, window, segment_ids, causal):
  """2-simplicial attention (Roy et al.) as loops over queries and key pairs, in float64."""
  q, k1, k2, v1, v2 = (np.asarray(x, np.float64) for x in (q, k1, k2, v1, v2))
  d = q.shape[-1]
  out = np.zeros(q.shape)
  for (b, i), seen in _naive_rows(q, segment_ids, window, causal).items():
    if seen is None:
      continue
    for h in range(q.shape[2]):
      pairs = [(j, l) for j in seen for l in seen]
      w = _softmax(
        np.array([np.sum(q[b, i, h] * k1[b, j, h] * k2[b, l, h]) for j, l in pairs]) / np.sqrt(d)
      )
      out[b, i, h] = sum(wp * v1[b, j, h] * v2[b, l, h] for wp, (j, l) in zip(w, pairs))
  return out


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("kind", ["talking_heads", "diff", "simplicial"])
def test_baseline_references_match_naive_loops(kind, causal):
  b, n, h, d = 2, 5, 2, 4
  keys = jax.random.split(jax.random.PRNGKey(len(kind) + causal), 6)
  x = lambda i, *shape: jax.random.normal(keys[i], shape or (b, n, h, d))
  segment_ids = packed_segments(b, n)
  positions = packed_positions(segment_ids)
  mask = dict(window=3, segment_ids=segment_ids, causal=causal)
  if kind == "talking_heads":
    args = (x(0), x(1), x(2), x(3, h, h), x(4, h, h))
    rope = dict(positions=positions, rope_theta=100.0)
    got = ops.talking_heads_attention(*args, **mask, **rope, implementation="reference")
    want = naive_talking_heads(*args, **mask, **rope)
  elif kind == "diff":
    args = (x(0, b, n, h, 2, d), x(1, b, n, h, 2, d), x(2, b, n, h, 2 * d), x(3, h))
    rope = dict(positions=positions, rope_theta=100.0)
    got = ops.diff_attention(*args, **mask, **rope, implementation="reference")
    want = naive_diff(*args, **mask, **rope)
  else:
    args = tuple(x(i) for i in range(5))
    got = ops.simplicial_attention(*args, **mask, implementation="reference")
    want = naive_simplicial(*args, **mask)
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_interleave_order_and_roundtrip():
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 3, 4, 5, 6))  # [B, N, H, P, d]
  y = ops.interleave(x)
  chex.assert_shape(y, (2, 15, 4, 6))
  for n in range(3):
    for p in range(5):
      np.testing.assert_array_equal(y[:, n * 5 + p], x[:, n, :, p])
  np.testing.assert_array_equal(ops.deinterleave(y, 5), x)


def test_virtual_positions_and_segments():
  positions = jnp.array([[0, 1, 0, 1]], jnp.int32)
  np.testing.assert_array_equal(
    ops.virtual_positions(positions, 3), [[0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5]]
  )
  np.testing.assert_array_equal(
    ops.virtual_segment_ids(jnp.array([[1, 2, 0]]), 2), [[1, 1, 2, 2, 0, 0]]
  )


@pytest.mark.parametrize("implementation", ["reference", "xla"])
@pytest.mark.parametrize("window", [None, 3])
def test_p1_identity_mixing_is_exactly_mha(implementation, window):
  b, n, h, d = 2, 9, 3, 8
  q, k, v, *_ = random_iha_inputs(jax.random.PRNGKey(7), b, n, h, d, 1)
  eye = jnp.eye(h)[:, :, None]  # alpha[m, h, 0] = [m == h], collapse[h, h', 0] = [h == h']
  segment_ids = packed_segments(b, n)
  positions = packed_positions(segment_ids)
  kwargs = dict(
    window=window, segment_ids=segment_ids, positions=positions, implementation=implementation
  )
  iha = ops.iha_attention(q, k, v, eye, eye, eye, eye, **kwargs)
  mha = ops.mha_attention(q, k, v, **kwargs)
  np.testing.assert_array_equal(np.asarray(iha), np.asarray(mha))


def test_identity_mixing_is_not_mha_for_p2():
  """docs/design.md: with P >= 2 every earlier token is seen P times, so it is not MHA."""
  b, n, h, d, p = 1, 6, 2, 8, 2
  q, k, v, *_ = random_iha_inputs(jax.random.PRNGKey(3), b, n, h, d, p)
  alpha = jnp.broadcast_to(jnp.eye(h)[:, :, None], (h, h, p))
  collapse = alpha / p
  iha = ops.iha_attention(q, k, v, alpha, alpha, alpha, collapse, implementation="reference")
  mha = ops.mha_attention(q, k, v, implementation="reference")
  assert float(jnp.abs(iha - mha).max()) > 1e-3


@pytest.mark.parametrize("implementation", ["reference", "xla"])
@pytest.mark.parametrize("window", [None, 5])
def test_causality(implementation, window):
  b, n, h, d, p = 2, 8, 2, 8, 3
  args = random_iha_inputs(jax.random.PRNGKey(11), b, n, h, d, p)
  fn = jax.jit(lambda *a: ops.iha_attention(*a, window=window, implementation=implementation))
  base = fn(*args)
  for n_changed in (0, 3, n - 1):
    changed = list(args)
    for i in range(3):  # perturb token n_changed in q, k and v
      changed[i] = args[i].at[:, n_changed].add(1.0 + args[i][:, n_changed] ** 2)
    out = fn(*changed)
    np.testing.assert_array_equal(np.asarray(out[:, :n_changed]), np.asarray(base[:, :n_changed]))
    assert float(jnp.abs(out[:, n_changed] - base[:, n_changed]).max()) > 1e-4


def test_padding_queries_output_zero_and_padding_keys_unseen():
  b, n, h, d, p = 2, 8, 2, 4, 2
  args = list(random_iha_inputs(jax.random.PRNGKey(5), b, n, h, d, p))
  segment_ids = packed_segments(b, n)
  out = ops.iha_attention(*args, segment_ids=segment_ids, implementation="reference")
  np.testing.assert_array_equal(np.asarray(out)[np.asarray(segment_ids) == 0], 0.0)
  for i in range(3):  # change the padding tokens: nothing else may move
    args[i] = jnp.where((segment_ids == 0)[:, :, None, None], 5.0, args[i])
  changed = ops.iha_attention(*args, segment_ids=segment_ids, implementation="reference")
  np.testing.assert_array_equal(np.asarray(changed), np.asarray(out))


def test_rope_relative_invariance():
  """RoPE scores depend only on the offset of the virtual positions."""
  x = jax.random.normal(jax.random.PRNGKey(0), (1, 2, 1, 8))

  def score(shift):
    pos = jnp.array([[3 + shift, 10 + shift]], jnp.int32)
    r = ops.apply_rope(x, pos, 10000.0)
    return jnp.vdot(r[0, 0, 0], r[0, 1, 0])

  assert_close(score(17), score(0), jnp.float32)


class FunctionalOpsVariantsTest(chex.TestCase):
  """The functional ops give the naive loop's values traced under jit and run eagerly alike
  (a Python branch on a traced value, or a host-side step, breaks one variant)."""

  @chex.variants(with_jit=True, without_jit=True)
  def test_iha_attention_window_packed(self):
    b, n, h, d, p = 2, 5, 2, 4, 2
    args = random_iha_inputs(jax.random.PRNGKey(21), b, n, h, d, p)
    segment_ids = packed_segments(b, n)
    positions = packed_positions(segment_ids)
    mask = dict(window=3, segment_ids=segment_ids, positions=positions, rope_theta=100.0)
    for implementation in ("reference", "xla"):
      attend = self.variant(
        lambda *a, impl=implementation: ops.iha_attention(*a, **mask, implementation=impl)
      )
      got = attend(*args)
      chex.assert_shape(got, (b, n, h, d))
      np.testing.assert_allclose(np.asarray(got), naive_iha(*args, **mask), rtol=1e-5, atol=1e-5)

  @chex.variants(with_jit=True, without_jit=True)
  def test_mix_interleave_rope_collapse(self):
    b, n, h, d, p = 2, 3, 2, 4, 3
    x = jax.random.normal(jax.random.PRNGKey(22), (b, n, h, d))
    alpha = jax.random.normal(jax.random.PRNGKey(23), (h, h, p))
    collapse = jax.random.normal(jax.random.PRNGKey(24), (h, h, p))
    positions = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n))

    def pipeline(x, alpha, collapse):
      pseudo = ops.pseudo_mix(x, alpha)  # [B, N, H, P, d]
      virtual = ops.apply_rope(ops.interleave(pseudo), ops.virtual_positions(positions, p), 10.0)
      return ops.collapse_heads(ops.deinterleave(virtual, p), collapse)

    got = np.asarray(self.variant(pipeline)(x, alpha, collapse))
    xs, a, c = (np.asarray(v, np.float64) for v in (x, alpha, collapse))
    pseudo = np.einsum("bnmd,mhp->bnhpd", xs, a)
    for bi, ni, hi, pi in np.ndindex(b, n, h, p):
      pseudo[bi, ni, hi, pi] = _naive_rope(pseudo[bi, ni, hi, pi], ni * p + pi, 10.0)
    want = np.einsum("bngpd,hgp->bnhd", pseudo, c)
    chex.assert_shape(got, (b, n, h, d))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
