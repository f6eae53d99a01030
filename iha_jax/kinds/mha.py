"""Multi-head attention (`M` global, `S` sliding window): the paper's standard baseline."""

from __future__ import annotations

from iha_jax.kinds.base import AttentionKind, Letter, project_qkv
from iha_jax.ops import mha_attention

_KERNELS = "iha_jax.kernels.sharded:mha_on_current_mesh"  # under shard_map on a mesh


class MultiHead(AttentionKind):
  """`softmax(rope(q) rope(k)^T / sqrt(d)) v` per head; `wq: [D, H, d]`, `wk, wv:
  [D, G, d]` (G = H, or grouped-query: query head h reads key/value head `h // (H // G)`),
  `wo: [H, d, D]`. Decodes with a cache of rotated keys and values (G heads)."""

  name = "mha"
  letters = (
    Letter("M", False, "global MHA"),
    Letter("S", True, "sliding-window MHA, window mha_window (tokens)"),
  )
  implementations = {
    "reference": ("iha_jax.ops.attention:mha_reference", {}),
    "xla": ("iha_jax.ops.attention:mha_xla", {}),
    "pallas_tpu": (_KERNELS, {"platform": "tpu"}),
    "pallas_gpu": (_KERNELS, {"platform": "gpu"}),
    # Nothing to materialise: the same kernel, so that a model-wide
    # implementation="pallas_gpu_mha" also serves MHA and differential layers.
    "pallas_gpu_mha": (_KERNELS, {"platform": "gpu"}),
    "cudnn": ("iha_jax.ops.cudnn_attention:mha_cudnn", {}),
  }
  decodes = True
  sequence_roles = ("q", "kv", "kv")

  def core(self, params, x, cfg, options, layer):
    q, k, v = project_qkv(params, x)
    return mha_attention(q, k, v, options)


MHA = MultiHead()
