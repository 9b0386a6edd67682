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


ONE_RANK = ("producer-raises-first", "producer-raises-later", "consumer-raises-first", "consumer-raises-last",
            "in-place-consumer", "lying-split", "straggler")


def test_every_new_case_is_listed_at_every_world_size():
    for n in (2, 3, 4):
        listed = cases("robustness", n)
        assert listed == list(ROBUSTNESS)
        for case in ("two-threads-one-group", "skipped-call", "symmetric-consumer-error", "mismatch-promptness",
                     *ONE_RANK):
            assert case in listed


@pytest.mark.parametrize("case", ONE_RANK)
def test_the_one_rank_cases_have_a_body_and_rules_and_run_from_two_ranks(case):
    assert case in _bodies._ROBUSTNESS
    assert _bodies.ROBUSTNESS_MIN_WORLD.get(case, 1) <= 2
    failures = judge_robustness(case, [_outcome(), _outcome()], LIMIT)
    assert not any("no rules" in f for f in failures), failures


def test_the_straggler_launch_outlasts_its_sleep():
    from commfuse.testing.suite import _LAUNCH_BOUNDS

    for t in (3.0, 10.0, 60.0):
        assert _LAUNCH_BOUNDS["straggler"](t) >= _bodies.STRAGGLER_LATE * t + 4 * t + 60


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


def test_a_survivor_that_heard_of_the_death_from_the_board_passes():
    heard = ("rank 0, waiting in step 1 of all_gather_consume (build(\"all_gather\", 4, algorithm=\"ring\")), receives "
             "from rank 3; sends to rank 1: the group was declared dead by rank 2, which found:\n  rank 2 failed in "
             "step 1 of all_gather_consume, receives from rank 1; sends to rank 3: the transport gave up")
    out = [_outcome("GroupDeadError", heard, 0.2), "FAILED: died with exit code -9 without reporting",
           _outcome("CommunicationError", "rank 2 failed in step 1 of all_gather_consume, receives from rank 1", 0.2),
           _outcome("GroupDeadError", heard.replace("rank 0,", "rank 3,"), 0.4)]
    assert judge_robustness("peer-death", out, LIMIT) == []


def test_a_survivor_that_died_otherwise_did_not_report():
    failures = judge_robustness("absent-peer", ["FAILED: died with exit code -6 without reporting",
                                                _outcome("absent")], LIMIT)
    assert any("did not report" in f for f in failures), failures
    failures = judge_robustness("mismatched-shapes", [f"FAILED: CommfuseTimeoutError: {_HELD}",
                                                      _outcome("MismatchError", "rank 1: rank 0 ...")], LIMIT)
    assert any("did not report" in f for f in failures), failures  # only the two dead-peer cases accept it



# -- one rank fails, is misled or is late ---------------------------------------------------------------------

FAULT = _bodies.InjectedFault.__name__
OPS = {"producer-raises-first": "produce_reduce_scatter", "producer-raises-later": "produce_reduce_scatter",
       "consumer-raises-first": "all_gather_consume", "consumer-raises-last": "all_gather_consume"}


def _failing_rank(case, after):
    return _outcome(FAULT, f"rank 1's {'producer' if 'producer' in case else 'consumer'} fails (injected by the "
                    "conformance suite)", 0.01, before=["right"], after=after)


def _told(rank, op, kind="PeerFailedError", seconds=0.52, after=("right", "right")):
    """What a peer of rank 1 says when the board told it (the text of commfuse's PeerFailedError)."""
    message = (f"rank {rank}: {op} (call #1, build(\"all_gather\", 3, algorithm=\"ring\")) failed on rank 1 in step 0: "
               f"{FAULT}: rank 1's consumer fails on the shard of rank 1 (injected by the conformance suite). This "
               "rank stopped computing after step 1 and completed the call's transfers")
    return _outcome(kind, message, seconds, before=["right"], after=list(after))


def _unaffected(after=("right", "right"), result="right"):
    return _outcome("no error", "", 0.01, before=["right"], after=list(after), result=result)


def _timed_out(rank, op, seconds=LIMIT):
    return _outcome("CommfuseTimeoutError", f"rank {rank} timed out after {seconds:g} s in step 1 of {op} waiting for "
                    "receives from rank 1", seconds, before=["right"], after=["GroupDeadError"])


