"""Symbolic execution of a schedule: the proof that a builder is right.

The validator runs the schedule with symbols instead of tensors. For
all-gather and all-to-all a rank's state is the set of slices it holds; for
reduce-scatter it is, per output slice, the set of ranks whose partials its
running sum already contains (a bitset). Every step is executed in the order
of the contract in ``_ir``: sends read the state at the start of the step,
compute runs, receives land, adds happen. It checks

* matching: every send has exactly one receive on the peer in the same step,
  with the same slice and channel, and vice versa; the ``shift`` of each
  transfer agrees with the ring and is the same on every rank per channel;
* data flow: nothing is sent, computed on or added that the rank does not have
  at that moment; no partial is counted twice; no received sum is dropped;
* the result: all-gather consumes every slice of every shard exactly once,
  reduce-scatter leaves each rank its own output slices summed over every
  rank, all-to-all consumes every block destined for the rank exactly once;
* the tail property of the ring algorithms: nothing is posted in the last step
  of all-gather and all-to-all; reduce-scatter computes the rank's own shard
  last, so only the last receive and one add per slice follow the last compute.

Two modes share one engine. ``exhaustive`` executes every rank from its own
``steps(rank)``. The default *rotation* mode executes only the template rank:
every schedule is built as one template that each rank applies from its own
ring position, so the state of the rank ``q`` positions on is the template
state shifted by ``q``; reading a peer's state or steps through that shift
makes one execution cover every rank, in O(steps) instead of O(world size x
steps).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from commfuse.errors import InvalidScheduleError
from commfuse.schedule._ir import Algorithm, Collective, Schedule, SliceId, Step

_RINGS = (Algorithm.RING, Algorithm.BIDIRECTIONAL)


@dataclass
class _State:
    held: set[SliceId] = field(default_factory=set)  # all-gather / all-to-all
    consumed: Counter = field(default_factory=Counter)
    sums: dict[SliceId, int] = field(default_factory=dict)  # reduce-scatter: contributor bits
    computed: Counter = field(default_factory=Counter)


class _World:
    """Access to every rank's steps and state; subclassed per mode."""

    def __init__(self, schedule: Schedule) -> None:
        self.s = schedule
        self.n = schedule.world_size
        self.full = (1 << self.n) - 1

    # -- overridden ------------------------------------------------------
    simulated: tuple[int, ...]

    def step(self, rank: int, index: int) -> Step:
        raise NotImplementedError

    def held(self, rank: int, x: SliceId) -> bool:
        raise NotImplementedError

    def sum(self, rank: int, x: SliceId) -> int | None:
        raise NotImplementedError

    def state(self, rank: int) -> _State:
        raise NotImplementedError

    def hop(self, rank: int, shift: int) -> int:
        raise NotImplementedError


class _Exhaustive(_World):
    def __init__(self, schedule: Schedule) -> None:
        super().__init__(schedule)
        self.simulated = tuple(range(self.n))
        self.steps = [schedule.steps(r) for r in range(self.n)]
        self.states = [_State() for _ in range(self.n)]

    def step(self, rank, index):
        return self.steps[rank][index]

    def held(self, rank, x):
        return x in self.states[rank].held

    def sum(self, rank, x):
        return self.states[rank].sums.get(x)

    def state(self, rank):
        return self.states[rank]

    def hop(self, rank, shift):
        return self.s.ring.hop(rank, shift)


class _Rotation(_World):
    """The template rank stands for all: rank q's view is the template's shifted by q.

    Ranks here are ring offsets from the template rank (an identity ring), so
    the real ring order, a relabelling, does not enter.
    """

    def __init__(self, schedule: Schedule) -> None:
        super().__init__(schedule)
        self.simulated = (0,)
        self.template = schedule.template
        self.zero = _State()

    def _to(self, q: int):
        n = self.n
        return lambda v: (v + q) % n

    def step(self, rank, index):
        step = self.template[index]
        return step if rank == 0 else step._map(self._to(rank))

    def held(self, rank, x):
        return x._map(self._to(-rank)) in self.zero.held

    def sum(self, rank, x):
        bits = self.zero.sums.get(x._map(self._to(-rank)))
        if bits is None or rank == 0:
            return bits
        q, n = rank % self.n, self.n
        return ((bits << q) | (bits >> (n - q))) & self.full

    def state(self, rank):
        assert rank == 0
        return self.zero

    def hop(self, rank, shift):
        return (rank + shift) % self.n


