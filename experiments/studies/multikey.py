"""Multi-key needle retrieval against context length (the paper's RULER result, small).

Decoder LMs with the paper's layer schedules: IHA `LLLLM` (sliding-window IHA with the
FLOP-matched window, a global MHA layer every fifth), global MHA `M`, Global+Local
`SSSSM` (sliding-window MHA with IHA's window in tokens), Talking-Heads `T` and
differential attention `D` in every layer. Each is tuned and trained at one context
length, then its best parameters are tested, without further training, at longer
contexts (the windows stay those of training). The headline metric and the rate's
selector is accuracy per answer token: with the one-token values of `tiny` and `small`
it is RULER's exact match per query. `exact_match` beside it is per example: every
queried needle of the example right (4 at `small`).
"""

from __future__ import annotations

import ml_collections

from experiments.protocol import Scale, Study, Transfer, Variant
from experiments.studies.common import pha_edit, schedule_edit, study_config, with_pseudo

PAPER = (
  "RULER multi-key retrieval (needles among distractor needles), 2.4B models: IHA "
  "+27%, +32% and +112% relative over global attention at 4k, 8k and 16k context; "
  "RULER average exact match 44.0 (IHA), 40.6 (Global+Local), 37.2 (Diff "
  "Transformer), 35.0 (global attention)."
)

# Per scale: context length, needles (all queried), key/value tokens per needle, key and
# value vocabularies, model width, heads, P, layers, batch, examples
# train/validation/test, warm-up, test lengths.
_SIZES = {
  # The control: one needle of one key and one value token, learned in a few hundred
  # steps by every variant.
  "tiny": dict(
    length=24,
    needles=1,
    key_len=1,
    value_len=1,
    keys=8,
    vocab=8,
    width=16,
    heads=2,
    num_pseudo=2,
    layers=5,
    batch=16,
    examples=(512, 64, 64),
    warmup=10,
    test_lengths=(48,),
  ),
  # Learnable on 2 CPU cores: every needle queried (4 answers per example) at batch 64,
  # 8 key tokens. Probes with 32 key tokens, one query or batch 16 stayed on the
  # guessing plateau for thousands of steps.
  "small": dict(
    length=32,
    needles=4,
    key_len=1,
    value_len=1,
    keys=8,
    vocab=32,
    width=64,
    heads=4,
    num_pseudo=2,
    layers=5,
    batch=64,
    examples=(65536, 256, 256),
    warmup=100,
    test_lengths=(64, 128, 256),
  ),
  "paper": dict(
    length=4096,
    needles=4,
    key_len=2,
    value_len=3,
    keys=256,
    vocab=256,
    width=512,
    heads=8,
    num_pseudo=4,
    layers=10,
    batch=32,
    examples=(50_000, 500, 500),
    warmup=500,
    test_lengths=(8192, 16384),
  ),
}


def _config(scale: str) -> ml_collections.ConfigDict:
  size = _SIZES[scale]
  config = study_config(size["batch"], size["warmup"])
  config.data.name = "multikey_retrieval/cpu_demo"
  config.data.seq_len = size["length"]
  train, validation, test = size["examples"]
  config.data.options = {
    "length": size["length"],
    "num_needles": size["needles"],
    "num_queries": size["needles"],
    "key_len": size["key_len"],
    "value_len": size["value_len"],
    "num_filler": size["vocab"] // 2,
    "num_key_tokens": size["keys"],
    "num_value_tokens": size["vocab"],
    "num_train": train,
    "num_validation": validation,
    "num_test": test,
  }
  config.model.update(
    num_layers=size["layers"],
    model_dim=size["width"],
    num_heads=size["heads"],
    head_dim=size["width"] // size["heads"],
    mlp_dim=4 * size["width"],
    attention_schedule="LLLLM",
    iha_window="auto",
  )
  config.model.num_pseudo = size["num_pseudo"]
  return config


def _context_length(config: ml_collections.ConfigDict, length: int) -> None:
  """The test set at `length` tokens (the model, windows included, unchanged)."""
  config.data.seq_len = length
  # Only the test split is read: keep the others at one example.
  options = {**config.data.options, "length": length, "num_train": 1, "num_validation": 1}
  config.data.options = options


def _scale(name: str, **budget) -> Scale:
  size = _SIZES[name]
  transfer = Transfer("context_length", size["length"], size["test_lengths"], _context_length)
  return Scale(lambda: _config(name), transfers=(transfer,), **budget)


VARIANTS = (
  Variant("iha", "IHA (LLLLM)", schedule_edit("LLLLM")),
  Variant("mha", "global MHA (M)", schedule_edit("M")),
  Variant("global_local", "Global+Local (SSSSM)", schedule_edit("SSSSM")),
  Variant("talking_heads", "Talking-Heads (T)", schedule_edit("T")),
  Variant("diff", "differential (D)", schedule_edit("D")),
  # Learned mixing against paired heads (IHA's mixing fixed to selections) at IHA's window
  # and at IHA's attention FLOPs (twice the window), and IHA without interleaving (P = 1)
  # beside sliding-window MHA with P = 1's windows.
  Variant("pha", "PHA P = 2 (RRRRM)", pha_edit()),
  Variant("pha_wide", "PHA P = 2, IHA's FLOPs (RRRRM, 2x window)", pha_edit(2)),
  Variant("iha_p1", "IHA P = 1 (LLLLM)", with_pseudo("LLLLM", 1)),
  Variant("global_local_p1", "Global+Local, P = 1's windows (SSSSM)", with_pseudo("SSSSM", 1)),
)

MULTIKEY = Study(
  name="multikey_retrieval",
  title="Multi-key retrieval against context length",
  description=(
    "RULER-style multi-key needle retrieval: needles `NEEDLE key value` hidden in "
    "random filler; every needle is queried once, in random order, so each query has "
    "the other needles as distractors (answered in one pass: the first value token at "
    "the query's key, the others at placeholders). Decoder LMs with the paper's "
    "schedules, trained at one context length and tested at longer ones. Metrics: "
    "accuracy per answer token (with one-token values, RULER's exact match per query) "
    "and exact match per example (every queried needle right)."
  ),
  variants=VARIANTS,
  scales={
    "tiny": _scale(
      "tiny",
      learning_rates=(3e-3, 1e-2, 3e-2),
      total_steps=150,
      eval_every=50,
      patience=10,
      grid_extensions=0,
    ),
    # No early stopping (patience > evaluations): a run leaves the plateau abruptly, late.
    "small": _scale(
      "small", learning_rates=(1e-3, 3e-3, 1e-2), total_steps=1500, eval_every=100, patience=16
    ),
    "paper": _scale(
      "paper", learning_rates=(3e-4, 1e-3, 3e-3), total_steps=20_000, eval_every=500, patience=10
    ),
  },
  select="token_accuracy",
  metrics=("token_accuracy", "exact_match"),
  paper=PAPER,
  reference="mha",
)
