"""Tier (a), one process: when a rank's transport fails, the cause it names is the board's note of the call it
waits in, not an older failure that every rank settled alike and whose note the board happened to hand over
later (its notes come in the order they were written)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from commfuse.errors import PeerFailedError
from commfuse.runtime.board import Board, Stall
from commfuse.runtime.c10d import _board_cause
from commfuse.runtime.groups import GroupState


def _state(store, rank: int) -> GroupState:
    state = GroupState("group 'test'", None)
    state.rank, state.world_size, state.board = rank, 3, Board(store, rank, 3)
    return state


def _fail(store, rank: int, seq: int, message: str) -> None:
    Board(store, rank, 3).log("fail", seq=seq, lane=7, thread="MainThread", label=f"op{seq}", step=None,
                              exc="CommfuseValueError", message=message, continuing=False)


@pytest.mark.parametrize("order", ["old note last", "old note first"])
def test_the_cause_is_the_note_of_the_call_that_is_waited_in(order):
    store = dist.HashStore()
    writes = [(2, 12, "every rank refused this one"), (0, 13, "rank 0 refused its mask")]
    for rank, seq, message in (writes[::-1] if order == "old note last" else writes):
        _fail(store, rank, seq, message)
    error = _board_cause(_state(store, 1), 1, "waiting in hop 1 of call #13", (13, 7))
    assert isinstance(error, PeerFailedError)
    assert "rank 0 failed call #13" in str(error) and "rank 0 refused its mask" in str(error), str(error)


def test_without_a_note_of_that_call_the_latest_call_is_named():
    store = dist.HashStore()
    _fail(store, 0, 14, "a later call")
    _fail(store, 2, 12, "an older call")
    error = _board_cause(_state(store, 1), 1, "waiting in a post of call #13", (13, None))
    assert "rank 0 failed call #14" in str(error), str(error)


def test_a_board_with_no_note_names_nothing():
    assert _board_cause(_state(dist.HashStore(), 1), 1, "waiting", (13, 7)) is None


def _position(seq: int) -> dict:
    return {"seq": seq, "lane": 7, "thread": "MainThread", "digest": "d", "label": f"op{seq}", "check": True,
            "waits": [0], "fp": [], "what": "hop 1 of the call check"}


@pytest.mark.parametrize("read_before", [True, False], ids=["note read before the wait", "note read in the wait"])
def test_a_peer_serving_the_call_is_heard_even_when_its_note_was_read_before_the_wait_began(read_before):
    # rank 0 left call #13 and serves it; rank 1 read the board (in a wait of an earlier call, or a reader that
    # looks for other kinds) before it began to wait in call #13: its wait there must still drain the call
    store = dist.HashStore()
    Board(store, 0, 3).log("fail", seq=13, lane=7, thread="MainThread", label="op13", step=None,
                           exc="CommfuseValueError", message="rank 0 refused its mask", continuing=False, serves=True)
    state = _state(store, 1)
    if read_before:
        earlier = Stall(state, _position(12), str, None)
        earlier.poll()  # a wait of call #12 reads the note and passes it by
        earlier.finished()
    served = []

    def drain(note, position):
        served.append((note["rank"], position["seq"]))
        return PeerFailedError("drained")

    with pytest.raises(PeerFailedError, match="drained"):
        Stall(state, _position(13), str, None, drain).poll()
    assert served == [(0, 13)]


def test_a_note_read_before_the_wait_is_looked_at_once():
    # a continuing failure note of the call, read before the wait: the wait takes it as told, once
    store = dist.HashStore()
    Board(store, 0, 3).log("fail", seq=13, lane=7, thread="MainThread", label="op13", step=2,
                           exc="CommfuseValueError", message="rank 0 stopped", continuing=True)
    state = _state(store, 1)
    state.board.news()
    stall = Stall(state, _position(13), str, None)
    stall.poll()
    assert state.told is not None and state.told["rank"] == 0
    assert state.board.knows(7, 13, 1)
    state.told = None
    stall.poll()
    assert state.told is None  # looked at once per wait, not on every poll
