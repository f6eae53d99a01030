"""Config validation, the shipped configs, and the IHA-aware FLOP count."""

from __future__ import annotations

import base64
import re

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from flax import nnx

from configs import (
  default,
  diff_2p4b,
  global_2p4b,
  global_local_2p4b,
  global_local_default,
  iha_2p4b,
  mha_default,
  talking_heads_2p4b,
  tiny,
)
from iha_jax.core.masking import visible
from iha_jax.data import DataError
from iha_jax.models import FunctionalTransformerLM, TransformerConfig, TransformerLM, count_params
from iha_jax.models.layers import make_attention
from iha_jax.nn import MIXING_PARAMS, InterleavedHeadAttention
from iha_jax.nn.config import param_specs
from iha_jax.train import ConfigError, flops, model_config, validate
from iha_jax.train.config import config_differences, resolve_window, upgrade_saved_config
from iha_jax.train.optimizer import decay_mask, learning_rate_schedule, make_optimizer


@pytest.mark.parametrize(
  "overrides, message",
  [
    ({"mesh.fsdp": 1, "mesh.tensor": 3}, "model.num_heads=4 is not divisible by mesh.tensor=3"),
    (
      {"mesh.fsdp": 1, "mesh.tensor": 4, "model.vocab_size": -1},  # the data's 86
      "vocabulary (86, model.vocab_size or the data's) is not divisible by mesh.tensor=4: "
      "set model.vocab_size=88",
    ),
    ({"mesh.fsdp": 16}, "needs 16 devices, only 8"),
    ({"mesh.fsdp": 8, "train.batch_size": 12}, "not divisible by mesh.data * mesh.fsdp = 8"),
    ({"train.grad_accum_steps": 3}, "train.grad_accum_steps=3 does not divide train.batch_size=8"),
    ({"model.remat_policy": "dots"}, "model.remat_policy must be one of"),
    ({"model.dtype": "float64"}, "model.dtype must be one of"),
    ({"model.iha_window": "0"}, "model.iha_window must be a positive integer"),
    ({"model.iha_window": "wide"}, "model.iha_window must be a positive integer"),
    ({"model.attention_schedule": "IZ"}, "unknown letter 'Z'"),
    ({"model.attention_schedule": "S"}, "mha_window must be set"),
    ({"train.warmup_steps": 20}, "train.warmup_steps=20 must be below train.total_steps=20"),
    ({"train.total_steps": 0}, "train.total_steps must be an integer >= 1"),
    ({"checkpoint.keep": 0}, "checkpoint.keep must be an integer >= 1"),
  ],
)
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
  config.model.update(attention_schedule="LM", iha_window="24")  # as config_flags passes it
  assert validate(config, 8).iha_window == 24


@pytest.fixture(scope="module")
def llama3_sized_tokenizer(tmp_path_factory) -> str:
  """A tiktoken BPE file with Llama 3's 128,000 ranks (made up, no download): with its 256
  special tokens the vocabulary the paper configs read from their tokenizer file."""
  tokens = [bytes([b]) for b in range(256)]
  tokens += [bytes([a, b, c]) for a in range(256) for b in range(256) for c in (0, 1)][
    : 128000 - 256
  ]
  path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.model"
  path.write_bytes(b"".join(base64.b64encode(t) + b" %d\n" % i for i, t in enumerate(tokens)))
  return str(path)


def paper_config(module, tokenizer: str) -> ml_collections.ConfigDict:
  """A 2.4B config reading its vocabulary from `tokenizer` (the user's file in real runs)."""
  config = module.get_config()
  assert config.model.vocab_size == -1 and config.data.tokenizer == iha_2p4b.TOKENIZER
  config.data.tokenizer = tokenizer
  return config


def test_paper_configs_name_the_users_tokenizer_file():
  with pytest.raises(
    DataError,
    match=r"data.tokenizer: 'tokenizers/llama3/tokenizer.json' "
    r"is neither 'byte' nor an existing tokenizer file",
  ):
    validate(iha_2p4b.get_config(), 128)


