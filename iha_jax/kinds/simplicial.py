"""2-simplicial attention (`X`; Roy et al. 2025), used by the paper's App. D."""

from __future__ import annotations

from typing import Unpack

import jax

from iha_jax.core import validation
from iha_jax.core.masking import visible_pairs, visible_triples
from iha_jax.core.options import AttentionOptions, OptionFields
from iha_jax.core.simplicial import simplicial_reference, simplicial_xla
from iha_jax.kinds import registry
from iha_jax.kinds.base import (
  AttentionKind,
  Letter,
  check_no_groups,
  output_spec,
  project,
  projection_spec,
)


class Simplicial(AttentionKind):
  """Every query attends to pairs of keys through a trilinear form (no RoPE): `wq, wk1,
  wk2, wv1, wv2: [D, H, d]`, `wo: [H, d, D]`. O(N^2) scores per query."""

  name = "simplicial"
  letters = (Letter("X", False, "global 2-simplicial attention (no RoPE)"),)
  implementations = {"reference": simplicial_reference, "xla": simplicial_xla}
  uses_rope = False
  sequence_roles = ("q", "kv", "kv", "kv", "kv")

  def check_arrays(self, q, k1, k2, v1, v2):
    names = ("q", "k1", "k2", "v1", "v2")
    validation.check_arrays(names, (q, k1, k2, v1, v2), 4, "[B, N, H, d]")

  def validate(self, cfg):
    check_no_groups(cfg, "every head has its own two key and two value projections")

  def param_specs(self, cfg, kernel_init, mixing_noise_std):
    in_proj = projection_spec(cfg, kernel_init)
    names = ("wq", "wk1", "wk2", "wv1", "wv2")
    return {**dict.fromkeys(names, in_proj), "wo": output_spec(cfg, kernel_init)}

  def core(self, params, x, cfg, options, layer):
    q, k1, k2, v1, v2 = (project(x, params[w]) for w in ("wq", "wk1", "wk2", "wv1", "wv2"))
    return simplicial_attention(q, k1, k2, v1, v2, options)

  def core_flops(self, cfg, seq_len):
    # 4d per visible triple (i, j, l) plus 3d per visible pair, per head.
    triples = visible_triples(seq_len, cfg.window, cfg.causal)
    pairs = visible_pairs(seq_len, cfg.window, cfg.causal)
    return cfg.num_heads * (4 * cfg.head_dim * triples + 3 * cfg.head_dim * pairs)


SIMPLICIAL = Simplicial()


def simplicial_attention(
  q: jax.Array,
  k1: jax.Array,
  k2: jax.Array,
  v1: jax.Array,
  v2: jax.Array,
  options: AttentionOptions | None = None,
  **overrides: Unpack[OptionFields],
) -> jax.Array:
  """2-simplicial attention over `[B, N, H, d]` inputs.

  Args:
    q, k1, k2, v1, v2: `[B, N, H, d]`, one shape and dtype.
    options, **overrides: `AttentionOptions` as `iha_attention` (window in tokens);
      `positions` and `rope_theta` are unused (2-simplicial attention has no RoPE);
      `implementation` "reference", "xla" or "auto" (= "xla"); `block_sizes.block_q`,
      the most queries per block of the XLA path.

  Returns:
    `[B, N, H, d]` in q.dtype.

  Raises:
    ValueError: also when the scores in flight would exceed
      `iha_jax.core.simplicial.MAX_SCORES` float32 elements (`B*H*N^3` for "reference",
      `B*H*N^2` for one query of "xla" global layers); use a window, a smaller batch or
      fewer heads.
  """
  return registry.attend(SIMPLICIAL, q, k1, k2, v1, v2, options=options, **overrides)
