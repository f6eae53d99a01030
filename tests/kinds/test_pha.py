"""Paired-head attention (PHA; docs/design.md §8, "Paired-head attention").

Every implementation against an independent from-scratch loop (`loop_pha` below: explicit
loops over groups, virtual tokens and the mask rules, in jax.numpy so that autodiff gives
every gradient of the loop itself), forward and gradients with random cotangents in
float32 at highest precision; IHA with its mixing and collapse set to PHA's one-hot
selections computes the same function; the refusals; the layers (NNX = Linen) and decoding
(prefill + one-token steps equal the full forward, "source" and "pseudo" caches). The
Pallas kernels run interpreted on CPU.
"""

from __future__ import annotations

import contextlib
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.experimental.pallas import tpu as pltpu

from iha_jax import kinds, ops, parallel
from iha_jax.core import cudnn_attention
from iha_jax.kinds import AttentionConfig
from iha_jax.models import FunctionalTransformerLM, TransformerLM
from iha_jax.models.generate import decode_step, prefill
from iha_jax.nn import AttentionLinen, PairedHeadAttention
from iha_jax.train import flops
from tests.fixtures import tiny_model
from tests.utils import assert_close, packed_positions, packed_segments

THETA = 10000.0
F32 = jnp.float32

# --- The loop: the contract, one virtual query at a time. ------------------------------


def _rope(x: jax.Array, positions: np.ndarray) -> jax.Array:
  """Rotate-half RoPE of rows `x: [T, d]` at `positions: [T]`."""
  half = x.shape[1] // 2
  angle = positions[:, None] * THETA ** (-2.0 * np.arange(half) / x.shape[1])
  cos, sin = jnp.asarray(np.cos(angle), F32), jnp.asarray(np.sin(angle), F32)
  x1, x2 = x[:, :half], x[:, half:]
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=1)


def _sees(t: int, s: int, causal: bool, window: int | None) -> bool:
  """Whether virtual query t sees virtual key s by position (section 1 and 6's rules)."""
  seen = s <= t if causal else True
  if window is not None:
    seen = seen and (t - s if causal else abs(t - s)) < window
  return seen