def test_window_auto_is_flop_matched(llama3_sized_tokenizer):
  config = paper_config(iha_2p4b, llama3_sized_tokenizer)
  model = validate(config, 128)
  assert model.iha_window == 8192 // (2 * 20)  # N / (2P) virtual tokens, P = H = 20


# The global MHA baseline by hand: tied embedding [V, D] + final norm [D], per layer
# wq/wk/wv/wo [D, H d], a GELU MLP [D, F] + [F, D] and two norms [D].
GLOBAL_2P4B_PARAMS = 128256 * 2560 + 2560 + 26 * (4 * 2560 * 2560 + 2 * 2560 * 10240 + 2 * 2560)


@pytest.mark.parametrize(
  "module, schedule, extra",
  [
    (iha_2p4b, "LLLLM", 21 * 4 * 20 * 20 * 20),  # 21 'L': alpha_q/k/v, collapse [H, H, P]
    (global_2p4b, "M", 0),
    (global_local_2p4b, "SSSSM", 0),
    (talking_heads_2p4b, "T", 26 * 2 * 20 * 20),  # talk_logits, talk_weights [H, H]
    (diff_2p4b, "D", 26 * (4 * 128 + 256)),  # lambda_q1/k1/q2/k2 [d], norm_scale [2d]
  ],
)
def test_paper_configs_build_at_2p4b_without_allocating(
  module, schedule, extra, llama3_sized_tokenizer
):
  config = paper_config(module, llama3_sized_tokenizer)
  model_cfg = validate(config, 128)
  assert model_cfg.attention_schedule == schedule and model_cfg.num_layers == 26
  # docs/design.md §4: width 2560, H = 20, d = 128, MLP 10240, vocabulary 128256, theta 500000.
  assert (model_cfg.model_dim, model_cfg.num_heads, model_cfg.head_dim) == (2560, 20, 128)
  assert (model_cfg.mlp_dim, model_cfg.mlp_type) == (10240, "gelu")
  assert (model_cfg.vocab_size, model_cfg.rope_theta) == (128256, 500000.0)
  abstract = nnx.eval_shape(lambda: TransformerLM(model_cfg, rngs=nnx.Rngs(0)))
  leaves = jax.tree.leaves(nnx.state(abstract, nnx.Param))
  assert all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
  assert GLOBAL_2P4B_PARAMS == 2_373_194_240  # the paper's 2.4B
  assert sum(x.size for x in leaves) == GLOBAL_2P4B_PARAMS + extra


def test_mha_twin_matches_params_and_flops():
  iha, mha = (validate(m.get_config(), 1) for m in (default, mha_default))
  assert "I" in iha.schedule or "L" in iha.schedule
  assert set(mha.schedule) <= {"M", "S"}
  assert abs(count_params(iha) / count_params(mha) - 1) < 0.01
  seq = default.get_config().data.seq_len
  ratio = flops.train_flops_per_step(iha, 1, seq) / flops.train_flops_per_step(mha, 1, seq)
  assert abs(ratio - 1) < 0.05, ratio


def test_global_local_twin_has_the_iha_window_in_tokens():
  """make train's second model: the same parameters (to 1%), window = IHA's in tokens,
  its own tuned learning rate."""
  iha, local = (validate(m.get_config(), 1) for m in (default, global_local_default))
  assert local.schedule == "SM" and local.mha_window * iha.num_pseudo == iha.iha_window
  assert abs(count_params(iha) / count_params(local) - 1) < 0.01
  config = global_local_default.get_config()
  assert config.train.learning_rate == global_local_default.LEARNING_RATE


