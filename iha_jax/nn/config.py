"""Attention layer configuration and parameter layout, shared by the NNX and Linen modules.

One place defines every parameter's name, shape, logical axes and initializer, so the
two front ends cannot drift apart (same parameter tree in both).

Every parameter carries logical axis names (`iha_jax.parallel.axes`, mapped to mesh axes
by `iha_jax.parallel.rules`); the mixing/collapse tensors are tiny (`H*H*P`) and the
rules replicate their head and pseudo axes.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax

from iha_jax.nn.initializers import (
  fold_fan_in,
  identity_collapse_init,
  identity_mixing_init,
  identity_talking_init,
)
from iha_jax.ops import IMPLEMENTATIONS, KINDS, registry
from iha_jax.ops.options import AttentionOptions
from iha_jax.ops.validation import is_int
from iha_jax.parallel.axes import EMBED, HEAD_DIM, HEADS, HEADS_DST, HEADS_SRC, PSEUDO, QK_PAIR

COLLAPSE_MODES = ("full", "per_head")
DEFAULT_KERNEL_INIT = jax.nn.initializers.lecun_normal()


def _check_positive(name: str, value: Any, *, optional: bool = False) -> None:
  if optional and value is None:
    return
  if not is_int(value, 1):
    raise ValueError(
      f"{name} must be a positive integer{' or None' if optional else ''}, got {value!r}"
    )


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
  """Static description of one attention layer (validated on construction).

  Attributes:
    model_dim: D, width of the input and output `[B, N, D]`.
    num_heads: H (for "diff": the differential heads, each with two maps and value
      width 2d; H/2 of them match an MHA layer of H heads in parameters).
    head_dim: d (even when RoPE is on).
    kind: "iha" (Interleaved Head Attention), "mha", "talking_heads", "diff"
      (differential) or "simplicial" (2-simplicial, no RoPE).
    num_pseudo: P pseudo-heads per head (IHA only; None means P = H, the paper's default).
    window: sliding window in virtual tokens for IHA, tokens for the other kinds; None
      is global.
    rope_theta: RoPE base; None disables RoPE (2-simplicial never uses it).
    collapse_mode: "full" (`collapse: [H, H, P]`) or "per_head" (`[H, P]`), IHA only.
    causal: causal attention; False: bidirectional (encoders).
    layer: the layer's index counted from 1; sets differential attention's
      `lambda_init = 0.8 - 0.6 exp(-0.3 (layer - 1))`.
    dtype: computation dtype; None promotes the input and parameter dtypes.
    implementation: attention core backend passed to `iha_jax.ops`.
  """

  model_dim: int
  num_heads: int
  head_dim: int
  kind: str = "iha"
  num_pseudo: int | None = None
  window: int | None = None
  rope_theta: float | None = 10000.0
  collapse_mode: str = "full"
  causal: bool = True
  layer: int = 1
  dtype: Any = None
  implementation: str = "auto"

  def __post_init__(self):
    if self.kind not in KINDS:
      raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
    _check_positive("model_dim", self.model_dim)
    _check_positive("num_heads", self.num_heads)
    _check_positive("head_dim", self.head_dim)
    _check_positive("num_pseudo", self.num_pseudo, optional=True)
    _check_positive("window", self.window, optional=True)
    _check_positive("layer", self.layer)
    if self.kind != "iha" and self.num_pseudo is not None:
      raise ValueError(
        f"num_pseudo is an IHA option; {self.kind} attention has none "
        f"(got num_pseudo={self.num_pseudo})"
      )
    if self.collapse_mode not in COLLAPSE_MODES:
      raise ValueError(f"collapse_mode must be one of {COLLAPSE_MODES}, got {self.collapse_mode!r}")
    if not isinstance(self.causal, bool):
      raise ValueError(f"causal must be a bool (False: bidirectional), got {self.causal!r}")
    if self.rope_theta is not None and self.kind != "simplicial":
      if self.rope_theta <= 0:
        raise ValueError(f"rope_theta must be positive or None, got {self.rope_theta!r}")
      if self.head_dim % 2:
        raise ValueError(
          f"head_dim must be even with RoPE on (rope_theta={self.rope_theta}), got {self.head_dim}"
        )
    if self.implementation not in IMPLEMENTATIONS:
      raise ValueError(
        f"implementation must be one of {IMPLEMENTATIONS}, got {self.implementation!r}"
      )
    if self.implementation != "auto":
      registry.resolve(self.kind, self.implementation)  # e.g. no kernel for talking_heads

  def options(
    self, *, segment_ids: jax.Array | None = None, positions: jax.Array | None = None
  ) -> AttentionOptions:
    """The layer's options for its attention call (`window` in the kind's units)."""
    return AttentionOptions(
      window=self.window,
      causal=self.causal,
      rope_theta=self.rope_theta,  # 2-simplicial attention ignores it
      segment_ids=segment_ids,
      positions=positions,
      implementation=self.implementation,
    )

  @property
  def interleaved(self) -> bool:
    """True for Interleaved Head Attention."""
    return self.kind == "iha"

  @property
  def pseudo(self) -> int:
    """P, with the paper's default P = H resolved (1 for every other kind)."""
    if not self.interleaved:
      return 1
    return self.num_heads if self.num_pseudo is None else self.num_pseudo

  @property
  def value_dim(self) -> int:
    """Width of each head's value and output: 2d for "diff", d otherwise."""
    return 2 * self.head_dim if self.kind == "diff" else self.head_dim


