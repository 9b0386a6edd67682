"""Tier (b), real gloo ranks: ``commfuse.launch`` reports what each rank did even when teardown hangs.

The scenario: rank 0 posts an asynchronous all-reduce that rank 1 never
joins, then raises (or returns). Gloo's worker thread stays inside that
collective until the group's timeout (120 s), and ``destroy_process_group``
waits for it; rank 1 meanwhile blocks in a ``recv`` from rank 0, which only
fails once rank 0's process is gone. Before ranks reported ahead of their
teardown, both were killed at launch's deadline and their results lost; and a
rank whose teardown failed part-way (``commfuse.backends.release`` not importable, so
destroy was skipped) kept its group alive, and its interpreter's exit hung.
"""

from __future__ import annotations

import sys
import time

import pytest
import torch
import torch.distributed as dist

import commfuse.launch as launch_module
from commfuse.launch import launch

torch.set_num_threads(1)


def _abandoned_collective(rank: int, world_size: int, how: str) -> str:
    t = torch.ones(16)
    if rank == 1:
        dist.recv(t, 0)  # rank 0 never sends: this returns (raises) only once rank 0's process has exited
        return "rank 1 received"
    dist.all_reduce(t, async_op=True)  # rank 1 never joins: destroy_process_group waits for it
    time.sleep(0.5)  # let gloo's worker thread enter the collective
    if how == "raise, and teardown fails":
        sys.modules["commfuse.backends"] = None  # release cannot be imported: destroy must still be tried
    if how != "return":
        raise ValueError("rank 0 broke in the middle of an op")
    return "rank 0 done"


@pytest.mark.parametrize("how", ["raise", "return", "raise, and teardown fails"])
def test_results_survive_a_teardown_that_would_hang(how):
    start = time.monotonic()
    out = launch(_abandoned_collective, 2, how, timeout=120, allow_failures=True)
    took = time.monotonic() - start
    assert took < 60, (took, out)
    if how != "return":
        assert out[0].startswith("FAILED: ") and "ValueError" in out[0], out[0]
        assert "rank 0 broke in the middle of an op" in out[0]
    else:
        assert out[0] == "rank 0 done"
    # rank 1 reports its own error (the peer went away), not launch's deadline
    assert isinstance(out[1], str) and "did not finish" not in out[1], out[1]
    assert "did not finish" not in out[0]


def test_teardown_bound_is_a_few_seconds():
    assert 0 < launch_module.TEARDOWN_S <= 10


def _nccl_env(rank, n):
    import os

    return {k: os.environ.get(k) for k in ("NCCL_HOSTID", "NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE", "NCCL_IB_DISABLE",
                                           "NCCL_SOCKET_IFNAME")}


def test_each_launched_rank_can_look_like_its_own_nccl_host(monkeypatch):
    from commfuse.launch import ONE_GPU_ENV

    monkeypatch.delenv("NCCL_HOSTID", raising=False)
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    plain = launch(_nccl_env, 2, timeout=60)
    assert [e["NCCL_HOSTID"] for e in plain] == [None, None]
    monkeypatch.setenv(ONE_GPU_ENV, "1")
    one_gpu = launch(_nccl_env, 3, timeout=60)
    assert [e["NCCL_HOSTID"] for e in one_gpu] == ["commfuse-rank-0", "commfuse-rank-1", "commfuse-rank-2"]
    assert all(e["NCCL_P2P_DISABLE"] == e["NCCL_SHM_DISABLE"] == "1" and e["NCCL_SOCKET_IFNAME"] == "lo"
               for e in one_gpu)
