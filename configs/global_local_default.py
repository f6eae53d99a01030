"""Global+Local twin of configs/default.py ("SM"): the paper's cheaper baseline.

Layer 0 is sliding-window MHA whose window equals the IHA layer's in tokens (IHA's
"auto" window is seq_len / (2P) = 16 virtual tokens = 8 tokens at P = 2), layer 1 global
MHA, as in default.py. Same width, heads, data and steps; each model trains at its own
learning rate, tuned by `python -m experiments.run mqar --scale demo --seeds 3` (the
rates and the result are in docs/results.md). `make train` trains both and evaluates
them side by side.
"""

import ml_collections

from configs import default

LEARNING_RATE = 3e-3  # tuned (docs/results.md)


def get_config() -> ml_collections.ConfigDict:
  config = default.get_config()
  p = config.model.num_pseudo
  config.model.attention_schedule = "SM"
  config.model.mha_window = config.data.seq_len // (2 * p * p)  # IHA's window, in tokens
  config.model.iha_window = None
  config.model.num_pseudo = None
  config.train.learning_rate = LEARNING_RATE
  config.train.final_learning_rate = LEARNING_RATE / 100  # default.py's ratio
  return config
