"""`TransformerLM` as pure functions of a parameter dict, with remat and scan-over-layers.

How the trainer, the evaluator and the export tools run it: the parameters are a plain
nested dict (checkpoint-friendly, string keys) and the forward pass is the model's own
(each `DecoderBlock` rebuilt with `nnx.merge`); only the walk over the layers differs, a
`jax.lax.scan` over schedule periods, each block under `jax.checkpoint`. Layout:

    {"embedding": [V, D], "final_norm": {"scale": [D]}, ("lm_head": [D, V]),
     ("output_head": [D, O]), ("input_proj": [F, D]),
     "layers": {"0": block params, "1": ...},                  # unscanned layers
     "scanned": {"0": block params stacked [R, ...], ...}}     # scan_layers only

With `scan_layers`, the schedule period `S = len(attention_schedule)` is the scan body:
layer `r*S + j` (r < R = num_layers // S) lives at `scanned[str(j)][r]`; the remaining
`num_layers % S` layers stay unscanned under "layers" (e.g. 26 layers of "LLLLM": a scan
of 5 periods plus one tail layer).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from iha_jax.kernels.flash.attention import ATTENTION_RESIDUALS
from iha_jax.kinds import ATTENTION_OUT, KEY_PROJ, QUERY_PROJ, VALUE_PROJ
from iha_jax.models.config import TransformerConfig
from iha_jax.models.transformer import (
  TransformerLM,
  add_input_features,
  embed_tokens,
  output_logits,
)

Params = dict[str, Any]


def remat_policy(name: str) -> Callable | None:
  """Named policy -> `jax.checkpoint` policy ("none" -> no remat at all)."""
  if name == "full":
    return jax.checkpoint_policies.nothing_saveable
  projections = (QUERY_PROJ, KEY_PROJ, VALUE_PROJ, ATTENTION_OUT)
  if name == "save_projections":
    # Saves q/k/v and the attention output: the backward skips re-running projections;
    # the MLP and the attention kernels' forward (for their o and lse) are recomputed.
    return jax.checkpoint_policies.save_only_these_names(*projections)
  if name == "save_attention":
    # Also the kernels' o and lse where they are small enough to be named
    # (`flash.attention.ATTENTION_RESIDUALS`: o up to 0.5 GiB per call): no forward
    # kernel reruns: more memory for somewhat less estimated time (the 2.4B step at
    # P = 4 on v5p-128: docs/performance.md §14).
    return jax.checkpoint_policies.save_only_these_names(*projections, ATTENTION_RESIDUALS)
  raise ValueError(f"unknown remat policy {name!r}")


class FunctionalTransformerLM:
  """Functional wrapper of `TransformerLM(config)` (static: build once per config)."""

  def __init__(self, config: TransformerConfig, *, remat: str = "none", scan_layers: bool = False):
    self.config = config
    self.remat = remat
    self.scan_layers = scan_layers
    abstract = nnx.eval_shape(lambda: TransformerLM(config, rngs=nnx.Rngs(0)))
    self._block_defs = [nnx.split(layer)[0] for layer in abstract.layers]
    self._norm_def = nnx.split(abstract.final_norm)[0]
    self.period = len(config.attention_schedule)
    self.repeats = config.num_layers // self.period if scan_layers else 0
    self._specs = self._layout(
      nnx.to_pure_dict(nnx.get_partition_spec(nnx.state(abstract))),
      stack=lambda specs: PartitionSpec(None, *specs[0]),
    )

  def _layout(self, pure: dict[Any, Any], stack: Callable[[list], Any]) -> Params:
    """The model's `nnx.to_pure_dict` state -> this module's parameter layout."""
    layers = pure["layers"]
    out = {k: v for k, v in pure.items() if k != "layers"}
    period, repeats = self.period, self.repeats
    if repeats:
      out["scanned"] = {
        str(j): jax.tree.map(
          lambda *xs: stack(list(xs)),
          *[layers[r * period + j] for r in range(repeats)],
          is_leaf=lambda x: isinstance(x, PartitionSpec),
        )
        for j in range(period)
      }
    out["layers"] = {str(i): layers[i] for i in range(repeats * period, self.config.num_layers)}
    return out

  def init(self, seed: int | jax.Array) -> Params:
    """Fresh parameters (as `TransformerLM(config, rngs=nnx.Rngs(seed))`)."""
    model = TransformerLM(self.config, rngs=nnx.Rngs(jax.random.key(seed)))
    return self._layout(
      nnx.to_pure_dict(nnx.state(model, nnx.Param)), stack=lambda xs: jnp.stack(xs)
    )

  def module(self, params: Params) -> TransformerLM:
    """The `TransformerLM` holding `params` (the inverse of the layout), for tools that
    need the module itself, such as attention maps."""
    graphdef, state = nnx.split(
      nnx.eval_shape(lambda: TransformerLM(self.config, rngs=nnx.Rngs(0)))
    )
    layers = {int(k): v for k, v in params["layers"].items()}
    for j, stacked in params.get("scanned", {}).items():
      for r in range(self.repeats):
        layers[r * self.period + int(j)] = jax.tree.map(lambda x, r=r: x[r], stacked)
    pure = {k: v for k, v in params.items() if k not in ("layers", "scanned")}
    nnx.replace_by_pure_dict(state, {**pure, "layers": layers})
    return nnx.merge(graphdef, state)

  def logical_specs(self) -> Params:
    """Logical `PartitionSpec` of every parameter (stacked axes unsharded)."""
    return self._specs

  def _block(self, index: int) -> Callable:
    """`(block_params, x, segment_ids, positions, layer) -> x` of layer `index` (its
    graphdef), remat-wrapped. `layer` (counted from 1, may be traced) is the depth the
    block runs at: scanned blocks share the graphdef of the first period."""
    graphdef = self._block_defs[index]

    def apply(block_params, x, segment_ids, positions, layer=None):
      return nnx.merge(graphdef, block_params)(
        x, segment_ids=segment_ids, positions=positions, layer=layer
      )

    if self.remat == "none":
      return apply
    return jax.checkpoint(apply, policy=remat_policy(self.remat))

  def apply(
    self,
    params: Params,
    tokens: jax.Array,
    *,
    features: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    positions: jax.Array | None = None,
  ) -> jax.Array:
    """`tokens: [B, N]` int32 (+ `features: [B, N, F]`) -> float32 logits `[B, N, V]` (or
    `[B, N, num_outputs]`), as `TransformerLM.__call__`."""
    hidden = self.hidden_states(
      params, tokens, features=features, segment_ids=segment_ids, positions=positions
    )
    return output_logits(hidden, params, self.config)

  def hidden_states(
    self,
    params: Params,
    tokens: jax.Array,
    *,
    features: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    positions: jax.Array | None = None,
  ) -> jax.Array:
    """As `apply`, but stops before the output head: the final normalised `[B, N, D]` in
    `config.dtype` (the chunked loss builds the logits from it a chunk at a time)."""
    x = embed_tokens(params["embedding"], tokens, self.config.dtype, self.config.embedding_gradient)
    x = add_input_features(x, features, params.get("input_proj"), self.config)
    if self.repeats:
      blocks = [self._block(j) for j in range(self.period)]

      def period_body(x, scanned):
        period_params, repeat = scanned
        for j, block in enumerate(blocks):
          x = block(period_params[str(j)], x, segment_ids, positions, repeat * self.period + j + 1)
        return x, None

      x, _ = jax.lax.scan(period_body, x, (params["scanned"], jnp.arange(self.repeats)))
    for key, block_params in sorted(params["layers"].items(), key=lambda kv: int(kv[0])):
      x = self._block(int(key))(block_params, x, segment_ids, positions)
    return nnx.merge(self._norm_def, params["final_norm"])(x)
