"""Tier (b), real gloo ranks: the conformance suite passes gloo and catches each deliberately broken backend.

Runs ``commfuse conformance`` as a user would (a subprocess) and reads its
JSON report.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent


def _conformance(tmp_path, backend: str, *extra: str, n: int = 3,
                 capabilities: str | None = "toy_backends:FastCapabilities") -> dict:
    """``commfuse conformance`` on ``n`` ranks; ``capabilities=None`` runs with the backend's own."""
    report = tmp_path / "report.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "commfuse", "conformance", "--backend", backend, "-n", str(n),
           *(("--capabilities", capabilities) if capabilities else ()), "--report", str(report), *extra]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert report.exists(), f"no report written:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    data = json.loads(report.read_text())
    data["exit_code"] = done.returncode
    data["by_case"] = {t["test"].split("[", 1)[1].rstrip("]") if "[" in t["test"] else t["test"]: t
                       for t in data["tests"]}
    return data


def _outcome(data: dict, case: str) -> str:
    return data["by_case"][case]["outcome"]


def test_wrong_peer_is_caught_by_the_transport_tier(tmp_path):
    data = _conformance(tmp_path, "toy_backends:wrong_peer", "--tier", "transport")
    assert data["exit_code"] != 0
    assert _outcome(data, "ring-shift-forward") == "failed"
    reason = data["by_case"]["ring-shift-forward"]["reason"].lower()
    assert "received" in reason or "timed out" in reason, reason


def test_dropped_message_is_caught_by_the_transport_tier_as_a_timeout(tmp_path):
    data = _conformance(tmp_path, "toy_backends:dropped_message", "--tier", "transport")
    assert data["exit_code"] != 0
    reason = data["by_case"]["ring-shift-forward"]["reason"]
    assert _outcome(data, "ring-shift-forward") == "failed"
    assert "TimeoutError" in reason or "timed out" in reason.lower(), reason


def test_wrong_reduction_is_caught_by_the_reduce_scatter_schedules_only(tmp_path):
    data = _conformance(tmp_path, "toy_backends:wrong_reduction", "--tier", "schedules", "-k", "float32")
    assert data["exit_code"] != 0
    # whole reduce-scatters (vanilla, sliced) go through the broken collective; the ring never does
    assert _outcome(data, "reduce_scatter-vanilla-float32-exact") == "failed"
    assert _outcome(data, "reduce_scatter-sliced:2-float32-tolerance") == "failed"
    assert _outcome(data, "reduce_scatter-ring-float32-exact") == "passed"
    assert _outcome(data, "all_gather-vanilla-float32-exact") == "passed"
    assert _outcome(data, "all_to_all-vanilla-float32-exact") == "passed"


def test_dropped_empty_blocks_are_caught_by_the_uneven_all_to_all_schedules(tmp_path):
    data = _conformance(tmp_path, "toy_backends:drops_empty_blocks", "--tier", "schedules", "-k", "to_all",
                        capabilities="toy_backends:AllToAllCapabilities")
    assert data["exit_code"] != 0
    # even blocks have no empty ones, and the ring posts no empty message: both right
    for case in ("all_to_all-vanilla-float32-exact", "produce_all_to_all-vanilla-float32-exact",
                 "all_to_all-uneven-ring-float32", "produce_all_to_all-uneven-ring-float32"):
        assert _outcome(data, case) == "passed", (case, data["by_case"][case]["reason"])
    # an uneven whole all-to-all whose empty blocks lose their places hands blocks to the wrong sources
    for case in ("all_to_all-uneven-vanilla-float32", "produce_all_to_all-uneven-vanilla-float32"):
        assert _outcome(data, case) == "failed", case


def test_corrupted_data_is_caught_by_the_robustness_cases_that_compare_results(tmp_path):
    data = _conformance(tmp_path, "toy_backends:corrupt_data", "--tier", "robustness", "-k",
                        "two-threads or symmetric", n=2)
    assert data["exit_code"] != 0
    for case in ("two-threads-one-group", "symmetric-consumer-error"):
        assert _outcome(data, case) == "failed", case
        assert "differs from the reference" in data["by_case"][case]["reason"], data["by_case"][case]["reason"]


def test_a_backend_whose_waits_never_read_the_board_fails_the_one_rank_cases_that_need_it(tmp_path):
    # its peers of a failing or late rank 1 wait the timeout out (3 s) instead of being told in half of it; a
    # fault after rank 1's last transfer needs no telling, and the backend moves data right
    data = _conformance(tmp_path, "toy_backends:waits_without_the_board", "--tier", "robustness", "-k",
                        "producer-raises-first or consumer-raises or straggler")
    assert data["exit_code"] != 0
    for case in ("producer-raises-first", "consumer-raises-first"):
        reason = data["by_case"][case]["reason"]
        assert _outcome(data, case) == "failed", case
        assert re.search(r"rank 2 took \d+\.\d s to raise, over half the timeout \(1\.5 s\)", reason), reason
    reason = data["by_case"]["straggler"]["reason"]
    assert _outcome(data, "straggler") == "failed"
    assert "does not name rank 1 as late" in reason and "does not say that this rank was late" in reason, reason
    assert _outcome(data, "consumer-raises-last") == "passed", data["by_case"]["consumer-raises-last"]["reason"]


def test_a_backend_declaring_capturable_without_a_device_graph_fails_the_capture_tier(tmp_path):
    data = _conformance(tmp_path, "toy_backends:falsely_capturable", "--tier", "capture", n=2)
    assert data["exit_code"] != 0
    for op in ("all_gather_matmul", "matmul_reduce_scatter"):
        for alg in ("ring", "vanilla"):
            graph = data["by_case"][f"{op}-{alg}-graph"]
            assert graph["outcome"] == "failed" and "has no graph API" in graph["reason"], graph
            helper = data["by_case"][f"{op}-{alg}-helper"]  # commfuse.graphs.capture is CUDA-only: skipped
            assert helper["outcome"] == "skipped" and "CUDA work only" in helper["reason"], helper
    assert _outcome(data, "autograd-all_gather_matmul-ring-helper") == "skipped"


def test_the_capture_tier_skips_gloo_by_capability_without_launching(tmp_path):
    data = _conformance(tmp_path, "gloo", "--tier", "capture", n=2)
    assert data["exit_code"] == 0
    capture = [t for t in data["tests"] if "test_capture[" in t["test"]]
    assert len(capture) == 9 and all(t["outcome"] == "skipped" for t in capture), capture
    assert all("does not declare Capabilities.capturable" in t["reason"] for t in capture), capture


@pytest.mark.parametrize("n", [2])
def test_gloo_passes_every_tier(tmp_path, n):
    # gloo's own capabilities, as `commfuse conformance --backend gloo` runs it: this is CI's run at world size
    # 2 (ci/test.sh runs 3 and 4)
    data = _conformance(tmp_path, "gloo", n=n, capabilities=None)
    failed = [(t["test"], t["reason"][-1500:]) for t in data["tests"] if t["outcome"] == "failed"]
    assert not failed, failed
    assert data["exit_code"] == 0 and data["summary"]["passed"] > 100
    overlap = data["by_case"]["ring-hides-communication"]["figures"]
    assert "rank0.hidden_fraction" in overlap and "rank0.hidden_fraction_of_comm" in overlap
    assert 0.0 <= overlap["rank0.hidden_fraction"] <= 1.0
