"""The robustness tier's rules and the overlap tier's figure, judged on outcomes written out by hand.

``judge_robustness`` is what ``RobustnessTests`` applies to the ranks'
outcomes; each test here feeds it one outcome that breaks one rule (a wrong
result, a late or unnamed error, an unexpected exception) and checks that the
rule fires, next to the outcome the rule accepts. The runs on real gloo ranks
are in ``test_suite_catches_broken_backends.py``.
"""

from __future__ import annotations

import copy

import pytest

from commfuse.testing import _bodies
from commfuse.testing.capabilities import Capabilities
from commfuse.testing.suite import ROBUSTNESS, cases, judge_robustness, torchrun_skip_reason

LIMIT = 10.0


def _outcome(kind="no error", message="", seconds=0.1, problems=(), **figures):
    return {"kind": kind, "message": message, "seconds": seconds, "problems": list(problems), "figures": figures}


def _threads_ok(rank):
    return _outcome(owner_correct=5, refused=5, race_correct=20, race_refused=31, wrong=0, other=0)


def _mismatch(rank, n, odd, seq_differs=True):
    """The text a MismatchError has on ``rank`` when rank ``odd`` called differently."""
    others = [r for r in range(n) if r != odd]
    me = " (this rank)"
    lines = [f"  rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))}{me if rank != odd else ''}: "
             f"call #0 all_gather_matmul (all_gather, algorithm ring, parts=1, chunks=1): float32[16, 8]",
             f"  rank {odd}{me if rank == odd else ''}: call #{1 if seq_differs else 0} all_gather_matmul "
             f"(all_gather, algorithm ring, parts=1, chunks=1): float32[24, 8]"]
    hint = ""
    if seq_differs:
        hint = " The ranks are at different calls on this group: one of them skipped or added a call."
    return (f"rank {rank}: the ranks of group '0' called different ops (checked before the first transfer of "
            "all_gather_matmul, nothing was sent):\n" + "\n".join(lines) + hint)


def test_every_new_case_is_listed_at_every_world_size():
    for n in (2, 3, 4):
        listed = cases("robustness", n)
        assert listed == list(ROBUSTNESS)
        for case in ("two-threads-one-group", "skipped-call", "symmetric-consumer-error", "mismatch-promptness"):
            assert case in listed


def test_two_threads_accepts_refusals_and_right_results():
    assert judge_robustness("two-threads-one-group", [_threads_ok(r) for r in range(3)], LIMIT) == []


@pytest.mark.parametrize("counter", ["wrong", "other"])
def test_two_threads_fails_on_a_wrong_result_or_another_exception(counter):
    out = [_threads_ok(r) for r in range(2)]
    out[1]["figures"][counter] = 1
    out[1]["problems"] = ["race: an all_gather_matmul returned data that differs from the reference"]
    failures = judge_robustness("two-threads-one-group", out, LIMIT)
    assert any("rank 1: race: an all_gather_matmul returned data" in f for f in failures), failures
    assert any(f"1 {'wrong results' if counter == 'wrong' else 'unexpected'}" in f for f in failures), failures


def test_two_threads_fails_when_a_rank_hung_or_raised():
    out = [_threads_ok(0), "FAILED: did not finish within 120 s (killed)"]
    assert judge_robustness("two-threads-one-group", out, LIMIT) == [
        "rank 1 did not report: FAILED: did not finish within 120 s (killed)"]
    out = [_threads_ok(0), _outcome("CommfuseTimeoutError", "rank 1 timed out after 10 s in step 0", 10.0,
                                    owner_correct=5, refused=5, race_correct=3, wrong=0, other=0)]
    failures = judge_robustness("two-threads-one-group", out, LIMIT)
    assert any("rank 1 ended with CommfuseTimeoutError" in f for f in failures), failures


def test_two_threads_fails_when_nothing_was_refused():
    out = [_threads_ok(0), _threads_ok(1)]
    out[0]["figures"]["refused"] = 0
    assert any("did not run both phases" in f for f in judge_robustness("two-threads-one-group", out, LIMIT))


