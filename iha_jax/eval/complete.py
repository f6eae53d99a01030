"""Runs trained on text, side by side: test metrics (bits per byte included) and a greedy
and a sampled completion of one prompt through the KV-cache decoder (`eval.py --complete`).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np

from iha_jax import data as data_lib
from iha_jax import parallel
from iha_jax.data import text_stats, tokenizers
from iha_jax.eval.runs import EvalError, restore_run
from iha_jax.models.generate import generate

# A Python prompt in the style of the standard library.
DEFAULT_PROMPT = 'def read_lines(path):\n    """Return the lines of the file at path."""\n'


@dataclasses.dataclass(frozen=True)
class TextRun:
  """One run's test metrics and its two continuations of the prompt."""

  name: str
  step: int
  metrics: dict[str, float]  # loss (nats/token), perplexity, token_accuracy, bits_per_byte
  greedy: str
  sampled: str


def _continuation(tokens: np.ndarray, prompt_len: int, tokenizer: tokenizers.Tokenizer) -> str:
  """The generated text after the prompt, up to the first end-of-document token."""
  new = np.asarray(tokens)[0, prompt_len:]
  ends = np.flatnonzero(new == tokenizer.eos_id)
  return tokenizer.decode(new[: ends[0]] if len(ends) else new)


def complete_run(
  workdir: str,
  prompt: str,
  *,
  split: str = "test",
  max_new_tokens: int = 48,
  temperature: float = 0.8,
  top_k: int | None = 40,
  seed: int = 0,
  step: int | None = None,
  mesh: dict[str, int] | None = None,
) -> TextRun:
  """Restores `workdir` (see `restore_run`), evaluates `split` and continues `prompt`
  greedily and by sampling (`temperature`, `top_k`, PRNG `seed`).

  Raises:
    EvalError: if the run was not trained on a text corpus.
  """
  run = restore_run(workdir, step, mesh)
  data = run.config.data
  if not data_lib.is_text(data.name):
    raise EvalError(
      f"--complete: {workdir!r} was trained on {data.name!r}, not a text corpus; completions"
      " need a tokenizer (train on python_stdlib, local_text or tfds:<name>)"
    )
  metrics = run.evaluate(run.config, split)
  metrics = {k: metrics[k] for k in ("loss", "perplexity", "token_accuracy")}
  metrics["bits_per_byte"] = text_stats.scored_text(data, split).bits_per_byte(metrics["loss"])
  tokenizer = data_lib.load_tokenizer(data.tokenizer)
  bos = [tokenizer.bos_id] if tokenizer.bos_id >= 0 else []
  prompt_tokens = np.asarray([bos + tokenizer.encode(prompt).tolist()], np.int32)  # [1, L0]
  with parallel.activate(run.mesh):
    model = run.model.module(run.params)
    texts = [
      _continuation(
        generate(
          model,
          prompt_tokens,
          max_new_tokens=max_new_tokens,
          temperature=t,
          top_k=k,
          rng=jax.random.key(seed),
        ),
        prompt_tokens.shape[1],
        tokenizer,
      )
      for t, k in ((0.0, None), (temperature, top_k))
    ]
  return TextRun(run.name, run.step, metrics, *texts)


def side_by_side(runs: list[TextRun], split: str = "test") -> str:
  """A table of the runs' metrics on `split` (perplexity = exp(loss per token))."""
  width = max(len(r.name) for r in runs)
  lines = [
    f"{'run':<{width}}  {'step':>6}  {split + ' loss':>10}  {'perplexity':>10}  "
    f"{'bits/byte':>9}  {'accuracy':>8}"
  ]
  for r in runs:
    m = r.metrics
    lines.append(
      f"{r.name:<{width}}  {r.step:>6}  {m['loss']:>10.4f}  {math.exp(m['loss']):>10.2f}  "
      f"{m['bits_per_byte']:>9.4f}  {100 * m['token_accuracy']:>7.1f}%"
    )
  return "\n".join(lines)


def describe(run: TextRun, prompt: str, temperature: float, top_k: int | None) -> str:
  """The prompt and both continuations of one run, for the terminal."""
  rule = "-" * 60
  return (
    f"{rule}\n{run.name} (step {run.step}), greedy:\n{prompt}{run.greedy}\n{rule}\n"
    f"{run.name}, sampled (temperature {temperature}, top_k {top_k}):\n{prompt}{run.sampled}"
  )
