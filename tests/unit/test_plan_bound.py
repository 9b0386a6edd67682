"""Tier (a), one process on torch's fake process group: the planning table holds at most its bound in bytes,
counting each plan's receive buffers (``BufferPool.MAX_FREE`` per shape, once per pool) and an estimate of its
Python objects; it evicts the least recently used signatures, frees their buffers, keeps what runs over and
over, and says by name when the bound is too small. The fake group moves no data, so what is checked here is
the accounting; tests/distributed/test_plan_bound_gloo.py checks results on real ranks."""

from __future__ import annotations

import gc
import logging
import tracemalloc

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

import commfuse
from commfuse import backends
from commfuse.errors import CommfuseTypeError, CommfuseValueError
from commfuse.planning import table
from commfuse.runtime.programs import BufferPool, key_bytes

K = 16  # the columns of every input: small tensors, many shapes


@pytest.fixture
def fake_group():
    """Rank 0 of a fake group of ``n`` ranks (transfers complete at once, without data), the table empty and its
    bound back to the variable's after the test."""
    made = []

    def start(n: int = 2):
        backends.release()
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=n)
        made.append(n)
        return dist.group.WORLD

    yield start
    backends.release()
    table.set_bound(None)
    if made:
        dist.destroy_process_group()


def _calls(group, rows: int, algorithm: str = "ring", w=None):
    """One all_gather_matmul and one matmul_reduce_scatter of ``rows`` rows per shard (their pieces have one
    shape: one pool key)."""
    n = dist.get_world_size(group)
    w = torch.randn(K, K) if w is None else w
    commfuse.all_gather_matmul(torch.randn(rows, K), w, group=group, algorithm=algorithm, check=False)
    commfuse.matmul_reduce_scatter(torch.randn(n * rows, K), w, group=group, algorithm=algorithm, check=False)


def _pools() -> list[BufferPool]:
    return [table.get(key)._commfuse_pool for key in table.keys("backend")
            if hasattr(table.get(key), "_commfuse_pool")]


def test_a_signature_reserves_max_free_buffers_of_each_shape_once_per_pool(fake_group):
    group = fake_group(2)
    _calls(group, 5)
    (pool,) = _pools()
    key = ((5, K), torch.float32)  # the ring's slices of both ops: one shape
    assert set(pool.claims) == {key} and pool.claims[key] == 2  # two plans hold it
    assert pool.reserved == BufferPool.MAX_FREE * 5 * K * 4
    used = table.usage()
    assert used["reserved"] == pool.reserved and used["bytes"] == used["reserved"] + used["objects"]
    assert 0 < used["buffers"] <= used["reserved"]  # what the calls left in the pool, at most what is reserved
    assert used["buffers"] == pool.held() == sum(len(s) * key_bytes(k) for k, s in pool.free.items())


def test_the_table_stays_within_its_bound_and_keeps_what_runs_over_and_over(fake_group):
    group = fake_group(4)
    w = torch.randn(K, K)
    _calls(group, 3, w=w)
    hot = {key: table.get(key) for key in table.keys() if key[0] in ("all_gather_matmul", "matmul_reduce_scatter")}
    hot.update({key: table.get(key) for key in table.keys("plan")})
    bound = table.usage()["bytes"] + 192 * 1024  # the hot signature and about six of the others
    backends.plan_bytes(bound)
    peak = 0
    for rows in range(4, 64):  # a new shape per round, each with its own slice size (its own call entry)
        _calls(group, 3, w=w)  # the hot signature, every round
        _calls(group, rows, w=w)
        used = table.usage()
        peak = max(peak, used["bytes"])
        assert used["bytes"] <= bound, used
        assert used["buffers"] <= used["reserved"], used
        # what the hot signature runs was never evicted: the same objects under the same keys
        assert all(table.get(key) is value for key, value in hot.items()), f"round {rows}: the hot signature went"
    used = table.usage()
    assert used["evictions"] > 150, used  # the bound was reached, over and over
    assert peak > bound - 48 * 1024  # it fills the bound rather than clearing itself


def test_evicting_a_plan_drops_its_free_buffers_and_an_evicted_plan_keeps_none(fake_group):
    group = fake_group(2)
    _calls(group, 7)
    (pool,) = _pools()
    key = ((7, K), torch.float32)
    assert pool.free.get(key)  # a received buffer is kept for the next call
    backends.plan_bytes(0)  # keep nothing: every entry but the backend goes
    assert table.keys() == table.keys("backend")
    assert pool.claims == {} and pool.reserved == 0 and pool.held() == 0 and key not in pool.free
    assert table.usage()["reserved"] == 0
    # the shape's calls still run, planned each time, and the pool keeps nothing for them
    _calls(group, 7)
    assert pool.held() == 0 and table.keys() == table.keys("backend")


