"""Model FLOP and parameter budget of every attention kind (docs/design.md §2), peak table and MFU.

Forward FLOPs (a multiply-add is 2), per token and layer (D width, H heads and G
key/value heads of the layer's `AttentionConfig`, d head width, dv value width, P
pseudo-heads, F MLP width):
- projections: `2 *` the entries of the layer's projection matrices (`w*`), i.e.
  `2*D*(2H + 2G)*d` for iha / mha / pha (`4 * 2*D*H*d` at G = H) and talking_heads, the same for
  diff (wq `[D, H/2, 2, d]`, wk `[D, G/2, 2, d]`, wv `[D, G/2, 2d]`, wo `[H/2, 2d, D]`)
  and `6 * 2*D*H*d` for simplicial (q, k1, k2, v1, v2, o);
- IHA mixing `2*(H*H + 2*G*G)*P*d` (`2*3*H*H*P*d` at G = H) and collapse `2*H*H*P*d`
  (full) or `2*H*P*d` (per_head);
- MLP: `3 * 2*D*F` (SwiGLU) or `2 * 2*D*F` (GELU);
per sequence and layer, the attention core, from the visible query-key pairs of one head
(and, for simplicial, the visible key-key triples of one query):
- iha / mha: `4d` per pair and head (QK and PV); IHA counts over `T = N*P` virtual
  tokens with its window in virtual tokens;
- pha: `4d` per pair over `T = N*P` virtual tokens (window in virtual tokens) for each
  of its H/P groups: P times MHA's work (no mixing);
- talking_heads: `4d` per pair and head, plus the two `H x H` mixings of the logits and
  of the weights, `2*H*H` each per pair (`4*H*H` per pair for all heads);
- diff (H/2 heads): two maps of QK `2d` and PV `2*dv = 4d`: `12d` per pair and head;
- simplicial: `4d` per visible triple `(i, j, l)` (j and l both visible from i) plus `3d`
  per visible pair, per head; a query with `k` visible keys has `k^2` triples.
Plus the output head `2*D*V` per token (`2*D*num_outputs` with a per-token head).
Training = 3x forward. Packing/padding is ignored: every one of the `B*N` positions counts.

Visible keys of query t over `L` positions, window w (None: global):
causal `min(t+1, w)`; bidirectional `min(t, w-1) + min(L-1-t, w-1) + 1` (`|t-s| < w`),
global bidirectional `L`.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

# The visible-pair counts live beside the mask they count (re-exported here).
from iha_jax.core.masking import visible_keys, visible_pairs, visible_triples  # noqa: F401
from iha_jax.models import TransformerConfig, count_params
from iha_jax.nn import AttentionConfig
from iha_jax.nn.config import param_specs

# Dense bf16 peak TFLOP/s per device (per chip for TPU), by device_kind substring.
PEAK_TFLOPS = (
  ("TPU v6", 918.0),  # v6e (Trillium)
  ("TPU v5p", 459.0),
  ("TPU v5 lite", 197.0),  # v5e
  ("TPU v5e", 197.0),
  ("TPU v5", 459.0),  # v5p reports "TPU v5"
  ("TPU v4", 275.0),
  ("H200", 989.0),  # SXM, dense (no sparsity)
  ("H100", 989.0),  # SXM, dense (no sparsity)
  ("A100", 312.0),
)


def causal_pairs(length: int, window: int | None) -> int:
  """Unmasked (query, key) pairs of one causal head over `length` positions."""
  return visible_pairs(length, window, causal=True)


def attention_params(acfg: AttentionConfig) -> int:
  """Parameters of one attention layer, from `param_specs` shapes."""
  return sum(int(np.prod(s.shape)) for s in param_specs(acfg).values())


def projection_flops_per_token(acfg: AttentionConfig) -> int:
  """Forward FLOPs of the layer's projections (every `w*` matrix) for one token."""
  return sum(
    2 * int(np.prod(s.shape)) for name, s in param_specs(acfg).items() if name.startswith("w")
  )


