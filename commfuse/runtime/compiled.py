"""The compiled plan: one rank's steps of one schedule, with every slice numbered, and what a call
signature runs (:class:`Plan`).

Plan once, walk many times. A :class:`Compiled` is one rank's steps of one
schedule with every slice numbered (a *slot*): built once per (schedule,
rank), after which a step costs a few attribute reads, one ``post`` and one
``wait``. A :class:`Plan` adds what one call signature fixes (the op, the
timeout, the check mode, whether its compute overlaps) and what its first call
learns (its fingerprint's digest). What the data *is* lives in a
:class:`Program` (one per kind of op, see ``programs``); ``runtime.walks`` walks
the steps.

Here too: how a step, and a stall in it, is named in an error.
"""

from __future__ import annotations

import zlib

import torch

from commfuse.errors import CommfuseError, CommfuseTimeoutError, CommunicationError
from commfuse.runtime.fingerprints import ALGORITHMS, COLLECTIVES, FINGERPRINT_MAGIC, format_code
from commfuse.runtime.groups import SEQUENCE_WRAP, capture_probe, group_state
from commfuse.runtime.observe import trace_enabled
from commfuse.runtime.recorder import DEVICE, device_timing, recorder_for
from commfuse.schedule import Collective, Schedule, SliceId, Step


# -- compiled steps --------------------------------------------------------------------------------------------


class CompiledStep:
    """One step with slices as slot numbers: ``sends``/``recvs`` are ``(Transfer, slot)`` pairs."""

    __slots__ = ("index", "step", "sends", "recvs", "collectives", "compute", "accumulate", "release",
                 "communicates", "p2p")

    def __init__(self, step: Step, slot: dict[SliceId, int], release: tuple[int, ...]) -> None:
        self.index = step.index
        self.step = step
        self.sends = tuple((t, slot[t.slice]) for t in step.sends)
        self.recvs = tuple((t, slot[t.slice]) for t in step.recvs)
        self.collectives = step.collectives
        # sorted by (shard, piece): the order of their offsets along the dim, whatever the sizes
        self.compute = tuple(sorted((slot[x] for x in step.compute)))
        self.accumulate = tuple(slot[x] for x in step.accumulate)
        self.release = release
        self.communicates = step.communicates
        self.p2p = bool(step.sends or step.recvs)


class Compiled:
    """One rank's steps of one schedule, with every slice it touches numbered.

    Slots are numbered in (source, shard, piece) order, so sorting slot numbers
    sorts slices by their position along the collective's dim.
    """

    def __init__(self, schedule: Schedule, rank: int) -> None:
        self.schedule = schedule
        self.rank = rank
        steps = schedule.steps(rank)
        n = schedule.world_size
        seen: set[SliceId] = set()
        for step in steps:
            seen.update(step.compute, step.accumulate, (t.slice for t in step.sends), (t.slice for t in step.recvs))
        a2a = schedule.collective.blocks
        for step in steps:  # a whole collective touches this rank's slices of its chunk
            for call in step.collectives:
                for x in self._collective_slices(call.part, n, rank, schedule.halves, a2a):
                    seen.add(x)
        if a2a:
            for d in range(n):
                seen.update(schedule.slices(d, rank))
                seen.update(schedule.slices(rank, d))
        else:
            seen.update(schedule.slices(rank))
        order = sorted(seen, key=lambda x: (-1 if x.source is None else x.source, x.shard, schedule.piece(x)))
        self.slices: tuple[SliceId, ...] = tuple(order)
        self.slot: dict[SliceId, int] = {x: i for i, x in enumerate(order)}
        last: dict[int, int] = {}
        for step in steps:
            for x in step.compute + step.accumulate:
                last[self.slot[x]] = step.index
            for t in step.sends:
                last[self.slot[t.slice]] = step.index
            for call in step.collectives:
                for x in self._collective_slices(call.part, n, rank, schedule.halves, a2a):
                    s = self.slot[x]
                    last[s] = max(last.get(s, -1), step.index)
        done: dict[int, list[int]] = {}
        for s, i in last.items():
            done.setdefault(i, []).append(s)
        self.steps = tuple(CompiledStep(step, self.slot, tuple(sorted(done.get(step.index, ())))) for step in steps)
        self.communicates = any(st.communicates for st in self.steps)

    @staticmethod
    def _collective_slices(part: int, n: int, rank: int, halves: int, a2a: bool) -> list[SliceId]:
        if a2a:
            return [SliceId(d, part, 0, rank) for d in range(n)] + [SliceId(rank, part, 0, q) for q in range(n)]
        return [SliceId(d, part, h) for d in range(n) for h in range(halves)]

    def slots_of(self, shard: int, source: int | None = None) -> tuple[int, ...]:
        """The slots of every slice of one shard, in layout order."""
        return tuple(self.slot[x] for x in self.schedule.slices(shard, source))


