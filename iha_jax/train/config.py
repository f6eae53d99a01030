"""Training config: validation (fail fast, naming the key) and the model config it implies.

Window keys *(project)*:
- `model.iha_window`: window of the 'L' (sliding-window IHA) layers in VIRTUAL tokens, or
  "auto" = the paper's FLOP-matched `data.seq_len / (2 P)` virtual tokens (docs/design.md §2),
  or None when the schedule has no 'L'.
- `model.mha_window`: window of the 'S' (sliding-window MHA) layers in tokens.
- `model.vocab_size`: -1 takes the data's vocabulary (`iha_jax.data.vocab_size`).

Model variants: `model.causal` (False: encoder, every layer bidirectional),
`model.num_outputs` (None: vocabulary logits; an int: a per-token output head),
`model.mixing_noise_std` (noise on the identity init of the head mixings),
`model.input_features` (None, or F continuous features per token, for data with a
`features` field, e.g. `polynomial_filter`).
`train.decay_mixing`: decoupled weight decay on the head-mixing coefficients
(`iha_jax.nn.MIXING_PARAMS`); off by default, see `iha_jax.train.optimizer`.
`train.loss_chunk_tokens`: sequence positions per chunk of the chunked cross-entropy
(`iha_jax.train.losses`; any N, the remainder is one shorter chunk); 0 or None: whole
logits.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any

import jax.numpy as jnp
import ml_collections

from iha_jax import data as data_lib
from iha_jax.checks import is_int
from iha_jax.core.options import round_up
from iha_jax.errors import UserError
from iha_jax.kinds import LETTER_DESCRIPTIONS as LETTERS
from iha_jax.kinds import effective_num_pseudo, for_letter
from iha_jax.models import TransformerConfig
from iha_jax.parallel import resolve_mesh_shape
from iha_jax.train.losses import LOSSES, chunk_tokens_problem

REMAT_POLICIES = ("none", "full", "save_projections", "save_attention")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
# The `model.` section: TransformerConfig's fields by the same names (`iha_window` also
# takes "auto", resolved here) but `norm_eps` (fixed), plus how the trainer runs it.
MODEL_KEYS = tuple(
  f.name for f in dataclasses.fields(TransformerConfig) if f.name != "norm_eps"
) + ("remat_policy", "scan_layers")
# Model keys added after checkpoints were first saved: their value when a saved config
# lacks them (the model they describe is the one built before the key existed).
MODEL_DEFAULTS = {
  "causal": True,
  "num_outputs": None,
  "mixing_noise_std": 0.0,
  "input_features": None,
  "num_kv_heads": None,
  "embedding_gradient": "auto",
}


class ConfigError(UserError, ValueError):
  """An invalid training config; the message names the offending key."""


def _positive_int(config: ml_collections.ConfigDict, key: str, *, minimum: int = 1) -> int:
  section, name = key.split(".")
  value = config[section][name]
  if not is_int(value, minimum):
    raise ConfigError(f"{key} must be an integer >= {minimum}, got {value!r}")
  return value


def resolve_vocab_size(config: ml_collections.ConfigDict) -> int:
  """`model.vocab_size`, or the data's vocabulary when it is -1."""
  if config.model.vocab_size == -1:
    return data_lib.vocab_size(config.data)
  return config.model.vocab_size


def _window(config: ml_collections.ConfigDict) -> int | str | None:
  """`model.iha_window` as None, "auto" or an int (a `--config.model.iha_window=256`
  override of the string field "auto" arrives as the string "256")."""
  window = config.model.iha_window
  if isinstance(window, str) and window != "auto":
    try:
      return int(window)
    except ValueError:
      raise ConfigError(
        f"model.iha_window must be a positive integer, 'auto' or None, got {window!r}"
      ) from None
  return window


