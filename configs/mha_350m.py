"""MHA twin of configs/iha_350m.py: the same 25 layers, every one global MHA ("M").

The 'L' layers' FLOP-matched window (4096 / (2 P) virtual tokens) gives each IHA layer's
core about the query-key pairs of one causal MHA layer (docs/design.md §2); the twin lacks
IHA's mixing/collapse scalars (4 H^2 P = 4096 per IHA layer, 0.02% of the parameters).
"""

import ml_collections

from configs import iha_350m


def get_config() -> ml_collections.ConfigDict:
  config = iha_350m.get_config()
  config.model.attention_schedule = "M"
  config.model.iha_window = None
  config.model.num_pseudo = None
  return config