def test_skipped_call_accepts_a_mismatch_naming_rank_1_or_a_timeout_naming_a_step():
    out = [_outcome("MismatchError", _mismatch(r, 3, 1), 0.05) for r in range(3)]
    assert judge_robustness("skipped-call", out, LIMIT) == []
    out[0] = _outcome("CommfuseTimeoutError", "rank 0 timed out after 10 s in step 0 of all_gather_matmul "
                      "waiting for receives from rank 2", 10.0)
    assert judge_robustness("skipped-call", out, LIMIT) == []


def test_skipped_call_fails_on_returned_data_no_error_lateness_or_a_vague_message():
    good = [_outcome("MismatchError", _mismatch(r, 3, 1), 0.05) for r in range(3)]
    out = copy.deepcopy(good)
    out[2] = _outcome("no error", "", 0.2, problems=["valid call 0 returned data that differs from the reference"])
    failures = judge_robustness("skipped-call", out, LIMIT)
    assert any("rank 2: valid call 0 returned data that differs" in f for f in failures), failures
    assert any("rank 2 ended with 'no error'" in f for f in failures), failures
    out = copy.deepcopy(good)
    out[0]["seconds"] = 2 * LIMIT + 0.5
    assert any("rank 0 took 20.5 s" in f for f in judge_robustness("skipped-call", out, LIMIT))
    out = copy.deepcopy(good)
    out[1]["message"] = _mismatch(1, 3, 1, seq_differs=False)
    assert any("different calls" in f for f in judge_robustness("skipped-call", out, LIMIT))
    out = copy.deepcopy(good)
    out[0] = _outcome("CommfuseTimeoutError", "rank 0 timed out after 10 s", 10.0)
    assert any("does not name the step" in f for f in judge_robustness("skipped-call", out, LIMIT))


def test_symmetric_errors_fail_when_the_next_op_does_not_succeed_exactly():
    out = [_outcome(consumer_calls=1, compute_error="NotImplementedError") for _ in range(2)]
    assert judge_robustness("symmetric-consumer-error", out, LIMIT) == []
    out[0]["problems"] = ["the all_gather_matmul after the consumer's error returned data that differs"]
    out[1] = _outcome("CommfuseTimeoutError", "rank 1 timed out after 10 s in step 0", 10.0)
    failures = judge_robustness("symmetric-consumer-error", out, LIMIT)
    assert any(f.startswith("rank 0: the all_gather_matmul after") for f in failures), failures
    assert any("rank 1 ended with CommfuseTimeoutError" in f for f in failures), failures


def test_promptness_needs_every_rank_to_name_rank_2_in_seconds():
    good = [_outcome("MismatchError", _mismatch(r, 4, 2, seq_differs=False), 0.2) for r in range(4)]
    assert judge_robustness("mismatch-promptness", good, LIMIT) == []
    # a mismatch "found" by running out the 60 s timeout is no detection at all
    out = copy.deepcopy(good)
    out[0] = _outcome("CommfuseTimeoutError", "rank 0 timed out after 60 s in the call check of all_gather_matmul, "
                      "waiting for rank 3", 60.0)
    failures = judge_robustness("mismatch-promptness", out, LIMIT)
    assert any("rank 0 ended with 'CommfuseTimeoutError'" in f for f in failures), failures
    assert any("rank 0 took 60.0 s, over 10 s" in f for f in failures), failures
    out = copy.deepcopy(good)
    out[0]["seconds"] = 11.0
    assert judge_robustness("mismatch-promptness", out, LIMIT) == ["rank 0 took 11.0 s, over 10 s"]
    out = copy.deepcopy(good)  # rank 0 names a mismatch but not who: "rank 2" only inside "ranks 0, 2"
    out[0]["message"] = out[0]["message"].replace("rank 2: call", "ranks 1, 2: call")
    assert any("does not name rank 2" in f for f in judge_robustness("mismatch-promptness", out, LIMIT))


def test_promptness_bound_stays_well_below_the_timeout_the_case_runs_with():
    assert _bodies.PROMPTNESS_BOUND_S <= _bodies.PROMPTNESS_TIMEOUT_S / 4


