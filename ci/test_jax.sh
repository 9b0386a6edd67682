#!/usr/bin/env bash
# The JAX stage: set up the separate JAX environment (ci/setup_jax.sh), then on CPU host devices run
# every op and algorithm through commfuse's public ops on torchax tensors inside jax.jit(shard_map)
# at world sizes 2, 3, 4 and 8 (float32 and bfloat16, forward and backward, against plain torch),
# check each case's lowered HLO against its schedule, run a few cases across two processes of two
# devices each, and run the backend's tests. Extra arguments go to pytest.
#   COMMFUSE_JAX_VENV  the JAX environment (default: ~/.cache/commfuse/venv-jax)
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/setup_jax.sh
venv="${COMMFUSE_JAX_VENV:-$HOME/.cache/commfuse/venv-jax}"
"$venv/bin/python" -m commfuse_jax.verify --world-sizes 2 3 4 8 --dtypes float32 bfloat16 --hlo
"$venv/bin/python" -m commfuse_jax.verify --processes 2
"$venv/bin/python" -m pytest backends/jax/tests -p no:cacheprovider "$@"
