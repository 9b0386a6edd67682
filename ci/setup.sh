#!/usr/bin/env bash
# Create the project's virtual environment and install commfuse with the extras
# the tests use (test, bench, and hf: transformers, for commfuse's layers inside
# its models). torch==2.13.0 goes in first: a bare torch requirement on a
# machine without it can pull a multi-GB CUDA build.
#   COMMFUSE_VENV  where the environment lives (default: .venv in the repo)
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${COMMFUSE_VENV:-.venv}"
python="${PYTHON:-python3}"
if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv "$venv"
fi
"$venv/bin/python" -m pip install --quiet --upgrade pip
"$venv/bin/python" -m pip install --quiet "torch==2.13.0"
# pyproject.toml's package-dir makes the editable install a path entry for the clone's root, so commfuse imports
# from any folder, also from the one that holds the clone (tests/unit/test_editable_install.py)
"$venv/bin/python" -m pip install --quiet -e ".[test,bench,hf]"
echo "commfuse environment ready: $venv ($("$venv/bin/python" -c 'import torch, commfuse; print("torch", torch.__version__, "commfuse", commfuse.__version__)'))"
