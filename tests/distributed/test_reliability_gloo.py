"""Tier (b), real gloo ranks: no silently wrong result, no group left unusable, every rank told promptly.

Each test reproduces one defect found by using commfuse as a hostile but realistic user would (check
once per signature, a mismatch after a matching first call, two threads on one group, a skipped call,
a symmetric exception in user compute, auto on uneven shards, timeouts, uneven whole collectives,
posting errors, a group that was never initialised, the watchdog of stream-ordered waits).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # the rank-side bodies must import in spawned ranks too
import _reliability_cases as cases  # noqa: E402

import commfuse as cf  # noqa: E402
from commfuse.errors import CommfuseValueError  # noqa: E402
from commfuse.launch import launch  # noqa: E402
from commfuse.runtime.groups import resolve_timeout  # noqa: E402


def test_the_fingerprint_is_checked_once_per_signature_after_a_failure_and_always_when_asked():
    for ok, counts in launch(cases.check_once, 3, timeout=120):
        assert ok, "a result differs from the reference"
        hops = 2  # a ring all-gather of fingerprints over 3 ranks: 2 hops
        assert counts["first"] == hops
        assert all(counts[f"repeat{i}"] == 0 for i in range(5)), counts
        for new in ("new-shape", "new-dtype", "new-algorithm"):
            assert counts[new] == hops, (new, counts)
        assert counts["always-1"] == hops and counts["always-2"] == hops, counts
        assert counts["off"] == 0, counts
        assert counts["after-failure"] == hops and counts["then-repeat"] == 0, counts


def test_a_mismatch_after_a_matching_first_call_is_named_on_every_rank_when_checked_always():
    out = launch(cases.mismatch_later, 4, "always", [4], timeout=120)
    for rank, (kind, message, seconds) in enumerate(out):
        assert kind == "MismatchError", (rank, kind, message)
        assert "rank 1" in message and f"rank {rank}" in message, message
        assert seconds < 5, (rank, seconds)


@pytest.mark.parametrize("shapes", [[4], [4, 6]], ids=["new-signature", "signature-checked-before"])
def test_a_mismatch_after_a_matching_first_call_never_mixes_data_when_checked_once(shapes):
    # Checked once per signature, the ranks whose signature is not new do not check: rank 1 waits in its
    # check and the others in their first step, each until its timeout, named. Messages of different
    # signatures carry different tags, so even a signature rank 1 checked before cannot pair with the
    # others' (gloo would abort on the size, or fill a larger buffer silently).
    out = launch(cases.mismatch_later, 4, None, shapes, timeout=120)
    for rank, (kind, message, seconds) in enumerate(out):
        assert kind in ("MismatchError", "CommfuseTimeoutError", "CommunicationError"), (rank, kind, message)
        assert f"rank {rank}" in message, message
        assert kind == "MismatchError" or "step" in message or "call check" in message, message
        assert "COMMFUSE_CHECK=always" in message or kind != "CommfuseTimeoutError", message
        assert seconds < 2 * 8 + 10, (rank, seconds)


def test_each_side_of_a_mismatch_is_read_with_its_own_format():
    for kind, message in launch(cases.two_ops_decoded, 2, timeout=120):
        assert kind == "MismatchError", message
        assert "all_gather_matmul" in message and "matmul_reduce_scatter" in message, message
        assert "dtype#" not in message and "gathered along dim 0 to float32[8, 8]" in message, message
        assert "scattered along dim 0" in message, message


def test_an_op_started_while_another_is_in_flight_on_its_group_is_refused_by_name():
    for second, first_ok, after_ok in launch(cases.two_threads, 2, timeout=120):
        kind, message = second
        assert kind == "ConcurrentUseError", second
        assert "all_gather_consume" in message and "group" in message, message
        assert first_ok and after_ok


def test_a_call_skipped_on_one_rank_never_pairs_with_another_call():
    out = launch(cases.skipped_call, 3, timeout=180)
    for rank, (calls, seconds) in enumerate(out):
        results = [c for c in calls if c[0] != "validation"]
        assert all(c[1] is True for c in results if c[0] == "ok"), (rank, calls)  # never mixed data
        assert any(c[0] in ("MismatchError", "CommfuseTimeoutError", "CommunicationError") for c in results), (
            rank, calls)
        for c in results:
            if c[0] != "ok":
                assert f"rank {rank}" in c[1], c
        assert seconds < 2 * 8 * 2 + 10, (rank, seconds)
    assert out[1][0][0] == ("validation", "CommfuseValueError")
    assert any("different calls" in c[1] for calls, _ in out for c in calls if c[0] == "MismatchError"), out


def test_after_a_symmetric_exception_in_user_compute_the_group_stays_usable():
    for first, after1, second, after2 in launch(cases.symmetric_failure, 3, timeout=180):
        assert first == "ZeroDivisionError" and after1
        assert second in ("RuntimeError", "NotImplementedError") and after2


def test_auto_takes_the_same_algorithm_on_every_rank_from_sizes_every_rank_knows():
    out = launch(cases.auto_on_uneven_shards, 3, timeout=120)
    algorithms = {alg for alg, _ in out}
    assert len(algorithms) == 1, out
    assert all(ok for _, ok in out), out


@pytest.mark.parametrize("n", [2, 3])
def test_uneven_shards_with_whole_collectives_are_correct(n):
    for rank, result in enumerate(launch(cases.uneven_whole_collectives, n, timeout=120)):
        assert all(v == "ok" for v in result.values()), (rank, result)


def test_an_error_while_posting_names_rank_step_and_peer():
    for rank, (kind, message) in enumerate(launch(cases.posting_error, 2, timeout=120)):
        if kind == "CommunicationError" and "posting" in message:
            assert f"rank {rank}" in message and "step" in message and "rank" in message, message
            assert "connection reset by peer (injected)" in message
        else:  # the peer of a rank that failed to post is told through the group's board, by name
            assert kind == "GroupDeadError", (kind, message)
            assert "step" in message and "rank 0" in message and "(injected)" in message, message


def test_the_watchdog_names_a_step_that_outlives_its_deadline_and_stays_quiet_otherwise():
    errors, fired_after, quiet, delivered = launch(cases.watchdog_fires, 2, timeout=120)[0]
    assert errors and "rank 0" in errors[0] and "step 3" in errors[0], errors
    assert 0.4 < fired_after < 5, fired_after
    assert quiet == [] and delivered


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan, 0.0, 1e-4, 2e6, True, "5"])
def test_timeouts_without_a_real_bound_are_refused_up_front(bad):
    with pytest.raises(CommfuseValueError):
        resolve_timeout(bad)


def test_a_timeout_from_the_environment_is_checked_too(monkeypatch):
    monkeypatch.setenv("COMMFUSE_TIMEOUT_S", "inf")
    with pytest.raises(CommfuseValueError, match="COMMFUSE_TIMEOUT_S"):
        resolve_timeout(None)
    monkeypatch.setenv("COMMFUSE_TIMEOUT_S", "0.5")
    assert resolve_timeout(None) == 0.5


def test_an_op_refuses_to_run_unsharded_when_the_environment_says_there_are_ranks(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(CommfuseValueError, match="WORLD_SIZE=2"):
        cf.all_gather_matmul(torch.randn(4, 5), torch.randn(5, 3))
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert cf.all_gather_matmul(torch.randn(4, 5), torch.randn(5, 3)).shape == (4, 3)
