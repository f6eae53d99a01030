"""Config validation, the shipped configs, and the IHA-aware FLOP count."""
from __future__ import annotations

import re

import jax
import pytest
from flax import nnx

from configs import default, global_2p4b, global_local_2p4b, iha_2p4b, mha_default, tiny
from iha_jax.models import TransformerConfig, TransformerLM
from iha_jax.train import ConfigError, num_params, validate
from iha_jax.train import flops


@pytest.mark.parametrize("overrides, message", [
    ({"mesh.fsdp": 1, "mesh.tensor": 3}, "model.num_heads=4 is not divisible by mesh.tensor=3"),
    ({"mesh.fsdp": 16}, "needs 16 devices, only 8"),
    ({"mesh.fsdp": 8, "train.batch_size": 12}, "not divisible by mesh.data * mesh.fsdp = 8"),
    ({"train.grad_accum_steps": 3}, "train.grad_accum_steps=3 does not divide train.batch_size=8"),
    ({"model.remat_policy": "dots"}, "model.remat_policy must be one of"),
    ({"model.dtype": "float64"}, "model.dtype must be one of"),
    ({"model.window": "0"}, "model.window must be a positive integer"),
    ({"model.window": "wide"}, "model.window must be a positive integer"),
    ({"model.attention_schedule": "IX"}, "unknown letter 'X'"),
    ({"model.attention_schedule": "S"}, "mha_window must be set"),
    ({"train.warmup_steps": 50}, "train.warmup_steps=50 exceeds train.total_steps=20"),
    ({"train.total_steps": 0}, "train.total_steps must be an integer >= 1"),
    ({"checkpoint.keep": 0}, "checkpoint.keep must be an integer >= 1"),
])
def test_validation_names_the_key(overrides, message):
  config = tiny.get_config()
  for key, value in overrides.items():
    section, name = key.split(".")
    config[section][name] = value
  with pytest.raises(ConfigError, match=re.escape(message)):
    validate(config, 8)


def test_unknown_model_key():
  config = tiny.get_config()
  config.model.unlock()
  config.model.num_experts = 4
  with pytest.raises(ConfigError, match="unknown model key.*model.num_experts"):
    validate(config, 8)


def test_window_override_from_the_command_line():
  config = tiny.get_config()
  config.model.update(attention_schedule="LM", window="24")  # as config_flags passes it
  assert validate(config, 8).iha_window == 24


def test_window_auto_is_flop_matched():
  config = iha_2p4b.get_config()
  model = validate(config, 128)
  assert model.iha_window == 8192 // (2 * 20)  # N / (2P) virtual tokens, P = H = 20


@pytest.mark.parametrize("module, schedule", [(iha_2p4b, "LLLLM"), (global_2p4b, "M"),
                                              (global_local_2p4b, "SSSSM")])
def test_paper_configs_build_at_2p4b_without_allocating(module, schedule):
  config = module.get_config()
  model_cfg = validate(config, 128)
  assert model_cfg.attention_schedule == schedule and model_cfg.num_layers == 26
  # IHA_SPEC 4: width 2560, H = 20, d = 128, MLP 10240, vocabulary 128256, theta 500000.
  assert (model_cfg.model_dim, model_cfg.num_heads, model_cfg.head_dim) == (2560, 20, 128)
  assert (model_cfg.mlp_dim, model_cfg.mlp_type) == (10240, "gelu")
  assert (model_cfg.vocab_size, model_cfg.rope_theta) == (128256, 500000.0)
  abstract = nnx.eval_shape(lambda: TransformerLM(model_cfg, rngs=nnx.Rngs(0)))
  leaves = jax.tree.leaves(nnx.state(abstract, nnx.Param))
  assert all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
  assert 2.35e9 < num_params(model_cfg) < 2.45e9


def test_mha_twin_matches_params_and_flops():
  iha, mha = (validate(m.get_config(), 1) for m in (default, mha_default))
  assert "I" in iha.schedule or "L" in iha.schedule
  assert set(mha.schedule) <= {"M", "S"}
  assert abs(num_params(iha) / num_params(mha) - 1) < 0.01
  seq = default.get_config().data.seq_len
  ratio = flops.train_flops_per_step(iha, 1, seq) / flops.train_flops_per_step(mha, 1, seq)
  assert abs(ratio - 1) < 0.05, ratio


def test_flop_count_by_hand():
  d_model, h, d, f, v, n, p = 16, 2, 8, 32, 10, 6, 3
  common = dict(vocab_size=v, num_layers=1, model_dim=d_model, num_heads=h, head_dim=d,
                mlp_dim=f)
  dense = 2 * 4 * d_model * h * d + 6 * d_model * f + 2 * d_model * v  # per token
  mha = TransformerConfig(**common, attention_schedule="M")
  assert flops.forward_flops_per_sequence(mha, n) == n * dense + h * 4 * d * n * (n + 1) // 2
  iha = TransformerConfig(**common, attention_schedule="I", num_pseudo=p)
  t = n * p
  mixing = 2 * 3 * h * h * p * d + 2 * h * h * p * d
  assert flops.forward_flops_per_sequence(iha, n) == n * (dense + mixing) + h * 4 * d * t * (t + 1) // 2
  window = TransformerConfig(**common, attention_schedule="L", num_pseudo=p, iha_window=4)
  pairs = sum(min(i + 1, 4) for i in range(t))
  assert flops.causal_pairs(t, 4) == pairs
  assert flops.forward_flops_per_sequence(window, n) == n * (dense + mixing) + h * 4 * d * pairs
  assert flops.train_flops_per_step(window, 5, n) == 15 * flops.forward_flops_per_sequence(window, n)


def test_peak_table():
  class Fake:
    device_kind, platform = "TPU v5 lite", "tpu"
  assert flops.peak_tflops_per_device(Fake())[0] == 197.0
  Fake.device_kind = "NVIDIA H100 80GB HBM3"
  assert flops.peak_tflops_per_device(Fake())[0] == 989.0
  Fake.device_kind = "TPU v4"
  assert flops.peak_tflops_per_device(Fake())[0] == 275.0
  assert flops.measured_matmul_tflops(size=128, repeats=2) > 0
