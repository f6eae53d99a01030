"""The chunked cross-entropy equals the plain loss (sum, weights, correctness, every
gradient), on one device and on a mesh, and its compiled step holds no whole logits."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from iha_jax import parallel
from iha_jax.models import FunctionalTransformerLM
from iha_jax.models.transformer import output_logits
from iha_jax.train.losses import chunked_cross_entropy, loss_terms, position_losses
from iha_jax.train.optimizer import learning_rate_schedule, make_optimizer
from iha_jax.train.state import create_state
from iha_jax.train.step import make_eval_step, make_train_step
from tests.fixtures import TRAIN, tiny_model

MODEL = tiny_model("LM")


def _batch(b: int, n: int, vocab: int) -> dict[str, jax.Array]:
  """Random tokens; weights random in (0, 1) with padding (0) at some positions and at
  the end of every other row."""
  keys = jax.random.split(jax.random.key(7), 3)
  tokens = jax.random.randint(keys[0], (b, n + 1), 1, vocab)
  segment_ids = jnp.where(jnp.arange(n) < n - 3 * (jnp.arange(b)[:, None] % 2), 1, 0)
  weights = jax.random.uniform(keys[1], (b, n), minval=0.1) * (
    jax.random.uniform(keys[2], (b, n)) < 0.8
  )
  return {
    "inputs": tokens[:, :-1],
    "targets": tokens[:, 1:],
    "weights": weights * segment_ids,
    "segment_ids": segment_ids.astype(jnp.int32),
    "positions": jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n)),
  }


def _assert_trees_close(got, want) -> None:
  for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
    scale = np.abs(w).max()
    assert scale > 0, jax.tree_util.keystr(path)  # a gradient that is there
    np.testing.assert_allclose(
      g, w, rtol=1e-5, atol=1e-5 * scale, err_msg=jax.tree_util.keystr(path)
    )


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("chunk", [4, 5, 10])  # a remainder of 2, none, a single chunk
def test_chunked_cross_entropy_equals_plain(tied, chunk):
  """Loss sum, correctness (differentiated or not) and the VJP (random cotangent) w.r.t.
  the hidden states and the output head equal the plain loss over the whole `[B, N, V]`
  logits."""
  config = dataclasses.replace(MODEL, tie_embeddings=tied)
  b, n, d, v = 3, 10, config.model_dim, config.vocab_size
  keys = jax.random.split(jax.random.key(0), 3)
  hidden = jax.random.normal(keys[0], (b, n, d))
  head = (
    {"embedding": jax.random.normal(keys[1], (v, d)) * d**-0.5}
    if tied
    else {"embedding": jnp.ones((v, d)), "lm_head": jax.random.normal(keys[1], (d, v)) * d**-0.5}
  )
  batch = _batch(b, n, v)
  targets, weights = batch["targets"], batch["weights"]
  # Make some argmax hits, so correctness is not trivially all False.
  targets = targets.at[:, ::3].set(jnp.argmax(output_logits(hidden, head, config), -1)[:, ::3])

  def plain(hidden, head):
    per_position, correct, _ = position_losses(
      output_logits(hidden, head, config), targets, "cross_entropy"
    )
    return jnp.sum(per_position * weights), correct

  def chunked(hidden, head):
    return chunked_cross_entropy(hidden, head, targets, weights, config, chunk)

  (want, want_correct), want_vjp = jax.vjp(plain, hidden, head)
  (got, got_correct), got_vjp = jax.vjp(chunked, hidden, head)
  forward_only = chunked(hidden, head)  # not differentiated: no gradients computed
  for loss_sum, correct in ((got, got_correct), forward_only):
    np.testing.assert_allclose(loss_sum, want, rtol=1e-6)
    np.testing.assert_array_equal(correct, want_correct)
  assert 0 < int(want_correct.sum()) < b * n
  cotangent = (jnp.float32(0.73), np.zeros((b, n), jax.dtypes.float0))
  name = "embedding" if tied else "lm_head"  # untied: the embedding is not the head
  got_grads, want_grads = (
    (grad_hidden, grad_head[name])
    for grad_hidden, grad_head in (got_vjp(cotangent), want_vjp(cotangent))
  )
  _assert_trees_close(got_grads, want_grads)


@pytest.mark.full
def test_chunked_loss_on_a_mesh_equals_plain():
  """The model's loss terms and every parameter's gradient under a 2 x 2 x 2 (fsdp,
  context, tensor) mesh with scan-over-layers and full remat, chunks of 5 of each
  device's 8 positions (a remainder of 3): as the plain loss on the same mesh; the eval
  step's sums too. No loop reduces the head's gradient (`[V / tensor, D]`) per chunk."""
  model = FunctionalTransformerLM(MODEL, remat="full", scan_layers=True)
  mesh = parallel.create_mesh(dict(data=1, fsdp=2, context=2, tensor=2))
  state, shardings = create_state(model, make_optimizer(TRAIN), mesh, seed=0)
  rows = parallel.batch_sharding(mesh)
  batch = jax.device_put(_batch(8, 16, MODEL.vocab_size), rows)
  results = []
  with parallel.activate(mesh):
    for chunk in (None, 5):
      terms = (
        jax.jit(
          jax.value_and_grad(
            lambda p, b: loss_terms(model, p, b, chunk_tokens=chunk), has_aux=True
          ),
          in_shardings=(shardings.params, rows),
        )
        .lower(state.params, batch)
        .compile()
      )
      results.append(terms(state.params, batch))
    sums = jax.jit(make_eval_step(model, loss_chunk_tokens=5), in_shardings=(None, rows))
    sums = sums(state.params, batch)
  (want, want_aux), want_grads = results[0]
  (got, got_aux), got_grads = results[1]
  np.testing.assert_allclose(got, want, rtol=1e-6)
  np.testing.assert_allclose(got_aux["weight_sum"], want_aux["weight_sum"], rtol=1e-6)
  np.testing.assert_array_equal(got_aux["correct"], want_aux["correct"])
  _assert_trees_close(jax.tree.map(np.asarray, got_grads), jax.tree.map(np.asarray, want_grads))
  np.testing.assert_allclose(sums["loss_sum"], want, rtol=1e-6)
  assert sums["token_correct"] == np.sum(want_aux["correct"] & (batch["weights"] > 0)) > 0
  head_grad = re.compile(
    rf"= f32\[{MODEL.vocab_size // 2},{MODEL.model_dim}\]\S* (all-reduce|reduce-scatter)"
  )
  bodies = [c for c in terms.as_text().split("\n\n") if not c.lstrip().startswith("ENTRY")]
  assert not [c for c in bodies if head_grad.search(c)]


def _largest_f32(hlo: str) -> int:
  """Elements of the largest float32 array in HLO text."""
  return max(
    int(np.prod([int(x) for x in dims.split(",")]))
    for dims in re.findall(r"\bf32\[([\d,]+)\]", hlo)
  )


@pytest.mark.full
def test_compiled_train_step_holds_no_whole_logits():
  """The train step compiled with chunks of 16 of 64 positions holds no float32 array
  as large as the `[B, N, V]` logits, and needs at least one logits' bytes fewer
  temporaries; control: the plain step holds the logits."""
  config = dataclasses.replace(
    MODEL, vocab_size=2048, num_layers=1, model_dim=16, head_dim=4, attention_schedule="M"
  )
  b, n = 2, 64
  model = FunctionalTransformerLM(config)
  tx = make_optimizer(TRAIN)
  state = create_state(model, tx, parallel.create_mesh(dict(data=1, fsdp=1, tensor=1)), seed=0)[0]
  spec = lambda dtype: jax.ShapeDtypeStruct((b, n), dtype)  # noqa: E731
  batch = {"inputs": spec(jnp.int32), "targets": spec(jnp.int32), "weights": spec(jnp.float32)}
  logits = b * n * config.vocab_size
  compiled = {
    chunk: jax.jit(
      make_train_step(model, tx, learning_rate_schedule(TRAIN), 1, loss_chunk_tokens=chunk)
    )
    .lower(state, batch)
    .compile()
    for chunk in (None, 16)
  }
  assert _largest_f32(compiled[None].as_text()) >= logits
  assert _largest_f32(compiled[16].as_text()) <= logits // 4
  temp = {k: c.memory_analysis().temp_size_in_bytes for k, c in compiled.items()}
  assert temp[None] - temp[16] >= 4 * logits, temp


@pytest.mark.parametrize("chunk_tokens", [None, 4], ids=["whole", "chunked"])
def test_padding_positions_add_nothing_to_the_loss(chunk_tokens):
  """`loss_terms` is the cross entropy of the model's logits weighted by `weights`: targets
  at weight 0 (padding, unscored tokens) add nothing to the loss sum nor to `weight_sum`
  (tests/mutants.py: `loss_ignores_padding`)."""
  model = FunctionalTransformerLM(MODEL)
  params = model.init(0)
  batch = _batch(2, 8, MODEL.vocab_size)
  weights = batch["weights"]
  assert bool((weights == 0).any()) and bool((batch["segment_ids"] == 0).any())
  logits = model.apply(
    params, batch["inputs"], segment_ids=batch["segment_ids"], positions=batch["positions"]
  )
  log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  nll = -jnp.take_along_axis(log_probs, batch["targets"][..., None], axis=-1)[..., 0]
  loss_sum, aux = loss_terms(model, params, batch, chunk_tokens=chunk_tokens)
  np.testing.assert_allclose(loss_sum, jnp.sum(nll * weights), rtol=1e-5)
  np.testing.assert_allclose(aux["weight_sum"], jnp.sum(weights), rtol=1e-6)
