"""Tier (a), one process: the planning table's keys follow torch.distributed's default group, so a plan
made for one default group (or for none) is never run once another is in place; and a signature is planned
once, whether its calls want gradients or not."""

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


@pytest.mark.parametrize("algorithm", ["ring", "vanilla"])
def test_a_call_with_gradients_runs_the_forward_its_op_planned(monkeypatch, algorithm):
    """A call that wants gradients plans its forward once per signature, as one that does not: the autograd
    Function runs the forward its op planned instead of planning it again on every call."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from commfuse.planning import gather, scatter

    backends.release()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)  # transfers complete at once
    try:
        group = dist.group.WORLD
        planned: list[str] = []
        real = gather.kept_plan  # the one function, bound by name in both modules that plan these ops
        for module in (gather, scatter):
            monkeypatch.setattr(module, "kept_plan", lambda key: planned.append(key[2]) or real(key))
        x = torch.randn(4, 8, requires_grad=True)
        w, w2 = torch.randn(8, 6, requires_grad=True), torch.randn(6, 8, requires_grad=True)
        seen = []
        for _ in range(3):
            y = commfuse.all_gather_matmul(x, w, group=group, algorithm=algorithm, check=False)
            z = commfuse.matmul_reduce_scatter(y, w2, group=group, algorithm=algorithm, check=False)
            assert y.requires_grad and z.requires_grad and z.shape == (4, 8)
            seen.append(list(planned))
        assert set(seen[0]) == {"all_gather_matmul", "matmul_reduce_scatter"}
        assert seen[1] == seen[2] == seen[0]  # the repeated calls looked nothing up
    finally:
        backends.release()
        dist.destroy_process_group()
