"""The 64k long-context stage of the 2.4B Talking-Heads (T) model
(configs/talking_heads_2p4b.py), from its 8k run in workdirs/talking_heads_2p4b
(`--config.train.init_from=...` to change it). The stage's choices:
configs/long_context.py.
"""

import ml_collections

from configs import long_context, talking_heads_2p4b


def get_config() -> ml_collections.ConfigDict:
  return long_context.extend(
    talking_heads_2p4b.get_config(), init_from="workdirs/talking_heads_2p4b"
  )
