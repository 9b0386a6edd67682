#!/usr/bin/env bash
# The torchtitan stage: set up its own environment (ci/setup_torchtitan.sh: torch 2.13 CPU,
# torchtitan 0.3.0 from PyPI, commfuse editable), then run tests/torchtitan_stage there on gloo
# ranks: torchtitan's own Llama 3 with commfuse's modules against its stock TP plan, its
# MoE against commfuse.nn.MoE, and the seam checks (a torchtitan release that moved
# what the integration builds on fails here by name). Extra arguments go to pytest.
#   COMMFUSE_TORCHTITAN_VENV  the environment (default: ~/.cache/commfuse/venv-torchtitan)
set -euo pipefail
cd "$(dirname "$0")/.."
source ci/common.sh
set_up torchtitan setup_torchtitan.sh
venv="${COMMFUSE_TORCHTITAN_VENV:-$HOME/.cache/commfuse/venv-torchtitan}"
"$venv/bin/python" -m pytest tests/torchtitan_stage -p no:cacheprovider "$@"
