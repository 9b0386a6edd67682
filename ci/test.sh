#!/usr/bin/env bash
# Set up (ci/setup.sh), check the import layers (lint-imports, .importlinter; the vendor packages are found
# from their folders), run the whole test suite, then the plain install (commfuse
# with torch alone, no extras, on the newest torch pip installs: ci/test_plain_install.sh), the conformance suite
# against gloo at world sizes 3 and 4 (2 is in the main suite), then the vendor backends' stage
# (ci/test_backends.sh), the transformers stage (ci/test_transformers.sh: whole transformers decoder models
# under torch's and commfuse's tensor-parallel plans, against each model in one process), the JAX stage in its
# own environment (ci/test_jax.sh: the ring executed on host devices through torchax), the torchtitan stage in
# its own environment (ci/test_torchtitan.sh: torchtitan 0.3's models with commfuse's modules), and the
# version-sensitive CPU tests again on the torch floor in an environment of its own (ci/test_torch_floor.sh).
# The legacy torch-xla stage (ci/test_xla.sh, a 7 GB environment) is not run: its pure parts run in
# ci/test_backends.sh. Extra arguments go to the main pytest run.
# Conformance reports are kept in ci-artifacts/conformance-w<N>.json.
set -euo pipefail
cd "$(dirname "$0")/.."
# Ranks that commfuse.launch starts (the suites' gloo ranks, and the conformance runs below) fork from a server
# that has imported torch, instead of each importing it: about 2 s less per launch on two cores.
export COMMFUSE_LAUNCH_START="${COMMFUSE_LAUNCH_START:-forkserver}"
started=$SECONDS
times=()
status=0
stage() {  # stage NAME COMMAND...: runs COMMAND, notes its time, and marks the run failed if it fails
    local name="$1" begin=$SECONDS rc=0
    shift
    "$@" || rc=$?
    times+=("$(printf '%-34s %4d:%02d  %s' "$name" $(((SECONDS - begin) / 60)) $(((SECONDS - begin) % 60)) \
        "$([ "$rc" = 0 ] && echo ok || echo "FAILED ($rc)")")")
    [ "$rc" = 0 ] || status=1
    return 0
}
report() {  # each stage's time, at the end of the run whatever ended it
    echo "ci/test.sh: stage times (min:s)"
    printf '  %s\n' "${times[@]}"
    printf '  %-34s %4d:%02d\n' "all" $(((SECONDS - started) / 60)) $(((SECONDS - started) % 60))
}
trap report EXIT
stage "set-up (ci/setup.sh)" bash ci/setup.sh
[ "$status" = 0 ] || exit 1
# The later stages' own environments (the torch floor's, JAX's, torchtitan's) are made while the main suite runs:
# their downloads and installs wait on the network and the disk more than on the CPU. One after another (each
# installs this tree editable, which writes its metadata into the tree). A stage whose environment was made here
# skips its own set-up (COMMFUSE_SET_UP names the environments made); one whose set-up failed here runs it
# again, and fails there, in its own output. The logs are in ci-artifacts/setup-<name>.log.
# The plain install's fresh environment with torch alone (ci/setup_plain.sh) is made beside them, in a temporary
# folder the plain install's stage removes.
mkdir -p ci-artifacts
rm -f ci-artifacts/setup-*.ok
(for name in floor jax torchtitan; do
    bash "ci/setup_$name.sh" > "ci-artifacts/setup-$name.log" 2>&1 && touch "ci-artifacts/setup-$name.ok"
done) &
environments=$!
COMMFUSE_PLAIN_VENV="$(mktemp -d "${TMPDIR:-/tmp}/commfuse-plain-venv.XXXXXX")"
export COMMFUSE_PLAIN_VENV
(bash ci/setup_plain.sh > ci-artifacts/setup-plain.log 2>&1 && touch ci-artifacts/setup-plain.ok) &
plain=$!
export COMMFUSE_SET_UP="main"
venv="${COMMFUSE_VENV:-.venv}"
stage "import layers (lint-imports)" env \
    PYTHONPATH="backends/cuda:backends/npu:backends/xla:backends/jax:backends/tpu:backends/_template${PYTHONPATH:+:$PYTHONPATH}" \
    "$venv/bin/lint-imports" --config .importlinter
# Two pytest workers (pytest-xdist, COMMFUSE_TEST_WORKERS; 0 runs the suite in one process): while one test's
# ranks wait (a timeout on purpose, a rendezvous, a peer that is late by design) the other worker's use the CPU.
# Tests go to whichever worker is free (--dist worksteal). Keeping a file's tests on one worker (--dist loadfile),
# so that a file that launches its ranks once for all its tests does so once, measured slower: the floor 4:56
# against 4:13, the suite 19:35 against 18:34 (that run with the plain install beside it); the longest files
# were left running alone at the end.
source ci/common.sh  # parallel, from COMMFUSE_TEST_WORKERS
export COMMFUSE_TEST_WORKERS="$workers"
stage "main suite (pytest)" "$venv/bin/python" -m pytest "${parallel[@]}" "$@"
wait "$plain" || true
if [ -e ci-artifacts/setup-plain.ok ]; then
    stage "plain install" env COMMFUSE_SET_UP="$COMMFUSE_SET_UP plain" bash ci/test_plain_install.sh
else  # its set-up failed: the stage makes its own environment, and fails there in its own output
    rm -rf "$COMMFUSE_PLAIN_VENV"
    stage "plain install" bash ci/test_plain_install.sh
fi
# World size 2 is the main suite's run (tests/conformance/test_suite_catches_broken_backends.py's
# test_gloo_passes_every_tier, with gloo's own capabilities, as here): the stage runs the larger rings.
conformance() {
    for n in 3 4; do
        "$venv/bin/commfuse" conformance --backend gloo --world-size "$n" \
            --report "ci-artifacts/conformance-w$n.json" || return 1
    done
}
stage "conformance, gloo, world size 3 4" conformance
"$venv/bin/python" - <<'PY'
import json, pathlib
for path in sorted(pathlib.Path("ci-artifacts").glob("conformance-w*.json")):
    data = json.loads(path.read_text())
    overlap = [t["figures"] for t in data["tests"] if t["test"].endswith("[ring-hides-communication]")]
    hidden = overlap[0].get("rank0.hidden_fraction") if overlap else None
    print(f"conformance gloo world size {data['world_size']}: {data['summary']}"
          + (f", ring hid {hidden:.2f} of what it could hide, min(compute, comm) (rank 0)" if hidden is not None else ""))
PY
stage "vendor backends" bash ci/test_backends.sh
stage "transformers" bash ci/test_transformers.sh
wait "$environments" || true
for name in floor jax torchtitan; do
    if [ -e "ci-artifacts/setup-$name.ok" ]; then COMMFUSE_SET_UP="$COMMFUSE_SET_UP $name"; fi
done
stage "JAX" bash ci/test_jax.sh
stage "torchtitan" bash ci/test_torchtitan.sh
stage "torch floor" bash ci/test_torch_floor.sh
exit $status
