"""KV-cache decoding of `TransformerLM`: cached logits equal the full forward's, sampling."""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from iha_jax.kinds import registry
from iha_jax.models import TransformerConfig, TransformerLM
from iha_jax.models import generate as generate_module
from iha_jax.models.generate import decode_step, generate, prefill
from iha_jax.models.kv_cache import ring_slots
from iha_jax.nn import AttentionConfig

B, N, V, D, H, HEAD_DIM, F, P = 2, 14, 37, 32, 2, 8, 48, 2
IHA_WINDOW, MHA_WINDOW = 5, 3  # Ring buffers of 3 tokens each: N wraps them several times.


@functools.cache
def _model(schedule: str, **kw) -> TransformerLM:
  base = dict(
    vocab_size=V,
    num_layers=len(schedule),
    model_dim=D,
    num_heads=H,
    head_dim=HEAD_DIM,
    mlp_dim=F,
    num_pseudo=P,
    attention_schedule=schedule,
    iha_window=IHA_WINDOW,
    mha_window=MHA_WINDOW,
    implementation="reference",
  )
  config = TransformerConfig(**{**base, **kw})
  return TransformerLM(config, rngs=nnx.Rngs(len(schedule)))


def _tokens(seed: int, length: int = N) -> jax.Array:
  return jax.random.randint(jax.random.key(seed), (B, length), 0, V, jnp.int32)


def _assert_logits_close(actual, expected, what: str) -> None:
  np.testing.assert_allclose(
    np.asarray(actual), np.asarray(expected), rtol=1e-5, atol=1e-5, err_msg=what
  )


def _teacher_forced(
  model: TransformerLM, tokens: jax.Array, prefix: int, cache_mode: str
) -> jax.Array:
  """Prefill `prefix` tokens, then feed the rest one at a time: logits `[B, N, V]`."""
  logits, cache = prefill(model, tokens[:, :prefix], max_len=tokens.shape[1], cache_mode=cache_mode)
  steps = [logits]
  for n in range(prefix, tokens.shape[1]):
    step_logits, cache = decode_step(model, tokens[:, n], cache)
    steps.append(step_logits[:, None])
  np.testing.assert_array_equal(np.asarray(cache.length), tokens.shape[1])
  return jnp.concatenate(steps, axis=1)


# `make test`: L alone and the mixed schedules; the other single letters in test-all.
FULL = pytest.mark.full
CASES = [
  pytest.param("I", {}, id="I", marks=FULL),
  pytest.param("L", {}, id="L"),
  pytest.param("M", {}, id="M", marks=FULL),
  pytest.param("S", {}, id="S", marks=FULL),
  pytest.param("LMSI", dict(implementation="xla"), id="LMSI"),
  # P=3 with H=2, per-head collapse, no RoPE, untied head, a window of 4 virtual tokens.
  pytest.param(
    "LI",
    dict(
      num_pseudo=3, collapse_mode="per_head", rope_theta=None, tie_embeddings=False, iha_window=4
    ),
    id="LI",
  ),
]


@pytest.mark.parametrize("cache_mode", ["source", "pseudo"])
@pytest.mark.parametrize("schedule,kw", CASES)
def test_cached_logits_equal_full_forward(schedule, kw, cache_mode):
  model = _model(schedule, **kw)
  tokens = _tokens(1)
  expected = model(tokens)
  _assert_logits_close(
    _teacher_forced(model, tokens, 4, cache_mode), expected, f"{schedule} {cache_mode}, prefill 4"
  )


