"""Test helpers: random inputs and dtype-scaled comparisons (docs/design.md §5)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# Worst element, relative to the largest magnitude of the expected value.
TOLERANCE = {jnp.dtype(jnp.float32): 2e-5, jnp.dtype(jnp.bfloat16): 6e-2}
# Root-mean-square error relative to the expected value's RMS. bfloat16 rounds the
# pseudo-heads themselves (relative 2^-8), so single elements of sums with
# cancellation can be off by a few percent while the tensor as a whole is ~1e-2.
RMS_TOLERANCE = {jnp.dtype(jnp.float32): 1e-5, jnp.dtype(jnp.bfloat16): 3e-2}


def assert_close(actual, expected, dtype, what: str = "") -> None:
  """Leaf by leaf: worst-element and RMS errors within the dtype's tolerances."""
  actual_leaves = jax.tree_util.tree_leaves_with_path(actual)
  expected_leaves = jax.tree.leaves(expected)
  assert len(actual_leaves) == len(expected_leaves), f"{what}: tree structures differ"
  for (path, a), e in zip(actual_leaves, expected_leaves):
    a = np.asarray(jnp.asarray(a, jnp.float32))
    e = np.asarray(jnp.asarray(e, jnp.float32))
    assert a.shape == e.shape, f"{what}{jax.tree_util.keystr(path)}: {a.shape} vs {e.shape}"
    scale = max(1.0, float(np.abs(e).max()))
    err = float(np.abs(a - e).max())
    tol = TOLERANCE[jnp.dtype(dtype)] * scale
    name = f"{what}{jax.tree_util.keystr(path)}"
    assert err <= tol, f"{name}: max error {err:.3g} > {tol:.3g}"
    rms_err = float(np.sqrt(np.mean((a - e) ** 2)))
    rms_tol = RMS_TOLERANCE[jnp.dtype(dtype)] * max(1.0, float(np.sqrt(np.mean(e**2))))
    assert rms_err <= rms_tol, f"{name}: RMS error {rms_err:.3g} > {rms_tol:.3g}"


def random_iha_inputs(
  key,
  b: int,
  n: int,
  h: int,
  d: int,
  p: int,
  *,
  per_head: bool = False,
  dtype=jnp.float32,
  kv_heads: int | None = None,
):
  """Fresh random q `[B, N, H, d]`, k, v `[B, N, G, d]`, alpha_q `[H, H, P]`, alpha_k,
  alpha_v `[G, G, P]` and collapse (never zeros); G = `kv_heads` (None: H).

  Mixing and collapse weights are variance-preserving (std 1/sqrt(fan-in)), so
  logits stay O(1) as in a trained layer rather than growing with H.
  """
  g = h if kv_heads is None else kv_heads
  keys = jax.random.split(key, 7)
  q, k, v = (jax.random.normal(keys[i], (b, n, x, d), jnp.float32) for i, x in enumerate((h, g, g)))
  alphas = tuple(
    jax.random.normal(keys[3 + i], (x, x, p)) * x**-0.5 for i, x in enumerate((h, g, g))
  )
  fan_in = p if per_head else h * p
  collapse = jax.random.normal(keys[6], (h, p) if per_head else (h, h, p)) * fan_in**-0.5
  return tuple(x.astype(dtype) for x in (q, k, v) + alphas + (collapse,))


def packed_segments(b: int, n: int) -> jnp.ndarray:
  """`[B, N]` int32: row 0 packs two documents then padding, other rows one document."""
  rows = []
  for row in range(b):
    if row == 0:
      first = max(1, n // 3)
      pad = max(1, n // 4)
      rows.append([1] * first + [2] * (n - first - pad) + [0] * pad)
    else:
      rows.append([1] * n)
  return jnp.asarray(rows, jnp.int32)


def packed_positions(segment_ids: jnp.ndarray) -> jnp.ndarray:
  """Positions restarting at 0 at every segment start."""
  seg = np.asarray(segment_ids)
  pos = np.zeros_like(seg)
  for b in range(seg.shape[0]):
    for i in range(1, seg.shape[1]):
      pos[b, i] = 0 if seg[b, i] != seg[b, i - 1] else pos[b, i - 1] + 1
  return jnp.asarray(pos, jnp.int32)


def decode_png(path, *, dpi: int | None = None, figure=None) -> np.ndarray:
  """Decodes the PNG at `path` (float RGB(A) `[rows, cols, channels]`) and checks it is a
  picture, not a blank canvas; with `figure` and `dpi`, that it is that figure's size."""
  import matplotlib.image  # pylint: disable=import-outside-toplevel

  with open(path, "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n", f"{path}: not a PNG file"
  image = matplotlib.image.imread(path)
  assert image.ndim == 3 and image.shape[2] in (3, 4), image.shape
  assert image[..., :3].std() > 0.05, f"{path}: a blank canvas"
  if figure is not None:
    width, height = figure.get_size_inches() * dpi
    assert abs(image.shape[1] - width) <= 2 and abs(image.shape[0] - height) <= 2, (
      image.shape,
      (height, width),
    )
  return image