class Program:
    """What one call's data is; the loop asks it for tensors slot by slot.

    Subclasses (``programs``) implement the methods for all-gather,
    reduce-scatter and all-to-all. Slots are :class:`Compiled` slot numbers.
    """

    collective: Collective
    #: whether some slots may be empty (an uneven all-to-all): then an empty message is not posted, on
    #: either end (both ends know its size), and an empty buffer stands for what it would have received
    sparse = False

    def payload(self, s: int) -> torch.Tensor:  # what to send for slot s
        raise NotImplementedError

    def buffer(self, s: int) -> torch.Tensor:  # where s may be received
        raise NotImplementedError

    def land(self, s: int, tensor: torch.Tensor) -> None:  # s arrived
        raise NotImplementedError

    def compute(self, slots: tuple[int, ...]) -> None:
        raise NotImplementedError

    def add(self, s: int) -> None:  # reduce-scatter: partial(s) += received(s)
        raise NotImplementedError

    def collective_io(self, call) -> tuple[list[torch.Tensor], list[torch.Tensor], object]:
        """Inputs and outputs of one whole collective, and a function taking what arrived."""
        raise NotImplementedError

    def release(self, s: int) -> None:  # s's last use has passed
        pass

    def skip(self, slots: tuple[int, ...]) -> None:
        """Stand-in for ``compute`` in ``comm_only`` measurements: leave what sends need, compute nothing."""
        self.compute(slots)

    def meta(self) -> list[int]:
        """Integers (shapes, dims, dtypes) every rank of one call must agree on; see ``Plan.fingerprint``."""
        raise NotImplementedError


# -- the plan of one call signature ----------------------------------------------------------------------------


