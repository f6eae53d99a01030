"""Every logical axis name of the project, in one place.

Parameters and activations carry these names; `iha_jax.parallel.rules` maps them to
mesh axes. Parameters:

- `EMBED` ("embed"): model width D.
- `HEADS` ("heads"): the attention heads the core runs over (projection heads of
  q/o, the target head owning a pseudo-query).
- `KV_HEADS` ("kv_heads"): the key/value heads (`wk`, `wv`, the target axis of
  `alpha_k`, `alpha_v`): G of them, fewer than H under grouped-query attention; split
  like `heads` where the mesh axis divides G, else kept whole (`fit_to_shapes`).
- `HEAD_DIM` ("head_dim"): per-head width d (and the value width).
- `HEADS_SRC` ("heads_src"): the source head of a head mixing (`alpha_*`, `talk_*`
  axis 0): contracted, so kept whole.
- `HEADS_DST` ("heads_dst"): the output head of IHA's full collapse.
- `PSEUDO` ("pseudo"): IHA's pseudo-head index p.
- `QK_PAIR` ("qk_pair"): differential attention's two query/key maps.
- `MLP` ("mlp"): the MLP's hidden width F.
- `VOCAB` ("vocab"): embedding rows and output-head columns.
- `OUTPUTS` ("outputs"): the per-token output head's columns (encoders).
- `FEATURES` ("features"): continuous per-token input features (`input_proj` rows).

Activations (`ACTIVATION_*`) name the axes of `[B, N, ...]` tensors for
`flax.linen.with_logical_constraint`; the tuples below are the layouts the layers use.
"""

from __future__ import annotations

EMBED = "embed"
HEADS = "heads"
KV_HEADS = "kv_heads"
HEAD_DIM = "head_dim"
HEADS_SRC = "heads_src"
HEADS_DST = "heads_dst"
PSEUDO = "pseudo"
QK_PAIR = "qk_pair"
MLP = "mlp"
VOCAB = "vocab"
OUTPUTS = "outputs"
FEATURES = "features"

ACTIVATION_BATCH = "activation_batch"
ACTIVATION_LENGTH = "activation_length"
ACTIVATION_EMBED = "activation_embed"
ACTIVATION_HEADS = "activation_heads"
ACTIVATION_HEADS_SRC = "activation_heads_src"
ACTIVATION_VOCAB = "activation_vocab"

# The residual stream [B, N, D], logits [B, N, V], per-head tensors [B, N, H, d].
RESIDUAL_AXES = (ACTIVATION_BATCH, ACTIVATION_LENGTH, ACTIVATION_EMBED)
LOGITS_AXES = (ACTIVATION_BATCH, ACTIVATION_LENGTH, ACTIVATION_VOCAB)
HEADS_AXES = (ACTIVATION_BATCH, ACTIVATION_LENGTH, ACTIVATION_HEADS, None)
# q/k/v of layers that mix across heads (IHA, Talking-Heads): all source heads gathered.
SOURCE_HEADS_AXES = (ACTIVATION_BATCH, ACTIVATION_LENGTH, ACTIVATION_HEADS_SRC, None)
