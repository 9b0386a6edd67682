#!/usr/bin/env bash
# Install the vendor backend distributions (backends/cuda, npu, xla, jax, tpu, _template) into the
# project's environment (ci/setup.sh) and run their tests, then the conformance suite
# through the template backend. No vendor runtime is installed: each backend must
# install without pulling torch builds, torch_npu, torch_xla, torch_tpu, jax or torchax, and say why it cannot
# run here. Extra arguments go to every pytest run.
#   COMMFUSE_VENV  the environment (default: .venv in the repo)
set -euo pipefail
cd "$(dirname "$0")/.."
source ci/common.sh
set_up main setup.sh
venv="$(cd "${COMMFUSE_VENV:-.venv}" && pwd)"
py="$venv/bin/python"
torch_before="$("$py" -c 'import torch; print(torch.__version__)')"
"$py" -m pip install --quiet -e backends/cuda -e backends/npu -e backends/xla -e backends/jax -e backends/tpu \
    -e backends/_template
"$py" - "$torch_before" <<'PY'
import importlib.util, sys, torch
assert torch.__version__ == sys.argv[1], f"installing the backends changed torch: {sys.argv[1]} -> {torch.__version__}"
for vendor in ("torch_npu", "torch_xla", "torch_tpu", "jax", "torchax"):
    assert importlib.util.find_spec(vendor) is None, f"installing the backends pulled in {vendor}"
print(f"backends installed; torch {torch.__version__} untouched, no torch_npu, torch_xla, torch_tpu, jax or torchax")
PY
"$venv/bin/commfuse" backends
"$py" -m pytest backends/cuda/tests backends/npu/tests backends/xla/tests backends/jax/tests backends/tpu/tests \
    -p no:cacheprovider "$@"
# The template is tested from its own folder: its tests/conftest.py is the vendor's fixtures file. Its plugin
# tests and two tiers show the fixtures file plugs the suite in; the whole suite runs against the template once,
# at world size 3 below (gloo's runs at 2 in the main suite and at 3 and 4 in ci/test.sh: the template at 2
# as well would repeat them).
(cd backends/_template && "$py" -m pytest -p no:cacheprovider -k "template_plugin or transport or determinism" "$@")
report="${TMPDIR:-/tmp}/commfuse-template-conformance-n3.json"
"$venv/bin/commfuse" conformance --backend template --world-size 3 \
    --capabilities commfuse_template.conformance:Capabilities --report "$report"
