"""The TPU flash kernels' tile schedules (`iha_jax.kernels.flash.plan`) against brute
force: every visible (query tile, key tile) pair is attended exactly once, accumulators
start and end where the bands do, no tile index leaves its axis (the kernels run without
Mosaic's DMA bounds checks), and "no mask needed" is claimed only for entirely visible
pairs. NumPy only: no kernel runs."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from iha_jax.core.masking import visible
from iha_jax.kernels.flash.plan import Tiles


def _tiles(causal, window, block_q, block_k, q_rows, k_rows, keys, offset, max_offset=0):
  return Tiles(
    block_q=block_q,
    block_k=block_k,
    num_q=-(-q_rows // block_q),
    num_k=-(-k_rows // block_k),
    keys=keys,
    causal=causal,
    window=window,
    offset=offset,
    max_offset=max_offset,
  )


def _truth(tiles: Tiles, offset: int):
  """[query tile, key tile] booleans: any pair visible, every pair visible."""
  t = offset + np.arange(tiles.num_q * tiles.block_q)
  s = np.arange(tiles.num_k * tiles.block_k)
  seen = visible(t[:, None], s[None, :], None, None, tiles.window, tiles.causal)
  seen &= s[None, :] < tiles.keys
  blocks = seen.reshape(tiles.num_q, tiles.block_q, tiles.num_k, tiles.block_k)
  return blocks.any(axis=(1, 3)), blocks.all(axis=(1, 3))


def _walk(tiles: Tiles, offset, query_home: bool, rows: int, steps: int):
  """Simulates a grid: attended pairs (with their mask flag), inits and writes per home."""
  row, step = np.meshgrid(np.arange(rows), np.arange(steps), indexing="ij")
  row, step = row.reshape(-1), step.reshape(-1)  # row-major: steps of a row in order
  stepper = tiles.query_step if query_home else tiles.key_step
  st = stepper(row, step, None if tiles.offset is not None else offset)
  count_home = tiles.num_q if query_home else tiles.num_k
  count_tile = tiles.num_k if query_home else tiles.num_q
  assert (st.home >= 0).all() and (st.home < count_home).all()
  assert (st.tile >= 0).all() and (st.tile < count_tile).all()
  attended, inits, writes = {}, {}, {}
  for n in range(len(row)):
    home, tile = int(st.home[n]), int(st.tile[n])
    pair = (home, tile) if query_home else (tile, home)
    if st.first[n]:
      assert home not in inits, f"home {home} initialised twice"
      inits[home] = n
    if st.compute[n]:
      assert pair not in attended, f"pair {pair} attended twice"
      assert home in inits and home not in writes, f"pair {pair} outside its band's run"
      attended[pair] = bool(st.masked[n])
    if st.last[n]:
      assert home in inits and home not in writes, f"home {home} written out of order"
      writes[home] = n
  return attended, inits, writes


CASES = list(
  itertools.product(
    [(True, None), (True, 24), (False, None), (False, 20)],  # (causal, window) in rows
    [(16, 16), (16, 32), (32, 16)],  # (block_q, block_k)
    [0, 7],  # padded key rows
  )
)


@pytest.mark.parametrize("mask, blocks, padding", CASES)
def test_static_schedules_visit_every_visible_pair_once(mask, blocks, padding):
  causal, window = mask
  q_rows = k_rows = 100
  tiles = _tiles(causal, window, *blocks, q_rows, k_rows, keys=k_rows - padding, offset=0)
  any_visible, all_visible = _truth(tiles, 0)
  for query_home in (True, False):
    rows, steps = tiles.query_major() if query_home else tiles.key_major()
    attended, inits, writes = _walk(tiles, 0, query_home, rows, steps)
    assert set(attended) == {tuple(p) for p in np.argwhere(any_visible)}
    for pair, masked in attended.items():
      assert masked or all_visible[pair], f"{pair} unmasked but partly visible"
    homes = tiles.num_q if query_home else tiles.num_k
    assert set(inits) == set(writes) == set(range(homes))  # empty bands write zeros too


@pytest.mark.parametrize("causal, window", [(True, None), (True, 24), (False, 20)])
def test_traced_offset_bands_cover_every_offset(causal, window):
  """A sequence shard: 48 query rows at offsets -40..96 into 144 key rows; the grid is
  sized once (`offset=None`) for any offset up to `max_offset`."""
  tiles = _tiles(causal, window, 16, 32, 48, 144, keys=144, offset=None, max_offset=144)
  rows_q, steps_q = tiles.query_major()
  rows_k, steps_k = tiles.key_major()
  for offset in range(-40, 97, 8):
    any_visible, all_visible = _truth(tiles, offset)
    for query_home, rows, steps in ((True, rows_q, steps_q), (False, rows_k, steps_k)):
      attended, _, _ = _walk(tiles, offset, query_home, rows, steps)
      assert set(attended) == {tuple(p) for p in np.argwhere(any_visible)}, offset
      assert all(masked or all_visible[p] for p, masked in attended.items())


def test_folded_causal_rows_do_equal_work():
  """Causal global bands fold rows i and Q-1-i: both TensorCores of a v5p get equal
  halves, and no step is padding (Q even)."""
  tiles = _tiles(True, None, 32, 32, 256, 256, keys=256, offset=0)
  assert tiles.folded
  rows, steps = tiles.query_major()
  assert (rows, steps) == (4, 9)
  row, step = np.meshgrid(np.arange(rows), np.arange(steps), indexing="ij")
  assert tiles.query_step(row.reshape(-1), step.reshape(-1)).compute.all()


@pytest.mark.parametrize("causal, window", [(True, None), (True, 24), (False, None), (False, 20)])
def test_any_visible_matches_brute_force_on_blocks(causal, window):
  """`Tiles.any_visible` (which halves of a partly visible pair the kernels attend)
  against brute force over every 8 x 8 block at offsets -20..20: exact without padding
  keys, and never False where a pair is visible with them."""
  for keys in (96, 90):
    tiles = _tiles(causal, window, 16, 16, 96, 96, keys=keys, offset=0)
    for offset in (-20, 0, 5, 20):
      t, s = offset + np.arange(96), np.arange(96)
      seen = visible(t[:, None], s[None, :], None, None, window, causal) & (s[None, :] < keys)
      want = seen.reshape(12, 8, 12, 8).any(axis=(1, 3))
      i, j = np.meshgrid(np.arange(12), np.arange(12), indexing="ij")
      got = np.broadcast_to(
        tiles.any_visible(offset + 8 * i, offset + 8 * i + 7, 8 * j, 8 * j + 7), want.shape
      )
      assert (got == want).all() if keys == 96 else (got >= want).all(), (keys, offset)
