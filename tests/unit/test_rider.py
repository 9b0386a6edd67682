"""Tier (a), one process: the digest pair that rides a call's transfers (commfuse.runtime.rider). Every rank's
riders are walked through the real schedules of every point-to-point algorithm, step by step as the
executor posts and waits, the pairs delivered as the transport would: every rank must end with the same
verdict, and it must say "differ" exactly when some rank's digest differs, wherever that rank sits."""

from __future__ import annotations

import itertools

import pytest
import torch

from commfuse.runtime.groups import RIDER_CHANNEL
from commfuse.runtime.rider import Rider
from commfuse.schedule import SliceId, Transfer, build

SCHEDULES = [(c, a, p) for c in ("all_gather", "reduce_scatter") for a, p in
             (("ring", 1), ("ring", 2), ("bidirectional", 1), ("bidirectional", 2))]


def _walk(collective: str, algorithm: str, parts: int, digests: list[int]) -> list[bool | None]:
    """Every rank's verdict after one call of the schedule, each step posted by every rank, then waited."""
    n = len(digests)
    schedule = build(collective, n, algorithm=algorithm, parts=parts)
    riders = [Rider(d) for d in digests]
    steps = [schedule.steps(r) for r in range(n)]
    for i in range(schedule.num_steps):
        mail: dict[tuple[int, int], list[torch.Tensor]] = {}
        arriving = {}
        for r in range(n):  # every rank posts the step: its pairs go out with the flag it had before the step
            st = steps[r][i]
            sends = [(t, torch.zeros(1)) for t in st.sends]
            recvs = [(t, torch.zeros(1)) for t in st.recvs]
            sent, received, buffers = riders[r].extend(sends, recvs)
            for t, x in sent[len(sends):]:
                assert t.channel == RIDER_CHANNEL
                mail.setdefault((r, t.peer), []).append(x.clone())
            arriving[r] = (received[len(recvs):], buffers)
        for r in range(n):  # then waits: what each peer sent lands in the receive buffers
            extra, buffers = arriving[r]
            for (t, x), buffer in zip(extra, buffers):
                assert x is buffer
                buffer.copy_(mail[(t.peer, r)].pop(0))
            riders[r].absorb(buffers)
        assert all(not q for q in mail.values()), "a pair was sent that no rank received"
    return [rider.verdict() for rider in riders]


@pytest.mark.parametrize("collective,algorithm,parts", SCHEDULES)
@pytest.mark.parametrize("n", (2, 3, 4, 5))
def test_one_rank_that_differs_is_known_to_every_rank(collective, algorithm, parts, n):
    for odd in range(n):
        digests = [7] * n
        digests[odd] = 8
        assert _walk(collective, algorithm, parts, digests) == [False] * n, f"rank {odd} of {n} differs"
    assert _walk(collective, algorithm, parts, [7] * n) == [True] * n


@pytest.mark.parametrize("collective,algorithm,parts", SCHEDULES)
def test_any_pattern_of_digests_on_four_ranks(collective, algorithm, parts):
    for digests in itertools.product((1, 2, 3), repeat=4):
        want = len(set(digests)) == 1
        assert _walk(collective, algorithm, parts, list(digests)) == [want] * 4, digests


def test_one_pair_per_peer_each_way_and_the_step_untouched():
    rider = Rider(5)
    a, b = Transfer(SliceId(0), 1, 1, 0), Transfer(SliceId(0), 1, 1, 1)  # two messages to one peer
    c = Transfer(SliceId(2), 2, 1, 0)
    sends, recvs = [(a, torch.ones(2)), (b, torch.ones(2))], [(c, torch.ones(2))]
    out, inc, buffers = rider.extend(sends, recvs)
    assert out[:2] == sends and inc[:1] == recvs
    assert [t.peer for t, _ in out[2:]] == [1] and [t.peer for t, _ in inc[1:]] == [2]
    assert out[2][1].tolist() == [5, 0] and len(buffers) == 1 and buffers[0].dtype == torch.int64
    assert len(sends) == 2 and len(recvs) == 1  # the caller's lists are not changed


def test_a_flag_or_another_digest_sets_the_flag_and_it_rides_on():
    rider = Rider(5)
    rider.extend([], [])
    rider.absorb([torch.tensor([5, 0])])
    assert rider.verdict() is True
    rider.absorb([torch.tensor([5, 1])])
    assert rider.verdict() is False
    out, _, _ = rider.extend([(Transfer(SliceId(0), 1, 1, 0), torch.ones(1))], [])
    assert out[-1][1].tolist() == [5, 1]
    other = Rider(5)
    other.extend([], [])
    other.absorb([torch.tensor([6, 0])])
    assert other.verdict() is False


def test_no_verdict_without_a_ride_or_beside_a_whole_collective():
    assert Rider(1).verdict() is None
    rider = Rider(1)
    rider.extend([], [])
    rider.wholes += 1
    assert rider.verdict() is None


@pytest.mark.parametrize("digest", (-1, 1 << 63))
def test_a_digest_outside_63_bits_is_refused(digest):
    with pytest.raises(ValueError, match="below 2\\*\\*63"):
        Rider(digest)
