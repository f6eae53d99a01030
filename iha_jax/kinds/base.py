"""The record of an attention kind (`AttentionKind`; `iha_jax.kinds` says what it holds)
and the parameter specs and projections the records share.

The base class holds the defaults of a plain attention layer (`wq, wk, wv: [D, H, d]`,
`wo: [H, d, D]`, RoPE, one virtual token per token); each kind overrides what differs.
Records are stateless singletons registered in `iha_jax.kinds.registry`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, NamedTuple, Protocol

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from iha_jax.checks import warn_deprecated
from iha_jax.core.masking import visible_pairs
from iha_jax.core.norm import rms_norm
from iha_jax.core.options import AttentionOptions
from iha_jax.kinds.initializers import fold_fan_in
from iha_jax.parallel.axes import EMBED, HEAD_DIM, HEADS, KV_HEADS

Initializer = jax.nn.initializers.Initializer
Params = Mapping[str, jax.Array]
# An implementation: the kind's arrays, then the checked `AttentionOptions` -> the outputs
# (bind anything else, e.g. a kernel's platform, with functools.partial).
Implementation = Callable[..., jax.Array]

# Names for remat policies (e.g. `jax.checkpoint_policies.save_only_these_names`): the
# q/k/v projections and the core's output are what a memory-efficient attention backward
# needs, so saving them avoids recomputing the projections and the forward core.
QUERY_PROJ = "query_proj"
KEY_PROJ = "key_proj"
VALUE_PROJ = "value_proj"
ATTENTION_OUT = "attention_out"
# qk_norm's epsilon (Qwen 3's and Gemma 3's).
QK_NORM_EPS = 1e-6
# `AttentionConfig` fields read by the kinds whose projections are `project_qkv`'s.
PROJECTION_OPTIONS = ("qk_norm", "use_bias")


class LayerConfig(Protocol):
  """What the records read of a layer's configuration (`AttentionConfig`)."""

  @property
  def model_dim(self) -> int: ...
  @property
  def num_heads(self) -> int: ...
  @property
  def head_dim(self) -> int: ...
  @property
  def kind(self) -> str: ...
  @property
  def num_kv_heads(self) -> int | None: ...
  @property
  def kv_heads(self) -> int: ...
  @property
  def value_dim(self) -> int: ...
  @property
  def output_dim(self) -> int: ...
  @property
  def window(self) -> int | None: ...
  @property
  def causal(self) -> bool: ...
  @property
  def qk_norm(self) -> bool: ...
  @property
  def use_bias(self) -> bool: ...


class ParamSpec(NamedTuple):
  """Shape, logical axis names and initializer of one parameter."""

  shape: tuple[int, ...]
  axes: tuple[str, ...]
  init: Initializer


@dataclasses.dataclass(frozen=True)
class Letter:
  """A schedule letter of `TransformerLM`: the kind's global or sliding-window layer."""

  letter: str
  windowed: bool
  description: str


def projection_spec(
  cfg: LayerConfig,
  kernel_init: Initializer,
  width: int | None = None,
  heads: int | None = None,
  axis: str = HEADS,
) -> ParamSpec:
  """An input projection `[D, heads, width]` (default H heads of width d; `axis`: the
  heads' logical axis, `KV_HEADS` for key/value projections), fan-in D."""
  shape = (cfg.model_dim, heads or cfg.num_heads, width or cfg.head_dim)
  return ParamSpec(shape, (EMBED, axis, HEAD_DIM), fold_fan_in(kernel_init, 1))


def check_no_groups(cfg: LayerConfig, why: str) -> None:
  """Raises ValueError for `num_kv_heads` < `num_heads` in a kind without a grouped-query
  form (`why`)."""
  if cfg.kv_heads != cfg.num_heads:
    raise ValueError(
      f"num_kv_heads={cfg.num_kv_heads}: {cfg.kind} attention has no grouped-query form "
      f"({why}); leave num_kv_heads at None or num_heads={cfg.num_heads}"
    )


