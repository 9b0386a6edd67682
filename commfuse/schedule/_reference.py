"""Reference semantics of each collective over per-rank lists, in one process.

These are the definitions every test compares against (in the spirit of JAX's
``all_gather_ref``): plain Python over lists, so they work on numbers, tensors
or anything with ``+``. ``run_schedule`` executes a :class:`Schedule` over such
values, one rank after another per step, exactly by the contract in ``_ir``:
the bridge between the symbolic proof and real data.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from commfuse.errors import ScheduleError
from commfuse.schedule._ir import Collective, Schedule, SliceId

T = TypeVar("T")


def _check(per_rank: Sequence, what: str, inner: bool) -> int:
    n = len(per_rank)
    if n < 1:
        raise ScheduleError(f"{what}: needs the data of at least one rank, got none")
    if inner:
        for r, row in enumerate(per_rank):
            if len(row) != n:
                raise ScheduleError(f"{what}: rank {r} gives {len(row)} blocks, expected one per rank ({n})")
    return n


def all_gather_ref(shards: Sequence[T]) -> list[list[T]]:
    """``shards[r]`` is rank r's shard; every rank gets the list of all shards."""
    _check(shards, "all_gather_ref", inner=False)
    return [list(shards) for _ in shards]


def reduce_scatter_ref(partials: Sequence[Sequence[T]], add: Callable[[T, T], T] = operator.add) -> list[T]:
    """``partials[r][d]`` is rank r's partial of output shard d; rank d gets their sum over r."""
    n = _check(partials, "reduce_scatter_ref", inner=True)
    out = []
    for d in range(n):
        total = partials[0][d]
        for r in range(1, n):
            total = add(total, partials[r][d])
        out.append(total)
    return out


def all_to_all_ref(blocks: Sequence[Sequence[T]]) -> list[list[T]]:
    """``blocks[r][d]`` is rank r's block for rank d; rank d gets ``[blocks[s][d] for s]``."""
    n = _check(blocks, "all_to_all_ref", inner=True)
    return [[blocks[s][d] for s in range(n)] for d in range(n)]


def run_schedule(
    schedule: Schedule,
    data: Callable[[int, SliceId], Any],
    *,
    add: Callable[[Any, Any], Any] = operator.add,
) -> list[list[tuple[SliceId, Any]]]:
    """Execute ``schedule`` on values in one process; returns what each rank computed on / owns.

    ``data(rank, slice)`` supplies the input: for all-gather rank r's value of
    its own slice, for all-to-all rank r's block, for reduce-scatter rank r's
    partial of output slice ``slice``, for produce-all-to-all rank r's block as
    its compute makes it. All-gather and all-to-all return, per rank, the
    ``(slice, value)`` pairs in the order the rank computed on them;
    reduce-scatter returns per rank its own output slices with their sums;
    produce-all-to-all the blocks destined for the rank, by source.
    Point-to-point messages are delivered by matching (sender, receiver, step,
    channel, slice); collectives are carried out with the references above.
    """
    n, coll = schedule.world_size, schedule.collective
    steps = [schedule.steps(r) for r in range(n)]
    produce = coll is Collective.PRODUCE_ALL_TO_ALL
    if coll is Collective.REDUCE_SCATTER or produce:
        held: list[dict[SliceId, Any]] = [{} for _ in range(n)]
    elif coll is Collective.ALL_TO_ALL:
        held = [{x: data(r, x) for d in range(n) for x in schedule.slices(d, r)} for r in range(n)]
    else:
        held = [{x: data(r, x) for x in schedule.slices(r)} for r in range(n)]
    out: list[list[tuple[SliceId, Any]]] = [[] for _ in range(n)]
    for i in range(schedule.num_steps):
        mail: dict[tuple[int, int, int, SliceId], Any] = {}
        for r in range(n):  # payloads are read at the start of the step
            for t in steps[r][i].sends:
                mail[(r, t.peer, t.channel, t.slice)] = held[r][t.slice]
        landed: list[dict[SliceId, Any]] = [{} for _ in range(n)]
        for r in range(n):
            for t in steps[r][i].recvs:
                try:
                    landed[r][t.slice] = mail.pop((t.peer, r, t.channel, t.slice))
                except KeyError:
                    raise ScheduleError(f"rank {r}, step {i}: nothing was sent to match R({t.slice})<-{t.peer}") from None
            for call in steps[r][i].collectives:
                landed[r].update(_collective(schedule, held, r, call.part, add))
        if mail:
            (src, dst, _, x), _ = next(iter(mail.items()))
            raise ScheduleError(f"rank {src}, step {i}: the send of {x} to rank {dst} was never received")
        for r in range(n):
            step = steps[r][i]
            for x in step.compute:
                if coll is Collective.REDUCE_SCATTER or produce:
                    held[r][x] = data(r, x)
                else:
                    out[r].append((x, held[r][x]))
        for r in range(n):
            step = steps[r][i]
            if coll is Collective.REDUCE_SCATTER:
                for x, value in landed[r].items():
                    if x in step.accumulate:
                        held[r][x] = add(held[r][x], value)
                    else:  # the result of a whole reduce-scatter
                        held[r][x] = value
            else:
                held[r].update(landed[r])
    if coll is Collective.REDUCE_SCATTER:
        return [[(x, held[r][x]) for x in schedule.slices(r)] for r in range(n)]
    if produce:
        return [[(x, held[r][x]) for q in range(n) for x in schedule.slices(r, q)] for r in range(n)]
    return out


def _collective(schedule: Schedule, held, r: int, part: int, add) -> dict[SliceId, Any]:
    n, coll = schedule.world_size, schedule.collective
    if coll is Collective.ALL_GATHER:
        return {SliceId(q, part): held[q][SliceId(q, part)] for q in range(n)}
    if coll.blocks:
        return {SliceId(r, part, 0, q): held[q][SliceId(r, part, 0, q)] for q in range(n)}
    partials = [[held[q][SliceId(d, part)] for d in range(n)] for q in range(n)]
    return {SliceId(r, part): reduce_scatter_ref(partials, add)[r]}