@pytest.mark.parametrize(
  "implementation,cache_mode",
  [
    ("pallas_tpu", "source"),
    pytest.param("pallas_tpu", "pseudo", marks=FULL),
    pytest.param("pallas_gpu", "source", marks=FULL),
    pytest.param("pallas_gpu", "pseudo", marks=FULL),
  ],
)
def test_cached_calls_run_the_named_kernels_and_equal_the_full_forward(
  implementation, cache_mode, monkeypatch
):
  """A cached call is the layer's entry point with its queries at an offset into the
  cache's keys: with a kernel implementation named, prefill and every decoding step run
  that kernel (here in Pallas' interpreter, which warns), and the logits equal the
  reference model's full forward."""
  kw = dict(num_pseudo=3, collapse_mode="per_head", iha_window=4, tie_embeddings=False)
  tokens = _tokens(3, 8)
  expected = _model("LI", **kw)(tokens)  # the reference implementation, same parameters
  monkeypatch.setattr(registry, "_WARNED", set())  # the warning comes once per process
  with pytest.warns(UserWarning, match=f"{implementation!r} runs in Pallas' interpreter"):
    got = _teacher_forced(
      _model("LI", **{**kw, "implementation": implementation}), tokens, 5, cache_mode
    )
  np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-4, atol=1e-4)


@pytest.mark.full
def test_prefill_longer_than_window_then_decode():
  # The prompt alone overflows every ring buffer (3 tokens), and the last steps wrap again.
  model = _model("LLSM")
  tokens = _tokens(2)
  expected = model(tokens)
  for cache_mode in ("source", "pseudo"):
    _assert_logits_close(
      _teacher_forced(model, tokens, 9, cache_mode), expected, f"{cache_mode}, prefill 9"
    )


def test_cache_layouts_and_sizes():
  model = _model("LMSI")
  tokens = _tokens(3, 6)
  _, source = prefill(model, tokens, max_len=10, cache_mode="source")
  _, pseudo = prefill(model, tokens, max_len=10, cache_mode="pseudo")
  # Ring slots in tokens: L ceil((5-1)/2)+1 = 3, M 10, S 3, I 10.
  # Head-major ([B, H, slots, d]): the XLA attention core's layout.
  assert [c.k.shape for c in source.layers] == [(B, H, s, HEAD_DIM) for s in (3, 10, 3, 10)]
  assert [c.k.shape for c in pseudo.layers] == [(B, H, s, HEAD_DIM) for s in (6, 10, 3, 20)]
  source_iha = sum(source.layers[i].k.nbytes * 2 for i in (0, 3))
  pseudo_iha = sum(pseudo.layers[i].k.nbytes * 2 for i in (0, 3))
  assert pseudo_iha == P * source_iha
  assert pseudo.nbytes - pseudo_iha == source.nbytes - source_iha  # MHA layers: same cache.


@pytest.mark.parametrize(
  "window,kind,num_pseudo,expected",
  [
    (5, "iha", 2, 3),
    (4, "iha", 2, 3),
    (3, "iha", 2, 2),
    (2, "iha", 2, 2),
    (1, "iha", 2, 1),
    (7, "iha", 3, 3),
    (3, "mha", None, 3),
    (None, "iha", 2, 40),
    (500, "iha", 2, 40),
  ],
)
def test_ring_slots(window, kind, num_pseudo, expected):
  cfg = AttentionConfig(8, 2, 4, kind=kind, num_pseudo=num_pseudo, window=window)
  assert ring_slots(cfg, 40) == expected


def test_the_ring_slots_old_name_still_works_and_warns(monkeypatch):
  from iha_jax import checks
  from iha_jax.models import kv_cache
  from iha_jax.nn import cache

  monkeypatch.setattr(checks, "_DEPRECATIONS_WARNED", set())
  for module in (kv_cache, cache):
    with pytest.deprecated_call(match="window_tokens is deprecated; use ring_slots"):
      assert module.window_tokens is ring_slots


@pytest.mark.parametrize("cache_mode", ["source", pytest.param("pseudo", marks=FULL)])
def test_greedy_generation_is_argmax_of_full_forward(cache_mode):
  model = _model("LMSI")
  prompt = _tokens(4, 3)
  out = generate(model, prompt, max_new_tokens=9, cache_mode=cache_mode)
  assert out.shape == (B, 12)
  np.testing.assert_array_equal(np.asarray(out[:, :3]), np.asarray(prompt))
  expected = jnp.argmax(model(out), axis=-1)[:, 2:-1]
  np.testing.assert_array_equal(np.asarray(out[:, 3:]), np.asarray(expected))


