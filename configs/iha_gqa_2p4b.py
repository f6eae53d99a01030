"""The paper's 2.4B IHA model with grouped-query attention: 20 query heads over 5 key/value
heads (docs/design.md §9).

Everything as configs/iha_2p4b.py (26 layers, width 2560, H = 20, d = 128, P = H, schedule
LLLLM, RoPE theta 500000, context 8192, FSDP, bf16), except `num_kv_heads = 5`: four query
heads share each key/value head, the ratio of Llama 3 8B's attention (32 query heads over
8 key/value heads). Every layer then has `wk, wv: [2560, 5, 128]`; the IHA layers mix the
key/value heads among themselves (`alpha_k, alpha_v: [5, 5, 20]`) and the query heads among
themselves (`alpha_q: [20, 20, 20]`). *(project)* The paper trains plain multi-head
attention; this variant is what a Llama-style model with IHA swapped in looks like at the
paper's scale: 2.12B parameters instead of 2.37B, and a source-head KV cache a quarter the
size of the multi-head one.
"""

import ml_collections

from configs import iha_2p4b


def get_config() -> ml_collections.ConfigDict:
  config = iha_2p4b.get_config()
  config.model.num_kv_heads = 5
  return config
