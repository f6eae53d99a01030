"""Global+Local twin of configs/text_iha.py (`SSSSM`): the paper's cheaper baseline.

Four sliding-window MHA layers whose window equals the IHA layers' in tokens
(seq_len / (2 P^2) = 32 tokens at P = 2), then global MHA, repeated; same width, heads,
data, tokenizer and steps, at its own learning rate. `make train-text` trains both and
evaluates them side by side.
"""

import ml_collections

from configs import text_iha

# Global+Local's rate in the code_lm study (best of 3e-3 / 1e-2 / 3e-2 on validation).
LEARNING_RATE = 1e-2


def get_config() -> ml_collections.ConfigDict:
  config = text_iha.get_config()
  p = config.model.num_pseudo
  config.model.attention_schedule = "SSSSM"
  config.model.mha_window = config.data.seq_len // (2 * p * p)  # IHA's window, in tokens
  config.model.iha_window = None
  config.model.num_pseudo = None
  config.train.learning_rate = LEARNING_RATE
  config.train.final_learning_rate = LEARNING_RATE / 100
  return config
