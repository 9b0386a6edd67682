"""Tier (b), real gloo ranks: where the transport lacks a whole all-to-all, C10dBackend runs it as pairwise
sends and receives with the same results as torch's all-to-all, and says so once.

``COMMFUSE_PAIRWISE_ALL_TO_ALL=1`` makes the backend take that path on a torch whose gloo has the
collective (2.13); on one whose gloo refuses it (2.9, 2.11) the refusal itself takes it, which
``test_refusal_is_detected_and_remembered`` checks against what torch's gloo does here.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import _pairwise_all_to_all_cases  # noqa: E402

from commfuse.launch import launch  # noqa: E402

FORCED = {"COMMFUSE_PAIRWISE_ALL_TO_ALL": "1"}


@pytest.mark.parametrize("n", (2, 3, 4))
def test_pairwise_exchange_equals_torch_all_to_all_and_is_logged_once(n):
    results = launch(_pairwise_all_to_all_cases.exchange, n, env=FORCED, timeout=300)
    for rank, res in enumerate(results):
        assert res["problems"] == [], f"rank {rank}: " + "\n".join(res["problems"])
        # one message on the commfuse logger over ten exchanges, at WARNING, naming the backend and collective
        (message,) = res["messages"]
        assert message.startswith("WARNING: ") and "the gloo backend lacks all_to_all" in message, message
        assert "pairwise send/receive steps" in message and "COMMFUSE_PAIRWISE_ALL_TO_ALL" in message, message
        assert res["lacking"] == {"all_to_all": "COMMFUSE_PAIRWISE_ALL_TO_ALL is set"}
        # the exchange went over gloo's point-to-point transfers, not its all-to-all
        assert res["events"] == ["gloo:recv", "gloo:send"], res["events"]


def test_refusal_is_detected_and_remembered():
    results = launch(_pairwise_all_to_all_cases.detected, 3, timeout=300)
    for rank, res in enumerate(results):
        assert res["problems"] == [], f"rank {rank}: " + "\n".join(res["problems"])
        if res["has"]:  # torch's gloo here has dist.all_to_all: commfuse uses it and says nothing
            assert res["messages"] == [] and res["lacking"] == {}
        else:  # it refused: commfuse asked once, remembered the refusal for the group and logged it once
            (message,) = res["messages"]
            assert "the gloo backend lacks all_to_all" in message and "does not support alltoall" in message
            assert list(res["lacking"]) == ["all_to_all"] and "does not support alltoall" in res["lacking"]["all_to_all"]


def test_a_step_that_outlives_the_timeout_names_rank_step_and_peers():
    first, *others = launch(_pairwise_all_to_all_cases.stalled, 3, 1.0, env=FORCED, timeout=120)
    assert others == ["absent", "absent"]
    assert first.startswith("TimeoutError after "), first
    seconds = float(first.split()[2])
    assert 0.9 <= seconds < 10, first  # bounded by the call's timeout (the peers leave 10 s after it)
    assert "rank 0: step 1 of 2 of the pairwise all_to_all" in first, first
    assert "sending to rank 1 and receiving from rank 2" in first, first
