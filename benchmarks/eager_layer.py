"""A warm tiny layer called eagerly (outside jit): this package's NNX layers against flax's
`nnx.MultiHeadAttention`, median of warm calls.

    PYTHONPATH=. .venv/bin/python benchmarks/eager_layer.py [--repeats 20]

B 1, N 8, D 32, H 4 (d 8), float32, causal; IHA at P = 2. Prints each layer's median
milliseconds and its ratio to flax's; the last row is the layer's body run op by op
(`iha_jax.nn.call.apply_layer` outside jit: what an eager call ran before
`iha_jax.nn.eager` compiled it once per configuration).
"""

from __future__ import annotations

import argparse
import statistics

import jax
import jax.numpy as jnp
from flax import nnx

from benchmarks.timing import call_times
from iha_jax.nn import InterleavedHeadAttention, MultiHeadAttention
from iha_jax.nn.call import apply_layer

B, N, D, H = 1, 8, 32, 4


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--repeats", type=int, default=20)
  args = parser.parse_args()
  x = jax.random.normal(jax.random.key(0), (B, N, D))
  causal = jnp.tril(jnp.ones((N, N), bool))[None, None]
  flax_layer = nnx.MultiHeadAttention(
    num_heads=H, in_features=D, decode=False, deterministic=True, rngs=nnx.Rngs(0)
  )
  layers = {
    "flax nnx.MultiHeadAttention (causal mask)": lambda: flax_layer(x, mask=causal),
    "iha_jax MultiHeadAttention": MultiHeadAttention(D, H, D // H, rngs=nnx.Rngs(0)),
    "iha_jax InterleavedHeadAttention P=2": InterleavedHeadAttention(
      D, H, D // H, num_pseudo=2, rngs=nnx.Rngs(0)
    ),
  }
  iha = layers["iha_jax InterleavedHeadAttention P=2"]
  layers["iha_jax InterleavedHeadAttention P=2, op by op (apply_layer)"] = lambda: apply_layer(
    iha.param_values(), x, iha.config
  )
  medians = {}
  for name, layer in layers.items():
    call = layer if not isinstance(layer, nnx.Module) else (lambda layer=layer: layer(x))
    medians[name] = 1e3 * statistics.median(call_times(call, args.repeats, warmup=3))
  reference = medians["flax nnx.MultiHeadAttention (causal mask)"]
  print(f"eager warm call, B {B} N {N} D {D} H {H}, median of {args.repeats}, {jax.devices()[0]}")
  print("| layer | ms | / flax |")
  print("| --- | --- | --- |")
  for name, ms in medians.items():
    print(f"| {name} | {ms:.2f} | {ms / reference:.2f} |")


if __name__ == "__main__":
  main()
