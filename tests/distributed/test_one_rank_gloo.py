"""Tier (b), real gloo ranks: a failure on ONE rank reaches every rank, by name, long before the timeout,
and no rank ever returns a silently wrong result.

Each test injects one fault on one rank (a producer, consumer, expert or attention that raises; a policy
that fails; two threads on one group; a straggler; Ctrl-C; a shape changed after many matching calls; a
group destroyed and made again) and asserts what every rank saw. Ops run with a 30 s timeout
(``_one_rank_cases.TIMEOUT``): "told" means a named error in less than half of it, which only the group's
board (``commfuse.runtime.board``) can give; how long it really takes is printed by
``benchmarks/one_rank_failures.py``, not asserted here.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # the rank-side bodies must import in spawned ranks too
import _one_rank_cases as cases  # noqa: E402

from commfuse.launch import launch  # noqa: E402

TOLD = cases.TIMEOUT / 2
#: What a peer of the failing rank raises when told (all of them commfuse's CommunicationError kinds).
NAMED = ("PeerFailedError", "GroupDeadError", "MismatchError", "CommfuseTimeoutError", "CommunicationError")


def _told(outcome, *words):
    """The outcome of a call on a rank that was told of rank 1's failure: a named error, with ``words``, in
    less than half the timeout."""
    kind, message, seconds, named = outcome
    assert kind in NAMED and named, outcome
    for word in words:
        assert word in message, (word, message)
    assert seconds < TOLD, outcome


def _never_wrong(calls):
    """Calls after a failure: each right, or a named commfuse error; never a wrong result, never a raw one."""
    for kind, value, seconds, named in calls:
        assert (kind, value) == ("ok", True) or named, (kind, value)
        assert seconds < TOLD, (kind, value, seconds)


def _consistent(outs, index):
    """Call ``index`` after the failure went alike on every rank: right everywhere, or a named error
    everywhere (never one rank thinking the group fine while another was told it is dead)."""
    kinds = {out[1][index][0] == "ok" for out in outs}
    assert len(kinds) == 1, [out[1][index][:2] for out in outs]


# -- 1. a producer that raises on one rank ---------------------------------------------------------------


@pytest.mark.parametrize("op,algorithm", [
    ("produce_reduce_scatter", "ring"), ("produce_reduce_scatter", "bidirectional"),
    ("produce_reduce_scatter", "ring:2"), ("produce_reduce_scatter", "vanilla"),
    ("produce_all_to_all", "ring"), ("produce_all_to_all", "ring:2"), ("produce_all_to_all", "vanilla"),
])
@pytest.mark.parametrize("where", ["first", "later"])
def test_a_producer_raising_on_one_rank_is_told_to_every_rank_and_no_later_call_is_wrong(op, algorithm, where):
    outs = launch(cases.producer_raises, 3, op, algorithm, where, timeout=240)
    for rank, (failing, after) in enumerate(outs):
        if rank == 1:
            assert failing[0] == "Injected", failing
        elif failing[:2] != ("ok", True):
            _told(failing, "rank 1", "Injected", "call #")
        _never_wrong(after)
    for i in range(3):
        _consistent(outs, i)
    if where == "later":  # rank 1 completed the call's transfers: the group stays usable
        assert all(after[i][:2] == ("ok", True) for _, after in outs for i in range(3)), outs
        # rank 1 still had to send what it would have made next: its peers were told, not left to compute on it
        assert any(failing[0] == "PeerFailedError" for rank, (failing, _) in enumerate(outs) if rank != 1), outs
    else:  # rank 1 left before its first transfer: its peers, waiting on it, ended the group by name
        assert all(failing[0] in NAMED for rank, (failing, _) in enumerate(outs) if rank != 1), outs
        assert all(after[0][0] in NAMED for _, after in outs), outs


def test_a_policy_failing_on_one_rank_is_told_to_every_rank(tmp_path):
    bad = tmp_path / "broken.toml"  # a shipped profile with a latency no link has
    shipped = (Path(cases.__file__).parents[2] / "commfuse" / "sim" / "profiles" / "h100-sxm.toml").read_text()
    bad.write_text(re.sub(r"(?m)^latency = .*$", "latency = 1e308", shipped))
    outs = launch(cases.broken_profile, 3, str(bad), timeout=240)
    for rank, (failing, after) in enumerate(outs):
        if rank == 1:
            assert failing[0] == "ProfileError" and "broken.toml" in failing[1] and "latency" in failing[1], failing
        else:
            _told(failing, "rank 1", "ProfileError", "latency")
        _never_wrong(after)


def test_two_threads_sharing_a_group_never_get_a_wrong_result():
    for rank, counts in enumerate(launch(cases.two_threads, 3, 30, timeout=600)):
        assert counts["wrong"] == 0 and counts["other"] == 0, (rank, counts)
        assert counts["right"] + counts["named"] == 60, (rank, counts)


# -- 7 and 8. a consumer, an expert, an attention that raises on one rank ----------------------------------


@pytest.mark.parametrize("algorithm", ["ring", "bidirectional", "vanilla"])
def test_a_consumer_raising_after_its_transfers_leaves_the_group_usable_on_every_rank(algorithm):
    outs = launch(cases.consumer_raises, 3, algorithm, "last", timeout=240)
    for rank, (failing, after, reduced) in enumerate(outs):
        assert failing[0] == ("Injected" if rank == 1 else "ok"), failing
        assert rank == 1 or failing[1] is True, failing
        assert [a[:2] for a in after] == [("ok", True)] * 3, after
        assert reduced is True, reduced


@pytest.mark.parametrize("source", ["own", "next"])
@pytest.mark.parametrize("algorithm", ["ring", "ring:2", "bidirectional"])
def test_a_consumer_raising_mid_ring_is_told_to_every_peer_that_needs_its_data(algorithm, source):
    outs = launch(cases.consumer_raises, 3, algorithm, source, timeout=240)
    told = 0
    for rank, (failing, after, reduced) in enumerate(outs):
        if rank == 1:
            assert failing[0] == "Injected", failing
        elif failing[:2] != ("ok", True):
            _told(failing, "rank 1", "Injected", "all_gather_consume", "call #")
            told += 1
        assert [a[:2] for a in after] == [("ok", True)] * 3, after  # rank 1 completed the transfers
        assert reduced is True, reduced
    if source == "own" and algorithm != "bidirectional":  # the ring forwards rank 1's data onward after it
        assert told >= 1, outs


@pytest.mark.parametrize("body,n,args", [
    (cases.expert_raises, 2, ("ring",)), (cases.expert_raises, 2, ("vanilla",)), (cases.attention_raises, 3, ()),
], ids=["moe-expert-ring", "moe-expert-vanilla", "attention-query-slice"])
def test_a_layer_raising_on_one_rank_mid_call_is_told_to_every_rank(body, n, args):
    outs = launch(body, n, *args, timeout=240)
    for rank, (failing, after) in enumerate(outs):
        if rank == 1:
            assert failing[0] == "Injected", failing
        else:
            _told(failing, "rank 1", "Injected")
        _never_wrong(after)
    for i in range(2):
        _consistent(outs, i)


# -- 9, 10, 11, 12 -------------------------------------------------------------------------------------------


def test_a_straggler_is_named_late_by_its_peers_and_told_it_was_late():
    outs = launch(cases.straggler, 3, 8.0, 3.0, timeout=240)
    for rank, (kind, message, seconds, named) in enumerate(outs):
        assert named, (rank, kind, message)
        if rank == 1:
            assert "this rank" in message and "late" in message, message
            assert seconds < 3.0, (seconds, message)  # told as it arrives, not after a timeout of its own
        else:
            assert kind == "CommfuseTimeoutError", (kind, message)
            assert "rank 1" in message and "late" in message and "dead" not in message.split("late")[0], message


def test_ctrl_c_reaches_python_during_a_wait_and_the_peer_is_told():
    (kind, latency), (peer_kind, peer_message, peer_seconds, named) = launch(cases.interrupted, 2, 1.0, 8.0,
                                                                            timeout=240)
    assert kind == "KeyboardInterrupt", (kind, latency)
    assert latency < 4.0, latency  # long before the peer arrives (8 s): the wait did not hold the signal
    assert named and "rank 0" in peer_message and "KeyboardInterrupt" in peer_message, peer_message


def test_a_new_signature_on_one_rank_after_many_matching_calls_is_a_mismatch_on_every_rank():
    for rank, (kind, message, seconds, named) in enumerate(launch(cases.new_signature_later, 2, 20, timeout=240)):
        assert kind == "MismatchError", (rank, kind, message)
        assert "rank 1" in message and "float32[12, 8]" in message and "float32[8, 8]" in message, message
        assert seconds < TOLD, (rank, seconds)


def test_moe_auto_first_call_is_bounded_by_commfuses_timeout():
    outs = launch(cases.moe_auto_first_call, 2, env={"COMMFUSE_TIMEOUT_S": "3"}, timeout=240)
    kind, message, seconds, named = outs[0]
    assert kind == "CommfuseTimeoutError" and "rank 1" in message, (kind, message)
    assert seconds < 20, seconds  # the group's own timeout, which a raw collective would wait, is 120 s


# -- 13 and 5 ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 3])
def test_complex_shards_move_with_every_algorithm(n):
    for rank, out in enumerate(launch(cases.complex_vanilla, n, timeout=120)):
        assert out == {"vanilla": ("ok", True), "ring": ("ok", True), "sliced": ("ok", True)}, (rank, out)


def test_a_group_destroyed_and_made_again_is_never_called_with_old_plans():
    for rank, out in enumerate(launch(cases.group_remade, 3, timeout=240)):
        assert out["before"] == ("ok", True) and out["subgroup"] == ("ok", True), out
        for step in ("cached signature", "new signature", "old subgroup"):
            kind, message = out[step]
            assert kind in ("CommfuseValueError", "GroupDeadError") and "destroyed" in message, (step, out[step])
        assert out["remade"] == ("ok", True) and out["remade, new signature"] == ("ok", True), out


def test_no_call_reads_a_note_of_an_earlier_numbering():
    # issue 44: after release(), or on a group made again on the same store, a late rank's peers read the board
    # and took rank 1's failure of the old call #1 for the new call #1 (wrong data on one rank, a false
    # PeerFailedError on the others)
    for rank, out in enumerate(launch(cases.notes_of_an_earlier_numbering, 3, timeout=240)):
        for how in ("release", "group made again"):
            assert out[how] == ("ok", True), (rank, how, out)
            assert out[how + ", then"] == ("ok", True), (rank, how, out)


def test_a_stream_ordered_backends_watchdog_reads_the_board_for_a_pending_step():
    reported, seconds = launch(cases.watchdog_reads_the_board, 2, timeout=120)[0]
    assert reported, "the watchdog reported nothing"
    kind, message = reported[0]
    assert kind == "PeerFailedError" and "rank 1" in message and "Injected" in message, reported
    assert seconds < cases.TOLD_WITHIN, seconds