def output_spec(cfg: LayerConfig, kernel_init: Initializer) -> ParamSpec:
  """The output projection `wo: [H, dv, out]` (out: `cfg.output_dim`), fan-in H*dv."""
  shape = (cfg.num_heads, cfg.value_dim, cfg.output_dim)
  return ParamSpec(shape, (HEADS, HEAD_DIM, EMBED), fold_fan_in(kernel_init, 2))


# The projection biases of `use_bias` (`projection_option_specs`): never weight-decayed.
BIAS_PARAMS = ("bq", "bk", "bv", "bo")


def projection_option_specs(cfg: LayerConfig) -> dict[str, ParamSpec]:
  """The parameters of `qk_norm` (`q_norm, k_norm: [d]`, ones) and `use_bias` (`bq:
  [H, d]`, `bk, bv: [G, d]`, `bo: [out]`, zeros) of the kinds that `project_qkv`."""
  specs = {}
  d = cfg.head_dim
  if cfg.qk_norm:
    scale = ParamSpec((d,), (HEAD_DIM,), jax.nn.initializers.ones)
    specs.update(q_norm=scale, k_norm=scale)
  if cfg.use_bias:
    zeros = jax.nn.initializers.zeros
    kv_bias = ParamSpec((cfg.kv_heads, d), (KV_HEADS, HEAD_DIM), zeros)
    specs.update(bq=ParamSpec((cfg.num_heads, d), (HEADS, HEAD_DIM), zeros), bk=kv_bias, bv=kv_bias)
    specs["bo"] = ParamSpec((cfg.output_dim,), (EMBED,), zeros)
  return specs


def project(x: jax.Array, w: jax.Array, name: str | None = None) -> jax.Array:
  """`x: [B, N, D]` through `w: [D, ...]` -> `[B, N, ...]`, tagged `name` for remat."""
  y = jnp.einsum("bnD,D...->bn...", x, w)
  return y if name is None else checkpoint_name(y, name)


def _source_heads(params: Params, x: jax.Array, which: str, name: str) -> jax.Array:
  """Projection `w{which}` of `x`, plus its bias and RMSNorm where the layer has them."""
  y = project(x, params[f"w{which}"])
  if f"b{which}" in params:
    y = y + params[f"b{which}"]
  if f"{which}_norm" in params:
    y = rms_norm(y, params[f"{which}_norm"], QK_NORM_EPS)
  return checkpoint_name(y, name)


