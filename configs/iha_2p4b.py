"""The paper's 2.4B IHA model (docs/design.md §4): schedule LLLLM, FSDP, bf16, 240k steps.

26 layers, width 2560, H = 20, d = 128, P = H, vocabulary 128256, RoPE theta 500000,
context 8192; AdamW (0.9, 0.95), wd 0.1, peak LR 8e-4, 1000 warm-up steps, cosine to 8e-6,
clip 1.0; 128 x 8192 = 1M tokens per step (240B tokens in 240k steps).

MLP *(project)*: the paper's "MLP 10240" is read as a 2-matrix (GELU) MLP of width 10240:
with tied embeddings that gives the paper's 2.4B parameters (a 3-matrix SwiGLU of width
10240 would be 3.1B).
Window: 'L' layers use "auto" = 8192 / (2 P) = 204 virtual tokens (~10 tokens), the
paper's FLOP-matched window (docs/design.md §2).
Data: a text corpus prepared as array_record (data.name, default tfds:c4/en) and the paper's
tokenizer, Llama 3's (128,256 ids): a file the user supplies (docs/training.md's pod section shows
how to get it), `TOKENIZER` by default or `--config.data.tokenizer=PATH_OR_URL`. The
vocabulary is read from that file (model.vocab_size = -1).
"""

import ml_collections

from configs import default

# Llama 3's Hugging Face tokenizer.json, relative to the working directory (or a URL given
# with --config.data.tokenizer); its original tiktoken `tokenizer.model` works as well.
TOKENIZER = "tokenizers/llama3/tokenizer.json"


def get_config() -> ml_collections.ConfigDict:
  config = default.get_config()
  config.model.update(
    vocab_size=-1,
    num_layers=26,
    model_dim=2560,
    num_heads=20,
    head_dim=128,
    mlp_dim=10240,
    mlp_type="gelu",
    attention_schedule="LLLLM",
    iha_window="auto",
    rope_theta=500000.0,
    collapse_mode="full",
    tie_embeddings=True,
    dtype="bfloat16",
    param_dtype="float32",
    remat_policy="save_projections",
    scan_layers=True,
    implementation="auto",
  )
  config.model.num_pseudo = None  # P = H
  config.data.name = "tfds:c4/en"
  config.data.seq_len = 8192
  config.data.tokenizer = TOKENIZER  # 128,256 ids: the vocabulary
  config.data.options = {}
  config.train.update(
    batch_size=128,
    total_steps=240_000,
    learning_rate=8e-4,
    final_learning_rate=8e-6,
    warmup_steps=1000,
    weight_decay=0.1,
    b1=0.9,
    b2=0.95,
    eps=1e-8,
    grad_clip=1.0,
    grad_accum_steps=1,
    seed=0,
  )
  config.mesh.update(data=1, fsdp=-1, tensor=1)
  config.checkpoint.update({"every": 1000, "keep": 3, "async": True})
  config.log_every = 100
  config.eval_every = 5000
  return config
