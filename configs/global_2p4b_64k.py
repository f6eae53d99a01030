"""The 64k long-context stage of the 2.4B global attention (M) model
(configs/global_2p4b.py), from its 8k run in workdirs/global_2p4b
(`--config.train.init_from=...` to change it). The stage's choices:
configs/long_context.py.
"""

import ml_collections

from configs import global_2p4b, long_context


def get_config() -> ml_collections.ConfigDict:
  return long_context.extend(global_2p4b.get_config(), init_from="workdirs/global_2p4b")