def test_flop_count_by_hand():
  d_model, h, d, f, v, n, p = 16, 2, 8, 32, 10, 6, 3
  common = dict(vocab_size=v, num_layers=1, model_dim=d_model, num_heads=h, head_dim=d, mlp_dim=f)
  dense = 2 * 4 * d_model * h * d + 6 * d_model * f + 2 * d_model * v  # per token
  mha = TransformerConfig(**common, attention_schedule="M")
  assert flops.forward_flops_per_sequence(mha, n) == n * dense + h * 4 * d * n * (n + 1) // 2
  iha = TransformerConfig(**common, attention_schedule="I", num_pseudo=p)
  t = n * p
  mixing = 2 * 3 * h * h * p * d + 2 * h * h * p * d
  assert (
    flops.forward_flops_per_sequence(iha, n) == n * (dense + mixing) + h * 4 * d * t * (t + 1) // 2
  )
  window = TransformerConfig(**common, attention_schedule="L", num_pseudo=p, iha_window=4)
  pairs = sum(min(i + 1, 4) for i in range(t))
  assert flops.causal_pairs(t, 4) == pairs
  assert flops.forward_flops_per_sequence(window, n) == n * (dense + mixing) + h * 4 * d * pairs
  assert flops.train_flops_per_step(window, 5, n) == 15 * flops.forward_flops_per_sequence(
    window, n
  )


def test_peak_table():
  class Fake:
    device_kind, platform = "TPU v5 lite", "tpu"

  assert flops.peak_tflops_per_device(Fake())[0] == 197.0
  Fake.device_kind = "NVIDIA H100 80GB HBM3"
  assert flops.peak_tflops_per_device(Fake())[0] == 989.0
  Fake.device_kind = "TPU v4"
  assert flops.peak_tflops_per_device(Fake())[0] == 275.0


def test_measured_matmul_rate_is_flops_over_the_best_time(monkeypatch):
  ticks = iter([0.0, 0.004, 1.0, 1.002, 2.0, 2.003])  # (start, end) per repeat: best 2 ms
  monkeypatch.setattr(flops.time, "perf_counter", lambda: next(ticks))
  assert flops.measured_matmul_tflops(size=128, repeats=3) == pytest.approx(
    2 * 128**3 / 0.002 / 1e12
  )


def _replace(config: ml_collections.ConfigDict, key: str, value) -> None:
  """Sets `key` even to a value of another type (ConfigDict fields are type-safe)."""
  section, name = key.split(".")
  config[section] = ml_collections.ConfigDict({**config[section].to_dict(), name: value})


@pytest.mark.parametrize(
  "key, value, message",
  [
    ("model.causal", "no", "model.causal must be a bool"),
    ("model.num_outputs", 0, "model.num_outputs must be None (vocabulary logits) or an integer"),
    ("model.num_outputs", True, "model.num_outputs must be None"),
    ("model.mixing_noise_std", -0.5, "model.mixing_noise_std must be a number >= 0"),
    ("model.mixing_noise_std", "0.1", "model.mixing_noise_std must be a number >= 0"),
    ("train.decay_mixing", "yes", "train.decay_mixing must be a bool"),
    ("train.decay_mixing", None, "train.decay_mixing must be a bool"),
    ("train.loss", "mse", "train.loss must be one of"),
    ("train.loss", "binary_cross_entropy", "needs model.num_outputs=1"),
    ("train.loss", "mean_squared_error", "needs model.num_outputs (the number of"),
    ("model.input_features", 0, "model.input_features must be None (tokens only)"),
    ("train.loss_chunk_tokens", -1, "train.loss_chunk_tokens must be an integer >= 0"),
  ],
)
def test_new_keys_reject_bad_values(key, value, message):
  config = tiny.get_config()
  _replace(config, key, value)
  with pytest.raises(ConfigError, match=re.escape(message)):
    validate(config, 8)


def test_new_model_keys_reach_the_model_config():
  config = tiny.get_config()
  assert default.get_config().train.decay_mixing is False
  model = validate(config, 8)
  assert (model.causal, model.num_outputs, model.mixing_noise_std) == (True, None, 0.0)
  config.model.update(causal=False, num_outputs=3, mixing_noise_std=0.25)
  model = validate(config, 8)
  assert (model.causal, model.num_outputs, model.mixing_noise_std) == (False, 3, 0.25)
  # A config saved before the keys existed still builds (eval of old checkpoints).
  old = tiny.get_config()
  old.model = ml_collections.ConfigDict(
    {
      k: v
      for k, v in old.model.to_dict().items()
      if k not in ("causal", "num_outputs", "mixing_noise_std")
    }
  )
  assert model_config(old).causal is True
  # ... and resumes when the config keeps the keys' defaults (checkpoint.check_compatible).
  saved, current = old.model.to_dict(), config.model.to_dict()
  assert config_differences(saved, tiny.get_config().model.to_dict(), "model.") == []
  assert config_differences(saved, current, "model.") == [
    "model.causal: True (checkpoint) vs False (config)",
    "model.mixing_noise_std: 0.0 (checkpoint) vs 0.25 (config)",
    "model.num_outputs: None (checkpoint) vs 3 (config)",
  ]


