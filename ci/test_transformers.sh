#!/usr/bin/env bash
# The transformers stage: whole HuggingFace transformers decoder models (Llama, Mistral, Qwen2, Qwen3, Gemma 2
# and 3, Phi-3, OLMo 2, Qwen3-MoE, Mixtral, Granite, Cohere, StarCoder2, SmolLM3, GLM-4, HunYuan, EXAONE 4)
# built from small configs, trained on 2 gloo ranks under torch's tensor-parallel plan, commfuse's per-linear
# styles and commfuse's block styles, each against the model in one process (tests/transformers_stage); prints
# the table of runs. It runs in the main environment: the pinned transformers is commfuse's hf extra, which
# ci/setup.sh installs beside torch 2.13 without replacing it; a missing or other version runs the set-up.
# Extra arguments go to pytest.
#   COMMFUSE_VENV  the environment (default: .venv in the repo)
set -euo pipefail
cd "$(dirname "$0")/.."
export COMMFUSE_LAUNCH_START="${COMMFUSE_LAUNCH_START:-forkserver}"
venv="${COMMFUSE_VENV:-.venv}"
pinned() {
    "$venv/bin/python" - <<'PY' 2>/dev/null
import pathlib, re, sys
from importlib.metadata import version
pin = re.search(r'"transformers==([^"]+)"', pathlib.Path("pyproject.toml").read_text()).group(1)
sys.exit(0 if version("transformers") == pin else 1)
PY
}
if [ ! -x "$venv/bin/python" ] || ! pinned; then
    bash ci/setup.sh
fi
"$venv/bin/python" -m pytest tests/transformers_stage -p no:cacheprovider -s "$@"
