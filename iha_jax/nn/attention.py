"""Flax NNX attention layers: `InterleavedHeadAttention`, `MultiHeadAttention` and the
paper's baselines `TalkingHeadsAttention`, `DifferentialAttention`, `SimplicialAttention`.

One module, `Attention`, builds the parameters of any kind (`iha_jax.kinds`) from one
`AttentionConfig` and applies `iha_jax.nn.call.apply_layer`; the named classes fix the
kind. Parameters are `nnx.Param` attributes named as the kind lays them out (`wq, wk, wv,
wo`, plus `alpha_q, alpha_k, alpha_v, collapse` for IHA, ...), so `nnx.state(m,
nnx.Param)` is a flat dict of exactly those keys. Each carries its logical axis names as
metadata only (`iha_jax.nn.partitioning.logical_param`), so the modules build without a
mesh.
"""

from __future__ import annotations

import inspect
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from iha_jax.kinds import AttentionConfig
from iha_jax.nn.cache import LayerCache, init_layer_cache
from iha_jax.nn.config import DEFAULT_KERNEL_INIT, layer_config, param_specs
from iha_jax.nn.cross import ContextCache, cache_context
from iha_jax.nn.eager import call_layer
from iha_jax.nn.partitioning import logical_param

Initializer = jax.nn.initializers.Initializer


