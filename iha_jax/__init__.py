"""iha-jax: Interleaved Head Attention (Duvvuri et al., 2026) in JAX/Flax."""

__version__ = "0.1.0"