def loop_pha(q, k, v, *, num_pseudo, causal=True, window=None, seg=None, pos=None):
  """PHA over q `[B, N, H, d]`, k, v `[B, N, G, d]`; seg, pos `[B, N]` numpy (None: one
  sequence, arange). Per row and group j, loops build the virtual sequence (token
  `t = n*P + p` holds query head `j*P + p` and key/value head `(j*P + p) // (H // G)` of
  token n, RoPE at `pos*P + p`) and the mask, visible pair by pair; then one softmax
  attention per group; the outputs are read back head by head."""
  b_size, n_size, h_size, d = q.shape
  p_size, r = num_pseudo, h_size // k.shape[2]
  t_size = n_size * p_size
  seg = np.ones((b_size, n_size), int) if seg is None else np.asarray(seg)
  pos = np.tile(np.arange(n_size), (b_size, 1)) if pos is None else np.asarray(pos)
  rows = []
  for b in range(b_size):
    groups = []
    for j in range(h_size // p_size):
      token = [t // p_size for t in range(t_size)]
      head = [j * p_size + t % p_size for t in range(t_size)]
      kv_head = [h // r for h in head]
      at = np.asarray([pos[b, token[t]] * p_size + t % p_size for t in range(t_size)], float)
      qs = _rope(q[b, np.asarray(token), np.asarray(head)], at)
      ks = _rope(k[b, np.asarray(token), np.asarray(kv_head)], at)
      vs = v[b, np.asarray(token), np.asarray(kv_head)]
      seen = np.zeros((t_size, t_size), bool)
      for t in range(t_size):
        for s in range(t_size):
          same = seg[b, token[s]] == seg[b, token[t]]
          seen[t, s] = _sees(t, s, causal, window) and same
        seen[t, t] |= seg[b, token[t]] == 0  # (a padding query: zeroed below)
      scores = jnp.where(seen, qs @ ks.T / math.sqrt(d), -jnp.inf)
      out = jax.nn.softmax(scores, axis=1) @ vs
      real = np.asarray([seg[b, token[t]] != 0 for t in range(t_size)])
      groups.append(jnp.where(real[:, None], out, 0))  # padding queries output zeros
    # Head h of token n is virtual row n*P + h % P of group h // P.
    group = np.asarray([[h // p_size for h in range(h_size)] for _ in range(n_size)])
    row = np.asarray([[n * p_size + h % p_size for h in range(h_size)] for n in range(n_size)])
    rows.append(jnp.stack(groups)[group, row])
  return jnp.stack(rows)


def _inputs(seed: int, b: int, n: int, h: int, g: int, d: int):
  keys = jax.random.split(jax.random.key(seed), 4)
  shapes = ((b, n, h, d), (b, n, g, d), (b, n, g, d), (b, n, h, d))
  return tuple(jax.random.normal(key, s, F32) for key, s in zip(keys, shapes))


def _mask(name: str, b: int, n: int) -> dict:
  """The call's options and the loop's arrays for mask `name`."""
  causal = not name.startswith("bidirectional")
  window = 5 if "window" in name else None
  options = dict(causal=causal, window=window)
  loop = dict(causal=causal, window=window)
  if "packed" in name:
    seg = packed_segments(b, n)
    pos = packed_positions(seg)
    options.update(segment_ids=seg, positions=pos)
    loop.update(seg=np.asarray(seg), pos=np.asarray(pos))
  return options | {"loop": loop}


def _check_against_loop(
  implementation, mask_name, *, h=4, g=4, p=2, b=2, n=6, d=8, seed=0, dtype=F32
):
  """Forward and every gradient (q, k, v) of `implementation` in `dtype` against
  `loop_pha` in float32 on the same rounded inputs, at `dtype`'s tolerance."""
  low = tuple(x.astype(dtype) for x in _inputs(seed, b, n, h, g, d))
  q, k, v, cotangent = (x.astype(F32) for x in low)
  options = _mask(mask_name, b, n)
  loop = options.pop("loop")
  blocks = ops.BlockSizes(16, 16) if implementation.startswith("pallas_gpu") else None
  fast = lambda *a: ops.pha_attention(
    *a, num_pseudo=p, implementation=implementation, block_sizes=blocks, **options
  )
  with jax.default_matmul_precision("highest"):
    want, want_vjp = jax.vjp(lambda *a: loop_pha(*a, num_pseudo=p, **loop), q, k, v)
    want_grads = want_vjp(cotangent)
    interpret = pltpu.force_tpu_interpret_mode() if "pallas_tpu" in implementation else None
    with interpret or contextlib.nullcontext():
      got, got_vjp = jax.vjp(jax.jit(fast), *low[:3])
      got_grads = got_vjp(low[3])
  assert got.shape == (b, n, h, d) and got.dtype == dtype
  assert_close(got, want, dtype, f"{implementation} {mask_name} out")
  assert_close(got_grads, want_grads, dtype, f"{implementation} {mask_name} grads")


def test_xla_matches_the_loop_causal():
  _check_against_loop("xla", "causal")


def test_reference_matches_the_loop_grouped_window_packed():
  _check_against_loop("reference", "causal-window-packed", g=2, seed=1)


CASES = [
  ("reference", "bidirectional-packed", 4, 2),
  ("reference", "causal", 2, 4),  # P = 4 over G = 2: a group interleaves two kv heads
  ("xla", "causal-window-packed", 4, 2),
  ("xla", "bidirectional-window", 2, 2),
  ("xla", "causal", 1, 2),  # multi-query
  ("pallas_tpu", "causal-window-packed", 2, 2),
  ("pallas_tpu", "bidirectional-packed", 4, 2),
  ("pallas_gpu", "causal-window-packed", 4, 2),
  ("pallas_gpu", "bidirectional-window", 1, 2),
]


@pytest.mark.full
@pytest.mark.parametrize("implementation,mask,g,p", CASES)
def test_every_implementation_matches_the_loop(implementation, mask, g, p):
  _check_against_loop(
    implementation, mask, g=g, p=p, seed=CASES.index((implementation, mask, g, p))
  )


@pytest.mark.full
@pytest.mark.parametrize(
  "implementation,mask", [("xla", "causal-window-packed"), ("cudnn", "causal-window")]
)
def test_bfloat16_matches_the_loop(implementation, mask, monkeypatch):
  if implementation == "cudnn" and jax.default_backend() != "gpu":
    # Off-GPU the cuDNN pipeline runs with jax's XLA attention behind it.
    monkeypatch.setattr(cudnn_attention, "BACKEND", "xla")
  _check_against_loop(implementation, mask, g=2, seed=11, dtype=jnp.bfloat16)


@pytest.mark.full
def test_six_heads_in_pairs_over_two_key_value_heads():
  # r = 3 query heads per kv head, P = 2: group 1 (heads 2, 3) reads kv heads 0 and 1.
  _check_against_loop("xla", "causal-window", h=6, g=2, p=2, seed=7)


# --- IHA with one-hot selections is the same function. --------------------------------


def one_hot_iha(num_heads: int, num_pseudo: int):
  """`alpha [H, H, P]` and `collapse [H, H, P]` that make IHA compute PHA (the contract's
  equivalent check): `alpha[m, h, p] = 1` iff `m == (h // P)*P + p`; `collapse[h, h', p]
  = 1` iff `h' == (h // P)*P` and `p == h % P`."""
  alpha = np.zeros((num_heads, num_heads, num_pseudo), np.float32)
  collapse = np.zeros_like(alpha)
  for h in range(num_heads):
    for p in range(num_pseudo):
      alpha[(h // num_pseudo) * num_pseudo + p, h, p] = 1
    collapse[h, (h // num_pseudo) * num_pseudo, h % num_pseudo] = 1
  return jnp.asarray(alpha), jnp.asarray(collapse)


@pytest.mark.parametrize(
  "mask", ["causal-window-packed", pytest.param("bidirectional", marks=pytest.mark.full)]
)
def test_iha_with_one_hot_mixing_is_pha(mask):
  b, n, h, p, d = 2, 6, 4, 2, 8
  q, k, v, cotangent = _inputs(3, b, n, h, h, d)
  options = _mask(mask, b, n)
  options.pop("loop")
  alpha, collapse = one_hot_iha(h, p)
  with jax.default_matmul_precision("highest"):
    iha = lambda q, k, v: ops.iha_attention(q, k, v, alpha, alpha, alpha, collapse, **options)
    pha = lambda q, k, v: ops.pha_attention(q, k, v, num_pseudo=p, **options)
    want, want_vjp = jax.vjp(jax.jit(iha), q, k, v)
    got, got_vjp = jax.vjp(jax.jit(pha), q, k, v)
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)
    for a, e in zip(got_vjp(cotangent), want_vjp(cotangent)):
      np.testing.assert_allclose(a, e, atol=1e-6, rtol=0)


# --- Refusals, configuration, budgets. -------------------------------------------------


def test_refusals_name_the_argument_and_the_fix():
  q, k, v, _ = _inputs(0, 1, 4, 6, 6, 8)
  with pytest.raises(ValueError, match=r"num_pseudo=4 must divide q's H=6.*\[2, 3, 6\]"):
    ops.pha_attention(q, k, v, num_pseudo=4)
  with pytest.raises(ValueError, match="num_pseudo=3 must divide num_heads=4"):
    AttentionConfig(32, 4, 8, kind="pha", num_pseudo=3)
  with pytest.raises(ValueError, match="G = 4 key/value heads, which does not divide the H = 6"):
    ops.pha_attention(q, k[:, :, :4], v[:, :, :4])
  with pytest.raises(ValueError, match="collapse_mode is not an option of pha"):
    AttentionConfig(32, 4, 8, kind="pha", collapse_mode="per_head")


def test_config_letters_and_flops():
  cfg = AttentionConfig(32, 4, 8, kind="pha")
  assert cfg.num_pseudo == 2  # the kind's default, not H
  assert kinds.for_letter("P")[0] is kinds.PHA and kinds.for_letter("R")[1].windowed
  mha = AttentionConfig(32, 4, 8, kind="mha")
  # H/P groups over N*P rows: P times MHA's causal work, up to the diagonal's share.
  n = 64
  assert kinds.PHA.core_flops(cfg, n) == 2 * (4 * 8) * (2 * n) * (2 * n + 1) // 2
  assert 1.9 < kinds.PHA.core_flops(cfg, n) / kinds.MHA.core_flops(mha, n) < 2.0


# --- Layers and decoding. --------------------------------------------------------------


def test_layer_nnx_equals_linen_and_has_mhas_parameters():
  layer = PairedHeadAttention(32, 4, 8, num_kv_heads=2, window=5, rngs=nnx.Rngs(0))
  params = layer.param_values()
  assert {k: v.shape for k, v in params.items()} == {
    "wq": (32, 4, 8),
    "wk": (32, 2, 8),
    "wv": (32, 2, 8),
    "wo": (4, 8, 32),
  }
  x = jax.random.normal(jax.random.key(2), (2, 7, 32))
  linen = AttentionLinen(layer.config)
  chex.assert_trees_all_equal(linen.apply({"params": params}, x), layer(x))
  # The layer is the entry point between the projections.
  q, k, v = kinds.project_qkv(params, x)
  core = ops.pha_attention(q, k, v, num_pseudo=2, window=5)
  np.testing.assert_allclose(layer(x), kinds.project_out(params, core), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
  "kv_heads,num_pseudo", [(4, 2), pytest.param(2, 4, marks=pytest.mark.full)]
)
def test_prefill_and_decode_equal_the_full_forward(kv_heads, num_pseudo):
  layer = PairedHeadAttention(
    32, 4, 8, num_kv_heads=kv_heads, num_pseudo=num_pseudo, window=7, rngs=nnx.Rngs(1)
  )
  x = jax.random.normal(jax.random.key(5), (2, 6, 32))
  want = layer(x)
  for mode in ("source", "pseudo"):
    cache = layer.init_cache(2, 6, mode=mode)
    y, cache = layer(x[:, :3], cache=cache)
    got = [y]
    for n in range(3, 6):
      y, cache = layer(x[:, n : n + 1], cache=cache)
      got.append(y)
    np.testing.assert_allclose(jnp.concatenate(got, 1), want, rtol=1e-5, atol=1e-5, err_msg=mode)


def test_model_letters_share_num_pseudo_and_count_no_mixing():
  config = tiny_model("PRI", num_pseudo=None, iha_window=5)
  # None: each kind's default (PHA 2, IHA H); a value: both.
  assert config.attention_config("P").num_pseudo == 2
  assert config.attention_config("I").num_pseudo == 4
  assert tiny_model("PR", num_pseudo=4, iha_window=5).attention_config("R").num_pseudo == 4
  with pytest.raises(ValueError, match="num_pseudo=3 must divide num_heads=4"):
    tiny_model("P", num_pseudo=3)
  budgets = {b.letter: b for b in flops.layer_budgets(config, 16)}
  assert budgets["P"].params == 4 * 32 * 4 * 8  # wq, wk, wv, wo: MHA's
  assert budgets["P"].mixing_flops == 0
  assert budgets["R"].window == 5 and budgets["R"].virtual_tokens


@pytest.mark.full
def test_model_decodes_as_its_forward():
  model = TransformerLM(tiny_model("PRM", iha_window=5, num_kv_heads=2), rngs=nnx.Rngs(0))
  tokens = jax.random.randint(jax.random.key(4), (2, 8), 0, 40)
  want = model(tokens)
  for mode in ("source", "pseudo"):
    logits, cache = prefill(model, tokens[:, :3], max_len=8, cache_mode=mode)
    got = [logits]
    for n in range(3, 8):
      step, cache = decode_step(model, tokens[:, n], cache)
      got.append(step[:, None])
    np.testing.assert_allclose(jnp.concatenate(got, 1), want, rtol=1e-5, atol=1e-5, err_msg=mode)


def test_probabilities_and_cross_attention_through_the_views():
  layer = PairedHeadAttention(32, 4, 8, rngs=nnx.Rngs(2))
  x = jax.random.normal(jax.random.key(6), (2, 5, 32))
  y, probs = layer(x, return_probabilities=True)
  assert probs.shape == (2, 2, 10, 10)  # H/P groups over N*P virtual tokens
  np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-5)
  np.testing.assert_array_equal(y, layer(x))
  cross = PairedHeadAttention(32, 4, 8, causal=False, rope_theta=None, rngs=nnx.Rngs(3))
  context = jax.random.normal(jax.random.key(7), (2, 7, 32))
  want = cross(x, context=context)
  for mode in ("source", "pseudo"):
    got = cross(x, context=cross.cache_context(context, mode=mode))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=mode)


@pytest.mark.full
def test_scanned_functional_model_equals_unscanned_and_every_weight_learns():
  config = tiny_model("PRM", iha_window=5, num_layers=6, num_kv_heads=2)
  tokens = jax.random.randint(jax.random.key(8), (2, 8), 0, 40)
  scanned, plain = (FunctionalTransformerLM(config, scan_layers=s) for s in (True, False))
  logits = [jax.jit(m.apply)(m.init(0), tokens) for m in (scanned, plain)]
  np.testing.assert_allclose(logits[0], logits[1], atol=2e-5)
  loss = lambda params: jnp.sum(scanned.apply(params, tokens) ** 2)
  grads = jax.jit(jax.grad(loss))(scanned.init(0))
  for path, grad in jax.tree_util.tree_leaves_with_path(grads):
    assert np.abs(np.asarray(grad)).max() > 0, jax.tree_util.keystr(path)


@pytest.mark.full
def test_context_and_tensor_mesh_equals_one_device():
  """G = 2 of H = 4, a window crossing shards, packed segments: outputs and the q/k/v
  gradients at context 4 x tensor 2 equal one device's (the static Pairing crosses the
  shard_map as a leafless argument)."""
  b, n = 2, 16
  q, k, v, _ = _inputs(9, b, n, 4, 2, 8)
  seg = packed_segments(b, n)
  options = dict(window=7, segment_ids=seg, positions=packed_positions(seg))

  def loss(q, k, v):
    out = ops.pha_attention(q, k, v, implementation="xla", **options)
    return jnp.sum(out * jnp.cos(q)), out

  expected = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
  with parallel.activate(parallel.create_mesh(dict(data=1, fsdp=1, context=4, tensor=2))):
    got = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
  for a, e in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=1e-5, atol=1e-5)