class Attention(nnx.Module):
  """An attention layer of any registered kind: `x: [B, N, D]` -> `[B, N, out_features]`
  (D unless set); with `context: [B, M, D]`, cross-attention (IHA, MHA).

  `Attention(model_dim, num_heads, head_dim, kind=..., <options>, rngs=...)`, or from a
  configuration as it is, `Attention(config=AttentionConfig(...), rngs=...)` (or
  `Attention.from_config(...)`: the kind's named class); the named subclasses
  (`InterleavedHeadAttention`, `MultiHeadAttention`, ...) fix `kind`. Every option is
  checked on construction, naming the option.

  Args:
    model_dim: D.
    num_heads: H.
    head_dim: d (even when RoPE is on).
    kind: a registered kind (`iha_jax.kinds.names()`; default "iha"); fixed by a subclass.
    num_kv_heads: G key/value heads dividing H (grouped-query attention: query head h
      reads key/value head `h // (H // G)`; G = 1 multi-query); None: G = H.
    num_pseudo: IHA's P pseudo-heads per head; None: P = H, the paper's default (P^2
      times MHA's attention work per global layer). Start with P = 2 (P = 1 where MHA's
      step price is the limit) and raise it only where your own runs show a gain: in this
      project's study a larger P did not improve quality while the step price grows with
      P (docs/results.md, "Which P?"). PHA ("pha"): the heads per group, dividing H;
      None: 2.
    window: sliding window in the kind's units: VIRTUAL tokens for IHA and PHA (`N * P`
      per sequence), tokens for the other kinds; None: global.
    window_tokens: the window in TOKENS instead (IHA: `window_tokens * P` virtual tokens);
      give `window` or `window_tokens`, not both. The same w reaches one token further
      through IHA (P >= 2) than through MHA: MHA's output at token n depends on tokens
      n-w+1..n (w tokens), IHA's on n-w..n (w + 1 tokens; token n-w only through the
      pseudo-queries p < P-1, since query p of token n sees virtual keys from
      `(n-w)*P + p + 1` on). `window=(w-1)*P + 1` gives IHA MHA's reach.
    rope_theta: RoPE base, on by default (10000.0); None: no RoPE (a model that adds its
      own positions).
    collapse_mode: IHA's "full" (`collapse: [H, H, P]`) or "per_head" (`[H, P]`).
    causal: causal attention (default); False: bidirectional (encoders).
    layer: the layer's number, counted from 1 (differential attention's depth).
    dtype: computation dtype; None promotes the input and parameter dtypes.
    implementation: "auto" (default), "reference", "xla", "pallas_tpu", "pallas_gpu",
      "pallas_gpu_mha", "cudnn" (those of the kind).
    dropout_rate: attention dropout while not deterministic (the "xla" implementation;
      the others refuse a rate > 0); 0: none.
    deterministic: default of the call's `deterministic` (True: no dropout); required,
      here or at the call, when `dropout_rate > 0` (`model.eval()` / `model.train()`
      set it).
    param_dtype: storage dtype of the parameters.
    kernel_init: 2-D initializer for the projections, applied to `[D, H*d]` and `[H*d, D]`
      so that fan-in is the true input width.
    mixing_noise_std: std of Gaussian noise added to the identity init of the head
      mixings (IHA's `alpha_*` and `collapse`, Talking-Heads' `talk_*`).
    keep_rngs: keep a fork of `rngs.dropout` for dropout (when `dropout_rate > 0`), so the
      call needs no `rngs`.
    qk_norm: RMSNorm of every source query and key head over d (learned `q_norm, k_norm:
      [d]`), before IHA's mixing and RoPE (IHA, MHA, Talking-Heads).
    use_bias: biases `bq: [H, d]`, `bk, bv: [G, d]`, `bo: [out_features]` (IHA, MHA,
      Talking-Heads; flax's layer has them on by default, this one off).
    out_features: output width (`wo: [H, d, out_features]`); None: model_dim.
    in_features: flax's name for model_dim (give one of them).
    qkv_features: flax's name for `num_heads * head_dim` (give it or head_dim); both left
      out with `in_features` given: `in_features`, as flax's layer.
    normalize_qk: flax's LayerNorm of q and k, refused when True in one line naming
      `qk_norm` (this layer's RMSNorm); False or None: none.
    config: the layer's `AttentionConfig`, taken as it is, instead of the fields above
      (model_dim ... normalize_qk, which then stay unset).
    rngs: `nnx.Rngs` with a `params` stream (and `dropout` when dropping out).
  """

  kind: ClassVar[str | None] = None  # fixed by the named subclasses
  _named: ClassVar[dict[str, type[Attention]]] = {}

  def __init_subclass__(cls, **kwargs: Any):
    super().__init_subclass__(**kwargs)
    if cls.kind is not None:
      Attention._named.setdefault(cls.kind, cls)

  def __init__(
    self,
    model_dim: int | None = None,
    num_heads: int | None = None,
    head_dim: int | None = None,
    *,
    kind: str | None = None,
    num_kv_heads: int | None = None,
    num_pseudo: int | None = None,
    window: int | None = None,
    window_tokens: int | None = None,
    rope_theta: float | None = 10000.0,
    collapse_mode: str = "full",
    causal: bool = True,
    layer: int = 1,
    dtype: Any = None,
    implementation: str = "auto",
    dropout_rate: float = 0.0,
    deterministic: bool | None = None,
    param_dtype: Any = jnp.float32,
    kernel_init: Initializer = DEFAULT_KERNEL_INIT,
    mixing_noise_std: float = 0.0,
    keep_rngs: bool = True,
    qk_norm: bool = False,
    use_bias: bool = False,
    out_features: int | None = None,
    in_features: int | None = None,
    qkv_features: int | None = None,
    normalize_qk: bool | None = None,
    config: AttentionConfig | None = None,
    rngs: nnx.Rngs,
  ):
    fields = dict(
      window_tokens=window_tokens,
      in_features=in_features,
      qkv_features=qkv_features,
      normalize_qk=normalize_qk,
      qk_norm=qk_norm,
      use_bias=use_bias,
      out_features=out_features,
      model_dim=model_dim,
      num_heads=num_heads,
      head_dim=head_dim,
      kind=kind,
      num_kv_heads=num_kv_heads,
      num_pseudo=num_pseudo,
      window=window,
      rope_theta=rope_theta,
      collapse_mode=collapse_mode,
      causal=causal,
      layer=layer,
      dtype=dtype,
      implementation=implementation,
      dropout_rate=dropout_rate,
    )
    config = self._layer_config(config, fields)
    if deterministic not in (None, True, False):
      raise ValueError(f"deterministic must be None or a bool, got {deterministic!r}")
    self.config = config
    self.deterministic = deterministic
    specs = param_specs(config, kernel_init=kernel_init, mixing_noise_std=mixing_noise_std)
    for name, spec in specs.items():
      setattr(
        self, name, logical_param(spec.init, spec.axes, rngs.params(), spec.shape, param_dtype)
      )
    self._param_names = tuple(specs)
    # Only a layer that drops out holds a stream (no state otherwise: TransformerLM's
    # layers are unchanged).
    self.rngs = rngs.dropout.fork() if keep_rngs and config.dropout_rate > 0 else None

  def _layer_config(
    self, config: AttentionConfig | None, fields: dict[str, Any]
  ) -> AttentionConfig:
    """`config` as it is, or the one `fields` (the constructor's) describe; ValueError
    for both, or for a kind other than the class's."""
    if config is not None and not isinstance(config, AttentionConfig):
      raise TypeError(f"config must be an AttentionConfig, got {type(config).__name__}")
    kind = fields["kind"] if config is None else config.kind
    if self.kind is not None and kind not in (None, self.kind):
      raise ValueError(f"{type(self).__name__} is kind {self.kind!r}, got kind={kind!r}")
    if config is None:
      return layer_config(**{**fields, "kind": kind or self.kind or "iha"})
    given = [name for name, value in fields.items() if value != _FIELD_DEFAULTS[name]]
    if given:
      raise ValueError(
        f"config= holds every field of the layer; got {', '.join(given)} beside it: set "
        "them in the AttentionConfig (dataclasses.replace(config, ...))"
      )
    return config

  @classmethod
  def from_config(
    cls,
    config: AttentionConfig,
    *,
    rngs: nnx.Rngs,
    param_dtype: Any = jnp.float32,
    kernel_init: Initializer = DEFAULT_KERNEL_INIT,
    mixing_noise_std: float = 0.0,
    deterministic: bool | None = None,
  ) -> Attention:
    """The layer of `config` (taken as it is): on `Attention` itself, the kind's named
    class where one exists (e.g. `InterleavedHeadAttention` for "iha"), else `Attention`."""
    if cls is Attention:
      cls = Attention._named.get(config.kind, Attention)
    return cls(
      config=config,
      rngs=rngs,
      param_dtype=param_dtype,
      kernel_init=kernel_init,
      mixing_noise_std=mixing_noise_std,
      deterministic=deterministic,
    )

  def __call__(
    self,
    x: jax.Array,
    *,
    mask: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    positions: jax.Array | None = None,
    layer: int | jax.Array | None = None,
    cache: LayerCache | None = None,
    deterministic: bool | None = None,
    rngs: nnx.Rngs | nnx.RngStream | None = None,
    return_probabilities: bool = False,
    context: jax.Array | ContextCache | None = None,
  ) -> Any:
    """One call of the layer (`iha_jax.nn.call.apply_layer`).

    Args:
      x: `[B, N, D]`.
      mask: key validity in flax's convention, `[B, 1, 1, N]` bool (True: a real token);
        False keys are padding (never seen, zero outputs). Other masks are refused: use
        `causal`, `window` and `segment_ids`.
      segment_ids: `[B, N]` int32 packed-sequence ids (0 = padding).
      positions: `[B, N]` int32 token positions (default `arange(N)`; RoPE only).
      layer: overrides the configured layer number (may be traced, e.g. in a scan).
      cache: a `LayerCache` (`init_cache`): x holds each row's next N tokens after the
        `cache.length[b]` it holds (a prompt, then one token per call; `mask` marks
        padding among them, a ragged batch); returns `(y, cache)`.
      deterministic: True: no dropout; None: the constructor's (cached calls and
        probabilities never drop out).
      rngs: the dropout stream (`nnx.Rngs` or its `dropout` stream); None: the kept one.
      return_probabilities: also return the attention probabilities over the virtual
        sequence, float32 `[B, H, T, T]` (`T = N * P`; IHA and MHA): `(y, probs)`.
      context: `[B, M, D]`: cross-attention, queries from x, keys and values from the
        context (`iha_jax.nn.cross`; IHA and MHA built with causal=False, window=None,
        rope_theta=None); `mask` then says which context tokens are valid, `[B, 1, 1, M]`.
        Or the context's `ContextCache` (`cache_context`), projected once for many calls.

    Returns:
      `y: [B, N, out_features]`, or `(y, cache)` with a cache, or `(y, probs)`.
    """
    return call_layer(
      self.param_values(),
      x,
      self.config,
      mask=mask,
      segment_ids=segment_ids,
      positions=positions,
      layer=layer,
      cache=cache,
      dropout_rng=lambda: self._dropout_rng(deterministic, rngs),
      return_probabilities=return_probabilities,
      context=context,
    )

  def _dropout_rng(
    self, deterministic: bool | None, rngs: nnx.Rngs | nnx.RngStream | None
  ) -> jax.Array | None:
    """A dropout key, or None when deterministic (flax's `nnx.MultiHeadAttention` rules)."""
    deterministic = self.deterministic if deterministic is None else deterministic
    if deterministic is None:
      raise ValueError(
        f"dropout_rate={self.config.dropout_rate}: pass deterministic=True (no dropout) or "
        "False to the call or the constructor (or nnx.view(model, deterministic=...))"
      )
    if deterministic:
      return None
    stream = rngs.dropout if isinstance(rngs, nnx.Rngs) else rngs
    stream = self.rngs if stream is None else stream
    if stream is None:
      raise ValueError("dropout needs rngs: pass rngs= to the call (the layer kept none)")
    return stream()

  def init_cache(
    self, batch: int, max_len: int, *, mode: str = "source", dtype: Any = None
  ) -> LayerCache:
    """An empty `LayerCache` for `batch` rows of at most `max_len` tokens each (mode
    "source" or "pseudo": `iha_jax.nn.cache`)."""
    return init_layer_cache(self.config, batch, max_len, mode, dtype)

  def cache_context(
    self, context: jax.Array, *, mask: jax.Array | None = None, mode: str = "source"
  ) -> ContextCache:
    """The keys and values of `context: [B, M, D]` projected once, for every call
    `layer(x, context=cache)` over it (equal to `layer(x, context=context, mask=mask)`);
    `mask`: flax's `[B, 1, 1, M]` valid context tokens; mode "source" or "pseudo"
    (`iha_jax.nn.cross`)."""
    return cache_context(self.param_values(), context, self.config, mask, mode)

  def param_values(self) -> dict[str, jax.Array]:
    """`{name: array}` of the layer's parameters (`iha_jax.nn.call.apply_layer`'s)."""
    return {name: getattr(self, name)[...] for name in self._param_names}