def project_qkv(params: Params, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Source-head projections `x: [B, N, D]` -> q `[B, N, H, d]`, k, v `[B, N, G, d]`, with
  biases and query/key RMSNorm where `params` has them, tagged for remat."""
  return (
    _source_heads(params, x, "q", QUERY_PROJ),
    _source_heads(params, x, "k", KEY_PROJ),
    _source_heads(params, x, "v", VALUE_PROJ),
  )


def project_out(params: Params, y: jax.Array) -> jax.Array:
  """Per-head outputs `y: [B, N, H, dv]` through `wo` (and `bo` where the layer has it)
  -> `[B, N, out]`."""
  out = jnp.einsum("bnhd,hdD->bnD", y, params["wo"])
  return out + params["bo"] if "bo" in params else out


class AttentionKind:
  """One attention kind: override what differs from plain multi-head attention.

  Class attributes:
    name: the kind's name (`AttentionConfig.kind`, the registry's key).
    letters: its schedule letters (global and/or sliding-window layers).
    implementations: `{name: callable}`, each taking the kind's arrays, then the checked
      `AttentionOptions` (positions defaulted), and computing the same function;
      "reference" and "xla" at least ("auto" picks one where `registry.resolve` names it).
    config_fields: `AttentionConfig` fields only this kind reads (e.g. IHA's
      `num_pseudo`); a model passes them to its layers of this kind only.
    virtual_tokens: the kind attends over virtual tokens (P per token): its window is
      in virtual tokens (`TransformerConfig.iha_window`), else in tokens (`mha_window`).
    default_num_pseudo: P when a layer's `num_pseudo` is None (kinds that read it);
      None: P = H (IHA's, the paper's default).
    uses_rope: False: the model gives its layers `rope_theta=None`.
    mixing_params: its identity-initialised head mixings (weight decay switch, noise).
    dropout_implementations: its implementations that apply attention dropout
      (`AttentionOptions.dropout_rate`); the others refuse a rate > 0 in one line.
    probability_implementations: `{"xla": callable}` (IHA, MHA; none otherwise): the
      arguments of `implementations` -> the attention probabilities, float32
      `[B, H, T, T]` over the kind's T virtual tokens.
    decodes: the layer's cached call, cross-attention and probabilities read the kind as
      pseudo-head attention (`entry_arrays`, `pseudo_heads`, `collapse`; wq, wk, wv, wo).
    sequence_roles: one per array argument of its implementations, "q" (query side),
      "kv" (key side) or "-": how a `context` mesh axis splits them
      (`iha_jax.parallel.context`); None: it cannot run sequence-sharded.
  """

  name: ClassVar[str]
  letters: ClassVar[tuple[Letter, ...]] = ()
  implementations: ClassVar[Mapping[str, Implementation]] = {}
  config_fields: ClassVar[tuple[str, ...]] = ()
  virtual_tokens: ClassVar[bool] = False
  default_num_pseudo: ClassVar[int | None] = None
  uses_rope: ClassVar[bool] = True
  mixing_params: ClassVar[tuple[str, ...]] = ()
  dropout_implementations: ClassVar[frozenset[str]] = frozenset()
  probability_implementations: ClassVar[Mapping[str, Implementation]] = {}
  decodes: ClassVar[bool] = False
  sequence_roles: ClassVar[tuple[str, ...] | None] = None

  def __init_subclass__(cls, **kwargs: Any):
    super().__init_subclass__(**kwargs)
    if "attend" in vars(cls):  # the layer method's old name: the layers no longer call it
      warn_deprecated(f"{cls.__name__}.attend", "entry_arrays (its arrays for registry.attend)")

  def __repr__(self) -> str:
    return f"<attention kind {self.name!r}>"

  # --- configuration ---------------------------------------------------------------

  def validate(self, cfg: LayerConfig) -> None:
    """Raises ValueError naming the field for a configuration this kind cannot run."""

  def layer_heads(self, num_heads: int) -> int:
    """Heads of this kind's layer in a model of `num_heads` heads (parameter-matched)."""
    return num_heads

  def layer_kv_heads(self, num_kv_heads: int) -> int:
    """Key/value heads of this kind's layer in a model of `num_kv_heads` of them."""
    return self.layer_heads(num_kv_heads)

  def value_dim(self, cfg: LayerConfig) -> int:
    """Width of each head's value and output."""
    return cfg.head_dim

  def num_pseudo(self, cfg: LayerConfig) -> int:
    """P, the pseudo-heads per head: the virtual tokens per token (1 for kinds without)."""
    return 1

  def pseudo_kv_heads(self, cfg: LayerConfig) -> int:
    """Heads of the pseudo-keys and pseudo-values `pseudo_heads` makes (a "pseudo" KV
    cache's heads): G = `cfg.kv_heads` unless the kind regroups them (PHA)."""
    return cfg.kv_heads

  # --- the entry point's call (`registry.attend`) ----------------------------------

  def check_arrays(self, *arrays: jax.Array, sliced: bool = False) -> None:
    """Raises ValueError naming the argument for arrays this kind cannot take (ranks,
    shapes, dtypes) before `attend` checks the options against the queries `arrays[0]`
    `[B, N, ...]`. `sliced=True` (kinds that decode only, a cached call): the keys may be
    longer than the queries."""

  def auto_inputs(self, *arrays: jax.Array) -> tuple[jax.Array, jax.Array | None, int]:
    """What "auto" weighs (`registry.resolve`): the queries `[B, N, H, d]`, the values
    `[B, N, G, dv]` (None: a kind without cuDNN or materialised paths) and the copies of
    q, k and v a materialising implementation makes (IHA's P)."""
    return arrays[0], None, 1

  # --- parameters and the layer's core ---------------------------------------------

  def param_specs(
    self, cfg: LayerConfig, kernel_init: Initializer, mixing_noise_std: float
  ) -> dict[str, ParamSpec]:
    """Every parameter of the layer, in creation order: `wq: [D, H, d]`, `wk, wv:
    [D, G, d]` (G = `cfg.kv_heads`), `wo: [H, d, out]`, then those of `qk_norm` and
    `use_bias` (`projection_option_specs`)."""
    kv_proj = projection_spec(cfg, kernel_init, heads=cfg.kv_heads, axis=KV_HEADS)
    return {
      "wq": projection_spec(cfg, kernel_init),
      "wk": kv_proj,
      "wv": kv_proj,
      "wo": output_spec(cfg, kernel_init),
      **projection_option_specs(cfg),
    }

  def core(
    self,
    params: Params,
    x: jax.Array,
    cfg: LayerConfig,
    options: AttentionOptions,
    layer: int | jax.Array,
  ) -> jax.Array:
    """`x: [B, N, D]` (computation dtype) -> per-head outputs `[B, N, H, dv]`, before
    the output projection `wo`. `layer` counts from 1 (may be traced)."""
    raise NotImplementedError

  def entry_arrays(
    self, params: Params, q: jax.Array, k: jax.Array, v: jax.Array, cfg: LayerConfig
  ) -> tuple[jax.Array, ...]:
    """The arrays of the kind's entry point on projected source heads q `[B, N, H, d]` and
    k, v `[B, Nk, G, d]`: those and the kind's mixings from `params` (IHA: `(q, k, v,
    alpha_q, alpha_k, alpha_v, collapse)`). Kinds that decode define it: the layer's
    cached call, cross-attention and probabilities pass them to `registry.attend`."""
    raise ValueError(
      f"{self.name} attention has no cached call, cross-attention or attention "
      "probabilities (its kind does not read as pseudo-head attention: "
      "AttentionKind.decodes); IHA, MHA and PHA layers have them"
    )

  # --- budgets (forward FLOPs; docs/design.md §2) ----------------------------------

  def core_flops(self, cfg: LayerConfig, seq_len: int) -> int:
    """Forward FLOPs of the attention core over one sequence of `seq_len` tokens, all
    heads: `4d` per visible (query, key) pair and head (QK and PV), counted over the
    kind's `seq_len * num_pseudo` positions with its window."""
    length = seq_len * self.num_pseudo(cfg)
    pairs = visible_pairs(length, cfg.window, cfg.causal)
    return cfg.num_heads * pairs * (2 * cfg.head_dim + 2 * self.value_dim(cfg))

  def mixing_flops(self, cfg: LayerConfig) -> int:
    """Forward FLOPs per token of head mixings outside the core (IHA's mix, collapse)."""
    return 0

  # --- pseudo-head view (a "pseudo" KV cache; kinds with `decodes`) -----------------

  def pseudo_heads(self, params: Params, cfg: LayerConfig, which: str, x: jax.Array):
    """Source heads `x: [B, N, H', d]` of projection `which` ("q": H' = H; "k", "v": H' =
    G) -> the heads the core attends with over virtual tokens, `[B, N * P, H', d]` (before
    RoPE; PHA: `[B, N * P, H/P, d]` queries, `pseudo_kv_heads` key/value heads)."""
    return x

  def collapse(self, params: Params, cfg: LayerConfig, out: jax.Array) -> jax.Array:
    """Attention outputs over virtual tokens `[B, N * P, H, d]` (PHA: `[B, N * P, H/P,
    d]`) -> `[B, N, H, d]`."""
    return out
