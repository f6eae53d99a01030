"""The 64k long-context stage of the 2.4B differential attention (D) model
(configs/diff_2p4b.py), from its 8k run in workdirs/diff_2p4b
(`--config.train.init_from=...` to change it). The stage's choices:
configs/long_context.py.
"""

import ml_collections

from configs import diff_2p4b, long_context


def get_config() -> ml_collections.ConfigDict:
  return long_context.extend(diff_2p4b.get_config(), init_from="workdirs/diff_2p4b")
