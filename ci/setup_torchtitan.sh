#!/usr/bin/env bash
# Create the torchtitan environment that commfuse.integrations.torchtitan is tested in:
# torch==2.13.0 (CPU), torchtitan 0.3.0 from PyPI with its own requirements (torch held
# at 2.13.0 by a constraint, so the resolver cannot swap in another build), and
# commfuse editable with its test requirements. Never the main venv: torchtitan pulls
# datasets, wandb, tensorboard and tyro, none of which commfuse needs.
# Idempotent: a venv that already has the pinned versions is reused as it is.
#   COMMFUSE_TORCHTITAN_VENV  where it lives (default: ~/.cache/commfuse/venv-torchtitan)
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${COMMFUSE_TORCHTITAN_VENV:-$HOME/.cache/commfuse/venv-torchtitan}"
python="${PYTHON:-python3}"
torch_version="2.13.0"
torchtitan_version="0.3.0"

if [ ! -x "$venv/bin/python" ]; then
    mkdir -p "$(dirname "$venv")"
    "$python" -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --upgrade pip
fi
have() {
    "$venv/bin/python" - "$torch_version" "$torchtitan_version" <<'PY' 2>/dev/null
import sys
from importlib.metadata import version
sys.exit(0 if (version("torch").split("+")[0], version("torchtitan")) == tuple(sys.argv[1:]) else 1)
PY
}
if ! have; then
    constraints="$(mktemp)"
    echo "torch==$torch_version" > "$constraints"
    "$venv/bin/python" -m pip install --quiet "torch==$torch_version"
    "$venv/bin/python" -m pip install --quiet -c "$constraints" "torchtitan==$torchtitan_version"
    rm -f "$constraints"
fi
"$venv/bin/python" -m pip install --quiet "pluggy>=1.3,<2" "pytest>=7.4" "hypothesis>=6.80"
"$venv/bin/python" -m pip install --quiet --no-deps -e .
echo "commfuse torchtitan environment ready: $venv ($("$venv/bin/python" -c 'import torch, commfuse; from importlib.metadata import version; print("torch", torch.__version__, "torchtitan", version("torchtitan"), "commfuse", commfuse.__version__)'))"
