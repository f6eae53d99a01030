"""Bad input to the functional API raises ValueError naming the argument, before tracing."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from iha_jax import ops
from tests.utils import random_iha_inputs

B, N, H, D, P = 2, 5, 2, 8, 3


def _args():
  return list(random_iha_inputs(jax.random.PRNGKey(0), B, N, H, D, P))


def _replace(index, value):
  args = _args()
  args[index] = value
  return args


BAD_ARGS = {
  "q_rank": (_replace(0, jnp.ones((B, N, H * D))), {}, r"q must have rank 4"),
  "k_shape": (_replace(1, jnp.ones((B, N + 1, H, D))), {}, r"q, k and v must have the same"),
  "v_dtype_int": (_replace(2, jnp.ones((B, N, H, D), jnp.int32)), {}, r"v must be a floating"),
  "alpha_heads": (_replace(3, jnp.ones((H + 1, H + 1, P))), {}, r"alpha_q must have shape"),
  "alpha_k_pseudo": (_replace(4, jnp.ones((H, H, P + 1))), {}, r"alpha_k has P = 4"),
  "num_pseudo_zero": (
    [*_args()[:3], *(jnp.ones((H, H, 0)),) * 3, jnp.ones((H, H, 0))],
    {},
    r"num_pseudo P\) must be >= 1",
  ),
  "collapse_shape": (_replace(6, jnp.ones((H, P, H))), {}, r"collapse must have shape"),
  "window_zero": (_args(), {"window": 0}, r"window must be None .* >= 1"),
  "window_float": (_args(), {"window": 2.5}, r"window must be None"),
  "segment_shape": (
    _args(),
    {"segment_ids": jnp.ones((B, N + 2), jnp.int32)},
    r"segment_ids must have shape \[B, N\]",
  ),
  "positions_float": (_args(), {"positions": jnp.ones((B, N))}, r"positions must be an integer"),
  "rope_theta": (_args(), {"rope_theta": -1.0}, r"rope_theta must be > 0"),
  "implementation": (_args(), {"implementation": "cuda"}, r"implementation must be one of"),
}


@pytest.mark.parametrize("case", sorted(BAD_ARGS))
def test_iha_attention_rejects(case):
  args, kwargs, message = BAD_ARGS[case]
  with pytest.raises(ValueError, match=message):
    ops.iha_attention(*args, **kwargs)


def test_odd_head_dim_needs_rope_off():
  q = jnp.ones((B, N, H, 5))
  with pytest.raises(ValueError, match=r"RoPE needs an even head_dim"):
    ops.mha_attention(q, q, q)
  assert ops.mha_attention(q, q, q, rope_theta=None, implementation="reference").shape == q.shape


@pytest.mark.parametrize(
  "kwargs, message",
  [
    ({"window": -3}, r"window"),
    ({"implementation": "flash"}, r"implementation"),
    ({"positions": jnp.zeros((N,), jnp.int32)}, r"positions"),
  ],
)
def test_mha_attention_rejects(kwargs, message):
  q, k, v, *_ = _args()
  with pytest.raises(ValueError, match=message):
    ops.mha_attention(q, k, v, **kwargs)


@pytest.mark.parametrize(
  "shape, options, limit",
  [
    ((B, N, H, 8), {}, "sliding windows only"),
    ((B, N, H, 256), {"window": 4, "rope_theta": None}, "head_dim 256"),
  ],
)
def test_onchip_window_path_refuses_what_it_cannot_take_in_one_line(shape, options, limit):
  """Named explicitly, the on-chip window path refuses a call it cannot take (a global
  layer, rows wider than 128 lanes) in one line naming the limit and the implementation
  that takes the call, while tracing (no compile); "auto" takes another path there."""
  b, n, h, d = shape
  q = jnp.ones(shape, jnp.float32)
  alphas = [jnp.ones((h, h, 2))] * 4
  impl = "pallas_tpu_window"
  call = jax.jit(lambda q: ops.iha_attention(q, q, q, *alphas, **options, implementation=impl))
  with pytest.raises(ValueError) as error:
    call.trace(q)
  message = str(error.value)
  assert "\n" not in message and limit in message and "'pallas_tpu'" in message, message


def test_errors_raise_before_tracing():
  """Validation is plain Python on shapes: it fires under jit before any compile."""
  args = _args()
  fn = jax.jit(lambda *a: ops.iha_attention(*a, window=0))
  with pytest.raises(ValueError, match="window"):
    fn(*args)


def test_options_object_and_keywords_are_one_call():
  """`AttentionOptions` and the keywords are the same options: keywords override the
  object, the object is a pytree (its arrays are jit arguments), unknown names fail."""
  args = _args()
  seg = jnp.array([[1, 1, 1, 2, 2], [1, 1, 1, 1, 0]], jnp.int32)
  options = ops.AttentionOptions(window=4, segment_ids=seg, implementation="reference")
  want = ops.iha_attention(*args, window=4, segment_ids=seg, implementation="reference")
  assert float(jnp.abs(want).max()) > 0
  assert jnp.array_equal(ops.iha_attention(*args, options), want)
  jitted = jax.jit(lambda o, *a: ops.iha_attention(*a, o))(options, *args)
  assert jnp.allclose(jitted, want, atol=1e-6)
  bidirectional = ops.iha_attention(*args, options, causal=False)
  assert not jnp.allclose(bidirectional, want)
  assert jnp.array_equal(bidirectional, ops.iha_attention(*args, options.replace(causal=False)))
  with pytest.raises(TypeError, match=r"unknown attention option\(s\) \['windows'\]"):
    ops.iha_attention(*args, windows=4)
  with pytest.raises(ValueError, match="window must be None"):
    ops.mha_attention(*args[:3], ops.AttentionOptions(window=0))


def test_clear_errors_for_traced_window_heads_first_layout_and_empty_sequence():
  args = _args()
  with pytest.raises(ValueError, match=r"window must be a static Python int.*static_argnames"):
    jax.jit(lambda w: ops.iha_attention(*args, window=w))(4)
  q, k, v, *mixing = args
  heads_first = [jnp.swapaxes(t, 1, 2) for t in (q, k, v)]  # [B, H, N, d]
  with pytest.raises(ValueError, match=r"looks laid out \[B, H, N, d\].*swapaxes"):
    ops.iha_attention(*heads_first, *mixing)
  empty = [t[:, :0] for t in (q, k, v)]
  with pytest.raises(ValueError, match="N = 0 tokens"):
    ops.iha_attention(*empty, *mixing)
  with pytest.raises(ValueError, match="N = 0 tokens"):
    ops.mha_attention(*empty)


def test_a_kernel_named_off_its_hardware_warns_once_that_it_is_interpreted(monkeypatch):
  """On CPU an explicitly named kernel runs in Pallas' interpreter: the first call says so
  (once per implementation), "auto" never does (it picks code this backend runs)."""
  import warnings

  from iha_jax.kinds import registry

  monkeypatch.setattr(registry, "_WARNED", set())
  q = jnp.ones((1, 8, 2, 8), jnp.float32)
  with pytest.warns(UserWarning, match="'pallas_gpu' runs in Pallas' interpreter on cpu"):
    ops.mha_attention(q, q, q, implementation="pallas_gpu")
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    ops.mha_attention(q, q, q, implementation="pallas_gpu")  # once only
    ops.mha_attention(q, q, q, implementation="auto")
  with pytest.warns(UserWarning, match="'splash' runs in Pallas' interpreter on cpu"):
    ops.mha_attention(q, q, q, implementation="splash")


def test_queries_at_an_offset_into_longer_keys():
  """A cached call's form: the keys of a longer sequence, the queries at `query_offset`
  into it, the keys' own ids and positions. It equals the same queries' rows of the call
  over the whole sequence; bad key-side arrays and kinds that do not decode are refused
  in one line."""
  q, k, v, *mixing = _args()
  whole = ops.iha_attention(q, k, v, *mixing, implementation="xla")
  offset = 2
  positions = jnp.broadcast_to(jnp.arange(offset, N, dtype=jnp.int32), (B, N - offset))
  kv_positions = jnp.broadcast_to(jnp.arange(N, dtype=jnp.int32), (B, N))
  tail = ops.iha_attention(
    q[:, offset:],
    k,
    v,
    *mixing,
    implementation="xla",
    positions=positions,
    query_offset=offset,
    kv_positions=kv_positions,
  )
  assert jnp.allclose(tail, whole[:, offset:], atol=1e-5)
  with pytest.raises(ValueError, match=r"kv_positions must have shape \[B, Nk\] = \[2, 5\]"):
    ops.iha_attention(q[:, offset:], k, v, *mixing, query_offset=offset, kv_positions=positions)
  t_q, t_k, t_v, logits, weights = (
    jnp.ones((B, N, H, D)),
    jnp.ones((B, N, H, D)),
    jnp.ones((B, N, H, D)),
    jnp.eye(H),
    jnp.eye(H),
  )
  with pytest.raises(ValueError, match="talking_heads attention takes the keys of its queries"):
    ops.talking_heads_attention(t_q, t_k, t_v, logits, weights, query_offset=1)


def test_option_keywords_are_typed_by_one_typed_dict_of_the_options_fields():
  """The entry points take `AttentionOptions`' fields as keywords, typed by `OptionFields`:
  one set of names, so that a field added to one is added to the other."""
  import dataclasses
  import inspect

  from iha_jax.kinds import registry

  fields = {f.name for f in dataclasses.fields(ops.AttentionOptions)}
  assert set(ops.OptionFields.__optional_keys__) == fields == set(ops.OptionFields.__annotations__)
  entries = (
    ops.iha_attention,
    ops.mha_attention,
    ops.talking_heads_attention,
    ops.diff_attention,
    ops.simplicial_attention,
    registry.attend,
    ops.AttentionOptions.replace,
  )
  for entry in entries:  # annotations are strings (`from __future__ import annotations`)
    (keywords,) = [
      p for p in inspect.signature(entry).parameters.values() if p.kind is p.VAR_KEYWORD
    ]
    assert keywords.annotation == "Unpack[OptionFields]", entry
  with pytest.raises(TypeError, match=r"unknown attention option\(s\) \['windows'\]"):
    ops.AttentionOptions().replace(windows=4)
