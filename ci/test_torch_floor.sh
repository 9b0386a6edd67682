#!/usr/bin/env bash
# The torch floor: the unit, gloo and conformance tests (tests/unit, tests/distributed,
# tests/conformance) again on the oldest torch pyproject.toml admits, in an environment of
# its own (ci/setup_floor.sh: torch 2.9.0 with the NVIDIA libraries it needs to import, without torch-xla),
# with commfuse from this working tree. tests/unit/test_packaging.py holds pyproject's
# floor to the torch pinned there. Extra arguments go to pytest.
#   COMMFUSE_FLOOR_VENV  the environment (default: ~/.cache/commfuse/venv-floor)
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/setup_floor.sh
venv="${COMMFUSE_FLOOR_VENV:-$HOME/.cache/commfuse/venv-floor}"
"$venv/bin/python" -c 'import commfuse, torch; print("torch floor:", torch.__version__, "commfuse from", commfuse.__file__)'
"$venv/bin/python" -m pytest tests/unit tests/distributed tests/conformance -p no:cacheprovider "$@"
