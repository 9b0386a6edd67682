"""Tier (a), one process on torch's ``fake`` process group: a group destroyed without
``commfuse.backends.release()`` is let go at the next planning (its state, backend object and planning-table
entries, so that torch can free it), unless a call on it is in flight; the groups that stay keep theirs."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.distributed as dist

import commfuse as cf
from commfuse import backends
from commfuse.planning import table
from commfuse.runtime import groups


@pytest.fixture
def world():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    backends.release()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)  # transfers complete at once
    try:
        yield
    finally:
        dist.destroy_process_group()
        backends.release()


def _call(group) -> None:
    cf.all_gather_matmul(torch.ones(4, 8), torch.ones(8, 3), group=group, algorithm="ring", check=False)


def _holds(group) -> list:
    """What of commfuse's still names ``group``: table keys that hold it, its state."""
    keys = [key for key in table.keys() if any(part is group for part in key)]
    return keys + [state for state in groups._STATES.values() if state.group is group]


def test_a_destroyed_group_is_let_go_at_the_next_planning_and_a_live_one_keeps_its_state(world):
    gone, kept = dist.new_group([0, 1]), dist.new_group([0, 1])
    _call(gone)
    _call(kept)
    state = groups.state_of_group(kept)
    numbers = dict(state.seqs)
    plans = table.entries("plan")
    name = groups.state_of_group(gone).name
    incarnations = dict(groups._INCARNATIONS)
    dist.destroy_process_group(gone)
    _call(dist.new_group([0, 1]))  # a new group: planning sweeps
    # asked for again once let go, the destroyed group's state is not kept, and counts no incarnation
    assert groups.state_of_group(gone).incarnation == incarnations[name]
    assert groups._INCARNATIONS[name] == incarnations[name] and _holds(gone) == []
    dead = weakref.ref(gone)
    del gone
    gc.collect()
    assert dead() is None, [type(r).__name__ for r in gc.get_referrers(dead())]
    assert groups.state_of_group(kept) is state and state.seqs == numbers  # not made again, nor renumbered
    assert _holds(kept) and table.entries("plan") == plans  # the new group's plan replaced the one let go
    _call(kept)  # the kept group's entry, found again
    assert state.seqs[next(iter(numbers))] == next(iter(numbers.values())) + 1


def test_a_group_with_a_call_in_flight_is_let_go_only_once_the_call_ends(world):
    busy = dist.new_group([0, 1])
    _call(busy)
    state = groups.state_of_group(busy)
    dist.destroy_process_group(busy)
    with state.lock:  # as a call on another thread holds it
        _call(dist.new_group([0, 1]))  # planning sweeps
        assert _holds(busy) and groups.state_of_group(busy) is state
    _call(dist.new_group([0, 1]))
    assert _holds(busy) == []


def test_only_entries_that_hold_the_group_or_what_it_kept_go(world):
    group = dist.new_group([0, 1])
    _call(group)
    table.remember(("flag", group), True)  # a value any key may hold for itself: not taken to mean the group
    table.remember(("other", True, 3), "stays")
    shared = set(table.keys("schedule")) | set(table.keys("compiled"))
    dist.destroy_process_group(group)
    _call(dist.new_group([0, 1]))  # planning sweeps
    assert table.get(("other", True, 3)) == "stays"
    assert set(table.keys("schedule")) | set(table.keys("compiled")) == shared  # every group's
    assert _holds(group) == []
    assert len(table.keys("call")) == len(table.keys("plan")) == len(table.keys("all_gather_matmul")) == 1  # the new group's
