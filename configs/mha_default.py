"""MHA twin of configs/default.py: the same model with every layer global MHA ("MM").

Matching (docs/design.md §2, the paper's recipe): the IHA layer of default.py is a
sliding-window layer whose window, seq_len / (2P) virtual tokens, gives its attention core about the
unmasked query-key pairs of one causal MHA layer (T * w ~ N^2 / 2 with T = N P,
w = N / (2P)); so "LM" and "MM" do about the same attention work. What is left:
- parameters: IHA adds 4 H^2 P = 128 mixing/collapse scalars per IHA layer (0.1% of the
  demo's ~140k); an MLP column costs 3 D = 192, so no integer MLP width absorbs them
  exactly: the twin keeps mlp_dim and is 128 parameters (0.09%) smaller;
- FLOPs: the mixing and collapse, 8 H^2 P d per token (~1% of the demo's FLOPs), are not
  matched, and the window layer's core counts slightly fewer pairs than a causal layer.
`tests/train/test_config.py` checks parameters within 1% and FLOPs within 5%; `train.py`
prints both budgets at start.
"""

import ml_collections

from configs import default


def get_config() -> ml_collections.ConfigDict:
  config = default.get_config()
  config.model.attention_schedule = "MM"
  config.model.iha_window = None
  config.model.num_pseudo = None
  return config
