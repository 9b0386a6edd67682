#!/usr/bin/env bash
# Create the plain install's environment: a fresh virtual environment with torch alone (COMMFUSE_PLAIN_TORCH,
# default 2.14.1, the newest torch pip installs here), nothing of commfuse's. ci/test_plain_install.sh then
# installs commfuse into it without extras, as README tells a user to, and runs its checks. ci/test.sh makes it
# in the background while the main suite runs (downloading and unpacking torch waits on the network and the
# disk more than on the CPU); the stage makes its own when this one was not made.
#   COMMFUSE_PLAIN_VENV  where it goes (required: a path that does not exist yet, or an empty folder; the
#                        stage removes it when it ends)
set -euo pipefail
venv="${COMMFUSE_PLAIN_VENV:?COMMFUSE_PLAIN_VENV names the folder the plain environment goes in}"
python="${PYTHON:-python3}"
if [ -e "$venv" ] && [ -n "$(ls -A "$venv")" ]; then
    echo "ci/setup_plain.sh: $venv is not empty: the plain environment must be a fresh one" >&2
    exit 1
fi
"$python" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet "torch==${COMMFUSE_PLAIN_TORCH:-2.14.1}"
echo "plain environment ready: $venv (torch $("$venv/bin/python" -c 'import torch; print(torch.__version__)'))"
