"""A ragged batch through a layer's cache: rows of different lengths, padded on either
side, prefill and decode together and each equals that row run alone."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from iha_jax.nn import Attention, AttentionConfig

B, D, H, HEAD_DIM, P = 3, 16, 2, 8, 2
LENGTHS = (5, 1, 7)  # each row's real prompt tokens, in a prompt of 7 columns
STEPS = 4  # one-token decoding steps after the prompt


def _layer(
  kind: str, window: int | None, kv_heads: int | None = None, implementation: str = "reference"
) -> Attention:
  cfg = AttentionConfig(
    kind=kind,
    model_dim=D,
    num_heads=H,
    head_dim=HEAD_DIM,
    num_pseudo=P if kind == "iha" else None,
    num_kv_heads=kv_heads,
    window=window,
    implementation=implementation,
  )
  return Attention(config=cfg, rngs=nnx.Rngs(0))


def _padded(rows: list[jax.Array], width: int, side: str, key: jax.Array):
  """Rows `[n_b, D]` in one `[B, width, D]` batch, padded on `side` with random vectors
  (padding must change nothing), and its validity `[B, width]`."""
  junk = jax.random.normal(key, (len(rows), width, D))
  batch, valid = [], []
  for row, fill in zip(rows, junk):
    pad = width - row.shape[0]
    parts = (fill[:pad], row) if side == "left" else (row, fill[:pad])
    batch.append(jnp.concatenate(parts))
    flags = (np.arange(width) >= pad) if side == "left" else (np.arange(width) < row.shape[0])
    valid.append(flags)
  return jnp.stack(batch), jnp.asarray(np.stack(valid))


def _mask(valid: jax.Array) -> jax.Array:
  return valid[:, None, None, :]


FULL = pytest.mark.full


@pytest.mark.parametrize(
  "kind,window,mode,kv_heads,side,implementation",
  [
    ("iha", 3, "pseudo", None, "left", "reference"),  # window 3 virtual tokens: 2 slots
    ("iha", 5, "source", 1, "right", "reference"),
    ("iha", 4, "source", None, "left", "pallas_tpu"),  # interpreted
    pytest.param("iha", None, "source", None, "left", "reference", marks=FULL),
    pytest.param("iha", 3, "pseudo", None, "right", "reference", marks=FULL),
    pytest.param("iha", 5, "source", 1, "left", "reference", marks=FULL),
    pytest.param("mha", 2, "source", None, "left", "reference", marks=FULL),
    pytest.param("mha", 2, "source", None, "right", "reference", marks=FULL),
    pytest.param("iha", 4, "pseudo", None, "right", "pallas_gpu", marks=FULL),
  ],
)
def test_a_ragged_batch_equals_each_row_alone(kind, window, mode, kv_heads, side, implementation):
  """Prefill in two chunks (the second ragged too: padding between a row's cached and new
  tokens), then one token per row per step; every real output equals the row's full
  forward (the reference's), padding outputs are zero and each row's length is its own.
  A named kernel runs every cached call (in Pallas' interpreter here)."""
  layer = _layer(kind, window, kv_heads, implementation)
  reference = _layer(kind, window, kv_heads)  # same parameters (same seed)
  keys = jax.random.split(jax.random.key(1), 8)
  rows = [jax.random.normal(k, (n + STEPS, D)) for k, n in zip(keys, LENGTHS)]
  alone = [reference(row[None])[0] for row in rows]  # each row's full forward

  first = [row[: n // 2] for row, n in zip(rows, LENGTHS)]
  second = [row[n // 2 : n] for row, n in zip(rows, LENGTHS)]
  cache = layer.init_cache(B, max(LENGTHS) + STEPS, mode=mode)
  got = [[] for _ in rows]
  for chunk, key in ((first, keys[4]), (second, keys[5])):
    x, valid = _padded(chunk, max(LENGTHS), side, key)
    y, cache = layer(x, cache=cache, mask=_mask(valid))
    for b in range(B):
      got[b].append(y[b][valid[b]])
      np.testing.assert_array_equal(np.asarray(y[b][~valid[b]]), 0.0)
  np.testing.assert_array_equal(np.asarray(cache.length), LENGTHS)
  for step in range(STEPS):
    x = jnp.stack([row[n + step] for row, n in zip(rows, LENGTHS)])[:, None]
    y, cache = layer(x, cache=cache)
    for b in range(B):
      got[b].append(y[b])
  tolerance = 2e-6 if implementation == "reference" else 1e-5
  for b in range(B):
    np.testing.assert_allclose(
      np.asarray(jnp.concatenate(got[b])), np.asarray(alone[b]), rtol=tolerance, atol=tolerance,
      err_msg=f"row {b}",
    )  # fmt: skip


def test_a_row_past_max_len_is_refused_naming_it():
  layer = _layer("iha", None)
  cache = layer.init_cache(B, 4)
  x, valid = _padded([jnp.ones((n, D)) for n in (2, 4, 1)], 4, "left", jax.random.key(0))
  _, cache = layer(x, cache=cache, mask=_mask(valid))
  with pytest.raises(ValueError, match=r"1 more token after the 4 that row 1 of this cache"):
    layer(jnp.ones((B, 1, D)), cache=cache)
