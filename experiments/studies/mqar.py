"""Multi-query associative recall (Zoology, Arora et al. 2023), two layers.

The first layer is the kind under test, the second global MHA: IHA with the paper's
FLOP-matched window (`LM`), global MHA (`MM`), Global+Local (`SM`: sliding-window MHA
whose window equals IHA's in tokens, the paper's cheaper baseline and the fairest twin
of `LM`), Talking-Heads (`TM`) and differential attention (`DM`). Accuracy per query
(token accuracy) picks the rate; exact match (every query of an example right) beside it.
Sweeps: the number of key-value pairs and the model width; the learning curves show how
fast each variant learns.
"""

from __future__ import annotations

import ml_collections

from configs import default
from experiments.protocol import Scale, Study, Sweep, Variant
from experiments.studies.common import schedule_edit, study_config

PAPER = (
  "The paper reports no MQAR results (its retrieval evidence is RULER multi-key, "
  "see the long-context study). Zoology (Arora et al. 2023) reports that two-layer "
  "softmax attention solves MQAR at these sizes when tuned."
)

_SIZES = {  # length, pairs, keys/values, width, heads, P, batch, examples, warm-up
  # The control: one pair, learned by every variant in ~100 steps.
  "tiny": dict(
    length=8,
    pairs=1,
    vocab=8,
    width=16,
    heads=2,
    num_pseudo=2,
    batch=16,
    examples=(512, 64, 64),
    warmup=10,
  ),
  "small": dict(
    length=64,
    pairs=8,
    vocab=64,
    width=64,
    heads=4,
    num_pseudo=2,
    batch=32,
    examples=(32768, 512, 512),
    warmup=100,
  ),
  "paper": dict(
    length=256,
    pairs=64,
    vocab=4096,
    width=256,
    heads=8,
    num_pseudo=4,
    batch=64,
    examples=(100_000, 3_000, 3_000),
    warmup=500,
  ),
}


def _config(scale: str) -> ml_collections.ConfigDict:
  size = _SIZES[scale]
  config = study_config(size["batch"], size["warmup"])
  config.data.name = "mqar/kv4_len64"
  config.data.seq_len = size["length"]
  train, validation, test = size["examples"]
  config.data.options = {
    "length": size["length"],
    "num_pairs": size["pairs"],
    "num_keys": size["vocab"],
    "num_values": size["vocab"],
    "num_train": train,
    "num_validation": validation,
    "num_test": test,
  }
  config.model.update(
    num_layers=2,
    model_dim=size["width"],
    num_heads=size["heads"],
    head_dim=size["width"] // size["heads"],
    mlp_dim=4 * size["width"],
    attention_schedule="LM",
    iha_window="auto",
  )
  config.model.num_pseudo = size["num_pseudo"]
  return config


def _demo_config() -> ml_collections.ConfigDict:
  """`make train`'s demo exactly (configs/default.py: mqar/cpu_demo, 3000 steps)."""
  config = default.get_config()
  config.eval_every = 0
  return config


def _pairs(config: ml_collections.ConfigDict, pairs: int) -> None:
  config.data.options = {**config.data.options, "num_pairs": pairs}


def _width(config: ml_collections.ConfigDict, width: int) -> None:
  heads = config.model.num_heads
  config.model.update(model_dim=width, head_dim=width // heads, mlp_dim=4 * width)


VARIANTS = (
  Variant("iha", "IHA window (LM)", schedule_edit("LM")),
  Variant("mha", "MHA global (MM)", schedule_edit("MM")),
  Variant("global_local", "Global+Local (SM)", schedule_edit("SM")),
  Variant("talking_heads", "Talking-Heads (TM)", schedule_edit("TM")),
  Variant("diff", "differential (DM)", schedule_edit("DM")),
)

MQAR = Study(
  name="mqar",
  title="Multi-query associative recall",
  description=(
    "MQAR (Zoology): key-value pairs, then every key queried once at a random "
    "later position; the target is the value at the query's position. Two "
    "layers; the first is the kind under test, the second global MHA. "
    "Metrics: accuracy per query, exact match per example."
  ),
  variants=VARIANTS,
  scales={
    "tiny": Scale(
      lambda: _config("tiny"),
      (1e-3, 3e-3, 1e-2),
      total_steps=80,
      eval_every=40,
      patience=10,
      sweeps=(Sweep("num_pairs", 1, (2,), _pairs),),
      grid_extensions=0,
    ),
    # A 2-core CPU budget (~3 h): 1200 steps, two more pair counts, one more width.
    "small": Scale(
      lambda: _config("small"),
      (1e-3, 3e-3, 1e-2),
      total_steps=1200,
      eval_every=100,
      patience=5,
      sweeps=(Sweep("num_pairs", 8, (4, 16), _pairs), Sweep("model_dim", 64, (32,), _width)),
    ),
    # The demo's own setting: tunes IHA and its twins for `make train`.
    "demo": Scale(_demo_config, (1e-3, 3e-3, 1e-2), total_steps=3000, eval_every=250, patience=4),
    "paper": Scale(
      lambda: _config("paper"),
      (3e-4, 1e-3, 3e-3, 1e-2),
      total_steps=20_000,
      eval_every=500,
      patience=10,
      sweeps=(
        Sweep("num_pairs", 64, (16, 32, 128), _pairs),
        Sweep("model_dim", 256, (64, 128, 512), _width),
      ),
    ),
  },
  select="token_accuracy",
  metrics=("token_accuracy", "exact_match"),
  paper=PAPER,
)
