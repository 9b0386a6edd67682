#!/usr/bin/env bash
# Set up (ci/setup.sh) and run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/setup.sh
venv="${COMMFUSE_VENV:-.venv}"
exec "$venv/bin/python" -m pytest "$@"
