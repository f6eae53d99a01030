"""Smoke-test config: a 2-layer IHA+MHA model on short retrieval examples (seconds on CPU).

Used by the tests; `python train.py --config configs/tiny.py --workdir /tmp/tiny`.
"""

import ml_collections

from configs import default


def get_config() -> ml_collections.ConfigDict:
  config = default.get_config()
  config.model.update(
    num_layers=2,
    model_dim=32,
    num_heads=4,
    head_dim=8,
    mlp_dim=64,
    num_pseudo=2,
    attention_schedule="IM",
  )
  config.data.name = "multikey_retrieval/cpu_demo"  # short retrieval examples
  config.data.seq_len = 48
  config.data.options = {
    "length": 48,
    "num_needles": 2,
    "num_train": 512,
    "num_validation": 32,
    "num_test": 32,
  }
  config.train.update(
    batch_size=8, total_steps=20, warmup_steps=2, learning_rate=3e-3, final_learning_rate=5e-5
  )
  config.mesh.update(data=1, fsdp=-1, tensor=1)
  config.checkpoint.update({"every": 10, "keep": 3, "async": False})
  config.log_every = 1
  return config
