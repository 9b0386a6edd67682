#!/usr/bin/env bash
# Create the torch-floor environment: torch==2.9.0 (pyproject's floor), commfuse editable from this
# working tree, and the test extras; ci/test_torch_floor.sh runs the CPU tests there. PyPI has torch 2.9.0
# for Linux x86_64 only as its CUDA build, which does not import without NVIDIA's libraries, even on a CPU
# (libtorch_cuda.so links cuBLAS, cuDNN, NCCL ...): about 3 GB to download, 6.9 GB installed. uv, installed
# into the environment first, downloads them in parallel (3m52s where pip took 7m15s, both cold, without
# torch-xla). Idempotent: a venv whose torch imports at the pinned version is reused as it is.
#   COMMFUSE_FLOOR_VENV  where it lives (default: ~/.cache/commfuse/venv-floor,
#                        outside the work tree so fresh clones on one machine share it)
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${COMMFUSE_FLOOR_VENV:-$HOME/.cache/commfuse/venv-floor}"
python="${PYTHON:-python3}"
torch_version="2.9.0"
uv_version="0.13.9"

if [ ! -x "$venv/bin/python" ]; then
    mkdir -p "$(dirname "$venv")"
    "$python" -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --upgrade pip
fi
if ! "$venv/bin/python" -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '$torch_version')" 2>/dev/null; then
    "$venv/bin/python" -m pip install --quiet "uv==$uv_version"
    # uv's cache inside the venv's folder: the venv's files are hard links into it, which stay once the cache
    # is removed, so the 6.6 GB are written once and not kept twice
    UV_CACHE_DIR="$venv/uv-cache" "$venv/bin/uv" pip install --quiet --python "$venv/bin/python" "torch==$torch_version"
    rm -rf "$venv/uv-cache"
fi
"$venv/bin/python" -m pip install --quiet "pluggy>=1.3,<2" "pytest>=7.4" "hypothesis>=6.80" numpy "matplotlib>=3.7" \
    "import-linter>=2.1" "setuptools>=77" "pytest-xdist>=3.5"
"$venv/bin/python" -m pip install --quiet --no-deps -e .
echo "commfuse torch-floor environment ready: $venv ($("$venv/bin/python" -c 'import torch, commfuse; print("torch", torch.__version__, "commfuse", commfuse.__version__)'))"
