#!/usr/bin/env bash
# Create the separate XLA environment that backends/xla is verified in:
# torch==2.9.0 + torch-xla==2.9.0 (CPU plugin, PJRT_DEVICE=CPU), commfuse core
# and commfuse-xla editable, and the test and bench extras: ci/test_torch_floor.sh
# runs the CPU tests there too, 2.9 being commfuse's torch floor. Never the main
# venv: torch-xla pins its own torch (a ~4 GB CUDA build from PyPI; the venv is
# ~7 GB, ~3 min to install).
# Idempotent: a venv that already has the pinned versions is reused as it is.
#   COMMFUSE_XLA_VENV  where it lives (default: ~/.cache/commfuse/venv-xla,
#                      outside the work tree so fresh clones on one machine share it)
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${COMMFUSE_XLA_VENV:-$HOME/.cache/commfuse/venv-xla}"
python="${PYTHON:-python3}"
torch_version="2.9.0"
xla_version="2.9.0"

if [ ! -x "$venv/bin/python" ]; then
    mkdir -p "$(dirname "$venv")"
    "$python" -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --upgrade pip
fi
have() {
    "$venv/bin/python" - "$torch_version" "$xla_version" <<'PY' 2>/dev/null
import sys
from importlib.metadata import version
sys.exit(0 if (version("torch").split("+")[0], version("torch_xla").split("+")[0]) == tuple(sys.argv[1:]) else 1)
PY
}
if ! have; then
    # One resolver run: torch-xla 2.9.0 pins torch 2.9.0 exactly.
    "$venv/bin/python" -m pip install --quiet "torch==$torch_version" "torch-xla==$xla_version"
fi
# Core and the backend without re-resolving torch (already pinned above).
"$venv/bin/python" -m pip install --quiet "pluggy>=1.3,<2" "tomli>=1.1; python_version < '3.11'" \
    "pytest>=7.4" "hypothesis>=6.80" numpy "matplotlib>=3.7" "import-linter>=2.1" "setuptools>=77"
"$venv/bin/python" -m pip install --quiet --no-deps -e . -e backends/xla
echo "commfuse XLA environment ready: $venv ($(PJRT_DEVICE=CPU "$venv/bin/python" -c 'import torch, torch_xla, commfuse; print("torch", torch.__version__, "torch_xla", torch_xla.__version__, "commfuse", commfuse.__version__)'))"