@pytest.mark.full
def test_sampling_is_deterministic_per_key_and_respects_top_k():
  model = _model("LM")
  prompt = _tokens(5, 3)
  sample = functools.partial(generate, model, prompt, max_new_tokens=10, temperature=1.0)
  first = sample(rng=jax.random.key(7))
  np.testing.assert_array_equal(np.asarray(first), np.asarray(sample(rng=jax.random.key(7))))
  assert not np.array_equal(np.asarray(first), np.asarray(sample(rng=jax.random.key(8))))
  # Every top-k draw is among the k most likely tokens of the full forward at its position.
  top3 = np.asarray(sample(rng=jax.random.key(9), top_k=3, temperature=2.0))
  ranks = np.argsort(-np.asarray(model(jnp.asarray(top3))), axis=-1)[:, 2:-1, :3]
  assert all(top3[b, n + 3] in ranks[b, n] for b in range(B) for n in range(10))
  greedy = generate(model, prompt, max_new_tokens=10)
  top1 = sample(rng=jax.random.key(10), top_k=1)
  np.testing.assert_array_equal(np.asarray(top1), np.asarray(greedy))


@pytest.mark.parametrize(
  "kwargs,match",
  [
    (dict(cache_mode="rotated"), "cache_mode"),
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(max_len=3), "prompt_tokens.*longer than the cache"),
    (dict(max_len=6), "max_new_tokens=4 .*exceeds the cache"),
    (dict(temperature=0.5), "rng"),
    (dict(top_k=V + 1), "top_k"),
    (dict(temperature=-1.0), "temperature"),
  ],
)
def test_generate_rejects_bad_arguments(kwargs, match):
  args = {**dict(max_new_tokens=4), **kwargs}
  with pytest.raises(ValueError, match=match):
    generate(_model("M"), _tokens(0, 4), **args)


def test_prefill_rejects_bad_arguments():
  model = _model("M")
  with pytest.raises(ValueError, match="cache_mode"):
    prefill(model, _tokens(0, 4), max_len=8, cache_mode="full")
  with pytest.raises(ValueError, match="tokens has 4 tokens.*longer than the cache"):
    prefill(model, _tokens(0, 4), max_len=3)
  with pytest.raises(ValueError, match="tokens must be an integer array"):
    prefill(model, jnp.zeros((B, 4)), max_len=8)
  _, cache = prefill(model, _tokens(0, 4), max_len=8)
  with pytest.raises(ValueError, match=r"token must be an integer array \[B=2\]"):
    decode_step(model, _tokens(0, 1), cache)


@pytest.mark.parametrize(
  "change,match",
  [
    (dict(causal=False), "needs a causal model"),
    (dict(num_outputs=3), "per-token head"),
    (dict(attention_schedule="LT"), r"supports schedule letters 'ILMSPR'.*\['T'\]"),
  ],
)
def test_decoding_refuses_encoders_and_uncached_kinds(change, match):
  """Encoders (every position sees later tokens), per-token heads and the baselines
  without a cache are refused up front with a message naming the reason."""
  model = _model(change.pop("attention_schedule", "LM"), **change)
  with pytest.raises(ValueError, match=match):
    generate(model, _tokens(0, 4), max_new_tokens=2)
  with pytest.raises(ValueError, match=match):
    prefill(model, _tokens(0, 4), max_len=8)


def _layer(window=None, num_pseudo=P, heads=H):
  from iha_jax.nn import InterleavedHeadAttention

  return InterleavedHeadAttention(
    D, num_heads=heads, head_dim=HEAD_DIM, num_pseudo=num_pseudo, window=window,
    implementation="reference", rngs=nnx.Rngs(0),
  )  # fmt: skip


def test_a_cache_refuses_another_layer_in_one_line():
  """A cache carries what it was made for: handed to a layer of another shape or window
  (same array shapes: a window layer's ring of the same size) it is refused, naming the
  fields that differ, before anything runs."""
  x = jax.random.normal(jax.random.key(0), (B, 1, D))
  window_cache = _layer(window=2 * P).init_cache(B, 3)  # ring of 2 tokens
  global_layer = _layer()
  with pytest.raises(ValueError) as error:
    global_layer(x, cache=window_cache)
  message = str(error.value)
  assert "\n" not in message and "window 4 (this layer: None)" in message, message
  with pytest.raises(ValueError, match=r"num_pseudo 2 \(this layer: 1\)"):
    _layer(num_pseudo=1)(x, cache=global_layer.init_cache(B, 3))