def _first_ok(n=3):
    """producer-raises-first as gloo gives it: every peer told by the board, the group dead afterwards."""
    op = OPS["producer-raises-first"]
    out = [_told(r, op, after=["GroupDeadError"]) for r in range(n)]
    for r in range(n):
        out[r]["message"] = (f"rank {r}, waiting in step 1 of {op}: rank 1 failed call #1 ({op}) before taking "
                             f"part: {FAULT}: rank 1's producer fails on its partial for rank 0")
    out[1] = _failing_rank("producer-raises-first", ["MismatchError"])
    return out


def test_producer_raising_first_accepts_peers_told_by_name_and_a_dead_group():
    assert judge_robustness("producer-raises-first", _first_ok(), LIMIT) == []
    out = _first_ok(4)
    out[3]["kind"] = "GroupDeadError"  # any CommunicationError kind that names rank 1 and the fault
    out[0]["figures"]["after"] = ["right"]  # or right, where the group still works
    assert judge_robustness("producer-raises-first", out, LIMIT) == []


def test_producer_raising_first_fails_a_peer_that_timed_out_instead_of_being_told():
    out = _first_ok()
    out[2] = _timed_out(2, "produce_reduce_scatter")
    failures = judge_robustness("producer-raises-first", out, LIMIT)
    assert any(f"rank 2's error does not name {FAULT}" in f for f in failures), failures
    assert any("rank 2 took 10.0 s to raise, over half the timeout (5 s)" in f for f in failures), failures


def test_producer_raising_first_fails_a_message_that_does_not_name_rank_1_or_a_peer_that_returned():
    out = _first_ok()
    out[0]["message"] = f"rank 0: a peer failed call #1 (produce_reduce_scatter): {FAULT} (ranks 10, 11 told)"
    out[2] = _unaffected(after=["GroupDeadError"], result="wrong")
    failures = judge_robustness("producer-raises-first", out, LIMIT)
    assert any("rank 0's error does not name rank 1" in f for f in failures), failures
    assert any("rank 2 ended with 'no error' instead of one of" in f for f in failures), failures


def test_producer_raising_first_fails_a_wrapped_fault_and_a_wrong_result_afterwards():
    out = _first_ok()
    out[1]["kind"] = "CommunicationError"
    out[0]["figures"]["after"] = ["wrong"]
    out[2]["figures"]["after"] = ["RuntimeError (not a commfuse error)"]
    failures = judge_robustness("producer-raises-first", out, LIMIT)
    assert any(f"rank 1 ended with 'CommunicationError' instead of its own {FAULT}" in f for f in failures), failures
    assert any("rank 0: the plain calls after the fault went ['wrong']" in f for f in failures), failures
    assert any("rank 2: the plain calls after the fault went ['RuntimeError" in f for f in failures), failures


LATER = ("producer-raises-later", "consumer-raises-first", "consumer-raises-last")


def _later_ok(case, n=3):
    out = [_unaffected() for _ in range(n)]
    out[1] = _failing_rank(case, ["right", "right"])
    return out


@pytest.mark.parametrize("case", LATER)
def test_a_fault_the_rank_completes_accepts_right_results_or_peers_told_by_name(case):
    out = _later_ok(case)
    assert judge_robustness(case, out, LIMIT) == []
    out[2] = _told(2, OPS[case])
    assert judge_robustness(case, out, LIMIT) == []


@pytest.mark.parametrize("case", LATER)
def test_a_fault_the_rank_completes_fails_a_wrong_result(case):
    out = _later_ok(case)
    out[0] = _unaffected(result="wrong")
    failures = judge_robustness(case, out, LIMIT)
    assert failures == ["rank 0 returned a result that differs from the reference (wrong)"], failures
    out = _later_ok(case)
    out[2]["figures"]["before"] = ["wrong"]  # the same call without a fault was wrong already
    assert judge_robustness(case, out, LIMIT) == ["rank 2: the call before the fault went ['wrong']"]


@pytest.mark.parametrize("case", LATER)
def test_a_fault_the_rank_completes_fails_a_peer_that_timed_out_or_was_not_told_by_name(case):
    op = OPS[case]
    out = _later_ok(case)
    out[2] = _timed_out(2, op)
    failures = judge_robustness(case, out, LIMIT)
    assert any("rank 2 ended with 'CommfuseTimeoutError' instead of one of ['PeerFailedError']" in f
               for f in failures), failures
    assert any("rank 2 took 10.0 s to raise, over half the timeout" in f for f in failures), failures
    assert any("rank 2: the plain calls after the fault went ['GroupDeadError'], each should be exactly right" in f
               for f in failures), failures
    out = _later_ok(case)
    out[2] = _told(2, op)
    out[2]["message"] = out[2]["message"].replace(op, "a call")
    assert any(f"rank 2's error does not name {op}" in f for f in judge_robustness(case, out, LIMIT))
    out = _later_ok(case)
    out[0] = _told(0, op, kind="GroupDeadError")  # told, but the group ended: it must stay usable
    assert any("rank 0 ended with 'GroupDeadError' instead of one of ['PeerFailedError']" in f
               for f in judge_robustness(case, out, LIMIT))