def test_mixing_noise_reaches_the_init():
  config = tiny.get_config()  # "IM": IHA then MHA, P = 2
  config.model.mixing_noise_std = 0.1
  # The model's own attention constructor (a whole eager model init takes seconds).
  attn = make_attention(model_config(config), "I", rngs=nnx.Rngs(0))
  alpha, collapse = np.asarray(attn.alpha_q[...]), np.asarray(attn.collapse[...])
  eye = np.broadcast_to(np.eye(alpha.shape[0])[:, :, None], alpha.shape)
  noise = np.concatenate([(alpha - eye).ravel(), (collapse - eye / 2).ravel()])
  assert np.all(noise != 0) and 0.05 < noise.std() < 0.2  # N(0, 0.1^2) on the identity


def test_visible_counts_match_the_mask():
  """The pair/triple counts are the mask's (iha_jax.core.masking.visible), and by hand."""
  for length, window, causal in [
    (7, None, True),
    (7, 3, True),
    (7, None, False),
    (7, 3, False),
    (5, 9, False),
    (1, 1, False),
  ]:
    t = np.arange(length)
    mask = np.asarray(visible(t[:, None], t[None, :], None, None, window, causal))
    keys = mask.sum(1)
    assert flops.visible_pairs(length, window, causal) == keys.sum()
    assert flops.visible_triples(length, window, causal) == (keys**2).sum()
  assert [flops.visible_keys(5, 2, c).tolist() for c in (True, False)] == [
    [1, 2, 2, 2, 2],
    [2, 3, 3, 3, 2],
  ]
  assert flops.visible_pairs(5, None, False) == 25 and flops.visible_triples(5, None) == 55
  assert flops.causal_pairs(18, 4) == sum(min(i + 1, 4) for i in range(18))


def _tiny(schedule: str, **kwargs) -> TransformerConfig:
  kwargs.setdefault("num_layers", len(schedule))
  return TransformerConfig(
    vocab_size=10,
    model_dim=16,
    num_heads=2,
    head_dim=8,
    mlp_dim=32,
    num_pseudo=3,
    attention_schedule=schedule,
    **kwargs,
  )


# D = 16, H = 2, d = 8, P = 3, N = 6 (T = 18 virtual tokens), per layer by hand:
# (params, projection FLOPs/token, mixing FLOPs/token, core FLOPs/sequence).
_MHA_PARAMS, _MHA_PROJ = 4 * 16 * 2 * 8, 2 * 4 * 16 * 2 * 8
_IHA_MIX = 2 * 3 * 2 * 2 * 3 * 8 + 2 * 2 * 2 * 3 * 8  # mixing + full collapse
_BY_HAND = {
  # Causal N = 6: 21 pairs, sum k^2 = 91 triples; T = 18: 171 pairs.
  ("M", True): (_MHA_PARAMS, _MHA_PROJ, 0, 2 * 4 * 8 * 21),
  ("T", True): (_MHA_PARAMS + 2 * 4, _MHA_PROJ, 0, 2 * 4 * 8 * 21 + 21 * 4 * 2 * 2),
  # One diff head: wq, wk [16, 1, 2, 8], wv [16, 1, 16], wo [1, 16, 16]; 12 d per pair.
  ("D", True): (_MHA_PARAMS + 4 * 8 + 16, _MHA_PROJ, 0, 1 * 12 * 8 * 21),
  ("X", True): (6 * 16 * 2 * 8, 2 * 6 * 16 * 2 * 8, 0, 2 * (4 * 8 * 91 + 3 * 8 * 21)),
  ("I", True): (_MHA_PARAMS + 4 * 2 * 2 * 3, _MHA_PROJ, _IHA_MIX, 2 * 4 * 8 * 171),
  # Causal window 4 over T = 18: 10 + 14 * 4 = 66 pairs.
  ("L", True): (_MHA_PARAMS + 4 * 2 * 2 * 3, _MHA_PROJ, _IHA_MIX, 2 * 4 * 8 * 66),
  # Bidirectional: global N = 6: 36 pairs, 216 triples; window 4 over T = 18:
  # 4+5+6 + 12*7 + 6+5+4 = 114 pairs; window 3 over N = 6: 3+4+5+5+4+3 = 24 pairs.
  ("M", False): (_MHA_PARAMS, _MHA_PROJ, 0, 2 * 4 * 8 * 36),
  ("X", False): (6 * 16 * 2 * 8, 2 * 6 * 16 * 2 * 8, 0, 2 * (4 * 8 * 216 + 3 * 8 * 36)),
  ("L", False): (_MHA_PARAMS + 4 * 2 * 2 * 3, _MHA_PROJ, _IHA_MIX, 2 * 4 * 8 * 114),
  ("S", False): (_MHA_PARAMS, _MHA_PROJ, 0, 2 * 4 * 8 * 24),
}


