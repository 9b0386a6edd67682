"""Schedule builders: pure functions of the world size and options.

Each builder writes the template of the rank at ring position 0 (see
``_ir``); ranks, shards and peers are ring offsets from that position, reduced
modulo the world size. ``build`` checks the options, calls the builder and
validates the result before handing it out.
"""

from __future__ import annotations

from collections.abc import Callable

from commfuse.errors import ScheduleError
from commfuse.schedule._ir import Algorithm, Collective, CollectiveCall, Schedule, SliceId, Step, Transfer
from commfuse.schedule._ring import Ring
from commfuse.schedule._validate import validate as check

#: Which algorithms each collective has.
ALGORITHMS: dict[Collective, tuple[Algorithm, ...]] = {
    Collective.ALL_GATHER: (Algorithm.RING, Algorithm.BIDIRECTIONAL, Algorithm.SLICED, Algorithm.VANILLA),
    Collective.REDUCE_SCATTER: (Algorithm.RING, Algorithm.BIDIRECTIONAL, Algorithm.SLICED, Algorithm.VANILLA),
    Collective.ALL_TO_ALL: (Algorithm.RING, Algorithm.SLICED, Algorithm.VANILLA),
    Collective.PRODUCE_ALL_TO_ALL: (Algorithm.RING, Algorithm.SLICED, Algorithm.VANILLA),
}

#: Above this world size ``build`` validates through the rotation argument only
#: (see ``_validate``); at or below it, every rank is also executed on its own.
EXHAUSTIVE_LIMIT = 32


def _parse(enum_type, value, what: str):
    if isinstance(value, enum_type):
        return value
    try:
        return enum_type(value)
    except ValueError:
        names = ", ".join(repr(m.value) for m in enum_type)
        raise ScheduleError(f"unknown {what} {value!r}; expected one of {names}") from None


