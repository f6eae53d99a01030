"""2-simplicial attention (`X`; Roy et al. 2025), used by the paper's App. D."""

from __future__ import annotations

from iha_jax.kinds.base import (
  AttentionKind,
  Letter,
  check_no_groups,
  output_spec,
  project,
  projection_spec,
)
from iha_jax.ops import simplicial_attention
from iha_jax.ops.masking import visible_pairs, visible_triples


class Simplicial(AttentionKind):
  """Every query attends to pairs of keys through a trilinear form (no RoPE): `wq, wk1,
  wk2, wv1, wv2: [D, H, d]`, `wo: [H, d, D]`. O(N^2) scores per query."""

  name = "simplicial"
  letters = (Letter("X", False, "global 2-simplicial attention (no RoPE)"),)
  implementations = {
    "reference": ("iha_jax.ops.simplicial:simplicial_reference", {}),
    "xla": ("iha_jax.ops.simplicial:simplicial_xla", {}),
  }
  uses_rope = False
  sequence_roles = ("q", "kv", "kv", "kv", "kv")

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
