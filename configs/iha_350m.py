"""A ~350M-parameter IHA LM (schedule LLLLM) for one H100: the single-GPU train-step benchmark.

`benchmarks/train_step.py --configs configs/iha_350m.py,configs/mha_350m.py` times it
against its MHA twin (every layer global MHA) at 4096 tokens per sequence.

25 layers (LLLLM x 5), width 1024, H = 16, d = 64, SwiGLU MLP 2816, vocabulary 32768 (tied):
355M parameters. P = 4 pseudo-heads (the kernels' tuned case; the paper's default is P = H),
'L' window "auto" = 4096 / (2 P) = 512 virtual tokens (docs/design.md §2). bf16 compute,
float32 parameters, layers scanned, projections saved for the backward pass; 8 x 4096 tokens
per step. Synthetic tokens in the benchmark (no data is read), so the vocabulary is set here.
"""

import ml_collections

from configs import default


def get_config() -> ml_collections.ConfigDict:
  config = default.get_config()
  config.model.update(
    vocab_size=32768,
    num_layers=25,
    model_dim=1024,
    num_heads=16,
    head_dim=64,
    mlp_dim=2816,
    mlp_type="swiglu",
    attention_schedule="LLLLM",
    iha_window="auto",
    rope_theta=10000.0,
    dtype="bfloat16",
    param_dtype="float32",
    remat_policy="save_projections",
    scan_layers=True,
    implementation="auto",
  )
  config.model.num_pseudo = 4
  config.data.seq_len = 4096
  config.train.update(batch_size=8, learning_rate=3e-4, final_learning_rate=3e-5)
  return config
