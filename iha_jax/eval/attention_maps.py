"""Attention pictures: every head's probabilities over the virtual sequence, as heat-maps.

An IHA layer attends over `T = N*P` virtual tokens (`t = n*P + p`, docs/design.md §1.3), so a
head's map is `[T, T]` and shows P x P blocks: pseudo-query p of token n against the
pseudo-keys of token m. The maps are the layer's own call with
`return_probabilities=True` (the XLA core's weights under the training mask), dense in
keys (O(T^2) output: for small N); MHA layers give `[N, N]` maps (P = 1). Layers are
numbered from 1, as everywhere in the project.
"""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from iha_jax.checks import is_int
from iha_jax.extras import require
from iha_jax.models import TransformerLM

if TYPE_CHECKING:
  from matplotlib.figure import Figure


@functools.partial(jax.jit, static_argnames=("graphdef", "layer_number"))
def _maps_jit(state, tokens, segment_ids, positions, *, graphdef, layer_number):
  model = nnx.merge(graphdef, state)
  x = model.embed(tokens)
  for block in model.layers[: layer_number - 1]:
    x = block(x, segment_ids=segment_ids, positions=positions)
  block = model.layers[layer_number - 1]
  _, probabilities = block(
    x, segment_ids=segment_ids, positions=positions, return_probabilities=True
  )
  return probabilities


def attention_maps(
  model: TransformerLM,
  tokens: jax.Array,
  *,
  layer_number: int | None = None,
  segment_ids: jax.Array | None = None,
  positions: jax.Array | None = None,
) -> np.ndarray:
  """Every head's attention probabilities in one layer for one sequence.

  Args:
    model: the language model.
    tokens: `[N]` (or `[1, N]`) int token ids.
    layer_number: the decoder block, counted from 1: `1 <= layer_number <= num_layers`.
    segment_ids, positions: optional `[N]` (or `[1, N]`) int32, as in the model's forward.

  Returns:
    float32 `[H, T, T]`, `T = N*P` for an IHA layer (N for MHA); padding rows are zero.
  """
  num_layers = model.config.num_layers
  if not is_int(layer_number, 1) or layer_number > num_layers:
    raise ValueError(
      f"layer_number must be an integer in 1..{num_layers} (counted from 1), got {layer_number!r}"
    )

  def as_row(name, value):
    if value is None:
      return None
    value = jnp.asarray(value)
    value = value[None] if value.ndim == 1 else value
    if value.ndim != 2 or value.shape[0] != 1:
      raise ValueError(
        f"{name} must be one sequence [N] or [1, N], got shape {tuple(jnp.shape(value))}"
      )
    return value.astype(jnp.int32)

  graphdef, state = nnx.split(model)
  probs = _maps_jit(
    state,
    as_row("tokens", tokens),
    as_row("segment_ids", segment_ids),
    as_row("positions", positions),
    graphdef=graphdef,
    layer_number=layer_number,
  )
  return np.asarray(probs[0])


PANEL_PIXELS = 300  # approximate width of one head's heat-map in the PNG (3.2 in, 120 dpi)
MIN_GRID_PIXELS = 12  # token-block lines closer than this would hide the attention band


def grid_step(
  num_virtual: int,
  num_pseudo: int,
  *,
  panel_pixels: int = PANEL_PIXELS,
  min_pixels: int = MIN_GRID_PIXELS,
) -> int | None:
  """Virtual tokens between two token-block lines: P when a P x P block spans at least
  `min_pixels` pixels, else the smallest multiple of P that does (lines every k tokens);
  None when even one line would be too dense (fewer than 2 blocks)."""
  pixels_per_block = panel_pixels * num_pseudo / num_virtual
  tokens = max(1, -(-min_pixels // max(pixels_per_block, 1e-9)))
  step = int(tokens) * num_pseudo
  return step if step < num_virtual else None


def plot_attention_maps(
  probs: np.ndarray, num_pseudo: int, path: str | os.PathLike, *, title: str | None = None
) -> Figure:
  """Writes one heat-map panel per head to a PNG file (local path or URL); returns the
  figure (panel `h` shows `probs[h]`).

  Args:
    probs: `[H, T, T]` attention probabilities (rows: queries, columns: keys).
    num_pseudo: P; faint lines outline the P x P token blocks, or every k-th block when
      blocks are only a few pixels wide (`grid_step`), so they never hide the band.
    path: output file (PNG).
    title: optional figure title.
  """
  # Imported here so the maps themselves do not need matplotlib; the object-oriented
  # Figure API renders with Agg without touching pyplot's global backend.
  require("plots", "plot_attention_maps")
  from matplotlib.colors import PowerNorm  # pylint: disable=import-outside-toplevel
  from matplotlib.figure import Figure  # pylint: disable=import-outside-toplevel

  from iha_jax import storage  # pylint: disable=import-outside-toplevel

  probs = np.asarray(probs)
  if probs.ndim != 3 or probs.shape[1] != probs.shape[2]:
    raise ValueError(f"probs must have shape [H, T, T], got {probs.shape}")
  if (
    isinstance(num_pseudo, bool)
    or not isinstance(num_pseudo, int)
    or num_pseudo < 1
    or probs.shape[1] % num_pseudo
  ):
    raise ValueError(
      f"num_pseudo must be a positive integer dividing T={probs.shape[1]}, got {num_pseudo!r}"
    )
  heads, t = probs.shape[:2]
  step = grid_step(t, num_pseudo)
  fig = Figure(figsize=(3.2 * heads + 1.0, 3.6), layout="constrained")
  axes = fig.subplots(1, heads, squeeze=False)[0]
  # Square-root colour scale: spread-out attention (1/window each) stays visible.
  norm = PowerNorm(gamma=0.5, vmin=0.0, vmax=1.0)
  for head, ax in enumerate(axes):
    image = ax.imshow(probs[head], cmap="viridis", norm=norm, interpolation="nearest")
    for edge in np.arange(step, t, step) - 0.5 if step else ():  # Token boundaries.
      ax.axhline(edge, color="white", linewidth=0.3, alpha=0.35)
      ax.axvline(edge, color="white", linewidth=0.3, alpha=0.35)
    ax.set_title(f"head {head}")
    ax.set_xlabel("key (virtual token)")
    if head == 0:
      ax.set_ylabel("query (virtual token)")
  fig.colorbar(image, ax=list(axes), shrink=0.8, label="probability (sqrt scale)")
  grid = (
    "no token lines (blocks too small)"
    if step is None
    else f"lines every {step // num_pseudo} token(s) = {step} virtual"
  )
  fig.suptitle(f"{title + chr(10) if title else ''}P = {num_pseudo}: {grid}", fontsize=9)
  with storage.as_path(path).open("wb") as f:
    fig.savefig(f, format="png", dpi=120)
  return fig
