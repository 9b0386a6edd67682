#!/usr/bin/env bash
# Create the torch-floor environment: torch==2.9.0 (pyproject's floor), commfuse editable from this
# working tree, and the test extras; ci/test_torch_floor.sh runs the CPU tests there. torch 2.9.0 from
# PyPI is its CUDA build with NVIDIA's libraries (it does not import without them, even on a CPU), but
# without torch-xla. Idempotent: a venv that already has the pinned torch is reused as it is.
#   COMMFUSE_FLOOR_VENV  where it lives (default: ~/.cache/commfuse/venv-floor)
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${COMMFUSE_FLOOR_VENV:-$HOME/.cache/commfuse/venv-floor}"
python="${PYTHON:-python3}"
torch_version="2.9.0"

if [ ! -x "$venv/bin/python" ]; then
    mkdir -p "$(dirname "$venv")"
    "$python" -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --upgrade pip
fi
if ! "$venv/bin/python" -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '$torch_version')" 2>/dev/null; then
    "$venv/bin/python" -m pip install --quiet "torch==$torch_version"
fi
"$venv/bin/python" -m pip install --quiet "pluggy>=1.3,<2" "pytest>=7.4" "hypothesis>=6.80" numpy "matplotlib>=3.7" \
    "import-linter>=2.1" "setuptools>=77"
"$venv/bin/python" -m pip install --quiet --no-deps -e .
echo "commfuse torch-floor environment ready: $venv ($("$venv/bin/python" -c 'import torch, commfuse; print("torch", torch.__version__, "commfuse", commfuse.__version__)'))"