# The constructor's defaults of the layer's fields: `config=` refuses any other value.
_FIELD_DEFAULTS = {
  name: parameter.default
  for name, parameter in inspect.signature(Attention.__init__).parameters.items()
  if parameter.kind is inspect.Parameter.KEYWORD_ONLY
  or name in ("model_dim", "num_heads", "head_dim")
}


class InterleavedHeadAttention(Attention):
  """Interleaved Head Attention layer, causal or bidirectional, optionally windowed.

  A drop-in for a multi-head attention layer (docs/your_model.md):

      attn = InterleavedHeadAttention(
        D, num_heads=8, head_dim=64, num_pseudo=2, rope_theta=None, rngs=nnx.Rngs(0)
      )
      y = attn(x)  # x: [B, N, D] -> [B, N, D]

  Defaults to know: RoPE is ON (`rope_theta=10000.0`) at virtual positions `pos*P + p`;
  pass `rope_theta=None` when your model adds its own positions. `num_pseudo=None` means
  P = H, the paper's default: a global layer then does P^2 = H^2 times MHA's attention
  work, so choose a small P (2-4) unless you mean it. The layer is causal (`causal=False`:
  bidirectional). `window` counts VIRTUAL tokens (N * P per sequence): `window=8` at P = 2
  reaches 4 tokens back; `window_tokens=8` counts tokens (8 * P virtual tokens), which
  reaches tokens n-8..n, one more than an MHA layer's `window_tokens=8` (n-7..n).

  Parameters: `wq: [D, H, d]`, `wk, wv: [D, G, d]`, `wo: [H, d, D]`, `alpha_q: [H, H, P]`
  and `alpha_k, alpha_v: [G, G, P]` (source, target, pseudo), `collapse: [H, H, P]`
  ("full") or `[H, P]` ("per_head"); G = `num_kv_heads` (None: G = H). Mixing and collapse
  start at the identity (docs/design.md §1). Options and the call as `Attention`.
  """

  kind = "iha"


class MultiHeadAttention(Attention):
  """Standard multi-head attention with the same conventions as IHA: `wq: [D, H, d]`,
  `wk, wv: [D, G, d]`, `wo: [H, d, D]`; `window` in tokens; causal and with RoPE by
  default. `num_kv_heads` G < H is grouped-query attention (query head h reads key/value
  head `h // (H // G)`). IHA's own options (`num_pseudo`, `collapse_mode`) are refused."""

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


class PairedHeadAttention(Attention):
  """Paired-head attention: groups of P = `num_pseudo` consecutive heads (None: 2, P
  dividing H) attend over `N * P` virtual tokens, virtual token `n*P + p` of group j
  holding head `j*P + p` (RoPE at `pos*P + p`; `window` in VIRTUAL tokens, as IHA's).
  Parameters as MHA's: `wq: [D, H, d]`, `wk, wv: [D, G, d]`, `wo: [H, d, D]`; no mixing."""

  kind = "pha"
