"""Language modelling on real text: the Python standard library's source (`python_stdlib`).

Small decoder LMs with the paper's layer schedules, matched in parameters: IHA `LLLLM`
(sliding-window IHA with the paper's FLOP-matched window, `seq_len / (2P)` virtual
tokens, and a global MHA layer every fifth), global MHA `M`, Global+Local `SSSSM`
(sliding-window MHA with IHA's window in tokens), Talking-Heads `T` and differential
attention `D` in every layer. The text is the train split of `python_stdlib/chunks`
(files split by path hash; documents of whole lines, at most 768 bytes), tokenized with a
byte-level BPE trained on that train split alone (`Study.prepare` trains it once per data
directory, under `DATA_DIR/tokenizers/`), packed into rows. The rate is chosen on
validation loss (nats per token); the test metrics are bits per byte (the loss over the
UTF-8 bytes the scored tokens cover: comparable across tokenizers), the loss and
next-token accuracy. Learning curves are drawn against training tokens and training
FLOPs. IHA also runs at P = 1 and P = 4 = H (the P sweep), Global+Local also with
P = 1's windows (P = 1's control), and at `small` the P sweep and its baselines are
compared again at equal training FLOPs (the `budget` sweep).
"""

from __future__ import annotations

import functools
import os

import ml_collections

from experiments.protocol import Scale, Study, Sweep, Variant
from experiments.studies.common import (
  heads_edit,
  pha_edit,
  schedule_edit,
  study_config,
  with_pseudo,
)
from iha_jax import data as data_lib
from iha_jax.data import train_tokenizer
from iha_jax.train import config as config_lib
from iha_jax.train import flops as flops_lib

PAPER = (
  "The paper trains 2.4B-parameter decoder LMs (IHA `LLLLM`, global attention, "
  "Global+Local, Talking-Heads, Diff Transformer) on 240B tokens of web text and reports "
  "downstream results (RULER multi-key retrieval 44.0 / 40.6 / 37.2 / 35.0 average exact "
  "match for IHA / Global+Local / Diff / global; GSM8K and MATH-500 after reasoning "
  "fine-tuning), not pretraining losses at a scale this study could be placed beside."
)

# Per scale: dataset options, BPE vocabulary, row length, width, heads, P, batch, warm-up.
_SIZES = {
  # A few small files of the corpus (the test suite's control): a 320-piece BPE (~1.5
  # bytes per token), documents of at most 80 bytes in 64-token rows, a 5-layer model of
  # width 32.
  "tiny": dict(
    options={"max_files": 8, "max_file_bytes": 6000, "chunk_bytes": 80},
    vocab=320,
    seq_len=64,
    width=32,
    heads=4,
    num_pseudo=2,
    batch=8,
    warmup=10,
  ),
  # Sized for one core of a 2-core CPU: 25 runs (5 variants x (3 rates + 2 seeds)) of
  # ~7-9 min each (~0.45 s per step), about 3 h of one core. 256-token rows of a
  # 2048-piece BPE (~2.8 bytes per token: ~700 bytes of code, ~18 lines, per row), so
  # IHA's window is 64 virtual tokens = 32 tokens and the global layers see 8x further;
  # 800 steps of 16 rows (3.3M token slots, ~90% filled by packing) are ~0.9 of a pass
  # over the 3.2M tokens the train split scores (5% more are cut off by truncation).
  # ~460k parameters, 131k of them the embedding.
  "small": dict(
    options={}, vocab=2048, seq_len=256, width=64, heads=4, num_pseudo=2, batch=16, warmup=100
  ),
}


def tokenizer_path(data_config: ml_collections.ConfigDict, vocab: int) -> str:
  """Where the BPE of `vocab` pieces trained on this dataset's train split lives."""
  options = dict(data_config.options or {})
  config = data_lib.builder_config(data_config.name, options)
  name = f"{data_config.name.split('/')[0]}-{config.name}-bpe{vocab}.json"
  return os.path.join(data_config.data_dir, "tokenizers", name)


def train_bpe(data_config: ml_collections.ConfigDict, vocab: int) -> str:
  """Prepares the dataset and trains its byte-level BPE on the train split, unless both
  exist; returns the tokenizer's path."""
  options = dict(data_config.options or {})
  data_lib.prepare(data_config.name, data_config.data_dir, options=options)
  path = tokenizer_path(data_config, vocab)
  if not os.path.exists(path):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    texts = train_tokenizer.iterate_texts(data_config.name, data_config.data_dir, options=options)
    partial = f"{path[: -len('.json')]}.{os.getpid()}.partial"
    written = train_tokenizer.train_bpe_json(texts, partial, vocab_size=vocab)
    os.replace(written, path)  # atomic: a concurrent study process sees all of it or none
  return path


def _prepare(config: ml_collections.ConfigDict, scale: str) -> None:
  config.data.tokenizer = train_bpe(config.data, _SIZES[scale]["vocab"])


def _config(scale: str) -> ml_collections.ConfigDict:
  size = _SIZES[scale]
  config = study_config(size["batch"], size["warmup"])
  config.data.name = "python_stdlib/chunks"
  config.data.seq_len = size["seq_len"]
  config.data.options = dict(size["options"])
  width, heads = size["width"], size["heads"]
  config.model.update(
    num_layers=5,
    model_dim=width,
    num_heads=heads,
    head_dim=width // heads,
    mlp_dim=4 * width,
    attention_schedule="LLLLM",
    iha_window="auto",
  )
  config.model.num_pseudo = size["num_pseudo"]
  return config