def test_a_cache_never_wraps_silently():
  """Tokens past `max_len` would wrap a global layer's ring: with a concrete length an
  error before anything runs; under jit NaN from the first token past it on (earlier
  tokens unchanged), which `checkify`'s float checks turn into an error, its user checks
  into one naming max_len."""
  from jax.experimental import checkify

  layer = _layer()
  x = jax.random.normal(jax.random.key(1), (B, 5, D))
  cache = layer.init_cache(B, 4)
  with pytest.raises(
    ValueError, match=r"5 more tokens after the 0 that row 0 of this cache holds exceed its max_len"
  ):
    layer(x, cache=cache)
  y, cache = layer(x[:, :3], cache=cache)

  @jax.jit
  def step(x, cache):
    return layer(x, cache=cache)

  y, _ = step(x[:, 3:5], cache)  # tokens 3 (fits) and 4 (past max_len)
  assert bool(jnp.all(jnp.isfinite(y[:, 0]))) and bool(jnp.all(jnp.isnan(y[:, 1])))
  error, _ = checkify.checkify(step, errors=checkify.float_checks)(x[:, 3:5], cache)
  assert "nan" in str(error.get()).lower()
  errors = checkify.user_checks | checkify.float_checks  # user checks name the cause
  error, _ = checkify.checkify(step, errors=errors)(x[:, 3:5], cache)
  assert "past its cache's max_len=4" in str(error.get())
  # A window layer's ring holds its window's whole reach: it decodes past max_len.
  window_layer = _layer(window=2 * P)
  wcache = window_layer.init_cache(B, 4)
  wy, wcache = window_layer(x, cache=wcache)
  assert bool(jnp.all(jnp.isfinite(wy)))


def test_decode_steps_trace_once(monkeypatch):
  """Every decode step after the first reuses the first one's program: the cache it returns
  matches the one it took (lengths traced, not Python ints)."""
  model = _model("LM")
  counted = chex.assert_max_traces(generate_module._decode_step, n=1)
  monkeypatch.setattr(generate_module, "_decode_step", counted)
  generate_module._decode_step_jit.clear_cache()
  tokens = _tokens(5)
  _, cache = prefill(model, tokens[:, :3], max_len=N)
  for n in range(3, 8):
    _, cache = decode_step(model, tokens[:, n], cache)
  np.testing.assert_array_equal(np.asarray(cache.length), 8)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("side", ["left", "right"])
def test_a_ragged_batch_generates_what_each_row_generates_alone(side, temperature):
  """Prompts of 5, 2 and 7 tokens padded to 7 (either side) generate together exactly
  the tokens each generates alone, greedy and sampled with the row's own key."""
  model = _model("LI", implementation="xla")
  lengths, width, new = (5, 2, 7), 7, 4
  prompts = [_tokens(10 + b, n)[0] for b, n in enumerate(lengths)]
  pad = lambda p: jnp.full((width - p.shape[0],), V - 1, jnp.int32)  # any token: unseen
  rows = [jnp.concatenate((pad(p), p) if side == "left" else (p, pad(p))) for p in prompts]
  columns = np.arange(width)
  mask = np.stack(
    [columns >= width - n if side == "left" else columns < n for n in lengths]
  )  # fmt: skip
  keys = jax.random.split(jax.random.key(7), len(lengths))
  sampling = dict(temperature=temperature, rng=keys)
  together = generate(
    model, jnp.stack(rows), max_new_tokens=new, prompt_mask=jnp.asarray(mask), **sampling
  )
  np.testing.assert_array_equal(np.asarray(together[:, :width]), np.stack(rows))
  for b, prompt in enumerate(prompts):
    alone = generate(
      model, prompt[None], max_new_tokens=new, temperature=temperature, rng=keys[b : b + 1]
    )
    np.testing.assert_array_equal(
      np.asarray(together[b, width:]), np.asarray(alone[0, lengths[b] :]), err_msg=f"row {b}"
    )
