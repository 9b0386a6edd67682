"""XLA tests run on XLA:CPU when torch_xla is importable (the environment of ci/setup_xla.sh)."""

import os

# Must be set before torch_xla is first imported; harmless where torch_xla is absent.
os.environ.setdefault("PJRT_DEVICE", "CPU")
