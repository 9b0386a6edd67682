"""The discrete-event engine: every rank walks its steps of the same ``Schedule``
objects the executor runs, with the cost model in place of a backend.

Each rank follows the step contract of ``commfuse.schedule._ir`` exactly:

1. at the step's start (after the host's per-step overhead) it posts the
   step's sends, receives and collectives, and starts the step's compute;
2. the compute runs (slowed by the profile's contention while any transfer
   of the rank is in flight);
3. it waits until everything it posted has completed;
4. it runs the step's adds (reduce-scatter), then the next step starts.

A point-to-point message starts when both ends have posted it (the sender's
send and the receiver's matching receive of the same step), spends the link
latency, then moves its bytes at a rate that changes over time: the link's
rate divided equally among the messages sharing a port, link or bus at that
moment (a fluid model: the engine recomputes rates whenever a message starts
or ends moving). A whole collective starts when every rank has posted it and
takes its ring cost (``_model.collective_time``). Before the first
communicating step of each op the ranks exchange the call fingerprint with
both ring neighbours, as the executor does (``check=True``).

Two ways to run, with the same results where both apply:

* ``full``: every rank is simulated; needed when ranks differ (shards of
  unequal size, as ``torch.tensor_split`` makes them);
* ``symmetric``: when every rank is alike (every schedule is one template
  rotated to each rank's ring position, and equal shards cost the same), all
  ranks have the same timeline, so the engine runs rank 0 alone. A message
  class ("every rank sends ``shift`` hops on") stands for all its messages;
  rank 0's receives complete with the class of the same shift and channel,
  and each class loads rank 0's ports and links with the weight
  ``_model.class_resources`` gives, so bandwidth sharing and contention are
  the full world's. Thousands of ranks cost what one does.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from commfuse.schedule import CollectiveCall, Schedule, SliceId, Step, Transfer
from commfuse.sim._model import Kernel, class_resources, collective_time, kernel_time, resources
from commfuse.sim._profile import Profile

#: Bytes of the fingerprint each rank sends to each ring neighbour before an op's first transfer
#: (48 int64 values, ``commfuse.runtime.executor.FINGERPRINT_LEN``).
FINGERPRINT_BYTES = 48 * 8
#: Channels of the fingerprint messages (``executor.FINGERPRINT_CHANNELS``): never a data channel.
_FP_CHANNELS = (1_000, 1_001)

MODES = ("overlap", "compute_only", "comm_only")


class OpCost(Protocol):
    """What a workload tells the engine about one op: the kernels of each step and the bytes of each message."""

    #: Whether every rank's costs are the same up to rotation (equal shards): allows the symmetric engine.
    uniform: bool

    def compute(self, rank: int, step: Step | None) -> Sequence[Kernel]:
        """The kernels of ``step``'s compute on ``rank`` (``step`` None: a phase with no schedule)."""

    def add(self, rank: int, step: Step) -> Sequence[Kernel]:
        """The kernels of ``step``'s adds on ``rank`` (reduce-scatter)."""

    def transfer_bytes(self, rank: int, transfer: Transfer) -> float:
        """Bytes of ``transfer`` sent by ``rank``."""

    def collective_bytes(self, rank: int, call: CollectiveCall) -> float:
        """Bytes of one rank's piece of the whole collective ``call`` (the per-step message of its ring)."""

    def flops(self, rank: int) -> float:
        """Useful flops of the op on ``rank`` (for MFU)."""


@dataclass(frozen=True)
class Phase:
    """One op of a workload, the same on every rank: its schedule (None for compute alone) and its costs."""

    name: str
    cost: OpCost
    schedule: Schedule | None = None
    check: bool = True


@dataclass(frozen=True, slots=True)
class Event:
    """One bar of a rank's timeline: ``lane`` is ``"compute"`` or ``"comm"``; times in seconds."""

    rank: int
    lane: str
    name: str
    start: float
    end: float
    phase: int
    step: int
    args: tuple = ()


