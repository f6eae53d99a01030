"""CPM-3 (count pairs modulo M), the paper's theory task, as an empirical probe.

The paper (sections 3-4, App. B) constructs IHA solutions of CPM-3 with
ceil(sqrt(N_max)) heads where MHA needs N_max, and trains no model on it. Here: one
bidirectional attention layer with a per-position classification head over the counts,
MHA against IHA with P = H, trained under the protocol at one head count (the base
point) and then swept over the number of heads H at each variant's chosen rate; one
variant pair per sequence length. Head width and model width stay fixed, so more heads
means more attention parameters for both kinds alike. Metrics: per-position accuracy
(the count exactly right) and whole-sequence exact match.

Two studies: `cpm3`, attention-only blocks (no MLP: the attention layer and a linear
readout, where the head count is the bottleneck), and `cpm3_mlp`, the usual block with
an MLP. With the MLP one head suffices for any length: a head that averages the values
gives the residue histogram `c` (n is fixed), and the MLP computes
`count_i = sum_r c[r] c[(-x_i - G r) mod M]` from it and `x_i`.
"""

from __future__ import annotations

import ml_collections

from experiments.protocol import Scale, Study, Variant
from experiments.studies.common import heads_sweep, mha_iha_pairs, probe_model, study_config
from iha_jax import data

PAPER = (
  "The paper proves that IHA solves the order-sensitive CPM-3 with ceil(sqrt(N_max)) "
  "heads where MHA needs N_max (sections 3-4, App. B) and trains no model on it: there "
  "are no numbers to place beside ours. Its example, M = 3, G = 10, x = (1, 2, 3), "
  "gives counts (3, 3, 3)."
)

# Per scale: sequence lengths (one MHA/IHA pair each), modulus, examples
# train/validation/test, model width, head width, base heads, swept heads, batch,
# warm-up.
_SIZES = {
  # The control: pairs of values mod 2 (count 2 or 4: is the other value mine?). Without
  # an MLP, IHA (H = P = 2) learns it in 200 steps; MHA with one head stays at 78% and
  # with two heads solved it in one of two seeds (measured).
  "tiny": dict(
    lengths=(2,),
    modulus=2,
    examples=(512, 64, 64),
    width=16,
    head_dim=8,
    heads=2,
    sweep=(1,),
    batch=16,
    warmup=10,
  ),
  "small": dict(
    lengths=(8, 16),
    modulus=3,
    examples=(8192, 512, 512),
    width=64,
    head_dim=16,
    heads=2,
    sweep=(1, 4, 8),
    batch=32,
    warmup=100,
  ),
  "paper": dict(
    lengths=(16, 32),
    modulus=3,
    examples=(40_000, 5_000, 5_000),
    width=128,
    head_dim=32,
    heads=4,
    sweep=(1, 2, 8, 16),
    batch=64,
    warmup=500,
  ),
}


def _config(scale: str, length: int, mlp: bool) -> ml_collections.ConfigDict:
  size = _SIZES[scale]
  config = study_config(size["batch"], size["warmup"])
  config.data.name = "cpm3/len8"
  config.data.seq_len = length
  config.data.packing = False
  train, validation, test = size["examples"]
  options = {
    "min_length": length,  # fixed: softmax attention cannot see n (iha_jax/data/cpm3.py)
    "max_length": length,
    "modulus": size["modulus"],
    "num_train": train,
    "num_validation": validation,
    "num_test": test,
  }
  config.data.options = options
  probe_model(
    config,
    width=size["width"],
    head_dim=size["head_dim"],
    heads=size["heads"],
    num_outputs=data.builder_config("cpm3/len8", options).num_classes,
    mlp_type="swiglu" if mlp else "none",
  )
  return config


def _variants(scale: str, mlp: bool) -> tuple[Variant, ...]:
  """An MHA and an IHA variant per sequence length of `scale`."""
  return mha_iha_pairs(_SIZES[scale]["lengths"], "n", lambda s, n: _config(s, n, mlp))


def _scale(name: str, mlp: bool, **budget) -> Scale:
  size = _SIZES[name]
  return Scale(
    lambda: _config(name, size["lengths"][0], mlp),
    # Re-tuned per head count: IHA's P = H changes with it, and one rate for every H left
    # most of IHA's attention-only runs untrained (measured).
    sweeps=(heads_sweep(size["heads"], size["sweep"], retune=True),),
    variants=_variants(name, mlp),
    **budget,
  )


def _study(mlp: bool) -> Study:
  block = "attention layer + MLP" if mlp else "attention layer without MLP"
  return Study(
    name="cpm3_mlp" if mlp else "cpm3",
    title=f"CPM-3: count pairs modulo M (the paper's theory task), {block}",
    description=(
      "A sequence of n values in 1..M (M = 3; 2 at `tiny`), one fixed n per variant; "
      "the label of position i is the number of ordered pairs (j1, j2) with "
      f"x_i + 10 x_j1 + x_j2 = 0 mod M, a class in 0..n^2. One bidirectional {block}, "
      "per-position softmax over the counts, cross-entropy. MHA against IHA with "
      "P = H; head width fixed; sweep over H. Metrics: accuracy per position, exact "
      "match per sequence."
    ),
    variants=_variants("small", mlp),
    scales={
      "tiny": _scale(
        "tiny",
        mlp,
        learning_rates=(3e-3, 1e-2, 3e-2),
        total_steps=200,
        eval_every=50,
        patience=10,
        grid_extensions=0,
      ),
      "small": _scale(
        "small",
        mlp,
        learning_rates=(1e-3, 3e-3, 1e-2),
        total_steps=1500,
        eval_every=100,
        patience=5,
      ),
      "paper": _scale(
        "paper",
        mlp,
        learning_rates=(3e-4, 1e-3, 3e-3, 1e-2),
        total_steps=20_000,
        eval_every=500,
        patience=10,
      ),
    },
    select="token_accuracy",
    metrics=("token_accuracy", "exact_match"),
    paper=PAPER,
  )


CPM3 = _study(mlp=False)
CPM3_MLP = _study(mlp=True)
