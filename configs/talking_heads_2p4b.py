"""The paper's Talking-Heads baseline of the 2.4B model: every layer global Talking-Heads ("T").

Same recipe as configs/iha_2p4b.py. Parameters: the global MHA baseline
(configs/global_2p4b.py) plus `talk_logits, talk_weights: [H, H]`, 2 H^2 = 800 per layer,
26 x 800 = 20,800 in all (checked by tests/train/test_config.py).
"""

import ml_collections

from configs import iha_2p4b


def get_config() -> ml_collections.ConfigDict:
  config = iha_2p4b.get_config()
  config.model.attention_schedule = "T"
  config.model.iha_window = None
  return config