@pytest.mark.parametrize("letter, causal", list(_BY_HAND))
def test_layer_budget_by_hand(letter, causal):
  config = _tiny(letter, causal=causal, iha_window=4, mha_window=3)
  (budget,) = flops.layer_budgets(config, 6)
  params, projection, mixing, core = _BY_HAND[letter, causal]
  assert (budget.params, budget.projection_flops, budget.mixing_flops, budget.core_flops) == (
    params,
    projection,
    mixing,
    core,
  )
  assert budget.attention_flops_per_token == core / 6 + mixing
  mlp = 3 * 2 * 16 * 32  # SwiGLU
  assert budget.block_params == params + mlp // 2 + 2 * 16
  head = 2 * 16 * 10
  per_token = projection + mixing + mlp + head
  assert flops.forward_flops_per_sequence(config, 6) == 6 * per_token + core
  assert budget.block_params + 10 * 16 + 16 == count_params(config)  # + embedding, final norm


def test_attention_only_blocks_count_no_mlp():
  """`mlp_type="none"`: blocks without MLP and its norm, in the budget and the model."""
  config = _tiny("I", mlp_type="none", num_outputs=3, causal=False)
  (budget,) = flops.layer_budgets(config, 6)
  assert budget.mlp_flops == 0 and budget.block_params == budget.params + 16
  assert budget.block_params + 10 * 16 + 16 + 16 * 3 == count_params(config)
  model = TransformerLM(config, rngs=nnx.Rngs(0))
  assert not hasattr(model.layers[0], "mlp") and not hasattr(model.layers[0], "mlp_norm")
  tokens = jnp.arange(1, 7, dtype=jnp.int32)[None]
  assert model(tokens).shape == (1, 6, 3)


def test_per_head_collapse_and_output_head_flops():
  config = _tiny("I", collapse_mode="per_head", num_outputs=3)
  (budget,) = flops.layer_budgets(config, 6)
  assert budget.mixing_flops == 2 * 3 * 2 * 2 * 3 * 8 + 2 * 2 * 3 * 8
  assert budget.params == _MHA_PARAMS + 3 * 2 * 2 * 3 + 2 * 3
  assert flops.output_head_flops_per_token(config) == 2 * 16 * 3


def test_budget_table_rows_and_totals():
  config = _tiny("ILMSTDX", iha_window=4, mha_window=3, causal=False)
  budgets = flops.layer_budgets(config, 6)
  assert [b.letter for b in budgets] == list("ILMSTDX")
  assert sum(b.params for b in budgets) + 7 * (3 * 16 * 32 + 2 * 16) + 10 * 16 + 16 == (
    count_params(config)
  )
  table = flops.budget_table(config, 6, batch_size=4)
  lines = table.splitlines()
  for letter, kind in zip(
    "ILMSTDX", ("iha", "iha", "mha", "mha", "talking_heads", "diff", "simplicial")
  ):
    assert any(line.split()[:2] == [letter, kind] for line in lines), table
  assert "4 virtual" in table and "3 tokens" in table and "bidir" in table
  assert f"parameters: {count_params(config):,}" in table
  assert "train FLOPs per step (batch 4)" in table


