"""Config edits shared by the decoder studies: a layer schedule with the paper's windows."""

from __future__ import annotations

from collections.abc import Callable

import ml_collections


def schedule_edit(schedule: str) -> Callable[[ml_collections.ConfigDict], None]:
  """An edit setting `model.attention_schedule` to `schedule` (repeated over the layers).

  The base config holds IHA's P. `S` layers (sliding-window MHA) get IHA's window in
  tokens, `seq_len / (2 P^2)` (IHA's "auto" window is `seq_len / (2 P)` virtual tokens,
  P per token): Global+Local is the FLOP-cheaper twin of IHA's `L` layers. Without `L`
  layers the IHA settings are dropped.
  """

  def edit(config: ml_collections.ConfigDict) -> None:
    p = config.model.num_pseudo
    config.model.attention_schedule = schedule
    if "S" in schedule:
      config.model.mha_window = max(1, config.data.seq_len // (2 * p * p))
    if "L" not in schedule:
      config.model.window = None
      config.model.num_pseudo = None

  return edit
