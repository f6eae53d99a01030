"""The paper's 64k long-context fine-tuning stage, applied to any 2.4B config.

The paper fine-tunes its 2.4B models at 64k tokens before RULER and states neither the
stage's tokens, learning rate nor RoPE scaling; the choices here *(project)*:
- starts from the 8k run's checkpoint (`train.init_from`): parameters only, a fresh
  optimizer and step 0; the model keys that shape the parameters must match it;
- 65,536 tokens per sequence, 16 sequences per step = 1M tokens per step (the 8k stage's
  step size), 10,000 steps = 10.5B tokens (~4% of pre-training);
- peak learning rate 8e-5 (a tenth of pre-training's 8e-4), 200 warm-up steps, cosine to
  8e-6 (pre-training's final rate);
- RoPE: base frequency raised with the length, `theta * 65536 / 8192` = 4,000,000 for
  theta 500,000 (no position interpolation), so the longest wavelength keeps its ratio to
  the (virtual) sequence: IHA rotates at virtual positions up to N * P;
- windows: IHA's 'L' window stays the FLOP-matched rule at the new length ("auto":
  `N / (2P)` virtual tokens = 1,638 at P = 20), so its attention FLOPs stay matched to a
  global layer's as in pre-training; Global+Local keeps its 512-token windows;
- mesh: the sequence split over 4 devices (`mesh.context`: 16,384 tokens each), FSDP
  over the rest, the balanced token layout for the causal global layers (docs/design.md,
  context parallelism); on v5p-128 (64 chips, a 4x4x4 torus) that is fsdp 16 x
  context 4, one sequence per FSDP group.
"""

import ml_collections

LONG_SEQ_LEN = 65536


def extend(config: ml_collections.ConfigDict, init_from: str) -> ml_collections.ConfigDict:
  """`config` (an 8k pre-training config) turned into its 64k fine-tuning stage, starting
  from the parameters of the run in `init_from` (a workdir, local or gs://)."""
  short = config.data.seq_len
  config.data.seq_len = LONG_SEQ_LEN
  config.model.rope_theta = config.model.rope_theta * LONG_SEQ_LEN / short
  config.train.update(
    init_from=init_from,
    batch_size=16,
    total_steps=10_000,
    learning_rate=8e-5,
    final_learning_rate=8e-6,
    warmup_steps=200,
  )
  config.mesh.update(data=1, fsdp=-1, context=4, tensor=1, context_load_balance=True)
  config.checkpoint.update({"every": 500})
  config.eval_every = 1000
  return config