def test_paper_diff_baseline_matches_mha_projections(llama3_sized_tokenizer):
  """Counts of all five 2.4B configs: test_paper_configs_build_at_2p4b_without_allocating."""
  diff = validate(paper_config(diff_2p4b, llama3_sized_tokenizer), 128)
  global_cfg = validate(paper_config(global_2p4b, llama3_sized_tokenizer), 128)
  assert diff.iha_window is None and diff.attention_config("D").num_heads == 10
  specs = param_specs(diff.attention_config("D"))
  assert specs["wq"].shape == (2560, 10, 2, 128) and specs["wv"].shape == (2560, 10, 256)
  assert specs["wo"].shape == (10, 256, 2560)
  mha = param_specs(global_cfg.attention_config("M"))
  weights = lambda specs: sum(np.prod(s.shape) for k, s in specs.items() if k.startswith("w"))
  assert weights(specs) == weights(mha) == 4 * 2560 * 2560


def _mask_leaves(params, decay_mixing: bool) -> dict[str, bool]:
  mask = decay_mask(params, decay_mixing=decay_mixing)
  return {
    "/".join(str(k.key) for k in path): leaf
    for path, leaf in jax.tree_util.tree_leaves_with_path(mask)
  }


def test_decay_mask_mixing_switch_and_scanned_shapes():
  # "ITD" x 1 scanned period + a tail "I" layer: mixing params both stacked and not.
  config = _tiny("ITD", num_layers=4)
  params = jax.eval_shape(FunctionalTransformerLM(config, scan_layers=True).init, 0)
  shapes = {
    "/".join(str(k.key) for k in path): x.shape
    for path, x in jax.tree_util.tree_leaves_with_path(params)
  }
  assert shapes["scanned/1/attn/talk_logits"] == (1, 2, 2)  # 3-D once stacked
  assert shapes["layers/3/attn/alpha_q"] == (2, 2, 3)
  off, on = _mask_leaves(params, False), _mask_leaves(params, True)
  for path, shape in shapes.items():
    name = path.split("/")[-1]
    per_layer_ndim = len(shape) - path.startswith("scanned/")
    if per_layer_ndim <= 1:  # norm scales, lambdas, diff norm: never decayed
      assert not off[path] and not on[path], path
    elif name in MIXING_PARAMS:
      assert not off[path] and on[path], path
    else:
      assert off[path] and on[path], path
  mixing = [p for p in shapes if p.split("/")[-1] in MIXING_PARAMS]
  assert {p.split("/")[-1] for p in mixing} == set(MIXING_PARAMS)
  assert not off["scanned/0/attn_norm/scale"] and not off["scanned/2/attn/lambda_q1"]
  assert off["embedding"] and off["scanned/2/attn/wq"] and off["layers/3/attn/wo"]


def test_decay_mask_spares_the_projection_biases():
  """A layer's biases (`use_bias`: `bq, bk, bv: [heads, d]`, 2-D, and `bo: [out]`) are
  never decayed, its weights are."""
  layer = InterleavedHeadAttention(
    num_heads=2, in_features=8, num_pseudo=2, use_bias=True, rngs=nnx.Rngs(0)
  )
  mask = decay_mask({"attn": layer.param_values()}, decay_mixing=True)["attn"]
  assert {name for name, decayed in mask.items() if not decayed} == {"bq", "bk", "bv", "bo"}