@dataclass
class Timeline:
    """What a run produced: per rank finish time, busy compute time and (when recorded) events."""

    world_size: int
    symmetric: bool
    finish: list[float]
    compute_busy: list[float]
    events: list[list[Event]] = field(default_factory=list)
    phase_end: list[list[float]] = field(default_factory=list)

    def rank_index(self, rank: int) -> int:
        return 0 if self.symmetric else rank

    @property
    def total(self) -> float:
        return max(self.finish) if self.finish else 0.0

    def events_of(self, rank: int) -> list[Event]:
        """Rank ``rank``'s events (in symmetric runs: rank 0's, which every rank shares)."""
        if not self.events:
            return []
        evs = self.events[self.rank_index(rank)]
        if self.symmetric and rank:
            return [Event(rank, e.lane, e.name, e.start, e.end, e.phase, e.step, e.args) for e in evs]
        return evs


class _Job:
    """Work that progresses at a rate: a rank's compute (nominal seconds) or a message's bytes.

    ``version`` changes (to a number unique in the run) whenever the rate does, so queued
    completions computed at an older rate, or for an earlier job, are recognised and dropped.
    """

    __slots__ = ("remaining", "rate", "t", "version")

    _versions = itertools.count(1)

    def __init__(self, remaining: float, rate: float, t: float) -> None:
        self.remaining, self.rate, self.t = remaining, rate, t
        self.version = next(_Job._versions)

    def retime(self, now: float, rate: float) -> None:
        if self.rate > 0:
            self.remaining -= self.rate * (now - self.t)
        self.t, self.rate = now, rate
        self.version = next(_Job._versions)


class _Flow:
    __slots__ = ("src", "dst", "nbytes", "usage", "job", "waiters", "ranks", "start", "moving")

    def __init__(self, src, dst, nbytes, usage, waiters, ranks) -> None:
        self.src, self.dst, self.nbytes, self.usage = src, dst, nbytes, usage
        self.waiters, self.ranks = waiters, ranks
        self.job: _Job | None = None
        self.start = 0.0
        self.moving = False


class _Rank:
    __slots__ = (
        "rank", "phase", "steps", "step", "pending", "job", "active", "t0", "t_compute", "t_comm",
        "checked", "busy", "events", "finish", "phase_end", "stage", "comm_end", "in_check", "adds",
    )

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.phase = -1
        self.steps: tuple[Step, ...] = ()
        self.step = -1
        self.pending = 0
        self.job: _Job | None = None
        self.active = 0
        self.t0 = self.t_compute = 0.0
        self.t_comm: float | None = None
        self.comm_end = 0.0
        self.checked = False
        self.in_check = False
        self.busy = 0.0
        self.events: list[Event] = []
        self.finish = 0.0
        self.phase_end: list[float] = []
        self.stage = ""
        self.adds = 0.0