@pytest.mark.parametrize("case", LATER)
def test_a_fault_the_rank_completes_must_leave_the_group_usable_on_every_rank(case):
    out = _later_ok(case)
    out[1]["figures"]["after"] = ["right", "GroupDeadError"]
    out[1]["figures"]["after_error"] = "GroupDeadError: rank 1: the group is dead"
    out[0]["figures"]["after"] = ["right"]  # stopped early
    failures = judge_robustness(case, out, LIMIT)
    assert any(f.startswith("rank 1: the plain calls after the fault went ['right', 'GroupDeadError']") and
               "the group is dead" in f for f in failures), failures
    assert any(f.startswith("rank 0: the plain calls after the fault went ['right']") for f in failures), failures


def _in_place_ok(n=3):
    return [_outcome(results=2 * n, wrong=0, inputs_changed=0) for _ in range(n)]


def test_in_place_consumers_pass_when_every_result_is_doubled_and_no_input_changed():
    assert judge_robustness("in-place-consumer", _in_place_ok(), LIMIT) == []


@pytest.mark.parametrize("field, value, said", [
    ("wrong", 1, "1 of 6 results not twice the reference (6 expected)"),
    ("inputs_changed", 2, "2 inputs changed"),
    ("results", 3, "0 of 3 results not twice the reference (6 expected)"),  # compared fewer than there are
])
def test_in_place_consumers_fail_on_a_wrong_result_a_changed_input_or_too_few_results(field, value, said):
    out = _in_place_ok()
    out[2]["figures"][field] = value
    out[2]["problems"] = ["all_to_all_consume: the result for the shard of rank 1 is not twice the reference"]
    failures = judge_robustness("in-place-consumer", out, LIMIT)
    assert any(f.startswith("rank 2: ") and said in f for f in failures), failures
    assert "rank 2: all_to_all_consume: the result for the shard of rank 1 is not twice the reference" in failures


SPLITS_ERROR = (f"rank 1: output_splits[0] = {_bodies.LYING_CLAIMED} rows claimed, but rank 0 sent "
                f"{_bodies.LYING_SENT} (rows along dim 0). The exchange ran with the sizes each rank really sent")


def _lying_ok(n=3):
    out = [_outcome(result="right", after=["right"]) for _ in range(n)]
    out[1] = _outcome("CommfuseValueError", SPLITS_ERROR, 0.06, after=["right"])
    return out


def test_a_lying_split_passes_when_only_the_liar_raises_naming_rank_0_and_both_sizes():
    assert judge_robustness("lying-split", _lying_ok(), LIMIT) == []


def test_a_lying_split_fails_a_vague_error_a_wrong_block_a_bad_next_call_or_an_abort():
    out = _lying_ok()
    out[1]["message"] = "rank 1: output_splits do not match what the peers sent"
    out[0]["figures"]["result"] = "wrong"
    out[2]["figures"]["after"] = ["MismatchError"]
    failures = judge_robustness("lying-split", out, LIMIT)
    assert any("rank 1's error does not name rank 0 and both sizes (6 claimed, 5 sent)" in f for f in failures)
    assert any("rank 0 returned a result that differs from the reference" in f for f in failures), failures
    assert any("rank 2: the plain calls after the fault went ['MismatchError']" in f for f in failures), failures
    out = _lying_ok()
    out[1] = _outcome("no error", "", 0.06, result="wrong", after=["right"])  # the lie was believed
    assert any("rank 1 ended with 'no error' instead of CommfuseValueError" in f
               for f in judge_robustness("lying-split", out, LIMIT))
    out = _lying_ok()
    out[0] = "FAILED: died with exit code -6 without reporting"  # gloo aborted on a buffer of the claimed size
    assert judge_robustness("lying-split", out, LIMIT) == [f"rank 0 did not report: {out[0]}"]


def _late_peer(rank, seconds=LIMIT + 0.02):
    return _outcome("CommfuseTimeoutError", f"rank {rank} timed out after 10 s in step 0 of all_gather_matmul, waiting "
                    f"for rank 1, 2. rank 1 never reached it: late (not waiting in any commfuse call, and no failure "
                    "noted: computing, or stuck in its own code), or hung; the group is now dead on this rank",
                    seconds, before=["right"])


