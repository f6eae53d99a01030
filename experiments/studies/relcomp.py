"""Relation composition (the paper's App. D): one bidirectional attention layer, H = 8,
P = 8 for IHA, a per-cell binary label, per-position binary cross-entropy.

Variants: IHA, MHA, 2-simplicial, Talking-Heads and differential attention, each a
one-layer encoder over the `m^2` cells (`relation_composition/*_encoder`), plus the
project's decoder-only rendering (a query block after the matrix, labels as tokens) for
IHA and MHA. Selection and headline metric: per-cell accuracy; whole-matrix exact match
beside it.
"""

from __future__ import annotations

import ml_collections

from experiments.protocol import Scale, Study, Variant
from experiments.studies.common import study_config

PAPER = (
  "IHA beats MHA and 2-simplicial attention on binary and ternary relation "
  'composition, "by up to 4.7 and 3.3 points over the strongest baseline" '
  "(App. D; one attention layer, H = 8, P = 8, 40k/5k/5k examples, LR 1e-3 or 1e-4, "
  "early stopping). The paper gives no per-variant table we could place beside ours."
)

# Per scale: matrix sides (None: the paper's), examples train/validation/test, model
# width, heads, P, batch, warm-up steps.
_SIZES = {
  # The control: 2 x 2 matrices, learned to 100% by every variant in ~100 steps.
  "tiny": dict(
    sides=(2, 2), examples=(512, 64, 64), width=16, heads=2, num_pseudo=2, batch=16, warmup=10
  ),
  # A 2-core CPU budget: the paper's H and P, smaller matrices (m in 4..6: 2-simplicial
  # is O(m^6) per example), fewer examples and steps.
  "small": dict(
    sides=(4, 6), examples=(8192, 512, 512), width=64, heads=8, num_pseudo=8, batch=16, warmup=100
  ),
  "paper": dict(
    sides=None,
    examples=(40_000, 5_000, 5_000),
    width=128,
    heads=8,
    num_pseudo=8,
    batch=64,
    warmup=500,
  ),
}


def _config(hops: int, scale: str, decoder: bool = False) -> ml_collections.ConfigDict:
  size = _SIZES[scale]
  loss = "cross_entropy" if decoder else "binary_cross_entropy"
  config = study_config(size["batch"], size["warmup"], loss=loss)
  name = "binary" if hops == 2 else "ternary"
  config.data.name = f"relation_composition/{name}{'' if decoder else '_encoder'}"
  max_side = size["sides"][1] if size["sides"] else (10 if hops == 2 else 8)
  config.data.seq_len = (2 * max_side**2 + 2) if decoder else max_side**2
  config.data.packing = False
  train, validation, test = size["examples"]
  config.data.options = {"num_train": train, "num_validation": validation, "num_test": test}
  if size["sides"]:
    config.data.options.update(min_size=size["sides"][0], max_size=size["sides"][1])
  config.model.update(
    num_layers=1,
    model_dim=size["width"],
    num_heads=size["heads"],
    head_dim=size["width"] // size["heads"],
    mlp_dim=4 * size["width"],
    attention_schedule="I",
    iha_window=None,
    causal=decoder,
    num_outputs=None if decoder else 1,
  )
  config.model.num_pseudo = size["num_pseudo"]
  return config


def _letter(letter: str):
  def edit(config: ml_collections.ConfigDict) -> None:
    config.model.attention_schedule = letter
    if letter != "I":
      config.model.num_pseudo = None

  return edit


def _study(hops: int) -> Study:
  name = "binary" if hops == 2 else "ternary"
  variants = (
    Variant("iha", "IHA (I)", _letter("I")),
    Variant("mha", "MHA (M)", _letter("M")),
    Variant("simplicial", "2-simplicial (X)", _letter("X")),
    Variant("talking_heads", "Talking-Heads (T)", _letter("T")),
    Variant("diff", "differential (D)", _letter("D")),
    Variant(
      "iha_decoder",
      "IHA decoder-only",
      _letter("I"),
      base=lambda scale: _config(hops, scale, decoder=True),
    ),
    Variant(
      "mha_decoder",
      "MHA decoder-only",
      _letter("M"),
      base=lambda scale: _config(hops, scale, decoder=True),
    ),
  )
  scales = {
    "tiny": Scale(
      lambda: _config(hops, "tiny"),
      (1e-3, 3e-3, 1e-2),
      total_steps=80,
      eval_every=40,
      patience=10,
      grid_extensions=0,
    ),
    "small": Scale(
      lambda: _config(hops, "small"),
      (1e-4, 3e-4, 1e-3),
      total_steps=800,
      eval_every=100,
      patience=5,
    ),
    "paper": Scale(
      lambda: _config(hops, "paper"),
      (1e-4, 3e-4, 1e-3, 3e-3),
      total_steps=20_000,
      eval_every=500,
      patience=10,
    ),
  }
  paper_sides = "6..10, density 0.325" if hops == 2 else "5..8, density 0.264"
  sides = (
    f"{paper_sides} at scale `paper`; {_SIZES['small']['sides'][0]}.."
    f"{_SIZES['small']['sides'][1]} at `small`, {_SIZES['tiny']['sides'][0]} at `tiny`"
  )
  return Study(
    name=f"relcomp_{name}",
    title=f"{name.capitalize()} relation composition",
    description=(
      f"`m x m` boolean relation (m in {sides}); label of cell (i, j): "
      f"{'R∘R' if hops == 2 else 'R∘R∘R'}. One attention layer (+ MLP), "
      "bidirectional over the `m^2` cell tokens (each names its value and "
      "(i, j)), a per-cell sigmoid output, per-position binary cross-entropy "
      "averaged over the real cells (batches right-padded). The decoder-only "
      "rows read the matrix, then a block of cell queries, with causal "
      "attention and label tokens. Metrics: per-cell accuracy, whole-matrix "
      "exact match."
    ),
    variants=variants,
    scales=scales,
    select="token_accuracy",
    metrics=("token_accuracy", "exact_match"),
    paper=PAPER,
  )


BINARY = _study(2)
TERNARY = _study(3)
