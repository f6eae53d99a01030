"""Paired-head attention (`P` global, `R` sliding window; docs/design.md §8, "Paired-head
attention"): IHA with its mixing and collapse replaced by fixed selections, no parameters
beyond MHA's."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Unpack

import jax

from iha_jax.checks import check_positive
from iha_jax.core import validation
from iha_jax.core.cudnn_attention import mha_cudnn
from iha_jax.core.masking import visible_pairs
from iha_jax.core.options import AttentionOptions, OptionFields
from iha_jax.core.paired import (
  Pairing,
  pair_heads,
  pair_kv_heads,
  paired_kv_heads,
  pha_probabilities,
  pha_reference,
  pha_via_mha,
  pha_xla,
  unpair_heads,
)
from iha_jax.kinds import registry
from iha_jax.kinds.base import PROJECTION_OPTIONS, AttentionKind, Letter, project_qkv
from iha_jax.kinds.mha import MHA

# P when `num_pseudo` is None: pairs of heads, the modded-nanogpt record's.
DEFAULT_NUM_PSEUDO = 2


def _via(name: str) -> Callable[..., jax.Array]:
  """PHA through MHA's implementation `name` over the virtual rows."""
  return functools.partial(pha_via_mha, mha=MHA.implementations[name])


# One object for both GPU names, as MHA's: nothing to materialise.
_GPU_KERNEL = _via("pallas_gpu")


class Paired(AttentionKind):
  """Query heads in H/P groups of P consecutive heads; group j attends over the `T = N*P`
  virtual tokens `n*P + p` holding head `j*P + p` of token n (RoPE at `pos*P + p`, window
  in virtual tokens), and virtual output `n*P + p` is head `j*P + p`'s output at token n.
  Attention work: P times MHA's (H/P heads over N*P rows). Parameters as MHA's (`wq: [D,
  H, d]`, `wk, wv: [D, G, d]`, `wo: [H, d, D]`). Grouped-query: member p of group j reads
  key/value head `(j*P + p) // (H // G)` (`iha_jax.core.paired`). Every implementation is
  MHA's over those rows; the "pseudo" cache holds them."""

  name = "pha"
  letters = (
    Letter("P", False, "global PHA (paired heads: groups of num_pseudo heads, default 2)"),
    Letter("R", True, "sliding-window PHA, window iha_window (virtual tokens)"),
  )
  implementations = {
    "reference": pha_reference,
    "xla": pha_xla,
    "pallas_tpu": _via("pallas_tpu"),
    "pallas_gpu": _GPU_KERNEL,
    "pallas_gpu_mha": _GPU_KERNEL,
    "cudnn": functools.partial(pha_via_mha, mha=mha_cudnn),
    "splash": _via("splash"),
  }
  config_fields = ("num_pseudo", *PROJECTION_OPTIONS)
  virtual_tokens = True
  default_num_pseudo = DEFAULT_NUM_PSEUDO
  dropout_implementations = frozenset({"xla"})
  probability_implementations = {"xla": pha_probabilities}
  decodes = True
  sequence_roles = ("q", "kv", "kv", "-")

  def validate(self, cfg):
    check_positive("num_pseudo", cfg.num_pseudo, optional=True)
    p = DEFAULT_NUM_PSEUDO if cfg.num_pseudo is None else cfg.num_pseudo
    check_pairing(cfg.num_heads, p, "num_heads")

  def check_arrays(self, q, k, v, pairing, sliced=False):
    if not isinstance(pairing, Pairing):
      raise TypeError(f"PHA's fourth array is its Pairing (static P), got {pairing!r}")
    validation.check_qkv(q, k, v, value_width=True, sliced=sliced)
    check_pairing(q.shape[2], pairing.num_pseudo, "q's H")

  def auto_inputs(self, q, k, v, pairing):
    return q, v, pairing.num_pseudo

  def num_pseudo(self, cfg):
    return cfg.num_pseudo  # resolved by AttentionConfig (None -> 2)

  def pseudo_kv_heads(self, cfg):
    return paired_kv_heads(cfg.num_heads, cfg.kv_heads, self.num_pseudo(cfg))

  def core(self, params, x, cfg, options, layer):
    arrays = self.entry_arrays(params, *project_qkv(params, x), cfg)
    return registry.attend(self, *arrays, options=options)

  def entry_arrays(self, params, q, k, v, cfg):
    return q, k, v, Pairing(self.num_pseudo(cfg))

  def core_flops(self, cfg, seq_len):
    # H/P groups over the N*P virtual rows: P times MHA's pairs per head-equivalent.
    p = self.num_pseudo(cfg)
    pairs = visible_pairs(seq_len * p, cfg.window, cfg.causal)
    return cfg.num_heads // p * pairs * (2 * cfg.head_dim + 2 * self.value_dim(cfg))

  def pseudo_heads(self, params, cfg, which, x):
    if which == "q":
      return pair_heads(x, self.num_pseudo(cfg))
    return pair_kv_heads(x, cfg.num_heads, self.num_pseudo(cfg))

  def collapse(self, params, cfg, out):
    return unpair_heads(out, self.num_pseudo(cfg))


def check_pairing(num_heads: int, num_pseudo: int, heads: str) -> None:
  """Raises ValueError unless P = `num_pseudo` divides H = `num_heads` (`heads` names it)."""
  if num_heads % num_pseudo:
    divisors = [p for p in range(2, num_heads + 1) if num_heads % p == 0] or [1]
    raise ValueError(
      f"num_pseudo={num_pseudo} must divide {heads}={num_heads}: PHA groups P consecutive "
      f"query heads; use one of {divisors}"
    )


PHA = Paired()


def pha_attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  options: AttentionOptions | None = None,
  *,
  num_pseudo: int = DEFAULT_NUM_PSEUDO,
  **overrides: Unpack[OptionFields],
) -> jax.Array:
  """Paired-head attention core (docs/design.md §8, "Paired-head attention").

  Args:
    q: source-head query projections before RoPE, `[B, N, H, d]`.
    k, v: source key/value projections, `[B, N, G, d]` (v may be `[B, N, G, dv]`), G
      dividing H (grouped-query: member p of group j reads key/value head
      `(j*P + p) // (H // G)`).
    options: the shared options (`AttentionOptions`; `window` in VIRTUAL tokens, as IHA's).
    num_pseudo: P, the heads per group and virtual tokens per token, dividing H (default 2).
    **overrides: any `AttentionOptions` field as a keyword, applied over `options`.

  Returns:
    `[B, N, H, dv]` in q.dtype, before the output projection.
  """
  check_positive("num_pseudo", num_pseudo)
  return registry.attend(PHA, q, k, v, Pairing(num_pseudo), options=options, **overrides)