def validate(schedule: Schedule, *, exhaustive: bool = False) -> None:
    """Raise :class:`InvalidScheduleError` unless ``schedule`` is right.

    The rotation proof always runs; ``exhaustive=True`` also executes every
    rank separately from ``steps(rank)`` (the test suite does so for every
    small world size, which also checks the rotation mapping itself).
    """
    _Engine(schedule, _Rotation(schedule)).run()
    if exhaustive:
        _Engine(schedule, _Exhaustive(schedule)).run()


class _Engine:
    def __init__(self, schedule: Schedule, world: _World) -> None:
        self.s = schedule
        self.w = world
        self.n = schedule.world_size
        self.rs = schedule.collective is Collective.REDUCE_SCATTER
        self.a2a = schedule.collective.blocks
        #: the produce side of all-to-all: compute makes a block of this rank's, which later steps send
        self.produce = schedule.collective is Collective.PRODUCE_ALL_TO_ALL

    def fail(self, rank: int, step: int | None, what: str) -> None:
        where = f"rank {rank}" + ("" if step is None else f", step {step}")
        raise InvalidScheduleError(f"{self.s.describe()}: {where}: {what}")

    # ------------------------------------------------------------------
    def run(self) -> None:
        s, w = self.s, self.w
        for r in w.simulated:
            st = w.state(r)
            if self.rs or self.produce:
                continue
            if self.a2a:
                st.held.update(x for d in range(self.n) for x in s.slices(d, r))
            else:
                st.held.update(s.slices(r))
        for r in w.simulated:  # a schedule's steps are numbered in order
            for i in range(s.num_steps):
                if w.step(r, i).index != i:
                    self.fail(r, i, f"step is numbered {w.step(r, i).index}")
        for i in range(s.num_steps):
            self._check_shifts(i)
            inbox = {r: self._deliveries(r, i) for r in w.simulated}
            for r in w.simulated:
                self._compute(r, i)
            for r in w.simulated:
                self._land(r, i, inbox[r])
        for r in w.simulated:
            self._final(r)
        if s.algorithm in _RINGS or s.world_size == 1:
            for r in w.simulated:
                self._tail(r)

    def _check_shifts(self, i: int) -> None:
        shifts: dict[int, int] = {}
        for r in self.w.simulated:
            step = self.w.step(r, i)
            for kind, ts, sign in (("sends to", step.sends, 1), ("receives from", step.recvs, -1)):
                for t in ts:
                    if not 0 < t.shift < self.n:
                        self.fail(r, i, f"transfer of slice {t.slice} has shift {t.shift}, outside 1..{self.n - 1}")
                    if t.peer != self.w.hop(r, sign * t.shift):
                        self.fail(r, i, f"{kind} rank {t.peer} with shift {t.shift}, which the ring does not place there")
                    if shifts.setdefault(t.channel, t.shift) != t.shift:
                        self.fail(
                            r,
                            i,
                            f"channel {t.channel} uses shifts {shifts[t.channel]} and {t.shift} in one step: "
                            "its messages do not form one permutation",
                        )

    def _deliveries(self, r: int, i: int) -> list[tuple[SliceId, object]]:
        """Match r's transfers of step i with its peers' and read the payloads."""
        w = self.w
        step = w.step(r, i)
        peers = {t.peer for t in step.sends + step.recvs}
        for q in peers:
            other = w.step(q, i)
            mine = Counter((t.slice, t.channel) for t in step.sends if t.peer == q)
            theirs = Counter((t.slice, t.channel) for t in other.recvs if t.peer == r)
            if mine != theirs:
                self.fail(r, i, f"sends to rank {q} {_fmt(mine)} but rank {q} receives {_fmt(theirs)} from it")
            mine = Counter((t.slice, t.channel) for t in step.recvs if t.peer == q)
            theirs = Counter((t.slice, t.channel) for t in other.sends if t.peer == r)
            if mine != theirs:
                self.fail(r, i, f"receives from rank {q} {_fmt(mine)} but rank {q} sends {_fmt(theirs)} to it")
        for t in step.sends:
            if self.rs:
                if w.sum(r, t.slice) is None:
                    self.fail(r, i, f"sends the running sum of {t.slice} to rank {t.peer} before having it")
            elif not w.held(r, t.slice):
                made = "producing" if self.produce else "holding"
                self.fail(r, i, f"sends {t.slice} to rank {t.peer} without {made} it")
            if self.a2a and (t.slice.source != r or t.slice.shard != t.peer):
                self.fail(r, i, f"sends block {t.slice} to rank {t.peer}; a rank sends only its own blocks, to their destination")
        out: list[tuple[SliceId, object]] = []
        for t in step.recvs:
            out.append((t.slice, w.sum(t.peer, t.slice) if self.rs else True))
        for call in step.collectives:
            if call.collective is not self.s.collective.transport:
                self.fail(r, i, f"calls {call.collective} inside a {self.s.collective} schedule")
            out.extend(self._collective(r, i, call.part))
        return out

    def _collective(self, r: int, i: int, part: int) -> list[tuple[SliceId, object]]:
        w, s, n = self.w, self.s, self.n
        if s.collective is Collective.ALL_GATHER:
            for q in range(n):
                if not w.held(q, SliceId(q, part)):
                    self.fail(r, i, f"all-gather of chunk {part}: rank {q} does not hold its slice {SliceId(q, part)}")
            return [(SliceId(q, part), True) for q in range(n) if q != r]
        if self.a2a:
            for q in range(n):
                if not w.held(q, SliceId(r, part, 0, q)):
                    self.fail(r, i, f"all-to-all of chunk {part}: rank {q} does not hold block {SliceId(r, part, 0, q)}")
            return [(SliceId(r, part, 0, q), True) for q in range(n) if q != r]
        total = 0
        for q in range(n):
            bits = w.sum(q, SliceId(r, part))
            if bits is None:
                self.fail(r, i, f"reduce-scatter of chunk {part}: rank {q} has no partial for {SliceId(r, part)}")
            if total & bits:
                self.fail(r, i, f"reduce-scatter of chunk {part} counts ranks {_ranks(total & bits)} twice")
            total |= bits
        return [(SliceId(r, part), ("reduced", total))]

    def _compute(self, r: int, i: int) -> None:
        w, st = self.w, self.w.state(r)
        step = w.step(r, i)
        if self.rs:
            for t in step.sends:  # the running sum has left; it must not be used again
                st.sums.pop(t.slice, None)
            for x in step.compute:
                if st.computed[x]:
                    self.fail(r, i, f"computes the partial of {x} a second time")
                st.computed[x] += 1
                st.sums[x] = 1 << r
            return
        if self.produce:
            for x in step.compute:
                if x.source != r:
                    self.fail(r, i, f"produces block {x}, which rank {x.source} holds")
                if st.computed[x]:
                    self.fail(r, i, f"produces block {x} a second time")
                st.computed[x] += 1
                st.held.add(x)
            return
        for x in step.compute:
            if x not in st.held:
                self.fail(r, i, f"computes on {x} before holding it")
            if self.a2a and x.shard != r:
                self.fail(r, i, f"computes on block {x}, which is destined for rank {x.shard}")
            st.consumed[x] += 1

    def _land(self, r: int, i: int, inbox: list[tuple[SliceId, object]]) -> None:
        st = self.w.state(r)
        step = self.w.step(r, i)
        if not self.rs:
            for x, _ in inbox:
                if x in st.held:
                    self.fail(r, i, f"receives {x}, which it already holds")
                st.held.add(x)
            if step.accumulate:
                self.fail(r, i, f"adds {step.accumulate[0]}, but {self.s.collective} has nothing to add")
            return
        received: dict[SliceId, int] = {}
        for x, payload in inbox:
            if isinstance(payload, tuple):  # a whole reduce-scatter: the result replaces the partials
                for j in range(self.n):
                    if j != r:
                        st.sums.pop(SliceId(j, x.part), None)
                st.sums[x] = payload[1]
                continue
            if x in received:
                self.fail(r, i, f"receives two running sums of {x}")
            received[x] = payload
        for x in step.accumulate:
            if x not in step.compute:
                self.fail(r, i, f"adds into {x}, which this step did not compute")
            if x not in received:
                self.fail(r, i, f"adds a running sum of {x} that it did not receive")
            bits = received.pop(x)
            if st.sums[x] & bits:
                self.fail(r, i, f"adding the sum of {x} counts ranks {_ranks(st.sums[x] & bits)} twice")
            st.sums[x] |= bits
        if received:
            self.fail(r, i, f"drops the received running sum of {next(iter(received))}")

    def _final(self, r: int) -> None:
        s, st, n = self.s, self.w.state(r), self.n
        if self.rs:
            expect = Counter(x for d in range(n) for x in s.slices(d))
            if st.computed != expect:
                self.fail(r, None, f"computed partials {_diff(st.computed, expect)}")
            for x in s.slices(r):
                bits = st.sums.get(x)
                if bits != self.w.full:
                    have = "nothing" if bits is None else f"the sum of ranks {_ranks(bits)}"
                    self.fail(r, None, f"ends with {have} for its output slice {x}, not the sum of all {n} ranks")
            return
        if self.produce:
            expect = Counter(x for d in range(n) for x in s.slices(d, r))
            if st.computed != expect:
                self.fail(r, None, f"produced blocks {_diff(st.computed, expect)}")
            for x in (x for q in range(n) for x in s.slices(r, q)):
                if x not in st.held:
                    self.fail(r, None, f"ends without block {x}, which is destined for it")
            return
        if self.a2a:
            expect = Counter(x for q in range(n) for x in s.slices(r, q))
        else:
            expect = Counter(x for q in range(n) for x in s.slices(q))
        if st.consumed != expect:
            self.fail(r, None, f"computed on {_diff(st.consumed, expect)}")

    def _tail(self, r: int) -> None:
        s, w = self.s, self.w
        last = w.step(r, s.num_steps - 1)
        if self.produce:
            if not last.compute:
                self.fail(r, last.index, "the last step computes nothing: its communication is an exposed tail")
            return
        if not self.rs:
            if last.communicates:
                self.fail(r, last.index, "the last step still communicates: the tail is exposed")
            return
        if not last.compute:
            self.fail(r, last.index, "the last step computes nothing: its communication is an exposed tail")
        if any(x.shard != r for x in last.compute):
            self.fail(r, last.index, f"the last step computes {', '.join(map(str, last.compute))}, not the rank's own shard")
        if s.world_size > 1 and set(last.accumulate) != set(last.compute):
            self.fail(r, last.index, "after the last compute there must be exactly one add per computed slice")
        # per part (and half): the own shard's slice comes after every other shard's (with parts > 1 the
        # first partial's later slices are made beside the own shard's earlier ones, each sent a step later)
        own_seen: set[tuple[int, int]] = set()
        for i in range(s.num_steps):
            for x in w.step(r, i).compute:
                if x.shard == r:
                    own_seen.add((x.part, x.half))
                elif (x.part, x.half) in own_seen:
                    self.fail(r, i, f"computes {x} after starting on its own shard's part {x.part}")


def _fmt(c: Counter) -> str:
    if not c:
        return "nothing"
    return "[" + ", ".join(f"{x} on channel {ch}" + (f" x{m}" if m > 1 else "") for (x, ch), m in sorted(c.items())) + "]"


def _ranks(bits: int) -> list[int]:
    return [i for i in range(bits.bit_length()) if bits >> i & 1]


def _diff(got: Counter, expect: Counter) -> str:
    missing = ", ".join(map(str, sorted((expect - got).elements())[:4])) or "nothing"
    extra = ", ".join(map(str, sorted((got - expect).elements())[:4])) or "nothing"
    return f"missing [{missing}], extra [{extra}]"
