#!/usr/bin/env bash
# The torch floor: the unit, gloo and conformance tests (tests/unit, tests/distributed,
# tests/conformance) again on the oldest torch pyproject.toml admits, in the XLA stage's
# environment (ci/setup_xla.sh: torch 2.9.0, so no second download), with commfuse
# from this working tree. tests/unit/test_packaging.py holds pyproject's floor to the
# torch pinned there. The XLA backend's own tests are ci/test_xla.sh's. Extra arguments
# go to pytest.
#   COMMFUSE_XLA_VENV  the environment (default: ~/.cache/commfuse/venv-xla)
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/setup_xla.sh
venv="${COMMFUSE_XLA_VENV:-$HOME/.cache/commfuse/venv-xla}"
"$venv/bin/python" -c 'import commfuse, torch; print("torch floor:", torch.__version__, "commfuse from", commfuse.__file__)'
"$venv/bin/python" -m pytest tests/unit tests/distributed tests/conformance -p no:cacheprovider "$@"
