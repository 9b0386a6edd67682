#!/usr/bin/env bash
# The JAX stage: set up the separate JAX environment (ci/setup_jax.sh), then on CPU host devices run
# every op and algorithm through commfuse's public ops on torchax tensors inside jax.jit(shard_map)
# at world sizes 2, 3, 4 and 8 (float32 and bfloat16, forward and backward, against plain torch),
# check each case's lowered HLO against its schedule, run a few cases across two processes of two
# devices each, and run the backend's tests (the conformance suite's traced tier among them). Extra
# arguments go to pytest.
#   COMMFUSE_JAX_VENV  the JAX environment (default: ~/.cache/commfuse/venv-jax)
set -euo pipefail
cd "$(dirname "$0")/.."
source ci/common.sh
set_up jax setup_jax.sh
venv="${COMMFUSE_JAX_VENV:-$HOME/.cache/commfuse/venv-jax}"
# XLA's compiled programs are kept beside the environment (JAX's persistent compilation cache, keyed by the
# lowered HLO, the compile options and jaxlib's version): a case whose HLO did not change since the last run
# loads its program instead of compiling it again. It is still traced, lowered, HLO-checked and executed.
export JAX_COMPILATION_CACHE_DIR="${JAX_COMPILATION_CACHE_DIR:-$venv/jax-compilation-cache}"
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=-1
export JAX_COMPILATION_CACHE_MAX_SIZE=$((1 << 30))  # bytes; the least recently used programs go first
"$venv/bin/python" -m commfuse_jax.verify --world-sizes 2 3 4 8 --dtypes float32 bfloat16 --hlo
"$venv/bin/python" -m commfuse_jax.verify --processes 2
"$venv/bin/python" -m pytest backends/jax/tests -p no:cacheprovider "$@"
