#!/usr/bin/env bash
# The plain install: what README's "Use it in your model" tells a user to run, with nothing else around it.
# A fresh virtual environment gets the newest torch pip installs here (COMMFUSE_PLAIN_TORCH, default 2.14.1:
# a CUDA build that runs on the CPU, about two minutes to install, so this stage is also the suites' check on
# the newest torch; the main suite runs on README's torch==2.13.0 and the floor stage on 2.9.0) and then
# commfuse from this checkout with NO extras, and the commands that need no extra must work:
# --help, simulate and its subcommands, schedule show, backends, the ops and layers on 2 gloo ranks, the
# bench (which needs no numpy), the README's example under torchrun. The parts that need an extra must refuse
# before any work and say how to install it: conformance (pytest, the 'test' extra) and bench --plot
# (matplotlib, the 'bench' extra). Every check says what it runs; the first failure ends the stage with
# a non-zero status. About a minute; the environment lives in a temporary folder, removed at the end.
# The fresh environment with torch alone is ci/setup_plain.sh's: made here, or, where COMMFUSE_SET_UP names
# "plain", made by ci/test.sh while the main suite ran, in COMMFUSE_PLAIN_VENV (removed at the end all the same).
set -euo pipefail
cd "$(dirname "$0")/.."
repo="$(pwd)"
tmp="$(mktemp -d "${TMPDIR:-/tmp}/commfuse-plain-install.XXXXXX")"
venv=""
trap 'rm -rf "$tmp" ${venv:+"$venv"}' EXIT
source ci/common.sh
if made plain; then
    venv="${COMMFUSE_PLAIN_VENV:?COMMFUSE_SET_UP names plain, yet COMMFUSE_PLAIN_VENV is not set}"
else
    venv="$tmp/venv"
    COMMFUSE_PLAIN_VENV="$venv" bash ci/setup_plain.sh
fi

# Build from a copy of what the build reads, so that pip's in-tree build/ never lands in the working tree.
mkdir "$tmp/src"
cp -r pyproject.toml README.md LICENSE commfuse "$tmp/src/"
py="$venv/bin/python"
bin="$venv/bin"
"$py" -m pip install --quiet "$tmp/src"
cd "$tmp"  # run where the checkout is not importable: the installed commfuse only

step() { echo "plain install: $*" >&2; }
fail() { echo "plain install: FAILED: $*" >&2; exit 1; }
quiet() {  # run a command, showing its output only if it fails
    local out
    if ! out="$("$@" 2>&1)"; then
        echo "$out" | tail -20 >&2
        fail "$*"
    fi
}

step "the environment has torch and commfuse's own requirements only"
"$py" - <<'PY' || fail "the plain environment is not plain"
import importlib.util, sys
present = [m for m in ("pytest", "matplotlib", "numpy", "hypothesis") if importlib.util.find_spec(m)]
if present:
    sys.exit(f"installed without extras, yet {present} came with it")
import torch, commfuse
print(f"  torch {torch.__version__}, commfuse {commfuse.__version__} from {commfuse.__file__}")
PY

step "import commfuse, commfuse.nn, commfuse.tp, commfuse.fsdp, commfuse.graphs"
quiet "$py" -c "import commfuse, commfuse.nn, commfuse.tp, commfuse.fsdp, commfuse.graphs"

step "commfuse --help"
help="$("$bin/commfuse" --help 2>&1)" || { echo "$help" >&2; fail "commfuse --help"; }
grep -q "conformance" <<<"$help" || fail "commfuse --help does not list conformance"

step "commfuse schedule show all_gather -n 4"
quiet "$bin/commfuse" schedule show all_gather -n 4

step "commfuse backends"
quiet "$bin/commfuse" backends