@pytest.mark.parametrize("decay_mixing", [False, True])
def test_optimizer_decays_by_the_mask(decay_mixing):
  train = tiny.get_config().train
  train.update(warmup_steps=0, weight_decay=0.5, decay_mixing=decay_mixing)
  params = {
    "scanned": {
      "0": {
        "attn": {"collapse": jnp.ones((2, 3, 3, 2)), "wq": jnp.ones((2, 4, 3, 2))},
        "mlp_norm": {"scale": jnp.ones((2, 4))},
      }
    },
    "layers": {"1": {"attn": {"talk_weights": jnp.ones((3, 3))}}},
  }
  tx = make_optimizer(train)
  # Zero gradients: only the decay moves a parameter. Jitted: one compile, not one per op.
  updates, _ = jax.jit(lambda p: tx.update(jax.tree.map(jnp.zeros_like, p), tx.init(p), p))(params)
  moved = {
    "/".join(str(k.key) for k in path): bool(jnp.any(u != 0))
    for path, u in jax.tree_util.tree_leaves_with_path(updates)
  }
  assert moved == {
    "scanned/0/attn/collapse": decay_mixing,
    "scanned/0/attn/wq": True,
    "scanned/0/mlp_norm/scale": False,
    "layers/1/attn/talk_weights": decay_mixing,
  }


def test_optimizer_clips_the_gradient_before_adamw():
  """Three steps of `make_optimizer` against AdamW written out in float64: the gradient
  clipped to `grad_clip` by its global norm first, then the moments with their bias
  correction, the decoupled decay of the matrix (not of the vector) and the schedule's
  rate. Gradients of global norms 30, 0.2 and 5 against a clip of 1: the clip changes
  how the moments mix the steps, so clipping AdamW's update instead shows."""
  train = tiny.get_config().train
  train.update(warmup_steps=0, total_steps=10, weight_decay=0.5, grad_clip=1.0, decay_mixing=False)
  rng = np.random.default_rng(0)
  params = {"w": rng.normal(size=(3, 4)), "scale": 1 + rng.normal(size=(4,))}
  grads = []
  for norm in (30.0, 0.2, 5.0):
    g = {k: rng.normal(size=v.shape) for k, v in params.items()}
    total = np.sqrt(sum(np.sum(x**2) for x in g.values()))
    grads.append({k: x * norm / total for k, x in g.items()})
  rate = learning_rate_schedule(train)
  want = dict(params)
  m = {k: np.zeros_like(v) for k, v in params.items()}
  v = {k: np.zeros_like(x) for k, x in params.items()}
  for t, g in enumerate(grads, start=1):
    norm = np.sqrt(sum(np.sum(x**2) for x in g.values()))
    g = {k: x * min(1.0, train.grad_clip / norm) for k, x in g.items()}
    for k in params:
      m[k] = train.b1 * m[k] + (1 - train.b1) * g[k]
      v[k] = train.b2 * v[k] + (1 - train.b2) * g[k] ** 2
      step = (m[k] / (1 - train.b1**t)) / (np.sqrt(v[k] / (1 - train.b2**t)) + train.eps)
      decay = train.weight_decay * want[k] if want[k].ndim > 1 else 0.0
      want[k] = want[k] - float(rate(t - 1)) * (step + decay)
  tx = make_optimizer(train)
  got = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)
  state = tx.init(got)
  update = jax.jit(tx.update)
  for g in grads:
    updates, state = update(jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), g), state, got)
    got = optax.apply_updates(got, updates)
  for k in params:
    np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)


def test_saved_configs_with_the_old_window_key_are_upgraded():
  """Runs saved before `model.window` was renamed `model.iha_window` restore, resume and
  evaluate with today's key (and nothing else changes)."""
  old = {"model": {"window": "auto", "num_heads": 4}, "train": {"seed": 1}}
  assert upgrade_saved_config(old) == {
    "model": {"iha_window": "auto", "num_heads": 4},
    "train": {"seed": 1},
  }
  assert old["model"] == {"window": "auto", "num_heads": 4}  # the input is not modified
  today = {"model": {"iha_window": 64}}
  assert upgrade_saved_config(today) is today


def test_auto_window_takes_phas_default_p_without_iha_layers():
  """'auto' is `seq_len / (2 P)`: P = H (None) with IHA layers, PHA's 2 without them."""
  for schedule, p in (("RM", 2), ("LRM", 4)):
    model = dict(attention_schedule=schedule, iha_window="auto", num_pseudo=None, num_heads=4)
    config = ml_collections.ConfigDict(dict(model=model, data=dict(seq_len=64)))
    assert resolve_window(config) == 64 // (2 * p), schedule
