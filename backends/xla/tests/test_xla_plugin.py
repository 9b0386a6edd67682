"""Tier (a), no processes, any environment: the xla plugin registers, reports why it can or cannot run,
and its pure lowering plan (permute per receive, global pairs, replica groups) is right for every schedule."""

from __future__ import annotations

import importlib.util

import pytest

import commfuse as cf
from commfuse.errors import CommfuseTypeError, CommfuseValueError
from commfuse.schedule import Ring, SliceId, Transfer
from commfuse_xla.backend import LoweringError, global_pairs, hop_slice, normalize_groups, permute_plan

HAVE_XLA = importlib.util.find_spec("torch_xla") is not None


def test_registered_through_the_entry_point():
    spec = cf.backends.spec("xla")
    assert spec.distribution == "commfuse-xla"
    assert spec.device_types == ("xla",)
    assert spec.capabilities.execution == "traced"
    assert spec.capabilities.bidirectional_links
    assert set(spec.capabilities.collectives) == {"all_gather", "reduce_scatter", "all_to_all"}
    assert not spec.capabilities.capturable  # traced: XLA replays its own graphs


def test_availability_tells_the_truth_about_this_environment():
    avail = cf.backends.availability("xla")
    if HAVE_XLA:
        assert avail.ok, avail.reason
        assert "PJRT" in avail.detail and "torch_xla" in avail.detail
    else:
        assert not avail.ok
        assert "torch_xla is not importable" in avail.reason
        assert "torch-xla" in avail.fix and "ci/setup_xla.sh" in avail.fix


@pytest.mark.skipif(HAVE_XLA, reason="asking for a backend that cannot run is only an error without torch_xla")
def test_get_without_torch_xla_says_how_to_fix():
    with pytest.raises(cf.CommfuseError, match="torch_xla is not importable.*to fix: install torch-xla"):
        cf.backends.get("xla")


def _all_schedules(max_world: int = 8):
    for n in range(1, max_world + 1):
        for collective, algorithms in (
            ("all_gather", ("ring", "bidirectional")),
            ("reduce_scatter", ("ring", "bidirectional")),
            ("all_to_all", ("ring",)),
        ):
            for algorithm in algorithms:
                for parts in (1, 2):
                    yield cf.schedule.build(collective, n, algorithm=algorithm, parts=parts)


def test_every_receive_is_fed_by_the_mirrored_send_on_every_rank():
    for s in _all_schedules():
        ring = Ring(s.world_size)
        for rank in range(s.world_size):
            for step in s.steps(rank):
                plan = permute_plan(ring, rank, step.sends, step.recvs)
                assert len(plan) == len(step.recvs)
                assert sorted(i for i, _, _ in plan) == list(range(len(step.sends)))
                for recv, (i, shift, channel) in zip(step.recvs, plan):
                    send = step.sends[i]
                    assert (send.shift, send.channel) == (recv.shift, recv.channel) == (shift, channel)
                    # What the sender (ring.prev) sends in this position is what this rank receives.
                    sender = ring.prev(rank, shift)
                    theirs = s.steps(sender)[step.index]
                    their_send = theirs.sends[permute_plan(ring, sender, theirs.sends, theirs.recvs)[
                        step.recvs.index(recv)][0]]
                    assert their_send.slice == recv.slice and their_send.peer == rank


def test_pairs_are_the_ring_permutation_in_global_ids():
    assert global_pairs(Ring(4), [[0, 1, 2, 3]], 1) == [[0, 1], [1, 2], [2, 3], [3, 0]]
    assert global_pairs(Ring(4), [[0, 1, 2, 3]], 3) == [[0, 3], [1, 0], [2, 1], [3, 2]]
    assert global_pairs(Ring(2), [[4, 6], [5, 7]], 1) == [[4, 6], [6, 4], [5, 7], [7, 5]]
    assert global_pairs(Ring(1), [[0]], 1) == [[0, 0]]


def test_hop_slice_moves_every_rank_of_a_slice():
    ring = Ring(4)
    assert hop_slice(ring, SliceId(3, 1, 1), 1) == SliceId(0, 1, 1)
    assert hop_slice(ring, SliceId(1, 0, 0, source=2), 2) == SliceId(3, 0, 0, source=0)


def test_a_send_to_a_peer_off_the_ring_is_refused_with_names():
    ring = Ring(4)
    bad = [Transfer(SliceId(1), peer=3, shift=1)]
    with pytest.raises(LoweringError, match=r"rank 1: a send of shard 1 on channel 0 goes to rank 3, but 1 hop"):
        permute_plan(ring, 1, bad, [Transfer(SliceId(0), peer=0, shift=1)])


def test_a_receive_without_its_mirrored_send_is_refused():
    ring = Ring(4)
    with pytest.raises(LoweringError, match="needs this rank to send shard 1 on the same channel"):
        permute_plan(ring, 1, [Transfer(SliceId(2), peer=2, shift=1)], [Transfer(SliceId(0), peer=0, shift=1)])
    with pytest.raises(LoweringError, match="has no receive on this rank"):
        permute_plan(ring, 1, [Transfer(SliceId(1), peer=2, shift=1)], [])


def test_replica_groups():
    assert normalize_groups(None, 3) == [[0, 1, 2]]
    assert normalize_groups([4, 5], None) == [[4, 5]]
    assert normalize_groups([[0, 2], [1, 3]], None) == [[0, 2], [1, 3]]
    with pytest.raises(CommfuseValueError, match="one size"):
        normalize_groups([[0, 1], [2]], None)
    with pytest.raises(CommfuseValueError, match="share or repeat"):
        normalize_groups([[0, 1], [1, 2]], None)
    with pytest.raises(CommfuseTypeError, match="group must be"):
        normalize_groups("all", None)
