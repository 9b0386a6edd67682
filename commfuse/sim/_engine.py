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
moment (a fluid model: rates are recomputed whenever a message starts or
stops moving). A whole collective starts when every rank has posted it and
takes its ring cost (``_model.collective_time``). With ``check`` on, the
ranks first exchange the call fingerprint with both ring neighbours before
an op's first communicating step, a stand-in for the executor's check (which
it runs on the first call of each call signature only, as a ring all-gather
of fingerprints; a steady training loop pays none, so the default is off,
and the benchmark times its runs without it).

Two ways to run, with the same results where both apply:

* ``full``: every rank is simulated; needed when ranks differ (shards of
  unequal size, as ``torch.tensor_split`` makes them);
* ``symmetric``: when every rank is alike (every schedule is one template
  rotated to each rank's ring position, and equal shards cost the same), all
  ranks have the same timeline, so the engine runs rank 0 alone. A message
  class ("every rank sends ``shift`` hops on") stands for all its messages:
  rank 0's receives complete with its send of the same shift and channel,
  and each class loads rank 0's ports and links with the weight
  ``_model.class_resources`` gives, so bandwidth sharing and contention are
  those of the full world. Thousands of ranks cost what one does.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from commfuse.errors import CommfuseValueError
from commfuse.schedule import CollectiveCall, Schedule, Step, Transfer
from commfuse.sim._model import Kernel, class_resources, collective_bytes, collective_time, kernel_time, resources
from commfuse.sim._profile import Profile

#: Bytes of the fingerprint each rank sends to each ring neighbour before an op's first transfer
#: (48 int64 values, ``commfuse.runtime.groups.FINGERPRINT_LEN``).
FINGERPRINT_BYTES = 48 * 8
#: Channels of the modelled fingerprint messages (the executor's ``FINGERPRINT_CHANNEL``): never a data channel.
_FP_CHANNELS = (1_000, 1_001)

#: ``overlap``: normal; ``compute_only``: transfers and collectives complete at once (and no
#: fingerprint), as under ``runtime.measure("compute_only")``; ``comm_only``: the fused ops' compute
#: takes no time (their adds, and phases outside the fused ops, still do), as under ``"comm_only"``.
MODES = ("overlap", "compute_only", "comm_only")

#: How much faster than its rate a shaped link moves the bytes its token bucket lets through (a loopback's
#: raw speed over the rates it is shaped to: GB/s against 100s of MB/s).
BURST_SPEEDUP = 20.0

#: The most actions one run of the engine simulates: a step, and each send, receive, collective, computed
#: slice and added slice in it, summed over the phases and the simulated ranks. An action costs the full
#: engine 1 to 15 us and ~50 B of records, and a table runs the engine three times per algorithm: at this
#: bound (e.g. 1024 ranks of a 1024-step ring op, each rank simulated) a run takes up to about a minute. The
#: symmetric engine simulates one rank, so only unequal shards, skewed routing or ``--full`` come near it;
#: where every rank is simulated a whole collective costs each rank its world size in computed slices.
MAX_SIMULATED_ACTIONS = 1 << 22


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
    """One op of a workload, the same on every rank: its schedule (None: compute outside the fused ops) and costs."""

    name: str
    cost: OpCost
    schedule: Schedule | None = None


class StepRecord(NamedTuple):
    """One step of one rank, timed like the executor's events (seconds from the start).

    ``start``..``post``: host overhead; ``post``..``computed``: the compute
    (empty when the step computes nothing); ``computed``..``end``: waiting and
    adding. ``comm``: (first message start, last message end) of the step's
    transfers and collectives, or None when it has none. ``step`` is -1 for
    a phase outside the fused ops, -2 for the fingerprint exchange.
    """

    phase: int
    step: int
    start: float
    post: float
    computed: float
    end: float
    comm: tuple[float, float] | None


@dataclass
class Timeline:
    """What a run produced: per rank finish time, busy compute time and (when recorded) step records."""

    world_size: int
    symmetric: bool
    phases: list[Phase]
    finish: list[float]
    compute_busy: list[float]
    records: list[list[StepRecord]] = field(default_factory=list)

    @property
    def total(self) -> float:
        """The slowest rank's finish time: what a step of the whole group takes."""
        return max(self.finish) if self.finish else 0.0

    def records_of(self, rank: int) -> list[StepRecord]:
        """Rank ``rank``'s steps (in symmetric runs every rank's are rank 0's)."""
        if not self.records:
            return []
        return self.records[0 if self.symmetric else rank]


class _Job:
    """Work that progresses at a rate: a rank's compute (nominal seconds) or a message's bytes.

    ``version`` changes (to a number unique in the process) whenever the rate does, so queued
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
    __slots__ = ("nbytes", "usage", "job", "waiters", "ranks")

    def __init__(self, nbytes, usage, waiters, ranks) -> None:
        self.nbytes, self.usage, self.waiters, self.ranks = nbytes, usage, waiters, ranks
        self.job: _Job | None = None


class _Rank:
    __slots__ = ("rank", "phase", "steps", "step", "pending", "job", "active", "t_start", "t_post", "t_computed",
                 "comm", "checked", "in_check", "busy", "records", "finish")

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.phase = -1
        self.steps: tuple = ()
        self.step = -1
        self.pending = 0
        self.job: _Job | None = None
        self.active = 0
        self.t_start = self.t_post = self.t_computed = 0.0
        self.comm: list | None = None
        self.checked = False
        self.in_check = False
        self.busy = 0.0
        self.records: list[StepRecord] = []
        self.finish = 0.0


class Engine:
    """Simulate ``phases`` (ops run one after another on every rank) over ``world_size`` ranks.

    ``mode``: one of :data:`MODES`. ``symmetric``: None picks it when every
    phase is uniform. ``check``: the fingerprint exchange before each op's
    first transfer (the executor's default; the benchmark's timed runs turn it
    off). ``record``: keep per-rank step records (for traces and plots).
    """

    def __init__(self, phases: Sequence[Phase], profile: Profile, world_size: int, *, mode: str = "overlap",
                 symmetric: bool | None = None, check: bool = False, record: bool = True) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        for p in phases:
            if p.schedule is not None and p.schedule.world_size != world_size:
                raise ValueError(f"phase {p.name!r} has a schedule over {p.schedule.world_size} ranks, "
                                 f"but the simulation is over {world_size}")
        symmetric = check_size(phases, world_size, symmetric)
        self.phases, self.profile, self.n, self.mode = list(phases), profile, world_size, mode
        self.sym, self.check, self.record = bool(symmetric), check, record
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
        self._usage: dict = {}
        self._kernels: dict = {}
        self._burst = profile.link.burst
        self._peak = BURST_SPEEDUP * self._rate
        self._bucket: dict = {}  # resource -> [tokens, time of that figure, version of its empty event]
        self._cap: dict = {}  # resource -> its rate now (the peak while its bucket has tokens)
        self.ranks = [_Rank(r) for r in ((0,) if self.sym else range(world_size))]

    # -- the event queue ----------------------------------------------------

    def _at(self, t: float, fn, arg, version: int = -1) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, fn, arg, version))

    def run(self) -> Timeline:
        for r in self.ranks:
            self._next_phase(r)
        heap, pop = self._heap, heapq.heappop
        while heap:
            t, _, fn, arg, version = pop(heap)
            self.now = t
            fn(arg, version)
        stuck = [r for r in self.ranks if r.phase < len(self.phases)]
        if stuck:  # sends and receives that do not pair would leave ranks waiting forever
            r = stuck[0]
            raise RuntimeError(f"simulation deadlocked: rank {r.rank} waits in step {r.step} of phase "
                               f"{self.phases[r.phase].name!r} ({r.pending} transfer(s) never completed)")
        return Timeline(self.n, self.sym, self.phases, [r.finish for r in self.ranks], [r.busy for r in self.ranks],
                        [r.records for r in self.ranks] if self.record else [])

    # -- rank progress ------------------------------------------------------

    def _next_phase(self, r: _Rank) -> None:
        r.phase += 1
        if r.phase >= len(self.phases):
            r.finish = self.now
            return
        phase = self.phases[r.phase]
        r.steps = phase.schedule.steps(0 if self.sym else r.rank) if phase.schedule is not None else (None,)
        r.step = -1
        r.checked = not self.check or phase.schedule is None or self.n == 1 or self.mode != "overlap"
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
        r.t_start = self.now
        r.comm = None
        if step is not None and not r.checked and step.communicates:
            r.checked = True
            r.step -= 1  # the fingerprint exchange first, then this step
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
        r.t_post = r.t_computed = self.now
        r.pending = 4
        r.job = None
        a, b = _FP_CHANNELS
        if self.sym:
            for shift in (1, self.n - 1):
                self._start_flow(FINGERPRINT_BYTES, [r, r], (r,), class_resources(self.profile, self.n, shift))
            return
        ring = self.phases[r.phase].schedule.ring
        nxt, prv = ring.next(r.rank), ring.prev(r.rank)
        self._pair((r.phase, -2, r.rank, nxt, a), r, FINGERPRINT_BYTES, sender=True)
        self._pair((r.phase, -2, r.rank, prv, b), r, FINGERPRINT_BYTES, sender=True)
        self._pair((r.phase, -2, prv, r.rank, a), r, 0, sender=False)
        self._pair((r.phase, -2, nxt, r.rank, b), r, 0, sender=False)

    def _kernels_time(self, kernels: Sequence[Kernel]) -> float:
        total = 0.0
        cache = self._kernels
        for k in kernels:
            t = cache.get(k)
            if t is None:
                t = cache[k] = kernel_time(self.profile, k)
            total += t
        return total

    def _post(self, r: _Rank, _version: int) -> None:
        phase = self.phases[r.phase]
        step = r.steps[r.step]
        r.t_post = self.now
        r.in_check = False
        cost = phase.cost
        r.pending = 0
        if step is not None and self.mode != "compute_only":
            r.pending = len(step.sends) + len(step.recvs) + len(step.collectives)
            if self.sym:
                classes = {}
                for t in step.sends:
                    classes[(t.shift, t.channel)] = self._start_flow(cost.transfer_bytes(0, t), [r], (r,),
                                                                     self._class_usage(t.shift))
                for t in step.recvs:
                    flow = classes.get((t.shift, t.channel))
                    if flow is None:
                        raise RuntimeError(f"step {step.index} of {phase.name!r}: rank 0 receives {t.slice} with "
                                           f"shift {t.shift} on channel {t.channel}, but sends nothing of that "
                                           f"shift and channel: the schedule is not rotation-symmetric")
                    flow.waiters.append(r)
            else:
                for t in step.sends:
                    self._pair((r.phase, step.index, r.rank, t.peer, t.channel), r, cost.transfer_bytes(r.rank, t),
                               sender=True)
                for t in step.recvs:
                    self._pair((r.phase, step.index, t.peer, r.rank, t.channel), r, 0, sender=False)
            for call in step.collectives:
                self._post_collective(r, step, call, cost.collective_bytes(r.rank, call))
        nominal = 0.0
        if step is None or self.mode != "comm_only":
            nominal = self._kernels_time(cost.compute(r.rank, step))
        if nominal > 0:
            r.job = _Job(nominal, self._slow if r.active else 1.0, self.now)
            self._at(self.now + nominal / r.job.rate, self._compute_done, r, r.job.version)
        else:
            r.job = None
            r.t_computed = self.now
            self._maybe_wait_done(r)

    def _compute_done(self, r: _Rank, version: int) -> None:
        job = r.job
        if job is None or job.version != version:
            return
        r.job = None
        r.t_computed = self.now
        r.busy += self.now - r.t_post
        self._maybe_wait_done(r)

    def _maybe_wait_done(self, r: _Rank) -> None:
        if r.job is not None or r.pending:
            return
        if r.in_check:
            r.in_check = False
            self._end_step(r, -2)
            return
        step = r.steps[r.step]
        add = 0.0
        if step is not None and step.accumulate:
            add = self._kernels_time(self.phases[r.phase].cost.add(r.rank, step))
        if add > 0:
            r.busy += add
            self._at(self.now + add, self._end_step, r, -1)
        else:
            self._end_step(r, -1)

    def _end_step(self, r: _Rank, kind: int) -> None:
        if self.record:
            step = r.steps[r.step] if kind != -2 else None
            index = -2 if kind == -2 else (-1 if step is None else step.index)
            comm = None if r.comm is None else (r.comm[0], r.comm[1])
            r.records.append(StepRecord(r.phase, index, r.t_start, r.t_post, r.t_computed, self.now, comm))
        # (after the fingerprint exchange, r.step still names the step it preceded, which comes next)
        # through the queue: a run of zero-time steps must not recurse once per step
        self._at(self.now, self._begin_step, r)

    # -- contention ---------------------------------------------------------

    def _activity(self, r: _Rank, delta: int) -> None:
        before = r.active
        r.active += delta
        if delta > 0:
            if r.comm is None:
                r.comm = [self.now, self.now]
        elif r.comm is not None:
            r.comm[1] = self.now
        if (before == 0) == (r.active == 0):
            return
        job = r.job
        if job is None or self._slow == 1.0:
            return
        job.retime(self.now, self._slow if r.active else 1.0)
        self._at(self.now + max(job.remaining, 0.0) / job.rate, self._compute_done, r, job.version)

    # -- point-to-point messages ---------------------------------------------

    def _class_usage(self, shift: int):
        u = self._usage.get(shift)
        if u is None:
            u = self._usage[shift] = class_resources(self.profile, self.n, shift)
        return u

    def _pair(self, key, r: _Rank, nbytes: float, *, sender: bool) -> None:
        """Full engine: one end of a message is posted; the message starts once both ends are."""
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
        self._start_flow(size, [src, dst], ranks, resources(self.profile, src.rank, dst.rank))

    def _start_flow(self, nbytes: float, waiters: list, ranks: tuple, usage) -> _Flow:
        flow = _Flow(nbytes, usage, waiters, ranks)
        for x in ranks:
            self._activity(x, +1)
        # through the queue even without latency: nothing may complete while its step is still posting
        self._at(self.now + self._latency, self._flow_moving, flow)
        return flow

    # token buckets (``link.burst``): a fluid too. While its bucket holds tokens a busy resource moves
    # bytes at BURST_SPEEDUP times the link's rate and the tokens drain at the difference; an idle one
    # refills at the link's rate up to ``burst``. Concurrent messages share the faster rate equally, so
    # the symmetric engine and the full one agree.

    def _bucket_now(self, key) -> list:
        """The bucket of ``key`` ([tokens, time of that figure, version]) brought up to now."""
        st = self._bucket.get(key)
        if st is None:
            st = self._bucket[key] = [self._burst, self.now, 0]
            return st
        dt = self.now - st[1]
        if dt > 0:
            if self._load.get(key, 0):
                st[0] = max(0.0, st[0] - (self._peak - self._rate) * dt)
            else:
                st[0] = min(self._burst, st[0] + self._rate * dt)
            st[1] = self.now
        return st

    def _bucket_busy(self, key, st) -> None:
        """``key`` just became busy (or stays busy): run at the peak rate until its tokens are gone."""
        st[2] += 1
        if st[0] > 0:
            self._cap[key] = self._peak
            self._at(self.now + st[0] / (self._peak - self._rate), self._bucket_empty, key, st[2])
        else:
            self._cap[key] = self._rate

    def _bucket_empty(self, key, version: int) -> None:
        st = self._bucket[key]
        if st[2] != version:
            return
        self._bucket_now(key)
        st[0] = 0.0
        self._cap[key] = self._rate
        self._rerate(((key, 0),))

    def _flow_moving(self, flow: _Flow, _version: int) -> None:
        if flow.nbytes <= 0:
            self._flow_done(flow, moving=False)
            return
        flow.job = _Job(flow.nbytes, 0.0, self.now)
        bucket = self._burst > 0
        for key, w in flow.usage:
            if bucket:
                st = self._bucket_now(key)
                if not self._load.get(key, 0):
                    self._load[key] = w
                    self._bucket_busy(key, st)
                else:
                    self._load[key] += w
            else:
                self._load[key] = self._load.get(key, 0) + w
            self._on.setdefault(key, set()).add(flow)
        self._rerate(flow.usage)

    def _rerate(self, usage) -> None:
        flows = set()
        for key, _ in usage:
            flows.update(self._on.get(key, ()))
        now, load, cap, rate = self.now, self._load, self._cap, self._rate
        for f in flows:
            new = min((cap.get(key, rate) if cap else rate) / load[key] for key, _ in f.usage)
            job = f.job
            if new == job.rate:
                continue
            job.retime(now, new)
            self._at(now + max(job.remaining, 0.0) / new, self._flow_end, f, job.version)

    def _flow_end(self, flow: _Flow, version: int) -> None:
        if flow.job is None or flow.job.version != version:
            return
        self._flow_done(flow, moving=True)

    def _flow_done(self, flow: _Flow, *, moving: bool) -> None:
        if moving:
            flow.job = None
            bucket = self._burst > 0
            for key, w in flow.usage:
                if bucket:
                    st = self._bucket_now(key)
                    self._load[key] -= w
                    if not self._load[key]:
                        st[2] += 1  # idle: its empty-bucket event no longer applies
                        self._cap[key] = self._rate
                else:
                    self._load[key] -= w
                self._on[key].discard(flow)
            self._rerate(flow.usage)
        for x in flow.ranks:
            self._activity(x, -1)
        for x in flow.waiters:
            x.pending -= 1
            if x.pending == 0:
                self._maybe_wait_done(x)

    # -- whole collectives --------------------------------------------------

    def _post_collective(self, r: _Rank, step: Step, call: CollectiveCall, piece: float) -> None:
        kind = call.collective.value
        if self.sym:
            self._start_collective([r], piece, kind)
            return
        key = (r.phase, step.index, call.part, call.collective)
        posted = self._coll.setdefault(key, [])
        posted.append((r, piece))
        if len(posted) == self.n:
            del self._coll[key]
            self._start_collective([x for x, _ in posted], max(p for _, p in posted), kind)

    def _start_collective(self, ranks: list, piece: float, kind: str) -> None:
        free = 0.0
        usage = self._class_usage(1)  # a ring step of the collective: every rank sends to its neighbour
        if self._burst > 0 and self.n > 1:
            # the bucket's tokens pass at once (a collective is costed in closed form); none refill until it ends
            free = collective_bytes(self.profile, self.n, piece, kind)
            states = []
            for key, w in usage:
                st = self._bucket_now(key)
                free = min(free, st[0] / w)
                states.append((st, w))
        duration = collective_time(self.profile, self.n, piece, kind, free)
        if self._burst > 0 and self.n > 1:
            for st, w in states:
                st[0] -= w * free
                st[1] = self.now + duration
        for x in ranks:
            self._activity(x, +1)
        self._at(self.now + duration, self._collective_done, (ranks, usage))

    def _collective_done(self, arg, _version: int) -> None:
        ranks, _usage = arg
        for x in ranks:
            self._activity(x, -1)
        for x in ranks:
            x.pending -= 1
            if x.pending == 0:
                self._maybe_wait_done(x)


def check_size(phases: Sequence[Phase], world_size: int, symmetric: bool | None = None) -> bool:
    """Whether the engine runs ``phases`` symmetric (None: when every phase is uniform); raises when it cannot,
    and when the run would be over :data:`MAX_SIMULATED_ACTIONS`, saying what to give instead."""
    uniform = all(p.cost.uniform for p in phases)
    if symmetric is None:
        symmetric = uniform
    elif symmetric and not uniform:
        bad = next(p.name for p in phases if not p.cost.uniform)
        raise ValueError(f"phase {bad!r} has unequal shards across ranks: the symmetric engine needs every rank "
                         f"alike; run with symmetric=False")
    actions = sum(1 + len(s.sends) + len(s.recvs) + len(s.collectives) + len(s.compute) + len(s.accumulate)
                  for p in phases if p.schedule is not None for s in p.schedule.steps(0))
    ranks = 1 if symmetric else world_size
    if ranks * actions > MAX_SIMULATED_ACTIONS:
        if symmetric:
            advice = "give fewer ranks or parts"
        elif uniform:
            advice = "every rank is alike, so let one stand for all: drop --full (symmetric=False)"
        else:
            advice = ("make every shard the same size (sizes that divide by the world size) so that one rank "
                      "stands for all, or give fewer ranks")
        raise CommfuseValueError(
            f"simulating {ranks} rank(s) x {actions} actions (steps, and the sends, receives, collectives and "
            f"slices computed in them) is over the engine's limit of {MAX_SIMULATED_ACTIONS} "
            f"(commfuse.sim._engine.MAX_SIMULATED_ACTIONS): {advice}")
    return bool(symmetric)


def simulate_phases(phases: Sequence[Phase], profile: Profile, world_size: int, *, mode: str = "overlap",
                    symmetric: bool | None = None, check: bool = False, record: bool = True) -> Timeline:
    """Run the engine once; see :class:`Engine`."""
    return Engine(phases, profile, world_size, mode=mode, symmetric=symmetric, check=check, record=record).run()


__all__ = ["Engine", "MODES", "OpCost", "Phase", "StepRecord", "Timeline", "simulate_phases"]
