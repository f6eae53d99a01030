"""`AttentionConfig`: the static description of one attention layer, for every kind,
checked on construction (what only one kind reads by its record, `AttentionKind.validate`)
so that a bad field is named before anything is traced.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from iha_jax.checks import check_positive
from iha_jax.core.options import AttentionOptions
from iha_jax.kinds import registry
from iha_jax.kinds.base import AttentionKind


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
  """Static description of one attention layer.

  Attributes:
    model_dim: D, width of the input and output `[B, N, D]`.
    num_heads: H (for "diff": the differential heads, each with two maps and value
      width 2d; H/2 of them match an MHA layer of H heads in parameters).
    head_dim: d (even when RoPE is on).
    num_kv_heads: G key/value heads, dividing H (grouped-query attention: query head h
      reads key/value head `h // (H // G)`; G = 1 is multi-query); None means G = H.
      IHA, MHA and differential attention take G < H; Talking-Heads and 2-simplicial
      attention refuse it.
    kind: a registered kind (`iha_jax.kinds.names()`): "iha" (Interleaved Head
      Attention), "mha", "talking_heads", "diff" (differential), "simplicial", "pha"
      (paired-head attention).
    num_pseudo: P pseudo-heads per head (IHA; None: P = H, the paper's default), or the
      heads per group of PHA ("pha"; None: 2); stored resolved.
    window: sliding window in the kind's sequence units: VIRTUAL tokens for IHA and PHA
      (`N * P` per sequence), tokens for the other kinds; None is global.
    rope_theta: RoPE base; None disables RoPE (2-simplicial attention stores None).
    collapse_mode: "full" (`collapse: [H, H, P]`) or "per_head" (`[H, P]`), IHA only.
    causal: causal attention; False: bidirectional (encoders).
    layer: the layer's number, counted from 1; sets differential attention's
      `lambda_init = 0.8 - 0.6 exp(-0.3 (layer - 1))`.
    dtype: computation dtype; None promotes the input and parameter dtypes.
    implementation: the attention core's implementation, one of the kind's
      (`iha_jax.kinds.registry.implementations`) or "auto".
    dropout_rate: the probability of dropping each attention weight while training (not
      deterministic); 0: none. Only the kind's `dropout_implementations` ("xla") do it.
    qk_norm: RMSNorm of every source query and key head over its d features (learned
      `q_norm, k_norm: [d]`, float32 statistics, eps 1e-6) after the projection, before
      IHA's mixing and RoPE; IHA, MHA, PHA and Talking-Heads.
    use_bias: projection biases `bq: [H, d]`, `bk, bv: [G, d]` (before mixing and RoPE)
      and `bo: [out_features]`, zeros at init; IHA, MHA, PHA and Talking-Heads.
    out_features: width of the output `[B, N, out_features]`; None: `model_dim`.
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
  num_kv_heads: int | None = None
  dropout_rate: float = 0.0
  qk_norm: bool = False
  use_bias: bool = False
  out_features: int | None = None

  def __post_init__(self):
    record = registry.get(self.kind)  # names the registered kinds otherwise
    check_positive("model_dim", self.model_dim)
    check_positive("num_heads", self.num_heads)
    check_positive("head_dim", self.head_dim)
    check_positive("num_kv_heads", self.num_kv_heads, optional=True)
    if self.num_kv_heads is not None and self.num_heads % self.num_kv_heads:
      raise ValueError(
        f"num_kv_heads={self.num_kv_heads} must divide num_heads={self.num_heads} (each "
        "key/value head serves num_heads // num_kv_heads query heads)"
      )
    check_positive("window", self.window, optional=True)
    check_positive("layer", self.layer)
    check_positive("out_features", self.out_features, optional=True)
    for name in ("causal", "qk_norm", "use_bias"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
    if self.rope_theta is not None and record.uses_rope:
      if self.rope_theta <= 0:
        raise ValueError(f"rope_theta must be positive or None, got {self.rope_theta!r}")
      if self.head_dim % 2:
        raise ValueError(
          f"head_dim must be even with RoPE on (rope_theta={self.rope_theta}), got {self.head_dim}"
        )
    registry.check_implementation_name(self.implementation)
    for name in registry.kind_fields():
      default = _FIELD_DEFAULTS[name]
      if name not in record.config_fields and getattr(self, name) != default:
        raise ValueError(
          f"{name} is not an option of {self.kind} attention (got {name}="
          f"{getattr(self, name)!r}; leave it at {default!r})"
        )
    if not record.uses_rope:
      object.__setattr__(self, "rope_theta", None)  # documented as ignored: stored as such
    record.validate(self)
    if "num_pseudo" in record.config_fields:  # stored resolved: the kind's default when None
      default = record.default_num_pseudo
      if self.num_pseudo is None and default is not None:
        object.__setattr__(self, "num_pseudo", default)
      object.__setattr__(self, "num_pseudo", effective_num_pseudo(self.num_pseudo, self.num_heads))
    if self.implementation != "auto":
      registry.resolve(self.kind, self.implementation)  # e.g. no kernel for talking_heads
    check_dropout(record, self.dropout_rate, self.implementation)

  @property
  def record(self) -> AttentionKind:
    """The kind's record (`iha_jax.kinds.base.AttentionKind`)."""
    return registry.get(self.kind)

  def options(
    self,
    *,
    segment_ids: jax.Array | None = None,
    positions: jax.Array | None = None,
    dropout_rng: jax.Array | None = None,
  ) -> AttentionOptions:
    """The layer's options for its attention call (`window` in the kind's units); with a
    `dropout_rng` (training, not deterministic) the layer's `dropout_rate` applies."""
    options = AttentionOptions(
      window=self.window,
      causal=self.causal,
      rope_theta=self.rope_theta if self.record.uses_rope else None,
      segment_ids=segment_ids,
      positions=positions,
      implementation=self.implementation,
    )
    if dropout_rng is None or not self.dropout_rate:
      return options  # the same object as without dropout: the same program
    return options.replace(dropout_rate=self.dropout_rate, dropout_rng=dropout_rng)

  @property
  def kv_heads(self) -> int:
    """G: key/value heads (`num_kv_heads`, or H when None)."""
    return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

  @property
  def output_dim(self) -> int:
    """Width of the layer's output: `out_features`, or `model_dim` when None."""
    return self.model_dim if self.out_features is None else self.out_features

  @property
  def value_dim(self) -> int:
    """Width of each head's value and output: 2d for "diff", d otherwise."""
    return self.record.value_dim(self)


_FIELD_DEFAULTS = {f.name: f.default for f in dataclasses.fields(AttentionConfig)}


def effective_num_pseudo(num_pseudo: int | None, num_heads: int) -> int:
  """IHA's P: `num_pseudo`, or H (`num_heads`) when None (the paper's default), the one
  place that reads None as H; ValueError unless None or a positive integer."""
  check_positive("num_pseudo", num_pseudo, optional=True)
  return num_heads if num_pseudo is None else num_pseudo


def check_dropout(record: AttentionKind, rate: Any, implementation: str) -> None:
  """Raises ValueError naming `dropout_rate` unless it is a number in [0, 1) that `record`
  can apply with `implementation` (checked again after "auto" resolves, per call)."""
  if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate < 1:
    raise ValueError(f"dropout_rate must be a number in [0, 1), got {rate!r}")
  if not rate:
    return
  allowed = sorted(record.dropout_implementations)
  if not allowed:
    raise ValueError(
      f"dropout_rate={rate}: {record.name} attention has no attention dropout in any "
      "implementation; use dropout_rate=0"
    )
  if implementation != "auto" and implementation not in allowed:
    raise ValueError(
      f"dropout_rate={rate}: {record.name} attention's {implementation!r} implementation "
      f"has no attention dropout; use implementation={allowed[0]!r}"
    )
