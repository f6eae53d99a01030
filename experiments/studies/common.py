"""Building blocks the studies share: the training section every study run uses, the
paper's layer schedules for decoder studies, and the MHA-vs-IHA head-count probes."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import ml_collections

from configs import default
from experiments.protocol import Sweep, Variant


def study_config(
  batch_size: int, warmup_steps: int, loss: str = "cross_entropy"
) -> ml_collections.ConfigDict:
  """configs/default.py with a study's training section: cosine decay to 1e-5, no
  evaluation inside train.py (the runner validates). The peak rate 1e-3 is a placeholder:
  every run sets its own, and the final rate keeps its ratio to the peak."""
  config = default.get_config()
  config.train.update(
    batch_size=batch_size, warmup_steps=warmup_steps, final_learning_rate=1e-5, loss=loss
  )
  config.train.learning_rate = 1e-3
  config.eval_every = 0
  return config


def schedule_edit(schedule: str) -> Callable[[ml_collections.ConfigDict], None]:
  """An edit setting `model.attention_schedule` to `schedule` (repeated over the layers).

  The base config holds IHA's P. `S` layers (sliding-window MHA) get IHA's window in
  tokens, `seq_len / (2 P^2)` (IHA's "auto" window is `seq_len / (2 P)` virtual tokens,
  P per token): Global+Local is the FLOP-cheaper twin of IHA's `L` layers. Without
  layers over virtual tokens (IHA `L`, PHA `R`, `P`) the IHA settings are dropped.
  """

  def edit(config: ml_collections.ConfigDict) -> None:
    p = config.model.num_pseudo
    config.model.attention_schedule = schedule
    if "S" in schedule:
      config.model.mha_window = max(1, config.data.seq_len // (2 * p * p))
    if not set(schedule) & set(_VIRTUAL_LETTERS):
      config.model.iha_window = None
      config.model.num_pseudo = None

  return edit


# The letters whose layers run over virtual tokens (P per token): IHA's window, PHA.
_VIRTUAL_LETTERS = "LRP"


def with_pseudo(schedule: str, p: int) -> Callable[[ml_collections.ConfigDict], None]:
  """An edit: `schedule` at P = `p` (the other variants keep the scale's P): 'L' and 'R'
  layers get the paper's window `seq_len / (2p)` virtual tokens ("auto"), 'S' layers the
  same window in tokens (`schedule_edit`), so Global+Local at P = 1 is IHA P = 1's model
  but for IHA's factored projections and mixing."""

  def edit(config: ml_collections.ConfigDict) -> None:
    config.model.num_pseudo = p
    schedule_edit(schedule)(config)

  return edit


def pha_edit(window_factor: int = 1) -> Callable[[ml_collections.ConfigDict], None]:
  """An edit: paired-head attention `RRRRM` (IHA `LLLLM`'s sliding-window layers with
  IHA's mixing and collapse fixed to selections) at the scale's P, over `window_factor`
  times IHA's "auto" window in virtual tokens. PHA's H / P groups do 1 / P of IHA's
  attention work at one window: `window_factor` = P equalises the two."""

  def edit(config: ml_collections.ConfigDict) -> None:
    schedule_edit("RRRRM")(config)
    p = config.model.num_pseudo
    # A string, as a command-line override of the field "auto" is (train.config reads it).
    config.model.iha_window = str(max(1, window_factor * config.data.seq_len // (2 * p)))

  return edit


def heads_edit(
  heads: int, then: Callable[[ml_collections.ConfigDict], None]
) -> Callable[[ml_collections.ConfigDict], None]:
  """An edit: `heads` heads of `model_dim / heads` (width kept), then the edit `then`."""

  def edit(config: ml_collections.ConfigDict) -> None:
    config.model.num_heads = heads
    config.model.head_dim = config.model.model_dim // heads
    then(config)

  return edit


# --- head-count probes: one bidirectional layer, MHA against IHA with P = H -------------


def probe_model(
  config: ml_collections.ConfigDict,
  *,
  width: int,
  head_dim: int,
  heads: int,
  num_outputs: int,
  **extra: Any,
) -> None:
  """Sets `config.model` to one bidirectional MHA layer (IHA's variants switch the
  letter) with a per-token head of `num_outputs`, IHA's P = H; `extra`: more model keys."""
  config.model.update(
    num_layers=1,
    model_dim=width,
    num_heads=heads,
    head_dim=head_dim,
    mlp_dim=4 * width,
    attention_schedule="M",
    iha_window=None,
    causal=False,
    num_outputs=num_outputs,
    **extra,
  )
  config.model.num_pseudo = None  # IHA's P = H, also along a head-count sweep


def set_heads(config: ml_collections.ConfigDict, heads: int) -> None:
  config.model.num_heads = heads  # IHA's P follows (num_pseudo None: P = H)


def heads_sweep(base: int, values: tuple[int, ...], retune: bool = False) -> Sweep:
  """The sweep over the number of heads H (head and model width fixed)."""
  return Sweep("num_heads", base, values, set_heads, retune=retune)


def mha_iha_pairs(
  points: Iterable[Any], symbol: str, base: Callable[[str, Any], ml_collections.ConfigDict]
) -> tuple[Variant, ...]:
  """An MHA and an IHA (P = H) variant per point of the task (a length, a number of
  powers): names `mha_{symbol}{point}`, labels "MHA, {symbol} = {point}", base configs
  `base(scale, point)`."""
  variants = []
  for point in points:
    for letter, kind, label in (("M", "mha", "MHA"), ("I", "iha", "IHA, P = H")):

      def edit(config: ml_collections.ConfigDict, letter=letter) -> None:
        config.model.attention_schedule = letter

      variants.append(
        Variant(
          f"{kind}_{symbol}{point}",
          f"{label}, {symbol} = {point}",
          edit,
          base=lambda scale, point=point: base(scale, point),
        )
      )
  return tuple(variants)
