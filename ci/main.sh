#!/usr/bin/env bash
# Set up (ci/setup.sh) and run the main job on this machine (CPU, no accelerator):
# `commfuse bench` over 2 gloo ranks, every algorithm side by side on the fused
# all-gather + GEMM and GEMM + reduce-scatter (docs/benchmarks.md).
#
# As root (CI is), the ranks talk over a loopback limited to 350 mbit in a
# private network namespace, which gives a 2-core CPU the comm/compute ratio of
# an accelerator cluster; otherwise over plain loopback, where it shows little
# overlap. Extra arguments go to `commfuse bench` (e.g. -w all, --repeats 20).
#   COMMFUSE_BENCH_OUT  where the JSON records, trace and Gantt chart go
#                       (default: bench-results/)
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/setup.sh
venv="${COMMFUSE_VENV:-.venv}"
out="${COMMFUSE_BENCH_OUT:-bench-results}"
args=(--ffn 16384 --repeats 10 --json "$out/records.json" --trace "$out/trace.json" --plot "$out/gantt.png")
if [ "$(id -u)" = 0 ] && command -v unshare >/dev/null && command -v ip >/dev/null && command -v tc >/dev/null; then
    args+=(--link-rate 350mbit)
else
    echo "main.sh: not root or no unshare/ip/tc: measuring on plain loopback (see docs/benchmarks.md)" >&2
fi
exec "$venv/bin/commfuse" bench "${args[@]}" "$@"
