#!/usr/bin/env bash
# The XLA stage: set up the separate torch-xla environment (ci/setup_xla.sh), then on
# XLA:CPU (PJRT_DEVICE=CPU) run world size 1 end to end and check the traced HLO of world
# sizes 2, 3, 4 and 8 without executing it (python -m commfuse_xla.verify), then the
# backend's tests in that environment. Extra arguments go to pytest.
#   COMMFUSE_XLA_VENV  the XLA environment (default: ~/.cache/commfuse/venv-xla)
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/setup_xla.sh
venv="${COMMFUSE_XLA_VENV:-$HOME/.cache/commfuse/venv-xla}"
export PJRT_DEVICE=CPU
"$venv/bin/python" -m commfuse_xla.verify --world-sizes 1 2 3 4 8
"$venv/bin/python" -m pytest backends/xla/tests -p no:cacheprovider "$@"