def mixing_flops_per_token(acfg: AttentionConfig) -> int:
  """Head mixings outside the core for one token (IHA's mix and collapse; 0 for the
  other built-in kinds), from the kind's record."""
  return acfg.record.mixing_flops(acfg)


def core_flops_per_sequence(acfg: AttentionConfig, seq_len: int) -> int:
  """Forward FLOPs of the attention core of one `[seq_len]` sequence, all heads, from
  the kind's record (Talking-Heads' per-pair logit/weight mixings included)."""
  return acfg.record.core_flops(acfg, seq_len)


@dataclasses.dataclass(frozen=True)
class LayerBudget:
  """Parameters and forward FLOPs of the layers of one schedule letter.

  Attributes:
    letter: schedule letter (I, L, M, S, T, D, X, ...).
    kind: attention kind (`iha_jax.kinds`).
    window: in virtual tokens for kinds over virtual tokens (IHA), tokens otherwise;
      None is global.
    causal: False for bidirectional (encoder) layers.
    count: layers of the model with this letter.
    heads: the layer's query heads H and key/value heads G, `(H, G)`.
    params: attention parameters of one layer (`param_specs` shapes).
    block_params: one whole block: attention, MLP and its two RMSNorm scales.
    projection_flops: per token.
    mixing_flops: per token (IHA mixing + collapse).
    core_flops: per sequence of `seq_len` tokens.
    mlp_flops: per token.
    seq_len: N.
  """

  letter: str
  kind: str
  window: int | None
  causal: bool
  count: int
  params: int
  block_params: int
  projection_flops: int
  mixing_flops: int
  core_flops: int
  mlp_flops: int
  seq_len: int
  virtual_tokens: bool = False
  heads: tuple[int, int] = (0, 0)

  @property
  def attention_flops_per_token(self) -> float:
    """Forward core + mixing FLOPs per token of one layer (projections excluded)."""
    return self.core_flops / self.seq_len + self.mixing_flops

  @property
  def forward_flops_per_sequence(self) -> int:
    """Forward FLOPs of one layer over one sequence (projections, attention, MLP)."""
    per_token = self.projection_flops + self.mixing_flops + self.mlp_flops
    return per_token * self.seq_len + self.core_flops


def layer_budgets(config: TransformerConfig, seq_len: int) -> list[LayerBudget]:
  """One `LayerBudget` per distinct schedule letter, in order of first appearance."""
  schedule = config.schedule
  mlp_matrices = {"swiglu": 3, "gelu": 2, "none": 0}[config.mlp_type]
  mlp_params = mlp_matrices * config.model_dim * config.mlp_dim
  budgets = []
  for letter in dict.fromkeys(schedule):
    acfg = config.attention_config(letter)
    params = attention_params(acfg)
    budgets.append(
      LayerBudget(
        letter=letter,
        kind=acfg.kind,
        window=acfg.window,
        causal=acfg.causal,
        count=schedule.count(letter),
        params=params,
        # + the RMSNorm scales (one without an MLP)
        block_params=params
        + mlp_params
        + (1 if config.mlp_type == "none" else 2) * config.model_dim,
        projection_flops=projection_flops_per_token(acfg),
        mixing_flops=mixing_flops_per_token(acfg),
        core_flops=core_flops_per_sequence(acfg, seq_len),
        mlp_flops=2 * mlp_params,
        seq_len=seq_len,
        virtual_tokens=acfg.record.virtual_tokens,
        heads=(acfg.num_heads, acfg.kv_heads),
      )
    )
  return budgets


def output_head_flops_per_token(config: TransformerConfig) -> int:
  """Vocabulary logits `2*D*V`, or `2*D*num_outputs` with a per-token output head."""
  outputs = config.vocab_size if config.num_outputs is None else config.num_outputs
  return 2 * config.model_dim * outputs