class Engine:
    """Simulate ``phases`` (ops run one after another on every rank) over ``world_size`` ranks.

    ``mode``: ``"overlap"`` (normal), ``"compute_only"`` (every transfer and
    collective completes at once, no fingerprint: ``runtime.measure``'s
    mode of the same name) or ``"comm_only"`` (compute kernels take no time,
    adds still do). ``symmetric``: None picks it when every phase is uniform.
    ``record``: keep per-rank events (for traces and plots).
    """

    def __init__(self, phases: Sequence[Phase], profile: Profile, world_size: int, *, mode: str = "overlap",
                 symmetric: bool | None = None, record: bool = True) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        for p in phases:
            if p.schedule is not None and p.schedule.world_size != world_size:
                raise ValueError(f"phase {p.name!r} has a schedule over {p.schedule.world_size} ranks, "
                                 f"but the simulation is over {world_size}")
        uniform = all(p.cost.uniform for p in phases)
        if symmetric is None:
            symmetric = uniform
        elif symmetric and not uniform:
            bad = next(p.name for p in phases if not p.cost.uniform)
            raise ValueError(f"phase {bad!r} has unequal shards across ranks: the symmetric engine needs every rank "
                             f"alike; run with symmetric=False")
        self.phases, self.profile, self.n, self.mode = list(phases), profile, world_size, mode
        self.sym, self.record = bool(symmetric), record
        self.now = 0.0
        self._heap: list = []
        self._seq = 0
        self._slow = 1.0 / (1.0 + profile.contention.compute_slowdown)
        self._rate = profile.link.rate
        self._latency = profile.link.latency
        self._load: dict = {}
        self._on: dict = {}
        self._half: dict = {}
        self._coll: dict = {}
        self._usage_cache: dict = {}
        self.ranks = [_Rank(r) for r in ((0,) if self.sym else range(world_size))]
        self._kernel_cache: dict = {}

    # -- the event queue ----------------------------------------------------

    def _at(self, t: float, fn, arg, version: int = -1) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, fn, arg, version))

    def run(self) -> Timeline:
        for r in self.ranks:
            self._next_phase(r)
        heap = self._heap
        while heap:
            t, _, fn, arg, version = heapq.heappop(heap)
            self.now = t
            fn(arg, version)
        stuck = [r for r in self.ranks if r.phase < len(self.phases)]
        if stuck:  # a schedule whose sends and receives do not pair would leave ranks waiting forever
            r = stuck[0]
            raise RuntimeError(f"simulation deadlocked: rank {r.rank} waits in step {r.step} of phase "
                               f"{self.phases[r.phase].name!r} ({r.pending} transfer(s) never completed)")
        return Timeline(
            self.n, self.sym, [r.finish for r in self.ranks], [r.busy for r in self.ranks],
            [r.events for r in self.ranks] if self.record else [], [r.phase_end for r in self.ranks],
        )

    # -- rank progress ------------------------------------------------------

    def _next_phase(self, r: _Rank) -> None:
        if r.phase >= 0:
            r.phase_end.append(self.now)
        r.phase += 1
        if r.phase >= len(self.phases):
            r.finish = self.now
            return
        phase = self.phases[r.phase]
        r.steps = phase.schedule.steps(0 if self.sym else r.rank) if phase.schedule is not None else (None,)
        r.step = -1
        r.checked = not phase.check or phase.schedule is None or self.n == 1 or self.mode != "overlap"
        overhead = self.profile.host.call_overhead if phase.schedule is not None else 0.0
        if overhead > 0:
            self._at(self.now + overhead, self._begin_step, r)
        else:
            self._begin_step(r, -1)

    def _begin_step(self, r: _Rank, _version: int) -> None:
        r.step += 1
        if r.step >= len(r.steps):
            self._next_phase(r)
            return
        step = r.steps[r.step]
        if step is not None and not r.checked and step.communicates:
            r.checked = True
            r.step -= 1  # run the fingerprint exchange, then this step
            self._post_check(r)
            return
        h = self.profile.host.step_overhead if step is not None else 0.0
        if h > 0:
            self._at(self.now + h, self._post, r)
        else:
            self._post(r, -1)

    def _post_check(self, r: _Rank) -> None:
        """The executor's fingerprint exchange: a tiny message to each ring neighbour and one from each."""
        r.in_check = True
        r.t0 = self.now
        r.pending = 4
        r.job = None
        r.t_comm = None
        ring = self.phases[r.phase].schedule.ring
        a, b = _FP_CHANNELS
        if self.sym:
            for shift, ch in ((1, a), (self.n - 1, b)):
                self._start_flow(0, shift % self.n, FINGERPRINT_BYTES, [r, r], (r,),
                                 class_resources(self.profile, self.n, shift))
            return
        nxt, prv = ring.next(r.rank), ring.prev(r.rank)
        key = (r.phase, -1)
        self._pair((*key, r.rank, nxt, a), r, FINGERPRINT_BYTES, sender=True)
        self._pair((*key, r.rank, prv, b), r, FINGERPRINT_BYTES, sender=True)
        self._pair((*key, prv, r.rank, a), r, 0, sender=False)
        self._pair((*key, nxt, r.rank, b), r, 0, sender=False)

    def _kernels_time(self, kernels: Sequence[Kernel]) -> float:
        total = 0.0
        for k in kernels:
            t = self._kernel_cache.get(k)
            if t is None:
                t = self._kernel_cache[k] = kernel_time(self.profile, k)
            total += t
        return total

    def _post(self, r: _Rank, _version: int) -> None:
        phase = self.phases[r.phase]
        step = r.steps[r.step]
        r.t0 = self.now
        r.t_comm = None
        r.in_check = False
        cost = phase.cost
        rank_for_cost = r.rank
        comm = self.mode != "compute_only"
        r.pending = 0
        if step is not None and comm:
            r.pending = len(step.sends) + len(step.recvs) + len(step.collectives)
            if self.sym:
                classes = {}
                for t in step.sends:
                    flow = self._start_flow(0, t.peer, cost.transfer_bytes(0, t), [r], (r,),
                                            self._class_usage(t.shift))
                    classes[(t.shift, t.channel)] = flow
                for t in step.recvs:
                    flow = classes.get((t.shift, t.channel))
                    if flow is None:
                        raise RuntimeError(f"step {step.index} of {phase.name!r}: rank 0 receives {t.slice} with "
                                           f"shift {t.shift} on channel {t.channel}, but sends nothing of that "
                                           f"shift and channel: the schedule is not rotation-symmetric")
                    flow.waiters.append(r)
            else:
                for t in step.sends:
                    self._pair((r.phase, step.index, r.rank, t.peer, t.channel), r,
                               cost.transfer_bytes(r.rank, t), sender=True)
                for t in step.recvs:
                    self._pair((r.phase, step.index, t.peer, r.rank, t.channel), r, 0, sender=False)
            for call in step.collectives:
                self._post_collective(r, step, call, cost.collective_bytes(rank_for_cost, call))
        nominal = 0.0
        if self.mode != "comm_only":
            nominal = self._kernels_time(cost.compute(rank_for_cost, step))
        r.t_compute = self.now
        if nominal > 0:
            r.job = _Job(nominal, self._slow if r.active else 1.0, self.now)
            self._at(self.now + nominal / r.job.rate, self._compute_done, r, r.job.version)
        else:
            r.job = None
            self._maybe_wait_done(r)

    def _compute_done(self, r: _Rank, version: int) -> None:
        job = r.job
        if job is None or job.version != version:
            return
        r.job = None
        if self.record:
            step = r.steps[r.step]
            r.events.append(Event(r.rank, "compute", self._compute_name(r, step), r.t_compute, self.now,
                                  r.phase, -1 if step is None else step.index))
        r.busy += self.now - r.t_compute
        self._maybe_wait_done(r)

    def _maybe_wait_done(self, r: _Rank) -> None:
        if r.job is not None or r.pending:
            return
        if r.in_check:
            r.in_check = False
            if self.record and r.t_comm is not None:
                r.events.append(Event(r.rank, "comm", "fingerprint", r.t_comm, self.now, r.phase, -1))
            self._at(self.now, self._begin_step, r)
            return
        step = r.steps[r.step]
        if self.record and r.t_comm is not None:
            r.events.append(Event(r.rank, "comm", self._comm_name(r, step), r.t_comm, r.comm_end, r.phase,
                                  step.index))
        add = 0.0
        if step is not None and step.accumulate:
            add = self._kernels_time(self.phases[r.phase].cost.add(r.rank, step))
        if add > 0:
            r.adds = self.now
            self._at(self.now + add, self._add_done, r)
        else:  # through the queue: a run of zero-time steps must not recurse once per step
            self._at(self.now, self._begin_step, r)

    def _add_done(self, r: _Rank, _version: int) -> None:
        if self.record:
            step = r.steps[r.step]
            r.events.append(Event(r.rank, "compute", f"{self.phases[r.phase].name} add", r.adds, self.now,
                                  r.phase, step.index))
        r.busy += self.now - r.adds
        self._begin_step(r, -1)

    def _compute_name(self, r: _Rank, step: Step | None) -> str:
        name = self.phases[r.phase].name
        if step is None:
            return name
        return f"{name} step {step.index}: " + " ".join(x.label() for x in step.compute)

    def _comm_name(self, r: _Rank, step: Step) -> str:
        name = self.phases[r.phase].name
        parts = []
        if step.collectives:
            parts.append(", ".join(f"{c.collective.value}[{c.part}]" for c in step.collectives))
        if step.sends:
            parts.append("send " + ",".join(f"{t.slice.label()}>{t.peer}" for t in step.sends))
        if step.recvs:
            parts.append("recv " + ",".join(f"{t.slice.label()}<{t.peer}" for t in step.recvs))
        return f"{name} step {step.index}: " + "; ".join(parts)

    # -- contention ---------------------------------------------------------

    def _activity(self, r: _Rank, delta: int) -> None:
        before = r.active
        r.active += delta
        if (before == 0) == (r.active == 0):
            return
        if r.t_comm is None and delta > 0:
            r.t_comm = self.now
        job = r.job
        if job is None or self._slow == 1.0:
            return
        job.retime(self.now, self._slow if r.active else 1.0)
        self._at(self.now + max(job.remaining, 0.0) / job.rate, self._compute_done, r, job.version)

    # -- point-to-point messages ---------------------------------------------

    def _class_usage(self, shift: int):
        u = self._usage_cache.get(shift)
        if u is None:
            u = self._usage_cache[shift] = class_resources(self.profile, self.n, shift)
        return u

    def _pair(self, key, r: _Rank, nbytes: float, *, sender: bool) -> None:
        """Full engine: one end of a message posted; the message starts once both ends are."""
        other = self._half.pop(key, None)
        if other is None:
            self._half[key] = (r, nbytes, sender)
            return
        o_rank, o_bytes, o_sender = other
        if o_sender == sender:
            raise RuntimeError(f"two {'senders' if sender else 'receivers'} for the message {key}")
        src, dst = (r, o_rank) if sender else (o_rank, r)
        size = nbytes if sender else o_bytes
        ranks = (src,) if src is dst else (src, dst)
        self._start_flow(src.rank, dst.rank, size, [src, dst], ranks, resources(self.profile, src.rank, dst.rank))

    def _start_flow(self, src: int, dst: int, nbytes: float, waiters: list, ranks: tuple, usage) -> _Flow:
        flow = _Flow(src, dst, nbytes, usage, waiters, ranks)
        flow.start = self.now
        for x in ranks:
            self._activity(x, +1)
        if self._latency > 0:
            self._at(self.now + self._latency, self._flow_moving, flow)
        else:
            self._flow_moving(flow, -1)
        return flow

    def _flow_moving(self, flow: _Flow, _version: int) -> None:
        if flow.nbytes <= 0:
            self._flow_done(flow, -1, moving=False)
            return
        flow.moving = True
        flow.job = _Job(flow.nbytes, 0.0, self.now)
        touched = set()
        for key, w in flow.usage:
            self._load[key] = self._load.get(key, 0) + w
            self._on.setdefault(key, set()).add(flow)
            touched.add(key)
        self._rerate(touched)

    def _rerate(self, keys) -> None:
        flows = set()
        for key in keys:
            flows.update(self._on.get(key, ()))
        now, load, rate = self.now, self._load, self._rate
        for f in flows:
            new = rate / max(load[key] for key, _ in f.usage)
            job = f.job
            if new == job.rate:
                continue
            job.retime(now, new)
            self._at(now + max(job.remaining, 0.0) / new, self._flow_end, f, job.version)

    def _flow_end(self, flow: _Flow, version: int) -> None:
        if flow.job is None or flow.job.version != version:
            return
        self._flow_done(flow, version, moving=True)

    def _flow_done(self, flow: _Flow, _version: int, *, moving: bool) -> None:
        if moving:
            flow.job = None
            touched = []
            for key, w in flow.usage:
                self._load[key] -= w
                self._on[key].discard(flow)
                touched.append(key)
            self._rerate(touched)
        for x in flow.ranks:
            x.comm_end = self.now
            self._activity(x, -1)
        for x in flow.waiters:
            x.pending -= 1
            if x.pending == 0:
                self._maybe_wait_done(x)

    # -- whole collectives --------------------------------------------------

    def _post_collective(self, r: _Rank, step: Step, call: CollectiveCall, piece: float) -> None:
        duration = collective_time(self.profile, self.n, piece)
        if self.sym:
            self._start_collective([r], duration)
            return
        key = (r.phase, step.index, call.part, call.collective)
        posted = self._coll.setdefault(key, [])
        posted.append((r, duration))
        if len(posted) == self.n:
            del self._coll[key]
            self._start_collective([x for x, _ in posted], max(d for _, d in posted))

    def _start_collective(self, ranks: list, duration: float) -> None:
        for x in ranks:
            self._activity(x, +1)
        self._at(self.now + duration, self._collective_done, ranks)

    def _collective_done(self, ranks: list, _version: int) -> None:
        for x in ranks:
            x.comm_end = self.now
            self._activity(x, -1)
        for x in ranks:
            x.pending -= 1
            if x.pending == 0:
                self._maybe_wait_done(x)


def simulate_phases(phases: Sequence[Phase], profile: Profile, world_size: int, *, mode: str = "overlap",
                    symmetric: bool | None = None, record: bool = True) -> Timeline:
    """Run the engine once; see :class:`Engine`."""
    return Engine(phases, profile, world_size, mode=mode, symmetric=symmetric, record=record).run()


__all__ = ["Engine", "Event", "MODES", "OpCost", "Phase", "SliceId", "Timeline", "simulate_phases"]