def test_the_torchrun_skip_says_the_command_that_runs_the_tier():
    reason = torchrun_skip_reason("gloo", 4, Capabilities())
    assert "commfuse conformance --backend gloo --world-size 4 --tier robustness" in reason
    assert "--capabilities" not in reason

    class Vendor(Capabilities):
        timeout_s = 3.0

    reason = torchrun_skip_reason("mine", 2, Vendor())
    assert f"--capabilities {__name__}:" in reason and "Vendor" in reason and "outside torchrun" in reason
    assert "COMMFUSE_NCCL_HOST_PER_RANK" not in reason

    class Nccl(Capabilities):
        dist_backend = "nccl"

    assert "COMMFUSE_NCCL_HOST_PER_RANK=1" in torchrun_skip_reason("cuda", 2, Nccl())


@pytest.mark.parametrize("total, compute, comm, hidden", [
    (0.100, 0.010, 0.100, 1.0),   # a slow link, perfectly overlapped: all the compute's worth of comm hid
    (0.110, 0.010, 0.100, 0.0),   # back to back
    (0.105, 0.010, 0.100, 0.5),
    (0.060, 0.050, 0.020, 0.5),   # compute dominates: judged against the 20 ms of comm
    (0.050, 0.050, 0.020, 1.0),
    (0.200, 0.050, 0.020, 0.0),   # slower than serial: clamped
    (0.040, 0.050, 0.020, 1.0),   # faster than either alone (noise): clamped
])
def test_hidden_fraction_is_judged_against_the_shorter_side(total, compute, comm, hidden):
    figures = _bodies.hidden_figures(total, compute, comm)
    assert figures["hidden_fraction"] == pytest.approx(hidden)
    assert figures["hidden_fraction_of_comm"] == pytest.approx(max(0.0, min(1.0, (compute + comm - total) / comm)))
    assert figures["total_ms"] == pytest.approx(1e3 * total)
    assert figures["compute_only_ms"] == pytest.approx(1e3 * compute)
    assert figures["comm_only_ms"] == pytest.approx(1e3 * comm)


def test_the_old_figure_could_not_credit_perfect_overlap_on_a_slow_link():
    figures = _bodies.hidden_figures(0.100, 0.010, 0.100)
    assert figures["hidden_fraction"] == pytest.approx(1.0)
    assert figures["hidden_fraction_of_comm"] == pytest.approx(0.1)


# -- a rank ended by commfuse's watchdog (stream-ordered backends) ------------------------------------------------

_HELD = ("rank 0 timed out after 10 s in step 0 of all_gather_matmul (ring all_gather over 2 ranks) waiting for "
         "receives from rank 1; sends to rank 1: the host was still inside the transport's post")
_FAILED = ("rank 0 failed in step 1 of all_gather_consume (ring all_gather over 2 ranks) while waiting for receives "
           "from rank 1; sends to rank 1: the transport failed them: DistBackendError: NCCL error: remote "
           "process exited")


@pytest.mark.parametrize("case, kind, message", [("absent-peer", "CommfuseTimeoutError", _HELD),
                                                  ("peer-death", "CommunicationError", _FAILED)])
def test_a_survivor_the_watchdog_ended_with_a_named_error_passes(case, kind, message):
    dead = "FAILED: died with exit code -9 without reporting" if case == "peer-death" else _outcome("absent")
    assert judge_robustness(case, [f"FAILED: {kind}: {message}", dead], LIMIT) == []


def test_a_survivor_the_watchdog_ended_must_still_name_the_step_and_the_peer():
    failures = judge_robustness("absent-peer", ["FAILED: CommfuseTimeoutError: rank 0 timed out somewhere",
                                                _outcome("absent")], LIMIT)
    assert any("does not name the step and the peer" in f for f in failures), failures


def test_a_survivor_that_died_otherwise_did_not_report():
    failures = judge_robustness("absent-peer", ["FAILED: died with exit code -6 without reporting",
                                                _outcome("absent")], LIMIT)
    assert any("did not report" in f for f in failures), failures
    failures = judge_robustness("mismatched-shapes", [f"FAILED: CommfuseTimeoutError: {_HELD}",
                                                      _outcome("MismatchError", "rank 1: rank 0 ...")], LIMIT)
    assert any("did not report" in f for f in failures), failures  # only the two dead-peer cases accept it
