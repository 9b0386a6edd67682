"""Helpers every kind of bench run shares (``runner``, ``compiled``, ``fakepg``).

``gather_objects`` collects a Python object from every rank, ``fingerprint_exchange``
turns the ops' fingerprint check off for timed runs, ``load_average`` and
``run_info`` describe the machine a run had, and ``fresh_inductor_cache`` and
``recompile_room`` set up ``torch.compile`` for a ``--compile`` run.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import random
import shutil
import tempfile
import time

import torch
import torch.distributed as dist

from commfuse.bench.memory import peak_memory
from commfuse.runtime import measure


def gather_objects(obj, world_size: int, device: torch.device) -> list:
    """Every rank's ``obj``, in rank order, on every rank: ``dist.all_gather_object`` without numpy (torch's
    unpickles through ``Tensor.numpy``, and commfuse does not require numpy). ``device`` is where the group's
    collectives take tensors (the CPU for gloo)."""
    data = pickle.dumps(obj)
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [torch.empty_like(size) for _ in range(world_size)]
    dist.all_gather(sizes, size)
    longest = max(int(s.item()) for s in sizes)
    mine = torch.zeros(longest, dtype=torch.uint8)
    mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    out = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(world_size)]
    dist.all_gather(out, mine.to(device))
    return [pickle.loads(bytes(t[: int(s.item())].cpu().tolist())) for t, s in zip(out, sizes)]


@contextlib.contextmanager
def fingerprint_exchange(on: bool):
    """Timed runs skip the ops' fingerprint exchange (``COMMFUSE_CHECK=0``) unless ``on``.

    The exchange is a safety check, one small round trip before an op's first
    transfer, not part of any algorithm; the checked first run of every
    algorithm has already shown that the ranks agree. ``--fingerprint`` times
    it too (what a caller gets with the default ``check``).
    """
    if on:
        yield
        return
    before = os.environ.get("COMMFUSE_CHECK")
    os.environ["COMMFUSE_CHECK"] = "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ["COMMFUSE_CHECK"]
        else:
            os.environ["COMMFUSE_CHECK"] = before


def load_average() -> float | None:
    """The 1-minute load average: how busy the machine was besides (and with) this run."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def run_info(load_before, world_size: int, dev) -> dict:
    """What a rank's run reports besides its results: the load before and after, the cores, the group."""
    return {
        "load": [load_before, load_average()],
        "cpus": os.cpu_count(),
        "world_size": world_size,
        "backend": dist.get_backend(),
        "device": str(dev),
    }


@contextlib.contextmanager
def fresh_inductor_cache(rank: int):
    """``TORCHINDUCTOR_CACHE_DIR`` pointed at a new temporary directory for the duration.

    Inductor's FX-graph cache does not key on a custom op's fake kernel, so a
    cache from another commfuse version could hand back stale code, and a warm
    cache would make the first-step figure a load, not a compile.
    """
    before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    path = tempfile.mkdtemp(prefix=f"commfuse-bench-inductor-r{rank}-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
    try:
        yield path
    finally:
        if before is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = before
        shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def recompile_room(graphs: int):
    """Let dynamo keep at least ``graphs`` graphs per code object (one per algorithm; its default limit is 8)."""
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    before = getattr(config, name)
    setattr(config, name, max(before, graphs + 2))
    try:
        yield
    finally:
        setattr(config, name, before)


def timed_rounds(config, items: list, step, sync, advance) -> list[list[float]]:
    """This rank's seconds per [repeat][item] of a workload timed in rows of its own (``-w strands``,
    ``-w ring_attention``). ``items`` are (row, measure mode or None); each of ``config.warmup`` +
    ``config.repeats`` rounds runs every item once, in an order shuffled from ``config.seed`` and the round,
    between a barrier and a drain of the device, under ``commfuse.runtime.measure(mode)``; the warm-up rounds
    are not kept. ``step(row)`` runs a row, ``sync()`` drains the device, ``advance(text)`` reports progress."""
    clock = time.perf_counter
    reps, warm = config.repeats, config.warmup
    wall = [[float("nan")] * len(items) for _ in range(reps)]
    with fingerprint_exchange(config.fingerprint):
        for rep in range(warm + reps):
            for i in random.Random(1_000_003 * config.seed + rep).sample(range(len(items)), len(items)):
                row, mode = items[i]
                dist.barrier()
                sync()
                with measure(mode):
                    t0 = clock()
                    step(row)
                    sync()
                    t1 = clock()
                if rep >= warm:
                    wall[rep - warm][i] = t1 - t0
                advance(f"{row}{' ' + mode if mode else ''} ({rep + 1}/{warm + reps})")
    return wall


def peak_per_row(config, rows: list, step, sync, device: torch.device, advance) -> tuple[list, str]:
    """Every row once more, warm, for its peak memory: per row, the largest over the ranks (None where a rank
    could not read it), and how it was read (``commfuse.bench.memory.peak_memory``)."""
    peaks, how = [], ""
    with fingerprint_exchange(config.fingerprint):
        for row in rows:
            dist.barrier()
            with peak_memory(device) as peak:
                step(row)
                sync()
            peaks.append(peak.bytes)
            how = peak.how
            advance(f"{row}: memory")
    every = gather_objects(peaks, dist.get_world_size(), device)
    return [None if any(p[k] is None for p in every) else max(p[k] for p in every) for k in range(len(rows))], how
