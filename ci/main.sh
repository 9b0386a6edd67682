#!/usr/bin/env bash
# Set up (ci/setup.sh) and run the main job on this machine (CPU, no accelerator).
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/setup.sh
venv="${COMMFUSE_VENV:-.venv}"
"$venv/bin/commfuse" schedule show all_gather --world-size 4 --algorithm ring
"$venv/bin/commfuse" schedule show reduce_scatter --world-size 4 --algorithm ring
