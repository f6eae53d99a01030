"""KV-cache decoding: IHA (LLLLM, both cache modes) vs MHA (M), cache bytes and tokens/s.

Builds small `TransformerLM`s of the same width, depth and heads: the paper's schedule
LLLLM (window max_len/(2P) virtual tokens, docs/design.md §2) and plain M, each also with
grouped-query attention (`--kv_heads` G key/value heads, default H/4: Llama 3 8B's ratio;
the caches hold G heads), generates greedily with a KV cache, and reports side by side the
cache bytes and the decode throughput (prefill time subtracted), best of `--repeats`, in
one process. `--ragged` adds a row per model with prompts of different lengths (row b
keeps the last `prompt_len * (b + 1) / B` tokens, left-padded: `prompt_mask`), the same
batch and new tokens.

  python benchmarks/decode.py                           # B=4, prompt 64, 448 new tokens
  python benchmarks/decode.py --iha_schedule I --num_pseudo 2   # global IHA: source vs pseudo
  python benchmarks/decode.py --ragged --no_gqa         # equal vs ragged prompts
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
from flax import nnx
from timing import call_times

from iha_jax.models import TransformerConfig, TransformerLM
from iha_jax.models.generate import generate, prefill


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batch", type=int, default=4)
  parser.add_argument("--prompt_len", type=int, default=64)
  parser.add_argument("--new_tokens", type=int, default=448)
  parser.add_argument("--layers", type=int, default=5)
  parser.add_argument("--model_dim", type=int, default=256)
  parser.add_argument("--heads", type=int, default=4)
  parser.add_argument("--head_dim", type=int, default=64)
  parser.add_argument("--num_pseudo", type=int, default=4)
  parser.add_argument("--kv_heads", type=int, default=0, help="G of the GQA rows; 0: H/4")
  parser.add_argument("--vocab", type=int, default=1024)
  parser.add_argument("--iha_schedule", default="LLLLM", help="schedule of the IHA model")
  parser.add_argument("--impl", default="xla", help="attention core of the prefill forward")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--ragged", action="store_true", help="also prompts of unequal lengths")
  parser.add_argument("--no_gqa", action="store_true", help="skip the grouped-query models")
  args = parser.parse_args()

  max_len = args.prompt_len + args.new_tokens
  iha_window = max(1, max_len // (2 * args.num_pseudo))
  common = dict(
    vocab_size=args.vocab,
    num_layers=args.layers,
    model_dim=args.model_dim,
    num_heads=args.heads,
    head_dim=args.head_dim,
    mlp_dim=4 * args.model_dim,
    implementation=args.impl,
  )
  prompt = jax.random.randint(
    jax.random.key(0), (args.batch, args.prompt_len), 0, args.vocab, jnp.int32
  )
  lengths = [args.prompt_len * (b + 1) // args.batch for b in range(args.batch)]
  prompt_masks = {"equal": None}
  if args.ragged:
    prompt_masks["ragged"] = (
      jnp.arange(args.prompt_len)[None] >= args.prompt_len - jnp.array(lengths)[:, None]
    )
  # S layers of a custom --iha_schedule get the same window, in tokens.
  iha = dict(
    attention_schedule=args.iha_schedule,
    num_pseudo=args.num_pseudo,
    iha_window=iha_window,
    mha_window=iha_window,
  )
  name = f"IHA {args.iha_schedule}"
  kv_heads = args.kv_heads or max(1, args.heads // 4)
  gqa = dict(num_kv_heads=kv_heads)
  runs = [
    (name, "source", iha),
    (name, "pseudo", iha),
    ("MHA M", "-", dict(attention_schedule="M")),
    (f"{name} G={kv_heads}", "source", {**iha, **gqa}),
    (f"{name} G={kv_heads}", "pseudo", {**iha, **gqa}),
    (f"MHA M G={kv_heads}", "-", dict(attention_schedule="M", **gqa)),
  ][: 3 if args.no_gqa else None]
  print(
    f"backend={jax.default_backend()} B={args.batch} prompt={args.prompt_len} "
    f"new={args.new_tokens} layers={args.layers} D={args.model_dim} H={args.heads} "
    f"d={args.head_dim} P={args.num_pseudo} iha_window={iha_window} virtual tokens"
    + (f"; ragged prompt lengths {lengths}" if args.ragged else "")
  )
  print(
    f"{'model':<18} {'cache':<7} {'prompts':<7} {'cache bytes':>12} {'prefill ms':>11} "
    f"{'decode tok/s':>13}"
  )
  for name, cache_mode, schedule in runs:
    model = TransformerLM(TransformerConfig(**common, **schedule), rngs=nnx.Rngs(0))
    mode = "source" if cache_mode == "-" else cache_mode  # MHA caches are the same either way.
    for prompts, mask in prompt_masks.items():
      run = dict(max_len=max_len, cache_mode=mode, prompt_mask=mask)
      _, cache = prefill(model, prompt, **run)
      t_prefill = min(call_times(lambda: prefill(model, prompt, **run), args.repeats))
      t_total = min(
        call_times(
          lambda: generate(model, prompt, max_new_tokens=args.new_tokens, **run), args.repeats
        )
      )
      # generate = prefill + (new_tokens - 1) cached decode steps.
      tokens_per_s = args.batch * (args.new_tokens - 1) / max(t_total - t_prefill, 1e-9)
      print(
        f"{name:<18} {cache_mode:<7} {prompts:<7} {cache.nbytes:>12,d} "
        f"{1e3 * t_prefill:>11.1f} {tokens_per_s:>13,.0f}"
      )


if __name__ == "__main__":
  main()