def _positive(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ScheduleError(f"{name} must be an integer, got {value!r}")
    if value < 1:
        raise ScheduleError(f"{name} must be >= 1, got {value}")
    return value


def build(
    collective: str | Collective,
    world_size: int,
    *,
    algorithm: str | Algorithm = "ring",
    parts: int = 1,
    chunks: int = 1,
    ring: Ring | None = None,
    validate: bool = True,
) -> Schedule:
    """Build and validate the schedule of ``collective`` over ``world_size`` ranks.

    ``parts`` (ring and bidirectional, the paper's m) cuts every shard into that
    many slices that travel one per step; ``chunks`` (sliced only) is the number
    of whole collectives the data is sliced into. ``ring`` places the ranks
    (default: rank order, data travelling to rank + 1).
    """
    collective = _parse(Collective, collective, "collective")
    algorithm = _parse(Algorithm, algorithm, "algorithm")
    world_size = _positive("world_size", world_size)
    parts = _positive("parts", parts)
    chunks = _positive("chunks", chunks)
    if algorithm not in ALGORITHMS[collective]:
        names = ", ".join(a.value for a in ALGORITHMS[collective])
        raise ScheduleError(f"algorithm {algorithm.value!r} is not defined for {collective.value}; it has {names}")
    if parts != 1 and algorithm in (Algorithm.SLICED, Algorithm.VANILLA):
        raise ScheduleError(
            f"parts={parts} applies to the ring algorithms only; {algorithm.value} has no per-hop slices"
            + (" (use chunks= to slice it)" if algorithm is Algorithm.SLICED else "")
        )
    if chunks != 1 and algorithm is not Algorithm.SLICED:
        raise ScheduleError(
            f"chunks={chunks} applies to algorithm 'sliced' only, not {algorithm.value!r}"
            + (" (use parts= for finer ring slices)" if algorithm in (Algorithm.RING, Algorithm.BIDIRECTIONAL) else "")
        )
    if ring is None:
        ring = Ring(world_size)
    elif ring.world_size != world_size:
        raise ScheduleError(f"ring has world size {ring.world_size} but the schedule has {world_size}")

    shell = Schedule(collective, world_size, algorithm, parts, chunks, ring)
    if world_size == 1:
        template = _compute_only(shell)
    else:
        template = _BUILDERS[(collective, algorithm)](shell)
    schedule = Schedule(collective, world_size, algorithm, parts, chunks, ring, tuple(template))
    if validate:
        check(schedule, exhaustive=world_size <= EXHAUSTIVE_LIMIT)
    return schedule


def _offset(n: int) -> Callable[[int], int]:
    return lambda x: x % n


def _interned() -> Callable[..., SliceId]:
    """A ``SliceId`` factory that returns one object per distinct value.

    Builders use it so that a slice received in one step and computed or sent
    in a later one is the same object, which ``Schedule.steps`` maps once.
    """
    pool: dict[tuple, SliceId] = {}

    def make(shard: int, part: int = 0, half: int = 0, source: int | None = None) -> SliceId:
        key = (shard, part, half, source)
        out = pool.get(key)
        if out is None:
            out = pool[key] = SliceId(shard, part, half, source)
        return out

    return make


def _compute_only(s: Schedule) -> list[Step]:
    """World size 1: every algorithm is the computation alone."""
    source = 0 if s.collective.blocks else None
    compute = s.slices(0, source)
    return [Step(0, compute=compute)]


def _ring_all_gather(s: Schedule) -> list[Step]:
    """Flash-AG (paper Algorithm 1 / Figure 6) and its bidirectional variant.

    At hop k rank r computes on shard (r - k) mod N while forwarding it to r + 1
    and receiving shard (r - k - 1) from r - 1; the backward ring does the mirror
    image with the second half of every slice. The last hop only computes.

    With ``parts`` m > 1 every shard travels as m slices, one per step, in hop
    order, and each received slice is computed in the very next step (as
    :func:`_ring_all_to_all` does), while it waits m steps for its own forward:
    the own shard's slices are spread over the first m steps, one each, beside
    the received slices. So what is left after the last transfer is one
    slice's compute, not a whole shard's; at two ranks, where the one hop could
    otherwise hide only behind the own shard, the peer's slice j + 1 flies
    while its slice j is computed ((N - 1) m + 1 steps instead of N m). With
    m = 1 this is the schedule above. (The paper cuts the sequence into m N
    slices; computing each on arrival rather than hop by hop is this
    library's.)
    """
    n, o, bidir, m = s.world_size, _offset(s.world_size), s.halves == 2, s.parts
    sl = _interned()
    items = [(k, p) for k in range(n - 1) for p in range(m)]  # hop k's slice p, in the order they travel
    steps: list[Step] = []
    for t in range(len(items) + 1):
        compute, sends, recvs = [], [], []
        if t < m:  # the own shard, slice t
            compute.append(sl(o(0), t, 0))
            if bidir:
                compute.append(sl(o(0), t, 1))
        if t >= 1:  # the slices received in the step before
            k, p = items[t - 1]
            compute.append(sl(o(-k - 1), p, 0))
            if bidir:
                compute.append(sl(o(k + 1), p, 1))
        if t < len(items):
            k, p = items[t]
            sends.append(Transfer(sl(o(-k), p, 0), o(1), 1, 0))
            recvs.append(Transfer(sl(o(-k - 1), p, 0), o(-1), 1, 0))
            if bidir:
                sends.append(Transfer(sl(o(k), p, 1), o(-1), o(-1), 1))
                recvs.append(Transfer(sl(o(k + 1), p, 1), o(1), o(-1), 1))
        steps.append(Step(t, tuple(sends), tuple(recvs), (), tuple(compute)))
    return steps


def _ring_reduce_scatter(s: Schedule) -> list[Step]:
    """Flash-RS (paper Algorithm 2 / Figure 7) and its bidirectional variant.

    At hop k rank r computes its partial of output shard (r - 1 - k) mod N; from
    hop 1 on it has meanwhile received the running sum of that shard from
    r - 1 and adds it, while its own previous sum travels on to r + 1. Its own
    shard comes last, so after the last compute only the last receive and one
    add remain.

    With ``parts`` m > 1, the mirror image of :func:`_ring_all_gather`'s: every
    slice of the first partial is sent in the step after the one that made it
    (as :func:`_ring_produce_all_to_all` does), so the first hop's slices are
    spread over the first m steps beside the sums that arrive, and only the
    first slice's compute has nothing to hide behind ((N - 1) m + 1 steps
    instead of N m). Every later slice is computed, and its running sum added,
    in the step it arrives, and travels on m steps later. With m = 1 this is
    the schedule above.
    """
    n, o, bidir, m = s.world_size, _offset(s.world_size), s.halves == 2, s.parts
    sl = _interned()
    items = [(k, p) for k in range(1, n) for p in range(m)]  # hop k's slice p, in the order they travel
    steps: list[Step] = []
    for t in range(len(items) + 1):
        compute, sends, recvs, accumulate = [], [], [], []
        if t < m:  # the first partial (for r - 1), slice t: sent in the next step
            compute.append(sl(o(-1), t, 0))
            if bidir:
                compute.append(sl(o(1), t, 1))
        if t >= 1:
            k, p = items[t - 1]
            sends.append(Transfer(sl(o(-k), p, 0), o(1), 1, 0))
            recvs.append(Transfer(sl(o(-1 - k), p, 0), o(-1), 1, 0))
            arrived = [sl(o(-1 - k), p, 0)]
            if bidir:
                sends.append(Transfer(sl(o(k), p, 1), o(-1), o(-1), 1))
                recvs.append(Transfer(sl(o(1 + k), p, 1), o(1), o(-1), 1))
                arrived.append(sl(o(1 + k), p, 1))
            compute += arrived
            accumulate += arrived
        steps.append(Step(t, tuple(sends), tuple(recvs), (), tuple(compute), tuple(accumulate)))
    return steps


def _ring_all_to_all(s: Schedule) -> list[Step]:
    """Pairwise all-to-all (paper Algorithm 5, Flash-All-to-All).

    At hop k rank r computes on the block that came from r - k (its own at hop
    0) while sending its block for r + k + 1 there and receiving the block of
    r - k - 1. The last hop only computes.

    With ``parts`` m > 1 every block travels as m slices, one per step, in hop
    order, and each received slice is computed in the very next step: the
    transfer leads the compute by one slice, not by one block. The own
    block's slices are spread over the first m steps, one each, beside the
    received slices. So at two ranks, where the one hop could otherwise hide
    only behind the own block, the peer's slice j + 1 flies while its slice
    j is computed (m + 1 steps instead of 2m). With m = 1 this is the
    schedule above.
    """
    n, o, m = s.world_size, _offset(s.world_size), s.parts
    sl = _interned()
    items = [(k, p) for k in range(1, n) for p in range(m)]  # hop k's slice p, in the order they travel
    steps: list[Step] = []
    for t in range(len(items) + 1):
        sends, recvs, compute = (), (), []
        if t < m:
            compute.append(sl(0, t, 0, 0))  # own block, slice t
        if t >= 1:
            k, p = items[t - 1]
            compute.append(sl(0, p, 0, o(-k)))  # the slice received in the step before
        if t < len(items):
            k, p = items[t]
            sends = (Transfer(sl(o(k), p, 0, 0), o(k), o(k), 0),)
            recvs = (Transfer(sl(0, p, 0, o(-k)), o(-k), o(k), 0),)
        steps.append(Step(t, sends, recvs, (), tuple(compute)))
    return steps


def _ring_produce_all_to_all(s: Schedule) -> list[Step]:
    """The produce side of the pairwise all-to-all (MoE's combine; torch's ``_pipelined_produce_and_all2all``).

    Hop 0 produces the block for r + 1. At hop k >= 1 rank r sends the block
    for r + k, made in the hop before, while producing the block for r + k + 1
    (its own block, which goes nowhere, at the last hop) and receiving the
    block of r - k. Only the first block's compute has nothing to hide behind;
    the last transfer flies under the last compute.

    With ``parts`` m > 1, the mirror image of :func:`_ring_all_to_all`'s: every
    slice is sent in the step after the one that made it, and the own block's
    slices are spread over the last m steps, so that only the first slice's
    compute is exposed and the last transfers fly under the own block.
    """
    n, o, m = s.world_size, _offset(s.world_size), s.parts
    sl = _interned()
    items = [(k, p) for k in range(1, n) for p in range(m)]  # the block for r + k, slice p, in send order
    first_own = len(items) + 1 - m
    steps: list[Step] = []
    for t in range(len(items) + 1):
        sends, recvs, compute = (), (), []
        if t < len(items):
            k, p = items[t]
            compute.append(sl(o(k), p, 0, 0))
        if t >= first_own:
            compute.append(sl(0, t - first_own, 0, 0))  # own block, which goes nowhere
        if t >= 1:
            k, p = items[t - 1]
            sends = (Transfer(sl(o(k), p, 0, 0), o(k), k, 0),)
            recvs = (Transfer(sl(0, p, 0, o(-k)), o(-k), k, 0),)
        steps.append(Step(t, sends, recvs, (), tuple(compute)))
    return steps


def _sliced(s: Schedule) -> list[Step]:
    """Data slicing (and ``vanilla``, its one-chunk case).

    Gathers (all-gather, all-to-all): the collective of chunk j flies while
    chunk j - 1 is computed; the first collective is exposed. Reduce-scatter:
    the collective of chunk j flies while chunk j + 1 is computed; the last one
    is the exposed tail. The produce side of all-to-all is ordered like
    reduce-scatter: chunk j's blocks for every rank are made while chunk
    j - 1's all-to-all flies.
    """
    n, c = s.world_size, s.splits

    def chunk(j: int) -> tuple[SliceId, ...]:
        if s.collective is Collective.ALL_TO_ALL:
            return tuple(SliceId(0, j, 0, x) for x in range(n))
        if s.collective is Collective.PRODUCE_ALL_TO_ALL:
            return tuple(SliceId(x, j, 0, 0) for x in range(n))
        return tuple(SliceId(x, j) for x in range(n))

    steps = []
    for j in range(c + 1):
        if s.collective in (Collective.REDUCE_SCATTER, Collective.PRODUCE_ALL_TO_ALL):
            calls = (CollectiveCall(s.collective.transport, j - 1),) if j >= 1 else ()
            compute = chunk(j) if j < c else ()
        else:
            calls = (CollectiveCall(s.collective, j),) if j < c else ()
            compute = chunk(j - 1) if j >= 1 else ()
        steps.append(Step(j, collectives=calls, compute=compute))
    return steps


_BUILDERS = {
    (Collective.ALL_GATHER, Algorithm.RING): _ring_all_gather,
    (Collective.ALL_GATHER, Algorithm.BIDIRECTIONAL): _ring_all_gather,
    (Collective.ALL_GATHER, Algorithm.SLICED): _sliced,
    (Collective.ALL_GATHER, Algorithm.VANILLA): _sliced,
    (Collective.REDUCE_SCATTER, Algorithm.RING): _ring_reduce_scatter,
    (Collective.REDUCE_SCATTER, Algorithm.BIDIRECTIONAL): _ring_reduce_scatter,
    (Collective.REDUCE_SCATTER, Algorithm.SLICED): _sliced,
    (Collective.REDUCE_SCATTER, Algorithm.VANILLA): _sliced,
    (Collective.ALL_TO_ALL, Algorithm.RING): _ring_all_to_all,
    (Collective.ALL_TO_ALL, Algorithm.SLICED): _sliced,
    (Collective.ALL_TO_ALL, Algorithm.VANILLA): _sliced,
    (Collective.PRODUCE_ALL_TO_ALL, Algorithm.RING): _ring_produce_all_to_all,
    (Collective.PRODUCE_ALL_TO_ALL, Algorithm.SLICED): _sliced,
    (Collective.PRODUCE_ALL_TO_ALL, Algorithm.VANILLA): _sliced,
}
