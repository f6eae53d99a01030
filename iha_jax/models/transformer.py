"""`TransformerLM`: a decoder LM (or, `causal=False`, an encoder) with a per-layer attention
schedule."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.linen import with_logical_constraint

from iha_jax.models import embedding as embedding_lib
from iha_jax.models.config import TransformerConfig
from iha_jax.models.kv_cache import KVCache
from iha_jax.models.layers import DecoderBlock, RMSNorm
from iha_jax.nn.config import DEFAULT_KERNEL_INIT
from iha_jax.nn.partitioning import logical_param
from iha_jax.parallel.axes import EMBED, FEATURES, LOGITS_AXES, OUTPUTS, RESIDUAL_AXES, VOCAB


class TransformerLM(nnx.Module):
  """Token embedding, `num_layers` pre-norm `DecoderBlock`s, final RMSNorm, output head.

  Parameters: `embedding: [V, D]` ("vocab", "embed"); `layers[i]` with the attention of
  schedule letter `config.schedule[i]`; `final_norm.scale: [D]`; and, untied,
  `lm_head: [D, V]` ("embed", "vocab"), or with `num_outputs`, a per-token
  `output_head: [D, num_outputs]` ("embed", "outputs") instead of vocabulary logits.
  With `input_features` F, `input_proj: [F, D]` ("features", "embed") adds each token's
  continuous features to its embedding.
  With `config.causal=False` every layer is bidirectional (an encoder).

  `iha_jax.models.FunctionalTransformerLM` runs this same model as a function of a parameter
  dict, with scan-over-layers and remat (how `train.py` trains it); both go through
  `embed`, the `DecoderBlock`s and `logits`, so the two agree to float rounding.
  """

  def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
    self.config = config
    d, v = config.model_dim, config.vocab_size

    def param(init, axes, shape):
      return logical_param(init, axes, rngs.params(), shape, config.param_dtype)

    # Std D**-0.5: with tied embeddings the unit-RMS final activations then give logits
    # of unit scale, the same as the fan-in-initialised untied head.
    self.embedding = param(jax.nn.initializers.normal(d**-0.5), (VOCAB, EMBED), (v, d))
    if config.input_features is not None:
      self.input_proj = param(DEFAULT_KERNEL_INIT, (FEATURES, EMBED), (config.input_features, d))
    self.layers = nnx.List(
      [
        DecoderBlock(config, letter, layer=i + 1, rngs=rngs)
        for i, letter in enumerate(config.schedule)
      ]
    )
    self.final_norm = RMSNorm(
      d, eps=config.norm_eps, dtype=config.dtype, param_dtype=config.param_dtype, rngs=rngs
    )
    if config.num_outputs is not None:
      self.output_head = param(DEFAULT_KERNEL_INIT, (EMBED, OUTPUTS), (d, config.num_outputs))
    elif not config.tie_embeddings:
      self.lm_head = param(DEFAULT_KERNEL_INIT, (EMBED, VOCAB), (d, v))

  def __call__(
    self,
    tokens: jax.Array,
    *,
    features: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    positions: jax.Array | None = None,
    cache: KVCache | None = None,
  ) -> jax.Array | tuple[jax.Array, KVCache]:
    """Per-token outputs: next-token logits, or the `num_outputs` head's outputs.

    Args:
      tokens: `[B, N]` int32 token ids.
      features: `[B, N, F]` continuous inputs; required with `config.input_features`
        (F), refused without.
      segment_ids: optional `[B, N]` int32 packed-sequence ids (0 = padding). With a
        cache, 0 marks padding among each row's new tokens (a ragged batch: it takes no
        position and writes nothing), any other id the row's one sequence.
      positions: optional `[B, N]` int32 token positions (default `arange(N)`).
      cache: a `KVCache` (`iha_jax.models.kv_cache.init_cache`) holding the tokens before
        these: every block runs its attention layer's cached call (a prompt, then one
        token per call; `iha_jax.models.generate`).

    Returns:
      `[B, N, V]` (or `[B, N, num_outputs]`) float32; with `causal`, position n depends
      only on tokens `<= n`. With a cache: `(logits, cache)` with the tokens written.
    """
    check_tokens(tokens, "tokens")
    x = self.embed(tokens, features)
    if cache is not None:
      if positions is not None:
        raise ValueError(
          "cache= places each row's real tokens at positions cache.length[b] + 0, 1, ..; "
          "positions belongs to the full forward (no cache)"
        )
      if segment_ids is not None and jnp.shape(segment_ids) != jnp.shape(tokens):
        raise ValueError(
          f"segment_ids has shape {jnp.shape(segment_ids)}; with cache= it marks padding "
          f"among the new tokens, shaped as tokens {jnp.shape(tokens)}"
        )
      layers = []
      for block, layer_cache in zip(self.layers, cache.layers):
        x, layer_cache = block(x, segment_ids=segment_ids, cache=layer_cache)
        layers.append(layer_cache)
      return self.logits(x), cache.replace(layers=tuple(layers))
    for block in self.layers:
      x = block(x, segment_ids=segment_ids, positions=positions)
    return self.logits(x)

  def embed(self, tokens: jax.Array, features: jax.Array | None = None) -> jax.Array:
    """`tokens: [B, N]` int (+ `features: [B, N, F]`) -> `[B, N, D]` in `config.dtype`
    (the first block's input)."""
    x = embed_tokens(self.embedding[...], tokens, self.config.dtype, self.config.embedding_gradient)
    proj = self.input_proj[...] if hasattr(self, "input_proj") else None
    return add_input_features(x, features, proj, self.config)

  def logits(self, x: jax.Array) -> jax.Array:
    """Last block's output `x: [B, N, D]` -> float32 `[B, N, V or num_outputs]` (final
    norm + head), apart from `embed` so that tools can run the blocks themselves."""
    heads = {
      name: getattr(self, name)[...]
      for name in ("embedding", "lm_head", "output_head")
      if hasattr(self, name)
    }
    return output_logits(self.final_norm(x), heads, self.config)


def embed_tokens(
  embedding: jax.Array, tokens: jax.Array, dtype: Any, gradient: str = "auto"
) -> jax.Array:
  """Lookup of `tokens: [B, N]` in `embedding: [V, D]` -> `[B, N, D]` in `dtype`; the
  table's gradient by `gradient` (`iha_jax.models.embedding.lookup`).

  The lookup reads a replicated table (gathered like any FSDP weight): a gather from a
  vocab/embed-sharded table would force a full rematerialisation of its output.
  """
  table = with_logical_constraint(embedding, (None, None))
  x = embedding_lib.lookup(table, tokens, dtype, gradient)
  return with_logical_constraint(x, RESIDUAL_AXES)


def add_input_features(
  x: jax.Array, features: jax.Array | None, input_proj: jax.Array | None, config: TransformerConfig
) -> jax.Array:
  """`x: [B, N, D]` + `features: [B, N, F] @ input_proj: [F, D]` (models with
  `config.input_features`); `x` unchanged otherwise. Raises ValueError naming `features`
  when it is missing, unexpected or of the wrong shape."""
  want = config.input_features
  if want is None:
    if features is not None:
      raise ValueError(
        "features given, but the model has no input_features: set "
        "model.input_features to their last dimension, or leave them out"
      )
    return x
  if features is None or jnp.shape(features) != (*jnp.shape(x)[:2], want):
    got = None if features is None else tuple(jnp.shape(features))
    raise ValueError(
      f"features must be [B, N, {want}] (model.input_features={want}) for tokens "
      f"{tuple(jnp.shape(x)[:2])}, got {got}"
    )
  projected = jnp.einsum(
    "bnF,FD->bnD", features.astype(config.dtype), input_proj.astype(config.dtype)
  )
  return with_logical_constraint(x + projected, RESIDUAL_AXES)


def check_tokens(tokens: jax.Array, name: str) -> None:
  """Raises ValueError naming `name` unless `tokens` is an integer `[B, N]` array, N >= 1."""
  if jnp.ndim(tokens) != 2 or not jnp.issubdtype(jnp.result_type(tokens), jnp.integer):
    raise ValueError(
      f"{name} must be an integer array [B, N], got shape "
      f"{tuple(jnp.shape(tokens))} dtype {jnp.result_type(tokens)}"
    )
  if jnp.shape(tokens)[1] < 1:
    raise ValueError(
      f"{name} must hold at least one token per row, got shape {tuple(jnp.shape(tokens))}"
    )


def output_logits(x: jax.Array, params: dict[str, Any], config: TransformerConfig) -> jax.Array:
  """Normalised `x: [B, N, D]` -> float32 `[B, N, V]` logits (or `[B, N, num_outputs]`)
  from the model's top-level parameters `params` (`embedding`, `lm_head`, `output_head`)."""
  if config.num_outputs is not None:  # a few outputs per token: not vocab-sharded
    logits = jnp.einsum(
      "bnD,DO->bnO",
      x,
      params["output_head"].astype(config.dtype),
      preferred_element_type=jnp.float32,
    )
    return with_logical_constraint(logits, RESIDUAL_AXES[:2] + (None,))
  logits = vocab_logits(x, params["embedding"], params.get("lm_head"), config.dtype)
  return with_logical_constraint(logits, LOGITS_AXES)


def vocab_logits(
  x: jax.Array, embedding: jax.Array, lm_head: jax.Array | None, dtype: Any
) -> jax.Array:
  """Normalised `x: [B, N, D]` -> float32 logits `[B, N, V]` through the tied
  `embedding [V, D]`, or through `lm_head [D, V]` when given (untied)."""
  if lm_head is None:
    return jnp.einsum("bnD,VD->bnV", x, embedding.astype(dtype), preferred_element_type=jnp.float32)
  return jnp.einsum("bnD,DV->bnV", x, lm_head.astype(dtype), preferred_element_type=jnp.float32)


def count_params(model_or_params: TransformerConfig | nnx.Module | Any) -> int:
  """Number of parameter scalars of a `TransformerLM` config (from shapes only, nothing
  allocated), an NNX module (its `nnx.Param`s) or a parameter pytree."""
  if isinstance(model_or_params, TransformerConfig):
    model_or_params = nnx.eval_shape(lambda: TransformerLM(model_or_params, rngs=nnx.Rngs(0)))
  if isinstance(model_or_params, nnx.Module):
    model_or_params = nnx.state(model_or_params, nnx.Param)
  return sum(math.prod(jnp.shape(leaf)) for leaf in jax.tree.leaves(model_or_params))