def _straggler_ok(n=3):
    out = [_late_peer(r) for r in range(n)]
    out[1] = _outcome("CommfuseTimeoutError", "rank 1 (this rank) was late, waiting in step 0 of all_gather_matmul: "
                      "rank 0 gave up waiting for it after 10 s", 0.01, before=["right"])
    return out


def test_a_straggler_passes_when_named_late_at_the_timeout_and_told_it_was_late_on_arrival():
    assert judge_robustness("straggler", _straggler_ok(), LIMIT) == []


def test_a_straggler_named_dead_instead_of_late_fails():
    out = _straggler_ok()
    out[0] = _outcome("GroupDeadError", "rank 0: rank 1 is dead (its connections closed); the group is dead", 0.3,
                      before=["right"])
    failures = judge_robustness("straggler", out, LIMIT)
    assert any("rank 0 ended with 'GroupDeadError' instead of a CommfuseTimeoutError naming rank 1 late" in f
               for f in failures), failures
    assert any("rank 0's error does not name rank 1 as late" in f for f in failures), failures
    assert any("rank 0 raised after 0.3 s, not at the timeout (10 s)" in f for f in failures), failures


def test_a_straggler_fails_a_peer_that_names_another_rank_late_or_waits_far_past_the_timeout():
    out = _straggler_ok()
    out[2]["message"] = out[2]["message"].replace("rank 1 never", "rank 0 never")
    out[0]["seconds"] = 3 * LIMIT
    failures = judge_robustness("straggler", out, LIMIT)
    assert any("rank 2's error does not name rank 1 as late" in f for f in failures), failures
    assert any("rank 0 raised after 30.0 s, not at the timeout" in f for f in failures), failures


def test_a_straggler_that_is_not_told_it_was_late_fails():
    out = _straggler_ok()
    out[1] = _outcome("CommunicationError", "rank 1 failed posting step 0 of all_gather_matmul: RuntimeError: "
                      "Connection closed by peer", 0.01, before=["right"])
    assert judge_robustness("straggler", out, LIMIT) == [
        "rank 1's error does not say that this rank was late: " + out[1]["message"]]
    out = _straggler_ok()
    out[1]["seconds"] = LIMIT  # waited out a timeout of its own
    assert any("rank 1 took 10.0 s to raise after arriving 20 s late" in f for f in judge_robustness("straggler", out,
                                                                                                  LIMIT))
    out = _straggler_ok()
    out[1] = _outcome("no error", "", 0.01, before=["right"], result="wrong")
    assert any("rank 1 (the straggler) ended with 'no error'" in f for f in judge_robustness("straggler", out, LIMIT))


def test_two_threads_accepts_a_race_that_ended_in_a_named_error():
    out = [_threads_ok(r) for r in range(3)]
    for o in out:  # the threads met the group in different orders on different ranks: named, the group ended
        o["figures"].update(race_correct=2, race_named=1)
    assert judge_robustness("two-threads-one-group", out, LIMIT) == []


@pytest.mark.parametrize("case", LATER)
def test_a_backend_that_ends_the_group_on_a_fault_may_raise_afterwards_but_never_return_a_wrong_result(case):
    # group_survives_one_rank_failure off (a stream-ordered backend): the peers are told, the group ends
    op = OPS[case]
    out = _later_ok(case)
    for o in out:
        o["figures"]["survives"] = False
    out[0] = _told(0, op, kind="GroupDeadError")
    out[0]["figures"].update(survives=False, after=["GroupDeadError"])
    out[2] = (f"FAILED: PeerFailedError: rank 2: {op} (call #1) failed on rank 1 in step 1: InjectedFault: "
              "injected")  # ended by commfuse's watchdog, with the named error as its result
    assert judge_robustness(case, out, LIMIT) == []
    out[0]["figures"]["after"] = ["wrong"]
    failures = judge_robustness(case, out, LIMIT)
    assert any("rank 0: the plain calls after the fault went ['wrong']" in f for f in failures), failures
    out = _later_ok(case)  # the same outcomes from a backend whose group must survive
    out[0] = _told(0, op, kind="GroupDeadError")
    out[2] = f"FAILED: PeerFailedError: rank 2: {op} failed on rank 1: InjectedFault: injected"
    failures = judge_robustness(case, out, LIMIT)
    assert any("rank 2 did not report" in f for f in failures), failures
