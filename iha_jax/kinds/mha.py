"""Multi-head attention (`M` global, `S` sliding window): the paper's standard baseline."""

from __future__ import annotations

import functools
from typing import Unpack

import jax

from iha_jax.core import validation
from iha_jax.core.attention import mha_probabilities, mha_reference, mha_xla
from iha_jax.core.cudnn_attention import mha_cudnn
from iha_jax.core.options import AttentionOptions, OptionFields
from iha_jax.kernels.sharded import mha_on_current_mesh, splash_on_current_mesh
from iha_jax.kinds import registry
from iha_jax.kinds.base import PROJECTION_OPTIONS, AttentionKind, Letter, project_qkv

# Under shard_map on a mesh. One object for both GPU names: nothing to materialise, so
# "auto" sees no path of its own in "pallas_gpu_mha", which a model-wide choice of it
# still finds for MHA and differential layers.
_GPU_KERNEL = functools.partial(mha_on_current_mesh, platform="gpu")


class MultiHead(AttentionKind):
  """`softmax(rope(q) rope(k)^T / sqrt(d)) v` per head; `wq: [D, H, d]`, `wk, wv:
  [D, G, d]` (G = H, or grouped-query: query head h reads key/value head `h // (H // G)`),
  `wo: [H, d, D]`. Decodes with a cache of keys and values (G heads)."""

  name = "mha"
  letters = (
    Letter("M", False, "global MHA"),
    Letter("S", True, "sliding-window MHA, window mha_window (tokens)"),
  )
  implementations = {
    "reference": mha_reference,
    "xla": mha_xla,
    "pallas_tpu": functools.partial(mha_on_current_mesh, platform="tpu"),
    "pallas_gpu": _GPU_KERNEL,
    "pallas_gpu_mha": _GPU_KERNEL,
    "cudnn": mha_cudnn,
    "splash": splash_on_current_mesh,  # jax's splash attention kernel (TPU)
  }
  config_fields = PROJECTION_OPTIONS
  dropout_implementations = frozenset({"xla"})
  probability_implementations = {"xla": mha_probabilities}
  decodes = True
  sequence_roles = ("q", "kv", "kv")

  def check_arrays(self, q, k, v, sliced=False):
    validation.check_qkv(q, k, v, value_width=True, sliced=sliced)

  def auto_inputs(self, q, k, v):
    return q, v, 1

  def core(self, params, x, cfg, options, layer):
    return mha_attention(*project_qkv(params, x), options)

  def entry_arrays(self, params, q, k, v, cfg):
    return q, k, v


MHA = MultiHead()


def mha_attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  options: AttentionOptions | None = None,
  **overrides: Unpack[OptionFields],
) -> jax.Array:
  """Standard multi-head attention with the same conventions as `iha_attention`.

  Args and returns as `iha_attention`, without mixing; `window` is in tokens. k and v
  have G heads, G dividing H (grouped-query attention: query head h reads key/value
  head `h // (H // G)`). v may be wider than q and k (`[B, N, G, dv]`, returned as
  `[B, N, H, dv]`).
  """
  return registry.attend(MHA, q, k, v, options=options, **overrides)
