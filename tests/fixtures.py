"""What many tests build: the repository's root, tiny model configs and optimizer settings
(one definition each; a test states only how its own differs)."""

from __future__ import annotations

import pathlib
from typing import Any

import ml_collections

from configs import tiny
from iha_jax.models import TransformerConfig

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]

# The optimizer settings of the small train-step tests (AdamW, warm-up 1, cosine over 10).
TRAIN = ml_collections.ConfigDict(
  dict(
    learning_rate=1e-2,
    final_learning_rate=1e-4,
    warmup_steps=1,
    total_steps=10,
    weight_decay=0.1,
    b1=0.9,
    b2=0.95,
    eps=1e-8,
    grad_clip=1.0,
  )
)


def train_settings(**changes: Any) -> ml_collections.ConfigDict:
  """`TRAIN` with `changes` (e.g. `total_steps=4`)."""
  return ml_collections.ConfigDict({**TRAIN.to_dict(), **changes})


def tiny_model(schedule: str, **changes: Any) -> TransformerConfig:
  """A model of one layer per letter of `schedule`: vocabulary 40, D = 32, H = 4, d = 8,
  MLP 64, P = 2, IHA windows of 12 virtual tokens, the XLA core; `changes` override."""
  fields = dict(
    vocab_size=40,
    num_layers=len(schedule),
    model_dim=32,
    num_heads=4,
    head_dim=8,
    mlp_dim=64,
    num_pseudo=2,
    attention_schedule=schedule,
    iha_window=12,
    implementation="xla",
  )
  return TransformerConfig(**{**fields, **changes})


def tiny_config(data_dir: str, **overrides: Any) -> ml_collections.ConfigDict:
  """configs/tiny.py with `section.key=value` overrides (`mesh__fsdp=8`)."""
  config = tiny.get_config()
  config.data.data_dir = data_dir
  for key, value in overrides.items():
    section, _, name = key.partition("__")
    if name:
      config[section][name] = value
    else:
      config[section] = value
  return config
