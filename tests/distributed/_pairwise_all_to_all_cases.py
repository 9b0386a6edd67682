"""Rank-side bodies of test_pairwise_all_to_all_gloo.py: the whole all-to-all run as pairwise sends and
receives where the transport lacks it (run inside ``commfuse.launch`` processes)."""

from __future__ import annotations

import logging
import time

import torch
import torch.distributed as dist

import commfuse as cf
from commfuse.runtime.c10d import C10dBackend, lacks_all_to_all
from commfuse.runtime.groups import group_state
from commfuse.schedule import Collective

from _ops_cases import torch_all_to_all


class _Records(logging.Handler):
    """Every record the ``commfuse`` logger passes on, kept."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(f"{record.levelname}: {record.getMessage()}")


def _listen() -> _Records:
    records = _Records()
    logger = logging.getLogger("commfuse")
    logger.addHandler(records)
    logger.setLevel(logging.INFO)
    return records


def _block(source: int, dest: int) -> torch.Tensor:
    """The block ``source`` sends to ``dest``: 2 x 5, its values naming the pair, so a block that reaches the
    wrong rank or lands in the wrong buffer cannot pass (gloo's all-to-all takes blocks of one shape)."""
    return torch.arange(10, dtype=torch.float32).reshape(2, 5) + 1000 * source + 100 * dest


def _gaps(got, want, what: str) -> list[str]:
    return [f"{what}: block from rank {s} is {g.tolist()}, expected {w.tolist()}"
            for s, (g, w) in enumerate(zip(got, want)) if g.shape != w.shape or not torch.equal(g, w)]


def exchange(rank: int, n: int) -> dict:
    """With ``COMMFUSE_PAIRWISE_ALL_TO_ALL=1`` in the environment: the backend's whole all-to-all, and the ops'
    ``vanilla``, ``sliced:2`` and ``sliced:3`` (several exchanges in one call)
    three times each, against what each rank sent and against torch's all-to-all; what the ``commfuse``
    logger said, how the group's lack is recorded, and which transfers the profiler saw."""
    records = _listen()
    be = C10dBackend()
    problems: list[str] = []
    inputs = [_block(rank, d) for d in range(n)]
    want = [_block(s, rank) for s in range(n)]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        got = be.collective(Collective.ALL_TO_ALL, inputs,
                            [torch.empty(2, 5) for _ in range(n)]).wait(30)
    events = sorted({e.name for e in prof.events() if e.name.startswith("gloo:")})
    reference = [torch.empty_like(w) for w in want]
    torch_all_to_all(reference, inputs)
    problems += _gaps(got, want, "backend.collective")
    problems += _gaps(reference, want, "torch's all-to-all")
    chunks = [_block(rank, d) for d in range(n)]
    for algorithm in ("vanilla", "sliced:2", "sliced:3"):
        for _ in range(3):
            out = cf.all_to_all_consume(chunks, lambda t, s: t.clone(), algorithm=algorithm, backend=be, timeout=30)
            problems += _gaps(out, [_block(s, rank) for s in range(n)], algorithm)
    dist.barrier()
    lacking = {c.value: why for c, why in group_state(be).lacking.items()}
    return {"problems": problems, "messages": records.messages, "lacking": lacking, "events": events}


def detected(rank: int, n: int) -> dict:
    """No forcing: whether torch's gloo here has the all-to-all of tensor lists (asked of torch directly),
    and what commfuse did over three ``vanilla`` calls: their results, its log, the group's record."""
    try:
        probe = [torch.empty(1) for _ in range(n)]
        dist.all_to_all(probe, [torch.full((1,), float(rank)) for _ in range(n)])
        has = True
    except RuntimeError as e:
        if not lacks_all_to_all(e):
            raise
        has = False
    records = _listen()
    be = C10dBackend()
    problems: list[str] = []
    chunks = [_block(rank, d) for d in range(n)]
    for _ in range(3):
        out = cf.all_to_all_consume(chunks, lambda t, s: t.clone(), algorithm="vanilla", backend=be, timeout=30)
        problems += _gaps(out, [_block(s, rank) for s in range(n)], "vanilla")
    lacking = {c.value: why for c, why in group_state(be).lacking.items()}
    return {"has": has, "problems": problems, "messages": records.messages, "lacking": lacking}


def stalled(rank: int, n: int, timeout: float) -> str:
    """With ``COMMFUSE_PAIRWISE_ALL_TO_ALL=1``: rank 0 runs the exchange with a ``timeout`` bound while the
    other ranks never join (they sleep past the bound, then leave); what rank 0 raised."""
    be = C10dBackend()
    if rank != 0:
        time.sleep(timeout + 10)
        return "absent"
    inputs = [_block(rank, d) for d in range(n)]
    handle = be.collective(Collective.ALL_TO_ALL, inputs, [torch.empty(2, 5) for _ in range(n)])
    began = time.monotonic()
    try:
        handle.wait(timeout)
    except TimeoutError as e:
        return f"TimeoutError after {time.monotonic() - began:.1f} s: {e}"
    return "no error"