def resolve_window(config: ml_collections.ConfigDict) -> int | None:
  """The window of the sliding-window layers over virtual tokens ('L', 'R') in virtual
  tokens ("auto": `seq_len / (2 P)`, at least 1; with `num_pseudo` None, P = H unless
  every such kind of the schedule has a default of its own, PHA's 2)."""
  window = _window(config)
  if window != "auto":
    return window
  p = effective_num_pseudo(config.model.num_pseudo, config.model.num_heads)
  letters = [x for x in dict.fromkeys(str(config.model.attention_schedule)) if x in LETTERS]
  defaults = {r.default_num_pseudo for r, _ in map(for_letter, letters) if r.virtual_tokens}
  if config.model.num_pseudo is None and defaults and None not in defaults:
    p = max(defaults)
  return max(1, config.data.seq_len // (2 * p))


def _model_variant(m: ml_collections.ConfigDict) -> dict[str, Any]:
  """`causal`, `num_outputs`, `mixing_noise_std`, `input_features` of `config.model`,
  type-checked, and `num_kv_heads` (checked by `TransformerConfig`)."""
  values = {key: m.get(key, default) for key, default in MODEL_DEFAULTS.items()}
  if not isinstance(values["causal"], bool):
    raise ConfigError(
      f"model.causal must be a bool (False: bidirectional encoder), got {values['causal']!r}"
    )
  outputs = values["num_outputs"]
  if outputs is not None and not is_int(outputs, 1):
    raise ConfigError(
      f"model.num_outputs must be None (vocabulary logits) or an integer >= 1, got {outputs!r}"
    )
  noise = values["mixing_noise_std"]
  if isinstance(noise, bool) or not isinstance(noise, (int, float)) or not noise >= 0:
    raise ConfigError(f"model.mixing_noise_std must be a number >= 0, got {noise!r}")
  features = values["input_features"]
  if features is not None and not is_int(features, 1):
    raise ConfigError(
      f"model.input_features must be None (tokens only) or an integer >= 1, got {features!r}"
    )
  return values


def model_config(config: ml_collections.ConfigDict) -> TransformerConfig:
  """The `TransformerConfig` of `config.model` (+ data vocabulary and "auto" window)."""
  m = config.model
  for key in ("dtype", "param_dtype"):
    if m[key] not in DTYPES:
      raise ConfigError(f"model.{key} must be one of {sorted(DTYPES)}, got {m[key]!r}")
  variant = _model_variant(m)
  vocab_size = resolve_vocab_size(config)  # a DataError names data.*, not model.*
  try:
    return TransformerConfig(
      vocab_size=vocab_size,
      num_layers=m.num_layers,
      model_dim=m.model_dim,
      num_heads=m.num_heads,
      head_dim=m.head_dim,
      mlp_dim=m.mlp_dim,
      mlp_type=m.mlp_type,
      num_pseudo=m.num_pseudo,
      attention_schedule=m.attention_schedule,
      iha_window=resolve_window(config),
      mha_window=m.mha_window,
      rope_theta=m.rope_theta,
      collapse_mode=m.collapse_mode,
      tie_embeddings=m.tie_embeddings,
      dtype=DTYPES[m.dtype],
      param_dtype=DTYPES[m.param_dtype],
      implementation=m.implementation,
      **variant,
    )
  except ValueError as e:
    raise ConfigError(f"model: {e}") from e


def context_axis_problem(config: ml_collections.ConfigDict, context: int) -> str | None:
  """Why `data.seq_len` cannot be split over `mesh.context = context` (None: it can):
  it must divide into `context` equal shards (2 x context chunks with
  `mesh.context_load_balance`)."""
  if context == 1:
    return None
  chunks = context * (2 if config.mesh.get("context_load_balance", False) else 1)
  seq_len = config.data.seq_len
  if seq_len % chunks:
    balance = " (x2: mesh.context_load_balance)" if chunks > context else ""
    return (
      f"data.seq_len={seq_len} is not divisible by mesh.context={context}{balance}: use a "
      f"seq_len that is a multiple of {chunks}"
    )
  return None


def tensor_axis_problem(model: TransformerConfig, tensor: int) -> str | None:
  """Why `model`'s parameters cannot be split over `mesh.tensor = tensor` (None: they can).

  The tensor axis splits the heads and the vocabulary axis of the embedding (and of an
  untied output head); Orbax cannot restore a checkpoint onto an uneven split.
  """
  if model.num_heads % tensor:
    return f"model.num_heads={model.num_heads} is not divisible by mesh.tensor={tensor}"
  g = model.num_kv_heads
  if g is not None and g % tensor and tensor % g:
    return (
      f"model.num_kv_heads={g} and mesh.tensor={tensor}: tensor parallelism splits the "
      "key/value heads when mesh.tensor divides them, or keeps them whole when they divide "
      "mesh.tensor; use sizes where one divides the other"
    )
  if model.vocab_size % tensor:
    padded = round_up(model.vocab_size, tensor)
    return (
      f"the vocabulary ({model.vocab_size}, model.vocab_size or the data's) is not divisible "
      f"by mesh.tensor={tensor}: set model.vocab_size={padded} (ids the data never uses are "
      "harmless)"
    )
  return None


def validate(config: ml_collections.ConfigDict, num_devices: int) -> TransformerConfig:
  """Checks `config` against itself and `num_devices`; returns the model config.

  Raises:
    ConfigError: naming the first invalid key (`train.batch_size`, `mesh.tensor`, ...).
  """
  for section in ("model", "data", "train", "mesh", "checkpoint"):
    if section not in config:
      raise ConfigError(f"config has no section {section!r}")
  _check_model_keys(config)
  model = model_config(config)
  _check_counts(config)
  _check_train(config.train, model)
  try:
    data, fsdp, context, tensor = resolve_mesh_shape(dict(config.mesh), num_devices)
  except ValueError as e:
    raise ConfigError(str(e)) from e
  problem = tensor_axis_problem(model, tensor) or context_axis_problem(config, context)
  if problem:
    raise ConfigError(problem)
  t = config.train
  if t.batch_size % t.grad_accum_steps:
    raise ConfigError(
      f"train.grad_accum_steps={t.grad_accum_steps} does not divide train.batch_size={t.batch_size}"
    )
  micro = t.batch_size // t.grad_accum_steps
  if micro % (data * fsdp):
    raise ConfigError(
      f"train.batch_size / train.grad_accum_steps = {micro} rows per "
      f"microbatch are not divisible by mesh.data * mesh.fsdp = {data * fsdp}"
    )
  if config.model.scan_layers:
    period = len(config.model.attention_schedule)
    if model.num_layers < period:
      raise ConfigError(
        f"model.scan_layers needs model.num_layers >= the schedule period "
        f"{period} (model.attention_schedule={config.model.attention_schedule!r})"
      )
  return model


def _check_model_keys(config: ml_collections.ConfigDict) -> None:
  """The `model.` keys `validate` reads before building the model: no unknown key (with
  the closest known one), the remat policy, the window's type."""
  unknown = sorted(set(config.model) - set(MODEL_KEYS))
  if unknown:
    guesses = [
      f"did you mean model.{close[0]}?"
      for close in (difflib.get_close_matches(key, MODEL_KEYS, n=1) for key in unknown)
      if close
    ]
    raise ConfigError(
      f"unknown model key(s) {', '.join('model.' + k for k in unknown)}"
      f"{'; ' + ' '.join(guesses) if guesses else ''}; "
      f"known: {', '.join(MODEL_KEYS)}"
    )
  if config.model.remat_policy not in REMAT_POLICIES:
    raise ConfigError(
      f"model.remat_policy must be one of {REMAT_POLICIES}, got {config.model.remat_policy!r}"
    )
  window = _window(config)
  if window not in (None, "auto") and not is_int(window, 1):
    raise ConfigError(
      f"model.iha_window must be a positive integer, 'auto' or None, got {window!r}"
    )


def _check_counts(config: ml_collections.ConfigDict) -> None:
  """The sizes, step counts and intervals: integers in range, each named."""
  for key in (
    "train.batch_size",
    "train.total_steps",
    "train.grad_accum_steps",
    "data.seq_len",
    "checkpoint.every",
    "checkpoint.keep",
  ):
    _positive_int(config, key)
  _positive_int(config, "train.warmup_steps", minimum=0)
  for key in ("log_every", "eval_every"):
    value = config[key]
    if not is_int(value, 0):
      raise ConfigError(f"{key} must be an integer >= 0 (0 disables), got {value!r}")


def _check_train(t: ml_collections.ConfigDict, model: TransformerConfig) -> None:
  """The `train.` section: schedule, optimizer numbers, the loss and what it needs of the
  model."""
  if t.warmup_steps >= t.total_steps:  # the cosine decay needs at least one step
    raise ConfigError(
      f"train.warmup_steps={t.warmup_steps} must be below train.total_steps={t.total_steps} "
      "(the cosine decay follows the warm-up): lower warmup_steps or raise total_steps"
    )
  for key in ("learning_rate", "weight_decay", "grad_clip", "final_learning_rate"):
    if not isinstance(t[key], (int, float)) or t[key] < 0:
      raise ConfigError(f"train.{key} must be a number >= 0, got {t[key]!r}")
  if not isinstance(t.get("decay_mixing"), bool):
    raise ConfigError(f"train.decay_mixing must be a bool, got {t.get('decay_mixing')!r}")
  loss = t.get("loss", "cross_entropy")
  if loss not in LOSSES:
    raise ConfigError(f"train.loss must be one of {LOSSES}, got {loss!r}")
  if loss == "binary_cross_entropy" and model.num_outputs != 1:
    raise ConfigError(
      f"train.loss='binary_cross_entropy' needs model.num_outputs=1 (one "
      f"logit per position), got {model.num_outputs!r}"
    )
  if loss == "mean_squared_error" and model.num_outputs is None:
    raise ConfigError(
      "train.loss='mean_squared_error' needs model.num_outputs (the number of "
      "regression values per position, e.g. the data's num_values)"
    )
  problem = chunk_tokens_problem(t.get("loss_chunk_tokens"))
  if problem:
    raise ConfigError(problem)


def upgrade_saved_config(saved: dict[str, Any]) -> dict[str, Any]:
  """A config saved by an older version in today's keys: `model.window` became
  `model.iha_window` (2026-11-28)."""
  model = dict(saved.get("model", {}))
  if "window" in model and "iha_window" not in model:
    model["iha_window"] = model.pop("window")
    return {**saved, "model": model}
  return saved


def config_differences(
  saved: dict[str, Any], current: dict[str, Any], prefix: str = ""
) -> list[str]:
  """`["model.num_layers: 2 (checkpoint) vs 4 (config)", ...]` for every differing leaf.

  A `MODEL_DEFAULTS` key missing from `saved` (a checkpoint older than the key) counts
  as its default, so such checkpoints still resume when the config keeps the default.
  """
  diffs = []
  for key in sorted(set(saved) | set(current)):
    name = f"{prefix}{key}"
    missing = MODEL_DEFAULTS.get(key, "<missing>") if prefix == "model." else "<missing>"
    a, b = saved.get(key, missing), current.get(key, "<missing>")
    if isinstance(a, dict) and isinstance(b, dict):
      diffs += config_differences(a, b, name + ".")
    elif a != b and not (
      isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and list(a) == list(b)
    ):
      diffs.append(f"{name}: {a!r} (checkpoint) vs {b!r} (config)")
  return diffs
