"""CPU demo: a small IHA LM on multi-query associative recall; trains in minutes on 2 CPU cores.

The paper's recipe in miniature: a sliding-window IHA layer with the FLOP-matched window
("auto" = seq_len / (2P) virtual tokens) followed by a global MHA layer ("LM").

`python train.py --config configs/default.py --workdir workdirs/default`
Every key of every config lives here; the other configs start from this one.
"""

import ml_collections
from ml_collections.config_dict import FieldReference, placeholder

from iha_jax import data


def get_config() -> ml_collections.ConfigDict:
  # Keys that may be None are typed FieldReferences/placeholders: `--config.KEY=VALUE`
  # cannot override a plain None.
  config = ml_collections.ConfigDict()

  config.model = ml_collections.ConfigDict(
    dict(
      vocab_size=-1,  # -1: the dataset's vocabulary
      num_layers=2,
      model_dim=64,
      num_heads=4,
      head_dim=16,
      mlp_dim=256,
      mlp_type="swiglu",  # swiglu | gelu (2-matrix)
      num_pseudo=FieldReference(2, field_type=int),  # P; None = H (the paper's default)
      # I/L = global/window IHA, M/S = global/window MHA, T = Talking-Heads,
      # D = differential (H/2 heads of value width 2d), X = 2-simplicial (no RoPE).
      attention_schedule="LM",
      # 'L' layers, in virtual tokens; "auto" = seq_len / (2P); None: no 'L' layers.
      iha_window=FieldReference("auto", field_type=str),
      mha_window=placeholder(int),  # 'S' layers, tokens (None: no 'S' layers)
      rope_theta=10000.0,
      collapse_mode="full",
      tie_embeddings=True,
      dtype="float32",  # compute; "bfloat16" on accelerators
      param_dtype="float32",
      remat_policy="none",  # none | full | save_projections | save_attention
      scan_layers=False,  # scan over repeats of the schedule period
      implementation="auto",  # attention core: auto | xla | reference | pallas_*
      causal=True,  # False: encoder, every layer bidirectional
      num_outputs=placeholder(int),  # None: vocabulary logits; an int: per-token head
      mixing_noise_std=0.0,  # noise on the identity init of alpha/collapse/talk_*
      embedding_gradient="auto",  # auto | scatter | matmul (iha_jax/models/embedding.py)
    )
  )

  config.data = data.default_config()
  # MQAR (Zoology): 64-token examples, 8 key-value pairs (64 keys, 64 values) then every
  # key queried once at a random later position; exact match needs all 8 values right
  # (chance (1/64)^8). The IHA demo learns it in ~1000 steps (docs/results.md: MQAR).
  config.data.name = "mqar/cpu_demo"
  config.data.data_dir = placeholder(str)  # None: $IHA_DATA_DIR or <workdir>/../data
  config.data.packing = placeholder(bool)
  config.data.seq_len = 64
  config.data.options = {"num_train": 32768}

  config.train = ml_collections.ConfigDict(
    dict(
      batch_size=32,
      total_steps=3000,
      # IHA's own tuned rate on this task (`python -m experiments.run mqar --scale demo`:
      # best of 1e-3..3e-2 on validation; docs/results.md); cosine decay to 1/100 of it.
      learning_rate=1e-2,
      final_learning_rate=1e-4,
      warmup_steps=100,
      weight_decay=0.1,
      b1=0.9,
      b2=0.95,
      eps=1e-8,
      grad_clip=1.0,
      grad_accum_steps=1,
      seed=0,
      # Weight decay on the head-mixing coefficients (alpha_*, collapse, talk_*): off.
      # They are identity-initialised structural coefficients, like norm gains; decoupled
      # decay pulls them toward 0, not toward their identity init, shrinking pseudo-heads
      # and the collapse. The paper states no decay rule for them.
      decay_mixing=False,
      # cross_entropy (softmax over the outputs) | binary_cross_entropy (needs
      # model.num_outputs=1: one sigmoid logit per position, 0/1 targets).
      loss="cross_entropy",
      # Sequence positions per chunk of the cross-entropy over the vocabulary: the float32
      # [B, N, V] logits never exist whole (iha_jax/train/losses.py); 0: whole logits.
      loss_chunk_tokens=1024,
      # A workdir whose newest checkpoint's parameters start this run (step 0, a fresh
      # optimizer; e.g. the long-context stage from its 8k run); None: a fresh init.
      init_from=placeholder(str),
    )
  )

  # context: sequence parallelism (the tokens of a sequence over devices,
  # iha_jax/parallel/context.py); context_load_balance: the balanced token order that
  # evens out causal attention's work per context shard.
  config.mesh = ml_collections.ConfigDict(
    dict(data=1, fsdp=-1, context=1, tensor=1, context_load_balance=False)
  )
  config.checkpoint = ml_collections.ConfigDict({"every": 1000, "keep": 2, "async": True})
  config.log_every = 100
  config.eval_every = 1000
  return config
