"""Flax NNX attention layers: `InterleavedHeadAttention`, `MultiHeadAttention` and the
paper's baselines `TalkingHeadsAttention`, `DifferentialAttention`, `SimplicialAttention`.

One module, `Attention`, builds the parameters of any kind (`iha_jax.kinds`) and applies
`attention_forward`; the named classes fix the kind. Parameters are `nnx.Param`
attributes named as the kind lays them out (`wq, wk, wv, wo`, plus `alpha_q, alpha_k,
alpha_v, collapse` for IHA, ...), so `nnx.state(m, nnx.Param)` is a flat dict of exactly
those keys. Each carries its logical axis names as metadata only
(`iha_jax.nn.partitioning.logical_param`), so the modules build without a mesh.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from iha_jax.kinds import AttentionConfig
from iha_jax.nn.config import DEFAULT_KERNEL_INIT, param_specs
from iha_jax.nn.functional import attention_forward
from iha_jax.nn.partitioning import logical_param

Initializer = jax.nn.initializers.Initializer


class Attention(nnx.Module):
  """An attention layer of any registered kind.

  `Attention(model_dim, num_heads, head_dim, kind=..., **options, rngs=...)`, or
  `Attention.from_config(AttentionConfig(...), rngs=...)`.

  Args:
    model_dim: D.
    num_heads: H.
    head_dim: d (even when RoPE is on).
    rngs: `nnx.Rngs` with a `params` stream.
    param_dtype: storage dtype of the parameters.
    kernel_init: 2-D initializer for the projections, applied to `[D, H*d]` and `[H*d, D]`
      so that fan-in is the true input width.
    mixing_noise_std: std of Gaussian noise added to the identity init of the head
      mixings (IHA's `alpha_*` and `collapse`, Talking-Heads' `talk_*`).
    **options: the `AttentionConfig` fields of the layer: `kind`, `num_kv_heads` (G key/value
      heads dividing H, grouped-query attention; None: G = H), `window` (VIRTUAL tokens
      for IHA, tokens otherwise; None: global), `rope_theta` (None: no RoPE), `causal`
      (False: bidirectional), `dtype` (computation; None promotes input and parameters),
      `implementation` ("reference", "xla", "pallas_tpu", "pallas_gpu", "pallas_gpu_mha",
      "cudnn", "auto"), and the kind's own: IHA's `num_pseudo` (P; None: P = H) and
      `collapse_mode` ("full" or "per_head"), the layer number `layer` (from 1;
      differential attention's depth).

  `__call__(x: [B, N, D], *, segment_ids=None, positions=None, layer=None) -> [B, N, D]`.
  """

  kind: ClassVar[str | None] = None  # fixed by the named subclasses
  _named: ClassVar[dict[str, type[Attention]]] = {}

  def __init_subclass__(cls, **kwargs: Any):
    super().__init_subclass__(**kwargs)
    if cls.kind is not None:
      Attention._named.setdefault(cls.kind, cls)

  def __init__(
    self,
    model_dim: int,
    num_heads: int,
    head_dim: int,
    *,
    rngs: nnx.Rngs,
    param_dtype: Any = jnp.float32,
    kernel_init: Initializer = DEFAULT_KERNEL_INIT,
    mixing_noise_std: float = 0.0,
    **options: Any,
  ):
    if self.kind is not None:
      if options.setdefault("kind", self.kind) != self.kind:
        raise ValueError(
          f"{type(self).__name__} is kind {self.kind!r}, got kind={options['kind']!r}"
        )
    try:
      config = AttentionConfig(model_dim, num_heads, head_dim, **options)
    except TypeError as e:  # an unknown keyword: name the known ones
      raise TypeError(f"{type(self).__name__}: {e}; options are AttentionConfig's fields") from None
    self.config = config
    specs = param_specs(config, kernel_init=kernel_init, mixing_noise_std=mixing_noise_std)
    for name, spec in specs.items():
      setattr(
        self, name, logical_param(spec.init, spec.axes, rngs.params(), spec.shape, param_dtype)
      )
    self._param_names = tuple(specs)

  @classmethod
  def from_config(
    cls,
    config: AttentionConfig,
    *,
    rngs: nnx.Rngs,
    param_dtype: Any = jnp.float32,
    kernel_init: Initializer = DEFAULT_KERNEL_INIT,
    mixing_noise_std: float = 0.0,
  ) -> Attention:
    """The layer of `config`: on `Attention` itself, the kind's named class where one
    exists (e.g. `InterleavedHeadAttention` for "iha"), else `Attention`."""
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    dims = (fields.pop("model_dim"), fields.pop("num_heads"), fields.pop("head_dim"))
    if cls is Attention:
      cls = Attention._named.get(config.kind, Attention)
    return cls(
      *dims,
      rngs=rngs,
      param_dtype=param_dtype,
      kernel_init=kernel_init,
      mixing_noise_std=mixing_noise_std,
      **fields,
    )

  def __call__(
    self,
    x: jax.Array,
    *,
    segment_ids: jax.Array | None = None,
    positions: jax.Array | None = None,
    layer: int | jax.Array | None = None,
  ) -> jax.Array:
    """`x: [B, N, D]` -> `[B, N, D]`; segment_ids, positions: optional `[B, N]` int32;
    `layer` overrides the configured layer number (may be traced, e.g. in a scan)."""
    return attention_forward(
      self.param_values(), x, self.config, segment_ids=segment_ids, positions=positions, layer=layer
    )

  def param_values(self) -> dict[str, jax.Array]:
    """`{name: array}` of the layer's parameters, as `attention_forward` takes them."""
    return {name: getattr(self, name)[...] for name in self._param_names}


class InterleavedHeadAttention(Attention):
  """Interleaved Head Attention layer, causal or bidirectional, optionally windowed.

  Parameters: `wq: [D, H, d]`, `wk, wv: [D, G, d]`, `wo: [H, d, D]`, `alpha_q: [H, H, P]`
  and `alpha_k, alpha_v: [G, G, P]` (source, target, pseudo), `collapse: [H, H, P]`
  ("full") or `[H, P]` ("per_head"); G = `num_kv_heads` (None: G = H). Mixing and collapse
  start at the identity (docs/design.md §1). Options as `Attention`: `num_kv_heads`,
  `num_pseudo` (P; None: P = H), `window` in VIRTUAL tokens (`N * P` per sequence),
  `collapse_mode`, `rope_theta`, `causal`, `dtype`, `implementation`.
  """

  kind = "iha"


class MultiHeadAttention(Attention):
  """Standard multi-head attention with the same conventions as IHA: `wq: [D, H, d]`,
  `wk, wv: [D, G, d]`, `wo: [H, d, D]`; `window` in tokens. `num_kv_heads` G < H is
  grouped-query attention (query head h reads key/value head `h // (H // G)`)."""

  kind = "mha"


class TalkingHeadsAttention(Attention):
  """Talking-Heads attention (Shazeer et al. 2020): logits mixed across heads before the
  softmax, probabilities after it. Parameters: `wq, wk, wv: [D, H, d]`, `wo: [H, d, D]`,
  `talk_logits, talk_weights: [H, H]` (source head, target head), identity at init
  (= MHA); `mixing_noise_std` perturbs them; `window` in tokens."""

  kind = "talking_heads"


class DifferentialAttention(Attention):
  """Differential attention (Ye et al. 2024): `A1 v - lam A2 v`, per-head RMSNorm, scale
  `1 - lambda_init`. Parameters: `wq, wk: [D, H, 2, d]`, `wv: [D, H, 2d]`, `wo: [H, 2d,
  D]`, `lambda_q1, lambda_k1, lambda_q2, lambda_k2: [d]`, `norm_scale: [2d]`. H
  differential heads of value width 2d match an MHA layer of 2H heads of width d in
  parameters. `layer` (counted from 1) sets `lambda_init`; any MHA implementation,
  kernels included, runs both maps."""

  kind = "diff"


class SimplicialAttention(Attention):
  """2-simplicial attention (Roy et al. 2025): every query attends to pairs of keys
  through a trilinear form; no RoPE. O(N^2) scores per query (see
  `iha_jax.ops.simplicial_attention` for the size limit). Parameters: `wq, wk1, wk2, wv1,
  wv2: [D, H, d]`, `wo: [H, d, D]`."""

  kind = "simplicial"
