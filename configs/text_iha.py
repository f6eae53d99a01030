"""A small IHA language model on the Python standard library's source (`make train-text`).

The model, data and tokenizer of the `code_lm` study (docs/results.md) at a shorter
budget: 5 layers `LLLLM` (sliding-window IHA, P = 2, the paper's FLOP-matched window of
seq_len / (2P) = 64 virtual tokens, then global MHA), width 64, 4 heads; rows of 256
tokens of a 2048-piece byte-level BPE trained on the corpus's train split. Prepare the
corpus and the tokenizer first (`make train-text` does both, into workdirs/data):

  python -m iha_jax.data.build --name=python_stdlib/chunks --data_dir=workdirs/data
  python -m iha_jax.data.train_tokenizer --name=python_stdlib/chunks \
      --data_dir=workdirs/data --format=tokenizer.json --vocab_size=2048 \
      --output=workdirs/data/tokenizers/python_stdlib-chunks-bpe2048
  python train.py --config configs/text_iha.py --workdir workdirs/text_iha

Other text: set `data.name` (e.g. `local_text/files`), `data.options`,
`data.tokenizer` and `data.data_dir` (docs/text.md, "Training on your own text").
"""

import ml_collections

from configs import default

TOKENIZER = "workdirs/data/tokenizers/python_stdlib-chunks-bpe2048.json"
# IHA's rate in the code_lm study (best of 3e-3 / 1e-2 / 3e-2 on validation, 800 steps).
LEARNING_RATE = 1e-2


def get_config() -> ml_collections.ConfigDict:
  config = default.get_config()
  config.model.update(
    num_layers=5,
    model_dim=64,
    num_heads=4,
    head_dim=16,
    mlp_dim=256,
    attention_schedule="LLLLM",
    iha_window="auto",
  )
  config.model.num_pseudo = 2
  config.data.name = "python_stdlib/chunks"
  config.data.seq_len = 256
  config.data.options = {}
  config.data.tokenizer = TOKENIZER
  config.train.update(
    batch_size=16,
    total_steps=400,
    warmup_steps=50,
    learning_rate=LEARNING_RATE,
    final_learning_rate=LEARNING_RATE / 100,
  )
  config.checkpoint.update({"every": 400, "keep": 1})
  config.log_every = 50
  config.eval_every = 0  # eval.py evaluates the finished runs side by side
  return config
