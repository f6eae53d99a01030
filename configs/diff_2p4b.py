"""The paper's differential-attention baseline of the 2.4B model: every layer global "D".

Same recipe as configs/iha_2p4b.py. H = 20 gives 10 differential heads, each with two
query/key maps of width d = 128 and value width 2d = 256: wq, wk `[2560, 10, 2, 128]`,
wv `[2560, 10, 256]`, wo `[10, 256, 2560]` hold exactly the entries of MHA's projections.
Parameters: the global MHA baseline (configs/global_2p4b.py) plus, per layer, the four
lambda vectors `[d]` and the head output norm `[2d]`: 4 * 128 + 256 = 768 per layer,
26 x 768 = 19,968 in all (checked by tests/train/test_config.py).
"""

import ml_collections

from configs import iha_2p4b


def get_config() -> ml_collections.ConfigDict:
  config = iha_2p4b.get_config()
  config.model.attention_schedule = "D"
  config.model.iha_window = None
  return config
