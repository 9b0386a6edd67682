#!/usr/bin/env bash
# Create the separate JAX environment that backends/jax is verified in: torch==2.13.0 (CPU),
# jax[cpu]==0.10.2 (the newest JAX for Python 3.11), torchax (torch ops on JAX arrays),
# commfuse core and commfuse-jax editable, and pytest. Never the main venv: JAX and torchax
# are the JAX backend's platform, not commfuse's dependencies (~1.5 GB, ~1 min to install).
# Idempotent: a venv that already has the pinned versions is reused as it is.
#   COMMFUSE_JAX_VENV  where it lives (default: ~/.cache/commfuse/venv-jax,
#                      outside the work tree so fresh clones on one machine share it)
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${COMMFUSE_JAX_VENV:-$HOME/.cache/commfuse/venv-jax}"
python="${PYTHON:-python3}"
torch_version="2.13.0"
jax_version="0.10.2"
# 0.0.13 fails to import on torch 2.13 (torch removed aten.prod.dim_Dimname); this build is the first that imports.
torchax_version="0.0.14.dev20261026"

if [ ! -x "$venv/bin/python" ]; then
    mkdir -p "$(dirname "$venv")"
    "$python" -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --upgrade pip
fi
have() {
    "$venv/bin/python" - "$torch_version" "$jax_version" "$torchax_version" <<'PY' 2>/dev/null
import sys
from importlib.metadata import version
got = (version("torch").split("+")[0], version("jax"), version("torchax"))
sys.exit(0 if got == tuple(sys.argv[1:]) else 1)
PY
}
if ! have; then
    # torch first and alone: a bare torch requirement (torchax's) could otherwise pull a CUDA build.
    "$venv/bin/python" -m pip install --quiet "torch==$torch_version"
    "$venv/bin/python" -m pip install --quiet "torch==$torch_version" "jax[cpu]==$jax_version" "torchax==$torchax_version"
fi
"$venv/bin/python" -m pip install --quiet "pluggy>=1.3,<2" "pytest>=7.4" numpy "setuptools>=77"
"$venv/bin/python" -m pip install --quiet --no-deps -e . -e backends/jax
echo "commfuse JAX environment ready: $venv ($("$venv/bin/python" -c 'import torch, jax, torchax, commfuse; print("torch", torch.__version__, "jax", jax.__version__, "torchax", torchax.__version__ if hasattr(torchax, "__version__") else "?", "commfuse", commfuse.__version__)'))"
