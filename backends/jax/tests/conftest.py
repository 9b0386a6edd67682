"""The JAX tests run on 8 CPU host devices where jax is importable (the environment of ci/setup_jax.sh)."""

import os

# Must be set before jax is first imported; harmless where jax is absent.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
