"""The paper's global-attention baseline of the 2.4B model: every layer global MHA ("M").

Same recipe as configs/iha_2p4b.py; it lacks only IHA's mixing/collapse parameters
(4 H^2 P = 32000 per IHA layer, 0.03% of the model).
"""

import ml_collections

from configs import iha_2p4b


def get_config() -> ml_collections.ConfigDict:
  config = iha_2p4b.get_config()
  config.model.attention_schedule = "M"
  config.model.iha_window = None
  return config
