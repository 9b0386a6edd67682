"""Tier (b): what ``pip install .`` without extras runs on gloo ranks, with numpy made unimportable in the parent
and in every rank it spawns (tests/unit/test_optional_extras.py's wrapper): ``commfuse bench`` with a trace. Its
ranks gather their traces, as they gather the moe workload's routing, with
``commfuse.bench.shared.gather_objects``, which must not need numpy (torch's ``all_gather_object`` does).
ci/test_plain_install.sh runs the ops and a layer on 2 ranks in an environment with torch alone."""

from __future__ import annotations

import json

from tests.unit.test_optional_extras import imported, run


def test_bench_with_a_trace_needs_no_numpy(tmp_path):
    done = run(tmp_path, "commfuse", "bench", "--preset", "tiny", "-r", "1", "--warmup", "0", "-a", "vanilla", "ring",
               "-w", "ag_matmul", "--trace", "trace.json", "--json", "records.json", "--no-progress",
               blocked=("numpy",))
    assert done.returncode == 0, done.stderr[-4000:]
    assert "numpy" not in imported(done)
    assert {r["algorithm"] for r in json.loads((tmp_path / "records.json").read_text())} == {"vanilla", "ring"}
    spans = [e for e in json.loads((tmp_path / "trace.json").read_text())["traceEvents"] if e["ph"] == "X"]
    assert {e["args"]["rank"] for e in spans} == {0, 1}, "the trace lacks a rank's spans"