def forward_flops_per_sequence(config: TransformerConfig, seq_len: int) -> float:
  """Forward FLOPs of one `[seq_len]` sequence through `TransformerLM(config)`."""
  layers = sum(b.count * b.forward_flops_per_sequence for b in layer_budgets(config, seq_len))
  return float(output_head_flops_per_token(config) * seq_len + layers)


def train_flops_per_step(config: TransformerConfig, batch_size: int, seq_len: int) -> float:
  """Model FLOPs of one training step (forward + backward = 3x forward); remat excluded."""
  return 3.0 * batch_size * forward_flops_per_sequence(config, seq_len)


def _si(value: float) -> str:
  """4 significant digits with a k/M/G/T/P suffix."""
  for suffix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
    if abs(value) >= scale:
      return f"{value / scale:.4g}{suffix}"
  return f"{value:.4g}"


def _window_text(budget: LayerBudget) -> str:
  if budget.window is None:
    return "global"
  return f"{budget.window} {'virtual' if budget.virtual_tokens else 'tokens'}"


def budget_table(config: TransformerConfig, seq_len: int, batch_size: int = 1) -> str:
  """Plain-text budget of `config` at `seq_len`: one row per schedule letter, then totals.

  Columns: letter, kind, window (virtual tokens for iha), mask, heads (H, or H/G with G
  key/value heads), layers, attention parameters per layer, block parameters per layer,
  attention FLOPs per token forward (core + mixing, projections excluded). Totals: model
  parameters, attention FLOPs per token summed over layers, train FLOPs per step at
  `batch_size`.
  """
  budgets = layer_budgets(config, seq_len)
  header = (
    "letter",
    "kind",
    "window",
    "mask",
    "heads",
    "layers",
    "attn params",
    "block params",
    "attn FLOPs/token",
  )
  rows = [
    (
      b.letter,
      b.kind,
      _window_text(b),
      "causal" if b.causal else "bidir",
      str(b.heads[0]) if b.heads[0] == b.heads[1] else f"{b.heads[0]}/{b.heads[1]}",
      str(b.count),
      f"{b.params:,}",
      f"{b.block_params:,}",
      _si(b.attention_flops_per_token),
    )
    for b in budgets
  ]
  widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
  line = lambda r: "  ".join(
    c.ljust(w) if i < 5 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))
  ).rstrip()
  attention = sum(b.count * b.attention_flops_per_token for b in budgets)
  lines = [
    f"budget at seq_len {seq_len} (forward FLOPs; train = 3x forward):",
    line(header),
    *map(line, rows),
    f"parameters: {count_params(config):,}",
    f"attention FLOPs per token (all layers, forward): {_si(attention)}",
    f"train FLOPs per step (batch {batch_size}): "
    f"{_si(train_flops_per_step(config, batch_size, seq_len))}",
  ]
  return "\n".join(lines)


def measured_matmul_tflops(
  device: jax.Device | None = None, size: int = 1024, dtype=jnp.float32, repeats: int = 5
) -> float:
  """Best-of-`repeats` rate of a `size`^3 matmul on `device`, in TFLOP/s (the CPU peak
  proxy; the benchmarks' measured peak on GPU/TPU). Random operands: constant ones run
  faster than real data on some accelerators."""
  device = device or jax.devices()[0]
  a = jax.device_put(jax.random.normal(jax.random.key(0), (size, size), dtype), device)
  matmul = jax.jit(lambda x: x @ x)
  matmul(a).block_until_ready()
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    matmul(a).block_until_ready()
    best = min(best, time.perf_counter() - start)
  return 2 * size**3 / best / 1e12


def peak_tflops_per_device(device: jax.Device | None = None) -> tuple[float, str]:
  """(peak TFLOP/s, source): the table's bf16 dense peak, else a measured matmul rate."""
  device = device or jax.devices()[0]
  kind = getattr(device, "device_kind", "")
  for pattern, peak in PEAK_TFLOPS:
    if pattern.lower() in kind.lower():
      return peak, f"table ({kind}, bf16 dense)"
  return measured_matmul_tflops(device), f"measured matmul ({kind or device.platform})"
