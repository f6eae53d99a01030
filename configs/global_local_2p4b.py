"""The paper's Global+Local baseline of the 2.4B model: "SSSSM", MHA windows of 512 tokens.

Same recipe as configs/iha_2p4b.py.
"""

import ml_collections

from configs import iha_2p4b


def get_config() -> ml_collections.ConfigDict:
  config = iha_2p4b.get_config()
  config.model.attention_schedule = "SSSSM"
  config.model.iha_window = None
  config.model.mha_window = 512
  return config
