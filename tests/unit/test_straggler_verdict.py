"""Tier (a), no processes: the straggler rule of ``commfuse.metrics.verdict`` over the figures ranks publish. A
rank's excess wait is held to a share of its peers' time per call, not to a fixed number of milliseconds: the
figures of two healthy ranks on a loaded host name nobody, a rank its peers spend most of each call waiting for is
named at any scale, and the variables that set the rule are read and checked."""

from __future__ import annotations

import pytest

from commfuse import metrics
from commfuse.errors import CommfuseValueError

MS = 1e6


def _ranks(*per_call, calls=16):
    """Published figures of ranks whose (wait, time) per call in ms are given; a time of None: not known."""
    return [{"calls": calls, "wait_ns": w * MS * calls, "call_ns": None if t is None else t * MS * calls}
            for w, t in per_call]


@pytest.fixture(autouse=True)
def _defaults(monkeypatch):
    monkeypatch.delenv("COMMFUSE_STRAGGLER_MS", raising=False)
    monkeypatch.delenv("COMMFUSE_STRAGGLER_SHARE", raising=False)


def test_two_healthy_ranks_on_a_loaded_host_are_not_a_straggler():
    # measured on 2 gloo ranks beside a spinning process on 2 cores (tests/distributed/test_observability_gloo.py's
    # loaded case): rank 1 waited 24.3 ms more per call than rank 0, on calls of about 78 ms
    found = metrics.verdict(_ranks((5.3, 76.7), (29.6, 77.8)))
    assert found.rank == 0 and found.excess == pytest.approx(24.3 * MS)
    assert found.call == pytest.approx(77.8 * MS) and found.threshold == pytest.approx(38.9 * MS)
    assert not found.named
    # the old rule (5 ms, and a quarter of the others' wait) named it
    assert found.excess >= max(5 * MS, 0.25 * found.others)


def test_a_rank_its_peers_wait_most_of_each_call_for_is_named():
    found = metrics.verdict(_ranks((450.0, 505.0), (2.0, 55.0), (440.0, 500.0)))
    assert found.named and found.rank == 1
    assert found.others == pytest.approx(445 * MS) and found.excess == pytest.approx(443 * MS)
    assert found.call == pytest.approx(502.5 * MS)  # the median of the others' time per call, not the candidate's


def test_the_rule_is_relative_to_the_calls_time_at_any_scale():
    # the same shares, on calls a hundred times shorter or longer: the same verdict while above the 1 ms floor
    for scale in (0.1, 1.0, 100.0):
        late = metrics.verdict(_ranks((60 * scale, 100 * scale), (5 * scale, 45 * scale)))
        noisy = metrics.verdict(_ranks((30 * scale, 100 * scale), (5 * scale, 75 * scale)))
        assert (late.named, noisy.named) == (True, False), (scale, late, noisy)


def test_the_floor_keeps_tiny_calls_from_naming_clock_noise(monkeypatch):
    tiny = _ranks((0.7, 1.0), (0.1, 0.4))  # a share of 0.6 of a 1 ms call, 0.6 ms
    assert not metrics.verdict(tiny).named
    monkeypatch.setenv("COMMFUSE_STRAGGLER_MS", "0.5")
    assert metrics.verdict(tiny).named
    assert metrics.verdict(tiny, floor_ms=1.0).named is False  # an argument wins over the variable


def test_the_share_is_set_by_its_variable(monkeypatch):
    loaded = _ranks((5.3, 76.7), (29.6, 77.8))
    monkeypatch.setenv("COMMFUSE_STRAGGLER_SHARE", "0.25")
    assert metrics.straggler_share() == 0.25
    assert metrics.verdict(loaded).named
    for bad in ("1.5", "-0.1", "half"):
        monkeypatch.setenv("COMMFUSE_STRAGGLER_SHARE", bad)
        with pytest.raises(CommfuseValueError, match="COMMFUSE_STRAGGLER_SHARE"):
            metrics.verdict(loaded)


def test_without_the_calls_time_the_excess_is_held_to_a_quarter_of_the_others_wait():
    # device stamps time the waits on the device only: the host's start and end time the enqueue
    device = _ranks((20.0, None), (2.0, None))
    found = metrics.verdict(device)
    assert found.call is None and found.threshold == pytest.approx(5 * MS) and found.named
    assert not metrics.verdict(_ranks((20.0, None), (16.0, None))).named  # 4 ms: under the quarter of 20


def test_no_verdict_until_every_rank_has_published_enough_calls():
    assert metrics.verdict(_ranks((50.0, 60.0), (1.0, 10.0), calls=metrics.MIN_CALLS - 1)) is None
    assert metrics.verdict(_ranks((50.0, 60.0))) is None  # one rank: nobody to wait for