step "commfuse simulate (mlp, tp 8, h100-sxm; llama3-70b at tp 8) and its subcommands"
quiet "$bin/commfuse" simulate --profile h100-sxm --workload mlp --tp 8 --seq 8192 --hidden 4096
quiet "$bin/commfuse" simulate --profile h100-sxm --model llama3-70b --tp 8
quiet "$bin/commfuse" simulate profiles
quiet "$bin/commfuse" simulate calibrate --help

# Refusals: exit status 2, the message names the missing package and the extra, and nothing ran.
refuses() {  # refuses PACKAGE EXTRA COMMAND...: fails unless COMMAND exits 2 within 60 s saying how to install
    local package="$1" extra="$2" rc=0 out
    shift 2
    out="$(timeout 60 "$@" 2>&1)" || rc=$?
    [ "$rc" = 2 ] || { echo "$out" | tail -20 >&2; fail "$* exited $rc, expected 2"; }
    grep -qF "needs $package" <<<"$out" || { echo "$out" >&2; fail "$* does not say it needs $package"; }
    grep -qF "pip install '.[$extra]'" <<<"$out" || { echo "$out" >&2; fail "$* does not say pip install '.[$extra]'"; }
    [ "$(grep -c . <<<"$out")" = 1 ] || { echo "$out" >&2; fail "$* printed more than its refusal: did work start?"; }
    echo "  $(grep -F "needs $package" <<<"$out" | head -1)" >&2
}
step "commfuse conformance --backend gloo -n 2 refuses: no pytest"
refuses pytest test "$bin/commfuse" conformance --backend gloo -n 2
step "commfuse bench --plot gantt.png refuses before any work: no matplotlib"
refuses matplotlib bench "$bin/commfuse" bench --plot gantt.png --preset tiny -r 1 --warmup 0
[ ! -e gantt.png ] || fail "bench --plot wrote gantt.png without matplotlib"
refuses matplotlib bench "$py" -m commfuse.bench --plot gantt.png --preset tiny -r 1 --warmup 0

step "the ops and a layer on 2 gloo ranks (commfuse.launch), against the one-process result"
cat > two_ranks.py <<'PY'
import torch

import commfuse as cf
from commfuse.launch import launch


def body(rank, n):
    torch.manual_seed(0)
    a, b = torch.randn(8, 16), torch.randn(16, 4)
    y = cf.all_gather_matmul(a.tensor_split(n)[rank], b, algorithm="ring")
    z = cf.matmul_reduce_scatter(a, b, algorithm="ring")
    assert torch.allclose(y, a @ b, atol=1e-5), "all_gather_matmul differs from the one-process product"
    assert torch.allclose(z, (n * (a @ b)).tensor_split(n)[rank], atol=1e-4), "matmul_reduce_scatter differs"
    out = cf.nn.ParallelMLP(16, 32)(torch.randn(2, 4, 16))
    out.sum().backward()
    return tuple(out.shape)


if __name__ == "__main__":  # the ranks are spawned: they import this file, and must not launch again
    print("  ranks returned", launch(body, 2))
PY
"$py" two_ranks.py || fail "the ops on 2 gloo ranks"

step "commfuse bench on 2 gloo ranks with --trace and --json (needs no numpy)"
quiet "$bin/commfuse" bench --preset tiny -r 1 --warmup 0 -a vanilla ring --no-progress \
    --trace trace.json --json records.json
[ -s trace.json ] && [ -s records.json ] || fail "bench wrote no trace or records"

step "the README's example under torchrun: torchrun --nproc-per-node 2 examples/tp_mlp.py"
out="$(OMP_NUM_THREADS=1 "$bin/torchrun" --standalone --nproc-per-node 2 "$repo/examples/tp_mlp.py" 2>&1)" \
    || { echo "$out" | tail -20 >&2; fail "examples/tp_mlp.py under torchrun"; }
grep -q "rank 1: y (4, 256, 1024)" <<<"$out" || { echo "$out" >&2; fail "examples/tp_mlp.py printed no result"; }

step "all passed"
