"""Shared pytest setup: float32 oracles at highest matmul precision on CPU."""

import os

# Fake CPU devices must be requested before the backend starts; sharding tests use 8.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
jax.config.update("jax_threefry_partitionable", True)
