"""The 64k long-context stage of the 2.4B Global+Local (SSSSM) model
(configs/global_local_2p4b.py), from its 8k run in workdirs/global_local_2p4b
(`--config.train.init_from=...` to change it). The stage's choices:
configs/long_context.py.
"""

import ml_collections

from configs import global_local_2p4b, long_context


def get_config() -> ml_collections.ConfigDict:
  return long_context.extend(global_local_2p4b.get_config(), init_from="workdirs/global_local_2p4b")
