"""Tier (a), one process: the planning table's keys follow torch.distributed's default group, so a plan
made for one default group (or for none) is never run once another is in place."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import commfuse
from commfuse import backends
from commfuse.errors import CommfuseValueError
from commfuse.planning import table


def _op_keys() -> list[tuple]:
    return table.keys("all_gather_matmul")


def test_single_process_plans_are_forgotten_when_a_group_is_made_and_destroyed():
    backends.release()
    x, w = torch.randn(4, 8), torch.randn(8, 3)
    torch.testing.assert_close(commfuse.all_gather_matmul(x, w, check=False), x @ w)  # one process
    assert [key[-1] for key in _op_keys()] == [None]
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        group = dist.group.WORLD
        torch.testing.assert_close(commfuse.all_gather_matmul(x, w), x @ w)
        torch.testing.assert_close(commfuse.all_gather_matmul(x, w), x @ w)  # the entry, found again
        # planning on the group forgot the single-process entry: one entry, keyed by the group
        assert [key[-1] for key in _op_keys()] == [group]
    finally:
        dist.destroy_process_group()
    # destroyed, none made again: the single-process plan is gone, so the call is refused, not run unsharded
    with pytest.raises(CommfuseValueError, match="default process group was destroyed"):
        commfuse.all_gather_matmul(x, w)
    backends.release()  # as the error says: a single process from here on
    torch.testing.assert_close(commfuse.all_gather_matmul(x, w), x @ w)
    backends.release()
