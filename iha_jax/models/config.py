"""Transformer configuration (decoder LM or encoder) and the per-layer attention schedule."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from iha_jax import kinds
from iha_jax.checks import is_int
from iha_jax.kinds import AttentionConfig

# Schedule letter -> description, one entry per letter of every registered kind (a live
# view: `iha_jax.kinds.register` adds a new kind's letters).
SCHEDULE_LETTERS = kinds.LETTER_DESCRIPTIONS


MLP_TYPES = ("swiglu", "gelu", "none")
# The token embedding's gradient (`iha_jax.models.embedding.lookup`).
GRADIENT_FORMS = ("auto", "scatter", "matmul")


def expand_schedule(schedule: str, num_layers: int) -> str:
  """Repeats/truncates `schedule` to one letter per layer (`("LLLLM", 10)` ->
  `"LLLLMLLLLM"`, `("LLLLM", 3)` -> `"LLL"`); ValueError for an empty schedule, an unknown
  letter or `num_layers < 1`."""
  if not isinstance(schedule, str) or not schedule:
    raise ValueError(
      f"schedule must be a non-empty string of letters "
      f"{'/'.join(SCHEDULE_LETTERS)}, got {schedule!r}"
    )
  for index, letter in enumerate(schedule):
    if letter not in SCHEDULE_LETTERS:
      allowed = ", ".join(f"{k} ({v})" for k, v in SCHEDULE_LETTERS.items())
      raise ValueError(
        f"schedule {schedule!r} has unknown letter {letter!r} at index {index}; "
        f"allowed letters: {allowed}"
      )
  if not is_int(num_layers, 1):
    raise ValueError(f"num_layers must be a positive integer, got {num_layers!r}")
  repeats = -(-num_layers // len(schedule))
  return (schedule * repeats)[:num_layers]


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  """Hyper-parameters of `TransformerLM` (validated on construction).

  Attributes:
    vocab_size: V.
    num_layers: number of decoder blocks.
    model_dim: D.
    num_heads: H.
    head_dim: d.
    num_kv_heads: G key/value heads of every attention layer, dividing H (grouped-query
      attention: query head h reads key/value head `h // (H // G)`; G = 1: multi-query);
      None means G = H. Differential ('D') layers, which have H/2 heads, get G/2 (G even);
      Talking-Heads ('T') and 2-simplicial ('X') layers refuse G < H.
    mlp_dim: F, hidden width of the MLP.
    num_pseudo: P for the IHA layers; None means P = H (the paper's default and the
      dearest; docs/results.md "Which P?" for which to pick). The PHA layers ('P', 'R')
      share it as their group size, dividing H; None gives them 2.
    attention_schedule: one letter per layer, repeated to `num_layers`: I (global IHA),
      L (sliding-window IHA), M (global MHA), S (sliding-window MHA), T (Talking-Heads),
      D (differential), X (2-simplicial), P (global PHA), R (sliding-window PHA), and
      those of kinds registered later (`SCHEDULE_LETTERS`).
    iha_window: window of the sliding-window layers of kinds over virtual tokens ('L',
      'R'), in VIRTUAL tokens (N*P per sequence).
    mha_window: window of the other sliding-window layers ('S'), in tokens.
    rope_theta: RoPE base; None disables RoPE.
    collapse_mode: "full" or "per_head" collapse in the IHA layers.
    embedding_gradient: the token table's gradient: "scatter" (XLA's scatter-add),
      "matmul" (a one-hot matmul, the same sums) or "auto" (the matmul on TPU where
      libtpu's scatter-add is slower by estimate: `iha_jax.models.embedding`).
    tie_embeddings: output head shares the token embedding; else an `lm_head [D, V]`.
    dtype: computation dtype (logits are always float32).
    param_dtype: storage dtype of the parameters.
    implementation: attention core backend, see `iha_jax.ops` (each kind's
      implementations: `iha_jax.kinds.registry.implementations`).
    norm_eps: RMSNorm epsilon.
    mlp_type: "swiglu" (`w_gate, w_up: [D, F]`, `w_down: [F, D]`), "gelu"
      (`w_up: [D, F]`, `w_down: [F, D]`) or "none" (attention-only blocks; `mlp_dim`
      is then unused).
    causal: True for a decoder LM; False builds an encoder (bidirectional attention
      in every layer; targets are per position, as the data gives them).
    num_outputs: None: next-token logits over the vocabulary; an int: a per-token head
      `output_head: [D, num_outputs]` (classification logits or regression values).
    mixing_noise_std: std of Gaussian noise added to the identity init of the head
      mixings (IHA's `alpha_*` and `collapse`, Talking-Heads' `talk_*`).
    input_features: None, or F: every token also reads `F` continuous features
      (`[B, N, F]`, projected by `input_proj: [F, D]` and added to its embedding).
  """

  vocab_size: int
  num_layers: int
  model_dim: int
  num_heads: int
  head_dim: int
  mlp_dim: int
  num_pseudo: int | None = None
  attention_schedule: str = "LLLLM"
  iha_window: int | None = None
  mha_window: int | None = None
  rope_theta: float | None = 10000.0
  collapse_mode: str = "full"
  tie_embeddings: bool = True
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32
  implementation: str = "auto"
  norm_eps: float = 1e-6
  mlp_type: str = "swiglu"
  causal: bool = True
  num_outputs: int | None = None
  mixing_noise_std: float = 0.0
  input_features: int | None = None
  num_kv_heads: int | None = None
  embedding_gradient: str = "auto"

  def __post_init__(self):
    for name in ("vocab_size", "num_layers", "mlp_dim"):
      value = getattr(self, name)
      if not is_int(value, 1):
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if self.embedding_gradient not in GRADIENT_FORMS:
      raise ValueError(
        f"embedding_gradient must be one of {GRADIENT_FORMS}, got {self.embedding_gradient!r}"
      )
    if self.mlp_type not in MLP_TYPES:
      raise ValueError(f"mlp_type must be one of {MLP_TYPES}, got {self.mlp_type!r}")
    if not self.norm_eps > 0:
      raise ValueError(f"norm_eps must be > 0, got {self.norm_eps!r}")
    if self.num_outputs is not None and not is_int(self.num_outputs, 1):
      raise ValueError(
        f"num_outputs must be None (vocabulary logits) or a positive integer, "
        f"got {self.num_outputs!r}"
      )
    if self.input_features is not None and not is_int(self.input_features, 1):
      raise ValueError(
        f"input_features must be None or a positive integer, got {self.input_features!r}"
      )
    if not isinstance(self.mixing_noise_std, (int, float)) or not self.mixing_noise_std >= 0:
      raise ValueError(f"mixing_noise_std must be a number >= 0, got {self.mixing_noise_std!r}")
    if self.num_kv_heads is not None and (
      not is_int(self.num_kv_heads, 1) or self.num_heads % self.num_kv_heads
    ):
      raise ValueError(
        f"num_kv_heads must be None (= num_heads) or a positive integer dividing "
        f"num_heads={self.num_heads}, got {self.num_kv_heads!r}"
      )
    try:
      schedule = expand_schedule(self.attention_schedule, self.num_layers)
    except ValueError as e:
      raise ValueError(f"attention_schedule: {e}") from e
    for letter in dict.fromkeys(schedule):
      record, spec = kinds.for_letter(letter)
      window = "iha_window" if record.virtual_tokens else "mha_window"
      if spec.windowed and getattr(self, window) is None:
        raise ValueError(
          f"{window} must be set: attention_schedule {self.attention_schedule!r} has "
          f"{letter!r} ({spec.description}) layers"
        )
    for letter in set(schedule):  # Validates dims, windows, collapse_mode, RoPE, ...
      self.attention_config(letter)

  @property
  def schedule(self) -> str:
    """The attention letter of every layer, `len == num_layers`."""
    return expand_schedule(self.attention_schedule, self.num_layers)

  def attention_config(self, letter: str, layer: int = 1) -> AttentionConfig:
    """The `AttentionConfig` of a layer with schedule letter `letter`; `layer` counts from
    1 (differential attention's lambda_init)."""
    record, spec = kinds.for_letter(letter)
    window_field = "iha_window" if record.virtual_tokens else "mha_window"
    shared = {"num_pseudo": self.num_pseudo, "collapse_mode": self.collapse_mode}
    kv_heads = None if self.num_kv_heads is None else record.layer_kv_heads(self.num_kv_heads)
    return AttentionConfig(
      self.model_dim,
      record.layer_heads(self.num_heads),
      self.head_dim,
      kind=record.name,
      window=getattr(self, window_field) if spec.windowed else None,
      rope_theta=self.rope_theta,
      causal=self.causal,
      layer=layer,
      dtype=self.dtype,
      implementation=self.implementation,
      num_kv_heads=kv_heads,
      **{name: shared[name] for name in record.config_fields if name in shared},
    )