class Plan:
    """What one call signature runs, decided on its first call and walked on every later one.

    ``label`` names the op (it also picks how a fingerprint is read back, see
    :func:`register_format`); ``overlap`` False runs the ``serial`` baseline
    (each step waits, then computes). ``checked`` turns True once the
    fingerprint of this signature has been agreed by every rank.
    """

    __slots__ = ("schedule", "compiled", "backend", "state", "label", "timeout", "check", "overlap", "checked",
                 "name", "traced", "rank", "checks", "begin", "trace", "steps", "digest", "signature", "whole",
                 "whole_compute", "one_by_one", "settled", "probe", "capturing", "recorder", "stamps", "sizes", "used")

    def __init__(self, schedule: Schedule, backend, *, label: str, timeout: float, check: str,
                 overlap: bool = True, compiled: Compiled | None = None) -> None:
        self.schedule = schedule
        self.backend = backend
        self.rank = backend.rank
        # the planning layer hands in the compiled steps it keeps per (schedule, rank); made here otherwise
        self.compiled = Compiled(schedule, backend.rank) if compiled is None else compiled
        self.state = group_state(backend)
        self.label = label
        self.timeout = timeout
        self.check = check
        self.overlap = overlap
        self.checked = False
        #: the signature is known and needs no check on a clean group (then, unless the group is dirty or
        #: something observes the call, a call may run without a program): set by execute
        self.settled = False
        self.name = f"commfuse.{label}.{schedule.algorithm.value if overlap else 'serial'}"
        # A traced backend (XLA) cannot compare values on the host without executing the graph mid-trace.
        self.traced = getattr(getattr(backend, "capabilities", None), "execution", "eager") == "traced"
        #: whether this plan's calls are ever checked (then: the first, after a failure, or always)
        self.checks = (check != "off" and not self.traced and schedule.world_size > 1
                       and self.compiled.communicates)
        self.begin = getattr(backend, "begin_call", None)
        #: whether the current stream captures a device graph (:func:`capture_probe`; None on CPU)
        self.probe = capture_probe(getattr(backend, "device", None))
        #: whether the call in progress is being captured: set by each call as it takes the group, False between
        #: calls (a stream-ordered backend then keeps its steps from the watchdog, see ``runtime.c10d``)
        self.capturing = False
        #: set by every call as it gives the group back; the planning table clears it, to learn which plans ran
        #: since it last looked (its second chance: ``commfuse.planning.table``)
        self.used = False
        self.trace = trace_enabled()  # COMMFUSE_TRACE is read when a signature is first planned
        #: the group's flight recorder (``runtime.recorder``; None: off), and the bytes each step sends and
        #: receives, ``{step index: (sent, received)}``, learned on the first recorded call
        self.recorder = recorder_for(self.state)
        #: whether the recorder stamps each step's wait: where the host blocks in waits (gloo), which costs
        #: tens of microseconds beside the stamps' fraction of one. A stream-ordered backend's host does not
        #: wait (its stamps would time nothing), nor does a group whose transfers complete at once (torch's
        #: ``fake`` group, the host-cost benchmark's). On the former, with ``COMMFUSE_DEVICE_TIMING=1`` and a backend
        #: that makes timing events (``timing_event``), the device's events stamp each wait instead (DEVICE)
        caps = getattr(backend, "capabilities", None)
        device = getattr(getattr(backend, "device", None), "type", "cpu")
        streamed = bool(getattr(caps, "streams", False)) and device != "cpu"
        if self.recorder is None or getattr(backend, "_instant", False):
            self.stamps: bool | str = False
        elif not streamed:
            self.stamps = True
        else:
            self.stamps = DEVICE if device_timing() and hasattr(backend, "timing_event") else False
        self.sizes: dict[int, tuple[int, int]] | None = None
        self.steps = self.compiled.steps
        self.digest: int | None = None  # of the fingerprint, less the call number: part of every tag
        self.signature: tuple | None = None  # the fingerprint less the call number
        # One whole collective and one compute over every slot, no P2P (vanilla): (its step, its call), and
        # the compute's slots. Such a call may take execute_into, with no program.
        self.whole = None
        self.whole_compute: tuple[int, ...] = ()
        steps = self.steps
        with_calls = [st for st in steps if st.collectives]
        # Point-to-point steps only, overlapped (ring, ring:m, bidirectional): such a call may take
        # execute_one_by_one, with no program.
        self.one_by_one = overlap and not with_calls
        if (len(steps) == 2 and len(with_calls) == 1 and len(with_calls[0].collectives) == 1
                and not any(st.p2p for st in steps) and sum(bool(st.compute) for st in steps) == 1):
            self.whole = (with_calls[0], with_calls[0].collectives[0])
            self.whole_compute = next(st.compute for st in steps if st.compute)

    def learn_signature(self, program: Program) -> None:
        """The signature (fingerprint less the call number) and its digest, from the first call's program."""
        self.signature = tuple(self.fingerprint(program, 0)[2:])
        self.digest = zlib.crc32(repr(self.signature).encode())

    def fingerprint(self, program: Program, seq: int) -> list[int]:
        s = self.schedule
        return [FINGERPRINT_MAGIC, seq % SEQUENCE_WRAP, format_code(self.label), COLLECTIVES.index(s.collective),
                ALGORITHMS.index(s.algorithm), int(self.overlap), s.parts, s.chunks, *program.meta()]



