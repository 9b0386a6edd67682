"""Rank-side bodies of test_group_release_gloo.py: process groups made, called once and destroyed with
torch's ``destroy_process_group`` (no ``commfuse.backends.release()``), over and over, while this rank
counts what it holds."""

from __future__ import annotations

import datetime
import gc
import os
import threading

import torch
import torch.distributed as dist

import commfuse as cf


def held() -> dict[str, int]:
    """What this process holds now: file descriptors, Python threads, native threads (tasks), RSS bytes."""
    gc.collect()
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return {"fds": len(os.listdir("/proc/self/fd")), "threads": threading.active_count(),
            "tasks": len(os.listdir("/proc/self/task")), "rss": rss}


def _ints(shape, seed: int) -> torch.Tensor:
    return ((torch.arange(shape[0] * shape[1], dtype=torch.float32).reshape(shape) + seed) % 7) - 3


def _agmm(rank: int, n: int, group, seed: int) -> bool:
    """One all_gather_matmul on ``group``, compared with its reference (integer values: exact)."""
    w = _ints((8, 3), seed)
    got = cf.all_gather_matmul(_ints((4, 8), 10 * rank + seed), w, group=group, algorithm="ring")
    want = torch.cat([_ints((4, 8), 10 * r + seed) for r in range(n)]) @ w
    return bool(torch.equal(got, want))


def _cycle(rank: int, n: int, seed: int) -> bool:
    group = dist.new_group(list(range(n)))
    ok = _agmm(rank, n, group, seed)
    dist.destroy_process_group(group)
    return ok


def cycles(rank: int, n: int, count: int, warm: int = 10, every: int = 10) -> dict:
    """``warm`` cycles (new_group, one call, destroy_process_group), then what this rank holds, then
    ``count`` more cycles and what it holds after. A group made before the cycles stays and is called every
    ``every`` cycles (its results and call numbers must go on). Then the whole world is destroyed (no
    argument), made again on the same store under a new prefix, and ``warm`` more cycles run: what it holds
    then is compared with the first count too. Each count is taken at the same point of a cycle (just after
    a destroy)."""
    torch.set_num_threads(1)
    from torch.distributed import distributed_c10d as c10d

    kept = dist.new_group(list(range(n)))
    ok = _agmm(rank, n, kept, 0)
    for i in range(warm):
        ok &= _cycle(rank, n, i)
    before = held()
    for i in range(count):
        ok &= _cycle(rank, n, i)
        if i % every == 0:
            ok &= _agmm(rank, n, kept, i)
    after = held()
    base = c10d._get_default_store()
    dist.destroy_process_group()  # the whole world, the kept group with it
    dist.init_process_group("gloo", store=dist.PrefixStore("again", base), rank=rank, world_size=n,
                            timeout=datetime.timedelta(seconds=60))
    ok &= _agmm(rank, n, None, 1)
    for i in range(warm):
        ok &= _cycle(rank, n, i)
    again = held()
    return {"ok": ok, "before": before, "after": after, "again": again}