class ParamSpec(NamedTuple):
  """Shape, logical axis names and initializer of one parameter."""

  shape: tuple[int, ...]
  axes: tuple[str, ...]
  init: jax.nn.initializers.Initializer


def param_specs(
  cfg: AttentionConfig,
  *,
  kernel_init: jax.nn.initializers.Initializer = DEFAULT_KERNEL_INIT,
  mixing_noise_std: float = 0.0,
) -> dict[str, ParamSpec]:
  """Every parameter of the layer, in creation order.

  Args:
    cfg: the layer configuration.
    kernel_init: 2-D initializer for the projections, applied to the folded matrices
      `[D, H*d]` (wq, wk, wv, ...) and `[H*d, D]` (wo) so fan-in is computed correctly.
    mixing_noise_std: std of the Gaussian noise added to the identity init of the head
      mixings (`alpha_*`, `collapse`, `talk_*`).

  Returns:
    `{name: ParamSpec}`: `wq, wk, wv, wo` (`[D, H, d]`, `[H, d, D]`), plus
    - iha: `alpha_q, alpha_k, alpha_v: [H, H, P]`, `collapse: [H, H, P]` or `[H, P]`;
    - talking_heads: `talk_logits, talk_weights: [H, H]` (identity init);
    - diff: `wq, wk: [D, H, 2, d]`, `wv: [D, H, 2d]`, `wo: [H, 2d, D]`,
      `lambda_q1, lambda_k1, lambda_q2, lambda_k2: [d]` (N(0, 0.1^2)) and the per-head
      output RMSNorm's `norm_scale: [2d]` (ones);
    - simplicial: `wq, wk1, wk2, wv1, wv2: [D, H, d]` and `wo`.
  """
  if not mixing_noise_std >= 0:
    raise ValueError(f"mixing_noise_std must be >= 0, got {mixing_noise_std!r}")
  d_model, h, d, dv = cfg.model_dim, cfg.num_heads, cfg.head_dim, cfg.value_dim
  in_proj = ParamSpec((d_model, h, d), (EMBED, HEADS, HEAD_DIM), fold_fan_in(kernel_init, 1))
  out_proj = ParamSpec((h, dv, d_model), (HEADS, HEAD_DIM, EMBED), fold_fan_in(kernel_init, 2))
  if cfg.kind == "simplicial":
    return {
      "wq": in_proj,
      "wk1": in_proj,
      "wk2": in_proj,
      "wv1": in_proj,
      "wv2": in_proj,
      "wo": out_proj,
    }
  if cfg.kind == "diff":
    pair = ParamSpec(
      (d_model, h, 2, d), (EMBED, HEADS, QK_PAIR, HEAD_DIM), fold_fan_in(kernel_init, 1)
    )
    lam = ParamSpec((d,), (HEAD_DIM,), jax.nn.initializers.normal(0.1))
    return {
      "wq": pair,
      "wk": pair,
      "wv": ParamSpec((d_model, h, dv), (EMBED, HEADS, HEAD_DIM), fold_fan_in(kernel_init, 1)),
      "wo": out_proj,
      "lambda_q1": lam,
      "lambda_k1": lam,
      "lambda_q2": lam,
      "lambda_k2": lam,
      "norm_scale": ParamSpec((dv,), (HEAD_DIM,), jax.nn.initializers.ones),
    }
  specs = {"wq": in_proj, "wk": in_proj, "wv": in_proj, "wo": out_proj}
  if cfg.kind == "talking_heads":
    talk = ParamSpec((h, h), (HEADS_SRC, HEADS), identity_talking_init(mixing_noise_std))
    specs.update(talk_logits=talk, talk_weights=talk)
  elif cfg.kind == "iha":
    p = cfg.pseudo
    mixing = ParamSpec(
      (h, h, p), (HEADS_SRC, HEADS, PSEUDO), identity_mixing_init(mixing_noise_std)
    )
    specs.update(alpha_q=mixing, alpha_k=mixing, alpha_v=mixing)
    collapse_init = identity_collapse_init(mixing_noise_std)
    if cfg.collapse_mode == "full":
      specs["collapse"] = ParamSpec((h, h, p), (HEADS_DST, HEADS, PSEUDO), collapse_init)
    else:
      specs["collapse"] = ParamSpec((h, p), (HEADS, PSEUDO), collapse_init)
  return specs


# Head-mixing parameters of every kind (identity-initialised coefficients, no projections):
# the optimizer's weight-decay switch and noise option act on exactly these.
MIXING_PARAMS = ("alpha_q", "alpha_k", "alpha_v", "collapse", "talk_logits", "talk_weights")
