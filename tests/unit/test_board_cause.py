"""Tier (a), one process: when a rank's transport fails, the cause it names is the board's note of the call it
waits in, not an older failure that every rank settled alike and whose note the board happened to hand over
later (its notes come in the order they were written)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from commfuse.errors import PeerFailedError
from commfuse.runtime.board import Board
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
