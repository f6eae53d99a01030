"""Training: config validation, optimizer, sharded train step, checkpoints, metrics, loop."""

from iha_jax.extras import require

require("train", "iha_jax.train")

from iha_jax.train.config import ConfigError, model_config, validate
from iha_jax.train.loop import NonFiniteLossError, train
from iha_jax.train.state import TrainState

__all__ = ["ConfigError", "NonFiniteLossError", "TrainState", "model_config", "train", "validate"]