def _scale(name: str, **budget) -> Scale:
  return Scale(lambda: _config(name), **budget)


# IHA and Global+Local first: a study stopped part-way has compared `make train-text`'s
# pair (the runner takes the variants in this order). The P sweep comes last: P = 1 (the
# mixing without interleaving's extra rows: one pseudo-head per head) and P = 4 = H, then
# P = 1's control: sliding-window MHA with P = 1's windows (128 tokens at `small`).
VARIANTS = (
  Variant("iha", "IHA P = 2 (LLLLM)", schedule_edit("LLLLM")),
  Variant("global_local", "Global+Local (SSSSM)", schedule_edit("SSSSM")),
  Variant("mha", "global MHA (M)", schedule_edit("M")),
  Variant("talking_heads", "Talking-Heads (T)", schedule_edit("T")),
  Variant("diff", "differential (D)", schedule_edit("D")),
  Variant("iha_p1", "IHA P = 1 (LLLLM)", with_pseudo("LLLLM", 1)),
  Variant("iha_p4", "IHA P = 4 = H (LLLLM)", with_pseudo("LLLLM", 4)),
  Variant("global_local_p1", "Global+Local, P = 1's windows (SSSSM)", with_pseudo("SSSSM", 1)),
  # Is IHA's learned mixing worth its price? Paired-head attention is IHA P = 2 with the
  # mixing and collapse fixed to selections: at IHA's window (half IHA's attention work)
  # and at twice it (IHA's attention FLOPs).
  Variant("pha", "PHA P = 2 (RRRRM)", pha_edit()),
  Variant("pha_wide", "PHA P = 2, IHA's FLOPs (RRRRM, 2x window)", pha_edit(2)),
  # The P sweep's P = H row at 8 heads of 8 (width kept), beside its 8-head MHA.
  Variant("iha_p8_h8", "IHA P = 8 = H, 8 heads (LLLLM)", heads_edit(8, with_pseudo("LLLLM", 8))),
  Variant("mha_h8", "global MHA, 8 heads (M)", heads_edit(8, schedule_edit("M"))),
)

# The equal-FLOPs comparison: the P sweep and PHA beside the baselines they are read
# against.
EQUAL_FLOPS_VARIANTS = (
  "iha_p1",
  "iha",
  "iha_p4",
  "mha",
  "global_local",
  "talking_heads",
  "pha",
  "pha_wide",
)


def train_flops_per_step(config: ml_collections.ConfigDict, vocab: int) -> float:
  """Model FLOPs of one training step of `config` with a `vocab`-piece vocabulary."""
  config = ml_collections.ConfigDict(config.to_dict())
  config.model.vocab_size = vocab  # the tokenizer may not exist yet: its size is known
  model = config_lib.validate(config, 1)
  return flops_lib.train_flops_per_step(model, config.train.batch_size, config.data.seq_len)


def equal_flops(scale: str, steps: int) -> Sweep:
  """The sweep point "equal_flops" (base "equal_steps"): each covered variant trains for
  the training FLOPs of the dearest covered variant's `steps` steps, rounded to whole
  steps, so the cheaper variants get more steps and the dearest keeps its base runs."""
  vocab = _SIZES[scale]["vocab"]

  @functools.cache
  def budget() -> float:
    dearest = 0.0
    for variant in VARIANTS:
      if variant.name in EQUAL_FLOPS_VARIANTS:
        config = _config(scale)
        variant.edit(config)
        dearest = max(dearest, train_flops_per_step(config, vocab))
    return steps * dearest

  def edit(config: ml_collections.ConfigDict, point: str) -> None:
    if point == "equal_flops":
      config.train.total_steps = round(budget() / train_flops_per_step(config, vocab))

  return Sweep("budget", "equal_steps", ("equal_flops",), edit, variants=EQUAL_FLOPS_VARIANTS)


CODE_LM = Study(
  name="code_lm",
  title="Language modelling on the Python standard library",
  description=(
    "Next-token prediction on the source of the Python standard library "
    "(`python_stdlib/chunks`: files split by a hash of their path, test packages "
    "excluded; documents of whole lines, at most 768 bytes), tokenized with a byte-level "
    "BPE trained on the train split, packed into rows. Decoder LMs with the paper's "
    "schedules, matched in parameters. The rate is chosen on validation loss; test "
    "metrics: bits per byte (the comparison across tokenizers), loss in nats per token, "
    "next-token accuracy."
  ),
  variants=VARIANTS,
  scales={
    "tiny": _scale(
      "tiny",
      learning_rates=(3e-3, 1e-2, 3e-2),
      total_steps=80,
      eval_every=40,
      patience=10,
      grid_extensions=0,
    ),
    # No early stopping (patience > evaluations): under the cosine schedule the
    # validation loss falls to the end; 8 validation passes draw the learning curves. The
    # grid is centred on 1e-2: a 300-step probe of global MHA gave validation loss 4.28 /
    # 3.96 / 4.14 at 3e-3 / 1e-2 / 3e-2; a best rate on an edge extends the grid (the
    # protocol's rule).
    # Then the same variants at equal training FLOPs (`budget` = "equal_flops").
    "small": _scale(
      "small",
      learning_rates=(3e-3, 1e-2, 3e-2),
      total_steps=800,
      eval_every=100,
      patience=16,
      sweeps=(equal_flops("small", 800),),
    ),
  },
  select="loss",
  metrics=("bits_per_byte", "loss", "token_accuracy"),
  paper=PAPER,
  prepare=_prepare,
  curves_against=("tokens", "train_flops"),
)