def describe_stall(plan: Plan, post_no: int, detail: str, failed: bool = False) -> str | None:
    """What a timeout (or, ``failed``, a transport's failure) in the ``post_no``-th post (from 1) of a call
    of ``plan`` says, ``detail`` last: the rank, the step, the op and the peers, as a host-blocking wait
    names them (a stream-ordered backend's watchdog reports through this). None when the plan has no such
    post."""
    posts = 0
    for st in plan.steps:
        calls = ((None,) if st.p2p else ()) + tuple(st.collectives)
        for call in calls:
            posts += 1
            if posts == post_no:
                if failed:
                    return failed_waiting(plan, st, call, detail)
                return str(waiting_error(plan, st, call, TimeoutError(detail)))
    return None


def stall_position(plan: Plan | None, checking: Plan | None, seq: int | None, post_no: int,
                   peers) -> tuple[dict, str] | None:
    """Where a rank waits, for its group's board (``commfuse.runtime.board.Stall``), and the step in words:
    post ``post_no`` (from 1) of a call of ``plan``, or of the call check of ``checking``. None when neither
    is known (a transfer outside commfuse's calls)."""
    which = plan if plan is not None else checking
    if which is None:
        return None
    state = which.state
    if plan is not None:
        what = f"post {post_no} of {plan.label}"
        posts = 0
        for st in plan.steps:
            for call in ((None,) if st.p2p else ()) + tuple(st.collectives):
                posts += 1
                if posts == post_no:
                    what = f"step {st.index} of {plan.label} ({plan.schedule.describe()}), {describe_traffic(st.step, call)}"
    else:
        what = f"hop {post_no} of the call check of {checking.label}"
    number = state.current()  # the call in progress (one op per group at a time); ``seq`` is its tag base
    signature = list(which.signature or ())
    position = {"seq": number, "lane": state.lane[1], "thread": state.lane[0], "digest": which.digest,
                "label": which.label, "check": plan is None, "waits": sorted(set(peers)), "what": what,
                "fp": [FINGERPRINT_MAGIC, number % SEQUENCE_WRAP, *signature] if signature else []}
    return position, what


def posting_error(plan: Plan, st: CompiledStep, call, e: Exception) -> CommunicationError:
    if isinstance(e, CommunicationError):  # the backend named it already (what the group's board said)
        return e
    return CommunicationError(
        f"rank {plan.rank} failed posting step {st.index} of {plan.label} ({plan.schedule.describe()}), "
        f"{describe_traffic(st.step, call)}: {type(e).__name__}: {e}"
    )


def waiting_error(plan: Plan, st: CompiledStep, call, e: BaseException) -> BaseException:
    if isinstance(e, CommfuseError):  # named already (a verdict of the group's board, a refusal)
        return e
    if isinstance(e, TimeoutError):
        hint = ""
        if plan.check != "always":
            hint = (" (if the ranks may have called different ops or shapes, COMMFUSE_CHECK=always compares "
                    "them on every call and names the difference)")
        return CommfuseTimeoutError(
            f"rank {plan.rank} timed out after {plan.timeout:g} s in step {st.index} of {plan.label} "
            f"({plan.schedule.describe()}) waiting for {describe_traffic(st.step, call)}{hint}: {e}"
        )
    if isinstance(e, CommunicationError):
        return e
    if not isinstance(e, Exception):
        return e
    return CommunicationError(failed_waiting(plan, st, call, f"{type(e).__name__}: {e}"))


def failed_waiting(plan: Plan, st: CompiledStep, call, detail: str) -> str:
    return (f"rank {plan.rank} failed in step {st.index} of {plan.label} ({plan.schedule.describe()}) while "
            f"waiting for {describe_traffic(st.step, call)}: {detail}")



def describe_traffic(step: Step, call) -> str:
    """What a step sends, receives or runs (or, ``call`` given, that whole collective), for errors and logs."""
    if call is not None:
        return f"the whole {call.collective.value} of chunk {call.part}"
    parts = []
    if step.recvs:
        parts.append("receives from rank " + ", ".join(str(t.peer) for t in step.recvs))
    if step.sends:
        parts.append("sends to rank " + ", ".join(str(t.peer) for t in step.sends))
    if step.collectives:
        parts.append(", ".join(f"{c.collective.value}[{c.part}]" for c in step.collectives))
    return "; ".join(parts) or "nothing"

