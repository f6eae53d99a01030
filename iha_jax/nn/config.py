"""Attention layer configuration and parameter layout, shared by the NNX and Linen modules.

One place defines every parameter's name, shape, logical axes and initializer, so the
two front ends cannot drift apart (IHA_SPEC 3: same parameter tree in both).

Logical axis names *(project)*; the sharding rules map them to mesh axes:

- `embed`: model width D.
- `heads`: the attention heads the core runs over (projection heads of q/k/v/o, and
  the head owning a pseudo-head), i.e. the head axis of the activations.
- `head_dim`: per-head width d.
- `heads_src`: source head m of the pseudo-head mixing (`alpha_*` axis 0).
- `heads_dst`: output head h of the full collapse (`collapse` axis 0).
- `pseudo`: pseudo-head index p.

The mixing/collapse tensors are tiny (`H*H*P`); rules normally replicate
`heads_src`, `heads_dst` and `pseudo`.
"""
from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax

from iha_jax.nn.initializers import fold_fan_in, identity_collapse_init, identity_mixing_init
from iha_jax.ops import IMPLEMENTATIONS

EMBED = "embed"
HEADS = "heads"
HEAD_DIM = "head_dim"
HEADS_SRC = "heads_src"
HEADS_DST = "heads_dst"
PSEUDO = "pseudo"

COLLAPSE_MODES = ("full", "per_head")
DEFAULT_KERNEL_INIT = jax.nn.initializers.lecun_normal()


def _check_positive(name: str, value: Any, *, optional: bool = False) -> None:
  if optional and value is None:
    return
  if isinstance(value, bool) or not isinstance(value, int) or value < 1:
    raise ValueError(f"{name} must be a positive integer{' or None' if optional else ''}, "
                     f"got {value!r}")


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
  """Static description of one attention layer (validated on construction).

  Attributes:
    model_dim: D, width of the input and output `[B, N, D]`.
    num_heads: H.
    head_dim: d (even when RoPE is on).
    interleaved: True for Interleaved Head Attention, False for standard MHA.
    num_pseudo: P pseudo-heads per head (IHA only; None means P = H, the paper's default).
    window: sliding window in virtual tokens for IHA, tokens for MHA; None is global.
    rope_theta: RoPE base; None disables RoPE.
    collapse_mode: "full" (`collapse: [H, H, P]`) or "per_head" (`[H, P]`), IHA only.
    dtype: computation dtype; None promotes the input and parameter dtypes.
    implementation: attention core backend passed to `iha_jax.ops`.
  """
  model_dim: int
  num_heads: int
  head_dim: int
  interleaved: bool = True
  num_pseudo: int | None = None
  window: int | None = None
  rope_theta: float | None = 10000.0
  collapse_mode: str = "full"
  dtype: Any = None
  implementation: str = "auto"

  def __post_init__(self):
    _check_positive("model_dim", self.model_dim)
    _check_positive("num_heads", self.num_heads)
    _check_positive("head_dim", self.head_dim)
    _check_positive("num_pseudo", self.num_pseudo, optional=True)
    _check_positive("window", self.window, optional=True)
    if self.collapse_mode not in COLLAPSE_MODES:
      raise ValueError(f"collapse_mode must be one of {COLLAPSE_MODES}, got {self.collapse_mode!r}")
    if self.rope_theta is not None:
      if self.rope_theta <= 0:
        raise ValueError(f"rope_theta must be positive or None, got {self.rope_theta!r}")
      if self.head_dim % 2:
        raise ValueError(f"head_dim must be even with RoPE on (rope_theta={self.rope_theta}), "
                         f"got {self.head_dim}")
    if self.implementation not in IMPLEMENTATIONS:
      raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, "
                       f"got {self.implementation!r}")

  @property
  def pseudo(self) -> int:
    """P, with the paper's default P = H resolved."""
    return self.num_heads if self.num_pseudo is None else self.num_pseudo


class ParamSpec(NamedTuple):
  """Shape, logical axis names and initializer of one parameter."""
  shape: tuple[int, ...]
  axes: tuple[str, ...]
  init: jax.nn.initializers.Initializer


def param_specs(cfg: AttentionConfig, *,
                kernel_init: jax.nn.initializers.Initializer = DEFAULT_KERNEL_INIT,
                mixing_noise_std: float = 0.0) -> dict[str, ParamSpec]:
  """Every parameter of the layer, in creation order (IHA_SPEC 1 and 3).

  Args:
    cfg: the layer configuration.
    kernel_init: 2-D initializer for the projections, applied to the folded matrices
      `[D, H*d]` (wq, wk, wv) and `[H*d, D]` (wo) so fan-in is computed correctly.
    mixing_noise_std: std of the Gaussian noise added to the identity init of
      `alpha_*` and `collapse`.

  Returns:
    `{name: ParamSpec}` with names `wq, wk, wv, wo` (+ `alpha_q, alpha_k, alpha_v,
    collapse` for IHA).
  """
  if not mixing_noise_std >= 0:
    raise ValueError(f"mixing_noise_std must be >= 0, got {mixing_noise_std!r}")
  d_model, h, d = cfg.model_dim, cfg.num_heads, cfg.head_dim
  in_proj = ParamSpec((d_model, h, d), (EMBED, HEADS, HEAD_DIM), fold_fan_in(kernel_init, 1))
  specs = {
      "wq": in_proj,
      "wk": in_proj,
      "wv": in_proj,
      "wo": ParamSpec((h, d, d_model), (HEADS, HEAD_DIM, EMBED), fold_fan_in(kernel_init, 2)),
  }
  if not cfg.interleaved:
    return specs
  p = cfg.pseudo
  mixing = ParamSpec((h, h, p), (HEADS_SRC, HEADS, PSEUDO), identity_mixing_init(mixing_noise_std))
  specs.update(alpha_q=mixing, alpha_k=mixing, alpha_v=mixing)
  collapse_init = identity_collapse_init(mixing_noise_std)
  if cfg.collapse_mode == "full":
    specs["collapse"] = ParamSpec((h, h, p), (HEADS_DST, HEADS, PSEUDO), collapse_init)
  else:
    specs["collapse"] = ParamSpec((h, p), (HEADS, PSEUDO), collapse_init)
  return specs