def test_a_pool_keeps_buffers_of_claimed_shapes_only_and_counts_a_shared_shape_once():
    backend = type("B", (), {"device": torch.device("cpu"), "empty": staticmethod(
        lambda shape, dtype: torch.empty(shape, dtype=dtype))})()
    pool = BufferPool(backend)
    a, b = ((3, 4), torch.float32), ((2,), torch.float64)
    assert pool.claim([a, b]) == BufferPool.MAX_FREE * (3 * 4 * 4 + 2 * 8)
    assert pool.claim([a]) == 0  # held already: counted once
    for _ in range(BufferPool.MAX_FREE + 2):
        pool.put(torch.empty(3, 4), a)
    assert len(pool.free[a]) == BufferPool.MAX_FREE  # never more than MAX_FREE a shape
    pool.put(torch.empty(5), ((5,), torch.float32))  # a shape nobody claimed: let go
    assert ((5,), torch.float32) not in pool.free
    assert pool.unclaim([a]) == 0 and a in pool.free  # another plan still holds it
    taken = pool.free[a]
    assert pool.unclaim([a]) == BufferPool.MAX_FREE * 48 and a not in pool.free
    assert len(taken) == BufferPool.MAX_FREE  # the list a call in flight took is left as it was
    assert pool.reserved == BufferPool.MAX_FREE * 16


@pytest.mark.parametrize("n, algorithm", [(2, "ring"), (8, "ring:4"), (4, "vanilla"), (4, "bidirectional")])
def test_the_estimate_of_python_objects_is_near_what_tracemalloc_measures(fake_group, n, algorithm):
    group = fake_group(n)
    w = torch.randn(K, K)
    _calls(group, 500, algorithm, w)  # the entries every shape shares (schedule, compiled steps) made first
    gc.collect()
    tracemalloc.start()
    try:
        before, counted = tracemalloc.get_traced_memory()[0], table.usage()["objects"]
        for rows in range(1, 25):
            _calls(group, rows * 4, algorithm, w)
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    estimated = table.usage()["objects"] - counted
    assert 0.5 * estimated <= grown <= 1.25 * estimated, (grown, estimated)


def test_an_entry_bigger_than_the_bound_is_not_kept_and_said_once(fake_group, caplog):
    group = fake_group(2)
    backends.plan_bytes(table.ENTRY_BYTES * 4)  # room for small entries, not for a plan with its buffers
    with caplog.at_level(logging.WARNING, logger="commfuse"):
        _calls(group, 64)
        _calls(group, 64)
    assert table.keys("plan") == []
    said = [r.getMessage() for r in caplog.records if "smaller than one 'plan' entry alone" in r.getMessage()]
    assert len(said) == 1 and "COMMFUSE_PLAN_BYTES" in said[0], said
    assert table.usage()["bytes"] <= table.bound()


def test_a_signature_planned_again_after_it_was_evicted_is_counted_and_said_once(fake_group, caplog):
    group = fake_group(2)
    w = torch.randn(K, K)
    _calls(group, 2, w=w)
    backends.plan_bytes(table.usage()["bytes"] + 8 * 1024)
    with caplog.at_level(logging.WARNING, logger="commfuse"):
        for _ in range(3):
            for rows in range(2, 40):
                _calls(group, rows, w=w)
    assert table.usage()["replanned"] > 10
    said = [r.getMessage() for r in caplog.records if "was planned again" in r.getMessage()]
    assert len(said) == 1 and "commfuse.backends.plan_bytes" in said[0], said


def test_the_bound_comes_from_the_variable_unless_code_sets_it(monkeypatch):
    backends.release()
    table.set_bound(None)
    monkeypatch.setenv("COMMFUSE_PLAN_BYTES", "64KiB")
    backends.release()
    assert backends.plan_bytes() == 64 * 1024
    monkeypatch.setenv("COMMFUSE_PLAN_BYTES", "1000")
    assert backends.plan_bytes() == 64 * 1024  # read once, until release
    backends.release()
    assert backends.plan_bytes() == 1000
    assert backends.plan_bytes(5000) == 5000  # code wins over the variable, across releases
    backends.release()
    assert backends.plan_bytes() == 5000
    assert backends.plan_bytes(None) == 1000  # back to the variable
    monkeypatch.delenv("COMMFUSE_PLAN_BYTES")
    backends.release()
    assert backends.plan_bytes() == table.DEFAULT_BOUND
    for bad in ("lots", "5MB", "-1", "1e3"):
        monkeypatch.setenv("COMMFUSE_PLAN_BYTES", bad)
        backends.release()
        with pytest.raises(CommfuseValueError, match="COMMFUSE_PLAN_BYTES"):
            backends.plan_bytes()
    monkeypatch.delenv("COMMFUSE_PLAN_BYTES")
    backends.release()
    with pytest.raises(CommfuseTypeError, match="int of bytes"):
        backends.plan_bytes(1.5)
    with pytest.raises(CommfuseValueError, match="from 0 to"):
        backends.plan_bytes(-1)


def test_release_lets_every_buffer_go(fake_group):
    group = fake_group(2)
    _calls(group, 9)
    (pool,) = _pools()
    assert pool.held() > 0
    backends.release()
    assert pool.held() == 0 and pool.reserved == 0 and pool.claims == {}
    assert table.usage()["bytes"] == 0
