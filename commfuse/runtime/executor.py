"""The executor: walks one rank's compiled steps on a backend.

Per step, in the order of the contract in ``commfuse.schedule._ir``: post the
step's transfers and collectives, run the caller's compute on the slices the
step names while they fly, wait (bounded by the timeout), hand what arrived
to the program, add where the schedule says, and drop slices whose last use
has passed. What the data *is* lives in a :class:`Program` (one per kind of
op, see ``programs``); the executor only knows steps.

Plan once, walk many times. A :class:`Compiled` is one rank's steps of one
schedule with every slice numbered (a *slot*): built once per (schedule,
rank), after which a step costs a few tuple reads, one ``post`` and one
``wait`` per handle. Checks that need the host run once per call signature.

Rules every call follows, whatever the backend (see ``docs/reliability.md``):

* **One op per group at a time.** A second op on a group while one is in
  flight (another thread, or a consumer calling an op) raises
  :class:`~commfuse.errors.ConcurrentUseError` naming the group and the op in
  flight, instead of mixing the two calls' messages.
* **Calls are numbered.** Every call on a group takes the group's next
  sequence number, on every rank, before any code of the caller's runs for it
  (:class:`Ticket`), also a call that fails validation before it
  communicates (:func:`announce_left`). Backends that match tags (gloo) fold
  it, with a digest of the call's signature and the calling thread's
  :func:`lane`, into them (``begin_call``), so a message can only pair with
  the same call of the same signature from the same thread on its peer; the
  fingerprint carries the number, so a rank that skipped or added a call is
  named. NCCL does not match tags: there the check after a failed call does
  this work.
* **Check once.** The fingerprint (collective, algorithm, shapes, dtypes,
  sequence number) is all-gathered around the ring on the first call of each
  signature, on the first call after any call on the group failed, and on
  every call with ``COMMFUSE_CHECK=always``; ``COMMFUSE_CHECK=0`` turns it
  off. Every rank sees every rank's fingerprint, so every rank names a
  mismatch within one ring's latency.
* **A failure on one rank is told to every rank** (``commfuse.runtime.board``).
  An exception in the caller's compute first waits (bounded) for the step's
  posted transfers; then the rank notes the failure on the group's board and
  completes the call's transfers without computing, sending only to peers
  that know (:func:`_compute_failed`), and raises its exception. A peer whose
  wait stalls reads the board, stops computing, completes the call the same
  way and raises ``PeerFailedError`` (:func:`_told`). The group stays usable.
  What cannot be completed (a failure before the first transfer, Ctrl-C, a
  broken transport) ends the group on every rank, by name
  (:func:`_after_failure`, ``board.declare_dead``).
* **Capture after the check.** A call made while the current stream captures
  a device graph (``torch.cuda.graph``) is walked like any other, with its
  receive buffers kept apart from eager calls' (``programs._Pool``) and, on a
  stream-ordered backend, its steps kept from the watchdog. A call that would
  check its fingerprint (a signature's first call, the call after a failure,
  ``COMMFUSE_CHECK=always``) is refused instead, by name: the check compares
  values on the host.

Every step is annotated with ``torch.profiler.record_function`` while a
profiler runs; ``COMMFUSE_TRACE=1`` prints a per-rank step log to stderr.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import sys
import threading
import time
import zlib
from collections.abc import Callable, Sequence

import torch
from torch.profiler import record_function

try:  # a build without torch.distributed has no groups: GroupState.group is then always None
    import torch.distributed.distributed_c10d as _c10d
except ImportError:  # pragma: no cover
    _c10d = None

from commfuse.errors import (
    CommfuseError,
    CommfuseTimeoutError,
    CommfuseValueError,
    CommunicationError,
    ConcurrentUseError,
    GroupDeadError,
    MismatchError,
    PeerFailedError,
)
from commfuse.runtime.board import RECOVER, board_of, declare_dead
from commfuse.schedule import Algorithm, AlgorithmSpec, Collective, Schedule, SliceId, Step, Transfer, build

#: Default bound on every wait, in seconds, when neither ``timeout=`` nor
#: ``COMMFUSE_TIMEOUT_S`` says otherwise. A ring step that has not completed in
#: five minutes is broken, not slow; NCCL's own watchdog default is ten.
DEFAULT_TIMEOUT_S = 300.0
#: Timeouts outside [MIN_TIMEOUT_S, MAX_TIMEOUT_S] are refused: transports
#: count in milliseconds (a smaller value would mean "no bound" to some), and a
#: wait of more than 11 days is no bound either. There is no unbounded wait.
MIN_TIMEOUT_S = 0.001
MAX_TIMEOUT_S = 1e6

#: Message tags: a data transfer's tag is ``channel + TAG_STRIDE * (sequence % SEQUENCE_WRAP)``; the
#: fingerprint ring uses :data:`FINGERPRINT_CHANNEL` with no sequence, so ranks at different calls still meet.
TAG_STRIDE = 2048
SEQUENCE_WRAP = 1 << 19
FINGERPRINT_CHANNEL = 1_000
#: The channel of a whole all-to-all run as pairwise point-to-point steps where the transport lacks it
#: (``commfuse.runtime.c10d``), tagged with the call's sequence like a schedule's transfers.
PAIRWISE_CHANNEL = 1_001
FINGERPRINT_LEN = 48
_MAGIC = 0xC0F5

_COLLECTIVES = list(Collective)
_ALGORITHMS = list(Algorithm)


def resolve_timeout(timeout: float | None) -> float:
    """``timeout`` if given, else ``COMMFUSE_TIMEOUT_S``, else :data:`DEFAULT_TIMEOUT_S`; checked."""
    source = "timeout"
    if timeout is None:
        env = os.environ.get("COMMFUSE_TIMEOUT_S")
        if not env:
            return DEFAULT_TIMEOUT_S
        source = "COMMFUSE_TIMEOUT_S"
        try:
            timeout = float(env)
        except ValueError:
            raise CommfuseValueError(f"COMMFUSE_TIMEOUT_S must be a number of seconds, got {env!r}") from None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise CommfuseValueError(f"{source} must be a positive number of seconds, got {timeout!r}")
    if not math.isfinite(timeout) or not MIN_TIMEOUT_S <= timeout <= MAX_TIMEOUT_S:
        raise CommfuseValueError(
            f"{source}={timeout!r} is out of range: give seconds between {MIN_TIMEOUT_S:g} and {MAX_TIMEOUT_S:g}; "
            "commfuse never waits without a bound"
        )
    return float(timeout)


def capture_probe(device) -> Callable[[], bool] | None:
    """The function that says whether the current stream of ``device``'s type is capturing a device graph
    (``torch.cuda.is_current_stream_capturing``; ``torch.npu``'s of the same name once torch_npu is imported),
    or None for a device type without graph capture (CPU, XLA, or no device): then no call is ever captured."""
    kind = getattr(device, "type", None)
    if kind is None or kind in ("cpu", "meta"):
        return None
    probe = getattr(getattr(torch, kind, None), "is_current_stream_capturing", None)
    return probe if callable(probe) else None


#: ``check`` modes: no check; once per call signature (and after a failure); on every call.
CHECK_MODES = ("off", "once", "always")


def check_mode(check: bool | str | None) -> str:
    """The fingerprint check mode: ``check`` if given (True = "once"), else ``COMMFUSE_CHECK``.

    ``COMMFUSE_CHECK``: ``0``/``off``/``false``/``no`` turn it off, ``always``
    checks every call, anything else (default) checks once per signature.
    """
    if check is None:
        env = os.environ.get("COMMFUSE_CHECK", "1").strip().lower()
        if env in ("0", "false", "no", "off"):
            return "off"
        return "always" if env == "always" else "once"
    if check is True:
        return "once"
    if check is False:
        return "off"
    if check in CHECK_MODES:
        return check
    raise CommfuseValueError(f"check must be True, False, None or one of {CHECK_MODES}, got {check!r}")


@functools.lru_cache(maxsize=256)
def cached_schedule(collective: str, world_size: int, algorithm: str, parts: int, chunks: int) -> Schedule:
    return build(collective, world_size, algorithm=algorithm, parts=parts, chunks=chunks)


# -- per-group state -------------------------------------------------------------------------------------------


class GroupState:
    """What every call on one process group shares: its sequence number, its one-op-at-a-time lock,
    whether the last call failed (the next one is checked), and the whole collectives its transport lacks;
    and what a rank knows of its peers: the group's board (``commfuse.runtime.board``, in the group's
    store) and whether a peer's part of the call in progress failed."""

    __slots__ = ("seqs", "now", "lock", "busy", "dirty", "error", "name", "checked", "lacking", "group", "rank",
                 "world_size", "board", "told", "lane", "__weakref__")

    def __init__(self, name: str, group=None) -> None:
        #: the next call number of each thread lane (:func:`lane`'s code): every thread's calls on the group
        #: are numbered apart, so a call pairs with its thread's call of the same number on every peer
        self.seqs: dict[int, int] = {}
        self.now = -1  # the number of the call in progress (set as it takes the group)
        #: the call signatures (fingerprints less the call number) the ranks have agreed on for this group:
        #: kept here, not per plan object, so that every rank checks the same calls however its plans were
        #: made (two threads making one signature's first plan at once, a plan cache that was cleared)
        self.checked: set[tuple] = set()
        self.lock = threading.Lock()
        self.busy: tuple[str, int] | None = None
        self.dirty = False
        self.error: BaseException | None = None  # every later call raises it (the group was declared dead)
        self.name = name
        #: the whole collectives the group's transport lacks, each with why it is taken to (its refusal):
        #: the backend runs them another way from then on, without asking the transport again
        self.lacking: dict[Collective, str] = {}
        #: the c10d process group (its store holds the board), this rank in it and its size (from the first
        #: backend that plans a call on it)
        self.group = group
        self.rank: int | None = None
        self.world_size = 1
        self.board = None  # a Board once made; False: the group has none
        #: a peer's note that the call in progress failed there (set by a stalled wait reading the board):
        #: this rank stops computing, completes the call's transfers and raises PeerFailedError
        self.told: dict | None = None
        self.lane: tuple[str, int] = ("", 0)  # the thread of the call in progress: (name, code)

    def take(self, code: int) -> int:
        """The next call number of lane ``code``, taken."""
        seq = self.seqs.get(code, 0)
        self.seqs[code] = seq + 1
        return seq

    def current(self) -> int:
        """The number of the call in progress."""
        return self.now


_STATES: dict[object, GroupState] = {}
_STATES_LOCK = threading.Lock()


def _group_name(group) -> str:
    name = getattr(group, "group_name", None)
    if name:
        return f"group {name!r}"
    return f"group {type(group).__name__}@{id(group):#x}"


def state_of_group(group) -> GroupState:
    """The :class:`GroupState` of a process group (or of a backend object that has no group)."""
    found = _STATES.get(group)
    if found is None:
        with _STATES_LOCK:
            found = _STATES.get(group)
            if found is None:
                found = _STATES[group] = GroupState(_group_name(group), _c10d_group(group))
    return found


def _c10d_group(group):
    """``group`` if it is a c10d process group (it has a store, where the board lives), else None."""
    module = sys.modules.get("torch.distributed")
    pg = getattr(module, "ProcessGroup", None) if module is not None else None
    return group if pg is not None and isinstance(group, pg) else None


def group_state(backend) -> GroupState:
    """The :class:`GroupState` shared by every backend object over the same group (cached on the backend)."""
    found = getattr(backend, "_commfuse_state", None)
    if found is None:
        group = getattr(backend, "group", None)
        try:
            hash(group)
        except TypeError:  # not a process group object (the XLA backend's replica-id lists): per backend
            group = None
        found = state_of_group(backend if group is None else group)
        if found.rank is None:
            found.rank = getattr(backend, "rank", None)
            found.world_size = getattr(backend, "world_size", 1)
        try:
            backend._commfuse_state = found
        except AttributeError:  # a backend that takes no attributes looks it up every call
            pass
    return found


def forget_groups() -> None:
    """Drop every group's state (``commfuse.backends.release`` calls it before groups are destroyed)."""
    with _STATES_LOCK:
        _STATES.clear()


# -- compiled steps --------------------------------------------------------------------------------------------


class CStep:
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
        self.steps = tuple(CStep(step, self.slot, tuple(sorted(done.get(step.index, ())))) for step in steps)
        self.communicates = any(st.communicates for st in self.steps)

    @staticmethod
    def _collective_slices(part: int, n: int, rank: int, halves: int, a2a: bool) -> list[SliceId]:
        if a2a:
            return [SliceId(d, part, 0, rank) for d in range(n)] + [SliceId(rank, part, 0, q) for q in range(n)]
        return [SliceId(d, part, h) for d in range(n) for h in range(halves)]

    def slots_of(self, shard: int, source: int | None = None) -> tuple[int, ...]:
        """The slots of every slice of one shard, in layout order."""
        return tuple(self.slot[x] for x in self.schedule.slices(shard, source))


@functools.lru_cache(maxsize=1024)
def compiled(schedule: Schedule, rank: int) -> Compiled:
    return Compiled(schedule, rank)


class Program:
    """What one call's data is; the executor asks it for tensors slot by slot.

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


# -- measurement modes -----------------------------------------------------------------------------------------

_MODES = ("compute_only", "comm_only")
_mode = threading.local()
#: How many ``measure``/``record_events`` scopes are open in any thread: while none is, a call reads no
#: thread-local state at all.
_observers = [0]


def measuring() -> str | None:
    """The :func:`measure` mode this thread runs ops in (None: normally)."""
    return getattr(_mode, "value", None) if _observers[0] else None


@contextlib.contextmanager
def measure(mode: str | None):
    """Run ops with their transfers removed (``"compute_only"``) or their compute removed (``"comm_only"``).

    The benchmark uses it to time the same schedule's two halves apart: with
    ``compute_only`` every post completes at once and receive buffers keep
    whatever they held (results are garbage, timings are those of the
    per-shard compute and the executor); with ``comm_only`` the programs skip
    their compute (reduce-scatter sends uninitialised partials of the right
    shape). The fingerprint check is skipped in both. ``None`` is normal.
    """
    if mode is not None and mode not in _MODES:
        raise CommfuseValueError(f"measure mode must be one of {_MODES} or None, got {mode!r}")
    previous = getattr(_mode, "value", None)
    _mode.value = mode
    _observers[0] += 1
    try:
        yield
    finally:
        _observers[0] -= 1
        _mode.value = previous


@contextlib.contextmanager
def record_events():
    """Collect the per-step timeline of every ``execute`` in this thread into a list.

    Each entry is a per-step dict (``step``, ``post``, ``compute``, ``wait``
    as (start, end) ``time.perf_counter()`` seconds, ``sends``/``recvs`` as
    (peer, channel), ``collectives``) plus ``label`` (the op) and
    ``algorithm``. The benchmark builds its traces and Gantt charts from these.
    """
    previous = getattr(_mode, "events", None)
    events: list[dict] = []
    _mode.events = events
    _observers[0] += 1
    try:
        yield events
    finally:
        _observers[0] -= 1
        _mode.events = previous


class _Done:
    """A handle that is already complete: what ``compute_only`` posts return."""

    __slots__ = ("outputs",)

    def __init__(self, outputs) -> None:
        self.outputs = list(outputs)

    def wait(self, timeout: float):
        return self.outputs


def _done_post(sends, recvs):
    return _Done(x for _, x in recvs)


class _SkippedEmpty:
    """The handle of a step whose empty messages were left out: its wait gives one tensor per receive, the
    empty buffers where nothing was received."""

    __slots__ = ("handle", "buffers")

    def __init__(self, handle, buffers) -> None:
        self.handle, self.buffers = handle, buffers

    def wait(self, timeout: float):
        got = self.handle.wait(timeout)
        live = sum(1 for b in self.buffers if b.numel())
        if len(got) != live:
            raise CommunicationError(f"the backend's post gave {len(got)} tensors for {live} receives")
        got = iter(got)
        return [next(got) if b.numel() else b for b in self.buffers]


def skipping_empty(post: Callable) -> Callable:
    """``post`` without the messages of no elements (``Program.sparse``): zero-row exchanges cost no transfer."""

    def post_nonempty(sends, recvs):
        live_sends = [m for m in sends if m[1].numel()]
        live_recvs = [m for m in recvs if m[1].numel()]
        if len(live_sends) == len(sends) and len(live_recvs) == len(recvs):
            return post(sends, recvs)
        buffers = [b for _, b in recvs]
        if not live_sends and not live_recvs:
            return _Done(buffers)
        return _SkippedEmpty(post(live_sends, live_recvs), buffers)

    return post_nonempty


def _done_collective(kind, inputs, outputs):
    return _Done(outputs)


def _done_into(kind, input, output):
    return _Done([output])


_NULL = contextlib.nullcontext()


def _trace_enabled() -> bool:
    return os.environ.get("COMMFUSE_TRACE", "").strip() not in ("", "0")


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
                 "whole_compute", "one_by_one", "settled", "probe", "capturing")

    def __init__(self, schedule: Schedule, backend, *, label: str, timeout: float, check: str,
                 overlap: bool = True) -> None:
        self.schedule = schedule
        self.backend = backend
        self.rank = backend.rank
        self.compiled = compiled(schedule, self.rank)
        self.state = group_state(backend)
        self.label = label
        self.timeout = timeout
        self.check = check
        self.overlap = overlap
        self.checked = False
        #: the signature is known and needs no check on a clean group (then, unless the group is dirty or
        #: something observes the call, a call may take a lean path): set by execute
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
        self.trace = _trace_enabled()  # COMMFUSE_TRACE is read when a signature is first planned
        self.steps = self.compiled.steps
        self.digest: int | None = None  # of the fingerprint, less the call number: part of every tag
        self.signature: tuple | None = None  # the fingerprint less the call number
        # One whole collective and one compute over every slot, no P2P (vanilla): (its step, its call), and
        # the compute's slots. Such a call may take execute_into, with no program.
        self.whole = None
        self.whole_compute: tuple[int, ...] = ()
        steps = self.steps
        with_calls = [st for st in steps if st.collectives]
        # Point-to-point steps only, each computing at most one slot, overlapped (ring, ring:m): such a call
        # may take execute_one_by_one, with no program.
        self.one_by_one = overlap and not with_calls and all(len(st.compute) <= 1 for st in steps)
        if (len(steps) == 2 and len(with_calls) == 1 and len(with_calls[0].collectives) == 1
                and not any(st.p2p for st in steps) and sum(bool(st.compute) for st in steps) == 1):
            self.whole = (with_calls[0], with_calls[0].collectives[0])
            self.whole_compute = next(st.compute for st in steps if st.compute)

    def lean(self) -> bool:
        """Whether the next call may skip the program (:func:`execute_into`, :func:`execute_one_by_one`): the
        plan is ``settled`` (its signature known, and agreed or never checked, with no check on every call and
        no trace), its group clean, and nothing observes the call (a measurement mode, the profiler)."""
        if not self.settled or _observers[0] or torch.autograd.profiler._is_profiler_enabled:
            return False
        return not (self.checks and self.state.dirty)

    def learn_signature(self, program: Program) -> None:
        """The signature (fingerprint less the call number) and its digest, from the first call's program."""
        import zlib

        self.signature = tuple(self.fingerprint(program, 0)[2:])
        self.digest = zlib.crc32(repr(self.signature).encode())

    def fingerprint(self, program: Program, seq: int) -> list[int]:
        s = self.schedule
        return [_MAGIC, seq % SEQUENCE_WRAP, format_code(self.label), _COLLECTIVES.index(s.collective),
                _ALGORITHMS.index(s.algorithm), int(self.overlap), s.parts, s.chunks, *program.meta()]


#: How to read a fingerprint's op-specific integers back, per op label.
_FORMATS: dict[int, tuple[str, object]] = {}


def format_code(label: str) -> int:
    """A stable small integer for an op label (the same on every rank running this version)."""
    import zlib

    return zlib.crc32(label.encode()) & 0xFFFFFF


def register_format(label: str, describe) -> None:
    """Say how ``describe(meta_values) -> str`` reads the fingerprint integers of op ``label``."""
    _FORMATS[format_code(label)] = (label, describe)


def describe_fingerprint(values: Sequence[int]) -> str:
    """A fingerprint in words, decoded with the format of the op that made it."""
    values = list(values)
    if len(values) < 8 or values[0] != _MAGIC:
        return f"an unrecognised fingerprint {values}"
    seq, code, coll, alg, overlap, parts, chunks = values[1:8]
    label, describe = _FORMATS.get(code, (f"op#{code}", None))
    coll_t = _COLLECTIVES[coll].value if 0 <= coll < len(_COLLECTIVES) else f"collective#{coll}"
    alg_t = _ALGORITHMS[alg].value if 0 <= alg < len(_ALGORITHMS) else f"algorithm#{alg}"
    if not overlap:
        alg_t = "serial"
    text = f"call #{seq} {label} ({coll_t}, algorithm {alg_t}, parts={parts}, chunks={chunks})"
    meta = values[8:]
    if describe is not None:
        try:
            return text + ": " + describe(meta)
        except Exception:  # noqa: BLE001 - a fingerprint that does not fit its format is shown raw
            pass
    return text + f": {meta}"


def _fit(values: list[int], length: int = FINGERPRINT_LEN) -> list[int]:
    if len(values) > length:
        values = values[: length - 1] + [hash(tuple(values)) & 0x7FFFFFFFFFFF]
    return values + [-1] * (length - len(values))


def _strip(values: list[int]) -> list[int]:
    while values and values[-1] == -1:
        values = values[:-1]
    return values


# -- running a plan --------------------------------------------------------------------------------------------


_graph_task = getattr(torch._C, "_current_graph_task_id", None)
_AUTOGRAD_LANE = ("autograd", zlib.crc32(b"autograd") & 0xFFFF)


def lane() -> tuple[str, int]:
    """The thread a call comes from, as every rank can name it: ``(name, code)``. The code goes into every
    tag and fingerprint, so a call from one thread never pairs with a peer's call from another (two threads
    that share a group and reach it in different orders on different ranks). Autograd's backward (on
    whatever thread the engine runs it) is the lane ``autograd``; a thread Python did not start (a C++
    thread) is ``native``; any other thread goes by its name (``MainThread``, ``Thread-2 (worker)``): threads
    that call commfuse must be started in the same order on every rank, or be named."""
    if _graph_task is not None and _graph_task() != -1:
        return _AUTOGRAD_LANE
    t = threading.current_thread()
    found = getattr(t, "_commfuse_lane", None)
    if found is None:
        name = "native" if isinstance(t, threading._DummyThread) else t.name
        found = (name, zlib.crc32(name.encode()) & 0xFFFF)
        try:
            t._commfuse_lane = found
        except AttributeError:
            pass
    return found


class Ticket:
    """A call's number, taken before any of the caller's code runs (a producer's first partial, a policy),
    and the group held for it: ``with enter_call(backend, label) as ticket: ...; execute(..., ticket=ticket)``.
    An exception before :func:`execute` takes the ticket over is announced on the board as this rank
    leaving call #seq without taking part (its peers, waiting on it, declare the group dead and say why), and
    the group's next call is checked."""

    __slots__ = ("state", "label", "seq", "used")

    def __init__(self, state: GroupState, label: str) -> None:
        self.state, self.label, self.used = state, label, False
        self.seq = -1

    def __enter__(self) -> "Ticket":
        state = self.state
        if not state.lock.acquire(False):
            raise _refused(self.label, state)
        if state.error is not None or (state.group is not None and state.group not in _c10d._world.pg_map):
            state.lock.release()
            raise _dead_again(self.label, state) if state.error is not None else _destroyed(self.label, state)
        state.busy = (self.label, threading.get_ident())
        state.told = None
        state.lane = which = lane()
        self.seq = state.now = state.take(which[1])
        return self

    def __exit__(self, kind, error, tb) -> bool:
        state = self.state
        try:
            if error is not None and not self.used:
                _left(state, self.seq, self.label, None, error)
        finally:
            state.busy = None
            state.lock.release()
        return False


def enter_call(backend, label: str) -> Ticket:
    """A :class:`Ticket` for one call of ``label`` on ``backend``'s group."""
    return Ticket(group_state(backend), label)


def announce_left(state: GroupState, label: str, error: BaseException) -> None:
    """A call failed on this rank before it reached the executor (its validation, its policy): it still takes
    its call number on the group, its failure goes on the board for the peers waiting on it, and the group's
    next call is checked, so it cannot pair with the peers' copy of this call. No lock: the op may have
    failed inside another op's consumer on this group, on this thread."""
    which = lane()
    _left(state, state.take(which[1]), label, None, error, which)


class op_calls:
    """A composite op's calls on one group, counted: ``with op_calls(backend, "MoE.forward", 3): ...`` (the op
    makes three calls). When an exception escapes the op before it made all of them (its router raised on
    this rank, or a call failed and the op gives up on the rest), the calls it did not make are announced on
    the board as this rank leaving them, one call number each, as :func:`announce_left` does for one: the
    peers that wait in them hear of it and say why, instead of waiting out the timeout, and this rank's
    call numbers stay those of the peers that completed the op. ``backend`` None (a single process): nothing."""

    __slots__ = ("state", "label", "planned", "start", "code")

    def __init__(self, backend, label: str, planned: int) -> None:
        self.state = None if backend is None else group_state(backend)
        self.label, self.planned = label, planned

    def __enter__(self) -> "op_calls":
        if self.state is not None:
            self.code = lane()[1]
            self.start = self.state.seqs.get(self.code, 0)
        return self

    def __exit__(self, kind, error, tb) -> bool:
        state = self.state
        if state is None:
            return False
        made = state.seqs.get(self.code, 0) - self.start
        planned = self._planned(made, error)
        if error is not None and state.rank is not None and state.world_size > 1:
            for _ in range(planned - made):
                announce_left(state, self.label, error)
        return False

    def _planned(self, made: int, error) -> int:
        return self.planned


class counted_calls(op_calls):
    """:class:`op_calls` for an op whose number of calls is learned rather than known: the first run of
    ``key`` that succeeds records how many calls it made, and a later run of ``key`` that an exception
    leaves early announces the ones it did not make (a run before any success announces none). For layers
    whose hooks run between their calls (a style's rope hook between its gather and its reduce-scatter).
    ``group`` None (a single process): nothing."""

    __slots__ = ("key",)
    _LEARNED: dict = {}

    def __init__(self, group, label: str, key) -> None:
        self.state = state_of_group(group) if group is not None else None
        self.label, self.key, self.planned = label, key, 0

    def _planned(self, made: int, error) -> int:
        learned = self._LEARNED
        if error is None:
            if len(learned) > 4096:
                learned.clear()
            learned[self.key] = made
            return made
        return learned.get(self.key, 0)


def _left(state: GroupState, seq: int, label: str, step, error: BaseException, which=None) -> None:
    """Note that this rank left call #seq without completing its transfers (``step`` None: before posting
    any), and mark the group for a check."""
    state.dirty = True
    if state.world_size <= 1:
        return
    board = board_of(state)
    if board is not None:
        name, code = which or state.lane
        board.log("fail", seq=seq, lane=code, thread=name, label=label, step=step, exc=type(error).__name__,
                  message=_first_line(error), continuing=False)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return (text.splitlines()[0] if text else "")[:500]


def execute(plan: Plan, program: Program, *, events: list | None = None, ticket: Ticket | None = None) -> None:
    """Run one call of ``plan`` with ``program``'s data on ``plan.backend`` (``ticket``: the call's number,
    taken already by :func:`enter_call`)."""
    state = plan.state
    if ticket is None:
        seq = _enter(plan, state)
    else:
        seq, ticket.used = ticket.seq, True
        probe = plan.probe
        if probe is not None and probe():
            plan.capturing = True
    posted = False
    try:
        mode = None
        if _observers[0]:
            mode = getattr(_mode, "value", None)
            if events is None:
                events = getattr(_mode, "events", None)
        begin = plan.begin
        if plan.digest is None:
            plan.learn_signature(program)
        code = state.lane[1]
        if plan.checks and mode is None and (not plan.checked or state.dirty or plan.check == "always"):
            signature = plan.signature
            if state.dirty or plan.check == "always" or signature not in state.checked:
                if plan.capturing:
                    raise _capture_refusal(plan, state)
                if begin is not None:
                    begin(None, plan)
                _check_fingerprint(plan, program, seq)
                state.checked.add(signature)
                state.dirty = False
            plan.checked = True
        if begin is not None:
            begin((seq + plan.digest + code) % SEQUENCE_WRAP, plan)
        if not plan.settled:
            plan.settled = not plan.trace and (not plan.checks or (plan.checked and plan.check != "always"))
        posted = True
        if mode is None and events is None and not plan.trace and not _profiler_on():
            _run(plan, program, seq)
        else:
            _run_observed(plan, program, mode, events, seq)
    except BaseException as e:
        _after_failure(plan, state, seq, e, posted)
        raise
    finally:
        if ticket is None:
            _leave(plan, state)
        else:
            plan.capturing = False


def _after_failure(plan: Plan, state: GroupState, seq: int, error: BaseException, posted: bool) -> None:
    """What a failed call leaves behind on this rank. A failure this rank settled (it told its peers and
    completed the call's transfers, or it was told and did the same) leaves the group as it was; so does a
    verdict a wait reached (whoever reached it declared the group dead). One before any transfer was posted
    (a mismatch every rank raises, a refused capture) marks the group for a check, and so does any failure
    on a group with no board to tell the peers on (they time out, as before it had one). Anything else
    (Ctrl-C, an error from the transport, a stream-ordered backend's failed compute) is noted on the board
    and ends the group here: a transfer that was posted cannot be taken back."""
    if getattr(error, "_commfuse_settled", None) == (id(state), seq) or state.error is not None:
        return
    if not posted or plan.schedule.world_size <= 1 or plan.traced:
        state.dirty = True
        return
    if isinstance(error, Exception) and board_of(state) is None:
        state.dirty = True
        return
    _left(state, seq, plan.label, None, error)
    declare_dead(state, GroupDeadError(
        f"rank {plan.rank}: {plan.label} (call #{seq}, {plan.schedule.describe()}) was left unfinished on this "
        f"rank by {type(error).__name__}: {_first_line(error)}; the group is dead: {RECOVER}"),
        getattr(plan.backend, "poison", None))


def _settled(error: BaseException, state: GroupState, seq: int) -> BaseException:
    """Mark ``error`` as one this rank settled for call #seq (see :func:`_after_failure`)."""
    try:
        error._commfuse_settled = (id(state), seq)
    except AttributeError:  # an exception that takes no attributes: the group is marked for a check
        pass
    return error


def _add_note(error: BaseException, text: str) -> None:
    add = getattr(error, "add_note", None)  # Python 3.11+
    if add is not None:
        try:
            add(text)
        except Exception:  # noqa: BLE001
            pass


# -- a failure on one rank: told, and the call's transfers completed ---------------------------------------------


def _compute_failed(plan: Plan, seq: int, index: int, error: BaseException, finish, st: CStep | None = None,
                    pending=None, land=None) -> BaseException:
    """This rank's compute (or code of the caller's) failed in step ``index`` of call #seq. First the step's
    posted transfers are waited for and what arrived is landed (``pending``, as :func:`_wait_all` takes
    them). Then, when the group has a board: note the failure there (op, step, exception), acknowledge it,
    complete the call's remaining transfers with ``finish(index + 1)``, which sends only to peers that know
    (so none of them computes on what this rank sends from now on), and return ``error`` to raise, marked
    settled: the group stays usable. Without a board, or for an exception that is not an ``Exception``
    (Ctrl-C), return ``error`` as it is (:func:`_after_failure` decides)."""
    state = plan.state
    if pending:
        try:
            _wait_all(plan, st, pending, land, plan.timeout)
        except BaseException as e:  # noqa: BLE001 - the transport failed too: the group is dead, say both
            _add_note(error, f"commfuse: rank {plan.rank} could not complete step {index} of call #{seq} after "
                             f"this failure: {type(e).__name__}: {_first_line(e)}")
            return error
    board = board_of(state) if plan.schedule.world_size > 1 and not plan.traced else None
    if board is None or not isinstance(error, Exception) or getattr(plan.backend, "_stream_ordered", False):
        # a stream-ordered backend's peers never stall on the host, so they could not learn before what this
        # rank would send reached their device: it ends the group instead (_after_failure)
        return error
    name, code = state.lane
    board.log("fail", seq=seq, lane=code, thread=name, label=plan.label, step=index, exc=type(error).__name__,
              message=_first_line(error), continuing=True)
    board.ack(code, seq)
    try:
        finish(index + 1)
    except BaseException as e:  # noqa: BLE001 - the group is dead (declared by whoever found out)
        _add_note(error, f"commfuse: rank {plan.rank} could not complete call #{seq} after this failure: "
                         f"{type(e).__name__}: {_first_line(e)}")
        return error
    _add_note(error, f"commfuse: rank {plan.rank}'s peers were told that {plan.label} (call #{seq}) failed here "
                     f"in step {index}, and the call's transfers were completed: the group stays usable")
    return _settled(error, state, seq)


def _told(plan: Plan, seq: int, index: int, finish) -> BaseException:
    """A stalled wait of this rank read on the board that call #seq failed on a peer (``state.told``): stop
    computing, complete the call's remaining transfers from step ``index + 1`` with ``finish``, and return
    the :class:`PeerFailedError` to raise (settled: the group stays usable)."""
    state = plan.state
    note = state.told
    finish(index + 1)
    step = note.get("step")
    error = PeerFailedError(
        f"rank {plan.rank}: {plan.label} (call #{seq}, {plan.schedule.describe()}) failed on rank {note['rank']}"
        + (f" in step {step}" if step is not None else "")
        + f": {note.get('exc')}: {note.get('message')}. This rank stopped computing after step {index} and "
        "completed the call's transfers, so the group stays usable; its result for this call is discarded")
    return _settled(error, state, seq)


def _gate(plan: Plan, seq: int, peers) -> None:
    """Wait (bounded by the call's timeout) until every rank in ``peers`` knows that call #seq failed, so that
    what this rank sends them from now on is never computed on unknowingly. A peer that waits on this rank
    stalls, reads the board and acknowledges within about the grace period."""
    state = plan.state
    board = board_of(state)
    if board is None:
        return
    code = state.lane[1]
    waiting = [q for q in peers if not board.knows(code, seq, q)]
    deadline = time.monotonic() + plan.timeout
    while waiting:
        if time.monotonic() > deadline:
            who = ", ".join(map(str, waiting))
            raise declare_dead(state, CommfuseTimeoutError(
                f"rank {plan.rank}: {plan.label} (call #{seq}) failed and rank {who} did not learn of it within "
                f"{plan.timeout:g} s (it never waited in the call: late, hung or gone), so the call's transfers "
                f"cannot be completed and the group is dead: {RECOVER}"), getattr(plan.backend, "poison", None))
        time.sleep(0.02)
        waiting = [q for q in waiting if not board.knows(code, seq, q)]


def _step_peers(plan: Plan, st: CStep) -> list[int]:
    if st.collectives:
        return [q for q in range(plan.schedule.world_size) if q != plan.rank]
    return sorted({t.peer for t, _ in st.sends})


def _ghost_compute(program: Program, slots) -> None:
    """Stand in for ``program.compute(slots)`` once the call failed: a program whose compute makes what later
    steps send (a reduce-scatter's partials, a produced block) gets tensors of the right shape (its
    ``skip``); a consuming program needs nothing (what it sends is what it received)."""
    if slots and program.collective in (Collective.REDUCE_SCATTER, Collective.PRODUCE_ALL_TO_ALL):
        program.skip(slots)


def _finisher(plan: Plan, program: Program, seq: int, failed_step: CStep | None):
    """``finish(start)``: walk steps ``start..`` of ``plan`` with no compute (see :func:`_compute_failed`)."""

    def finish(start: int) -> None:
        backend, timeout = plan.backend, plan.timeout
        post = skipping_empty(backend.post) if program.sparse else backend.post
        if failed_step is not None:
            _ghost_compute(program, failed_step.compute)
        for st in plan.steps[start:]:
            peers = _step_peers(plan, st)
            if peers:
                _gate(plan, seq, peers)
            pending = _post_step(plan, st, program, post, backend.collective)
            _ghost_compute(program, st.compute)
            _wait_all(plan, st, pending, program.land, timeout)
            for s in st.accumulate:
                program.add(s)
            for s in st.release:
                program.release(s)

    return finish


def execute_into(plan: Plan, input, output: torch.Tensor) -> None:
    """One call of a whole-collective plan (``plan.whole``, vanilla) straight into ``output``: the
    collective over single tensors (``collective_into``) and its wait, with :func:`execute`'s rules (one op
    per group at a time, the call number in the tags, a failure on one rank told to every rank) and no
    program. ``input`` is a tensor, or a function making it once the call has its number (a producer's
    partial: when it fails, the collective still runs, on zeros, once every peer knows). Only when
    ``plan.lean()``: the first call of a signature, a check, or an observed call take :func:`execute`."""
    state = plan.state
    seq = _enter(plan, state)
    try:
        st, call = plan.whole
        begin = plan.begin
        if begin is not None:
            begin((seq + plan.digest + state.lane[1]) % SEQUENCE_WRAP, plan)
        failed = None
        if callable(input):
            try:
                input = input()
            except Exception as e:
                failed = e
                n = plan.schedule.world_size
                rows = output.shape[0] * n if call.collective is Collective.REDUCE_SCATTER else output.shape[0] // n
                input = output.new_zeros((rows, *output.shape[1:]))
        if failed is not None:
            def finish(start: int) -> None:
                _gate(plan, seq, _step_peers(plan, st))
                _into(plan, st, call, input, output)

            raise _compute_failed(plan, seq, 0, failed, finish)
        _into(plan, st, call, input, output)
        if state.told is not None:
            raise _told(plan, seq, 0, lambda start: None)
    except BaseException as e:
        _after_failure(plan, state, seq, e, True)
        raise
    finally:
        _leave(plan, state)


def _into(plan: Plan, st: CStep, call, input: torch.Tensor, output: torch.Tensor) -> None:
    try:
        handle = plan.backend.collective_into(call.collective, input, output)
    except Exception as e:
        raise _posting_error(plan, st, call, e) from e
    try:
        handle.wait(plan.timeout)
    except BaseException as e:
        raise _waiting_error(plan, st, call, e) from e


def lean_walk(plan: Plan, start: list, size: list, key: list, own: frozenset) -> tuple:
    """``plan``'s steps as :func:`execute_one_by_one` walks them, with what each step reads resolved once,
    per step ``(st, pair, sends, recvs, compute, accumulate, release)``:

    - ``pair``: a step of exactly one send and one receive (every ring step) as ``(send's Transfer, its
      slot, receive's Transfer, the receive buffer's pool key)``, posted with no comprehension; else None;
    - ``sends``: ``(Transfer, slot)`` pairs of any other step with point-to-point transfers, else None;
    - ``recvs``: ``(Transfer, slot, key)``, ``key`` the receive buffer's pool key (for a ``pair`` too);
    - ``compute``: ``(slot, start, size, key)`` of the one slice the step computes, or None;
    - ``accumulate``, ``release``: ``(slot, key)`` pairs (``release`` less this rank's ``own`` slots).

    Plans with ``one_by_one`` only."""
    walk = []
    for st in plan.steps:
        compute = None
        if st.compute:
            (s,) = st.compute
            compute = (s, start[s], size[s], key[s])
        sends, pair = (st.sends if st.p2p else None), None
        if sends is not None and len(sends) == 1 and len(st.recvs) == 1:
            (t, s), (r, q) = sends[0], st.recvs[0]
            sends, pair = None, (t, s, r, key[q])
        walk.append((
            st,
            pair,
            sends,
            tuple((t, s, key[s]) for t, s in st.recvs),
            compute,
            tuple((s, key[s]) for s in st.accumulate),
            tuple((s, key[s]) for s in st.release if s not in own),
        ))
    return tuple(walk)


def execute_one_by_one(plan: Plan, walk: tuple, held: list, one: Callable, get: Callable, put: Callable,
                       inbox: list | None = None) -> None:
    """One call of a point-to-point plan whose steps each compute at most one slot (``plan.one_by_one``:
    ring, ring:m), walked with the least Python per step and no program; ``walk`` is the plan's
    :func:`lean_walk`.

    Slices are sent from ``held`` (by slot); a receive buffer is ``get(key)``; a step posts, computes
    ``one(start, size, held[slot])``, then waits. What ``one`` returns, when not None, becomes the slot's
    tensor (a reduce-scatter's partial). A received slice lands in ``held`` for a gather (``inbox`` None);
    for a reduce-scatter it lands in ``inbox`` and is added, in place, into the slot's partial where the
    step accumulates, its buffer going back with ``put``. A slot the step releases goes back with
    ``put(tensor, key)`` (this rank's own slots are not in the walk's releases: a reduce-scatter's result
    stays in ``held``).

    :func:`execute`'s rules hold (one op per group at a time, the call number in the tags, a failure on one
    rank told to every rank, transfers already posted drained when the compute fails). Only when
    ``plan.lean()``."""
    state = plan.state
    seq = _enter(plan, state)
    try:
        begin = plan.begin
        if begin is not None:
            begin((seq + plan.digest + state.lane[1]) % SEQUENCE_WRAP, plan)
        post = plan.backend.post
        landing = held if inbox is None else inbox
        i = -1
        for st, pair, sends, recvs, compute, accumulate, release in walk:
            i += 1
            handle = None
            if pair is not None or sends is not None:
                try:
                    if pair is not None:
                        t, s, r, k = pair
                        handle = post(((t, held[s]),), ((r, get(k)),))
                    else:
                        handle = post([(t, held[s]) for t, s in sends], [(t, get(k)) for t, _, k in recvs])
                except Exception as e:
                    raise _posting_error(plan, st, None, e) from e
            if compute is not None:
                s, at, length, _ = compute
                try:
                    made = one(at, length, held[s])
                except Exception as e:
                    pending = None if handle is None else ((handle, None, [(t, s) for t, s, _ in recvs]),)
                    raise _compute_failed(plan, seq, i, e, _lean_finisher(plan, seq, walk, held, get, put, inbox, i),
                                          st, pending, landing.__setitem__)
                if made is not None:
                    held[s] = made
            if handle is not None:
                _land_lean(plan, st, handle, recvs, landing)
                if state.told is not None:
                    raise _told(plan, seq, i, _lean_finisher(plan, seq, walk, held, get, put, inbox, None))
            for s, k in accumulate:
                received = inbox[s]
                inbox[s] = None
                held[s].add_(received)
                put(received, k)
            for s, k in release:
                t = held[s]
                held[s] = None
                if t is not None:
                    put(t, k)
    except BaseException as e:
        _after_failure(plan, state, seq, e, True)
        raise
    finally:
        _leave(plan, state)


def _land_lean(plan: Plan, st: CStep, handle, recvs, landing: list) -> None:
    """Wait for a lean step's transfers and put what arrived in ``landing``, by slot."""
    try:
        got = handle.wait(plan.timeout)
    except BaseException as e:
        raise _waiting_error(plan, st, None, e) from e
    for (_, s, _), tensor in zip(recvs, got):
        landing[s] = tensor


def _lean_finisher(plan: Plan, seq: int, walk: tuple, held: list, get: Callable, put: Callable,
                   inbox: list | None, failed: int | None):
    """:func:`_finisher` for :func:`execute_one_by_one`'s walk: a reduce-scatter's partials that were not made
    are buffers of their shape (``failed``: the step whose compute raised)."""

    def finish(start: int) -> None:
        post = plan.backend.post
        landing = held if inbox is None else inbox
        if failed is not None and inbox is not None:
            s, _, _, k = walk[failed][4]
            held[s] = get(k)
        for st, pair, sends, recvs, compute, accumulate, release in walk[start:]:
            peers = _step_peers(plan, st)
            if peers:
                _gate(plan, seq, peers)
            handle = None
            if st.p2p:
                try:
                    handle = post([(t, held[s]) for t, s in st.sends], [(t, get(k)) for t, _, k in recvs])
                except Exception as e:
                    raise _posting_error(plan, st, None, e) from e
            if compute is not None and inbox is not None:
                s, _, _, k = compute
                held[s] = get(k)
            if handle is not None:
                _land_lean(plan, st, handle, recvs, landing)
            for s, k in accumulate:
                received = inbox[s]
                inbox[s] = None
                held[s].add_(received)
            for s, k in release:
                held[s] = None

    return finish


def _enter(plan: Plan, state: GroupState) -> int:
    """Take the group for one call of ``plan`` (refused, by name, while another op is in flight on it; a
    group declared dead raises its error, and so does one torch.distributed destroyed) and return the call's
    number. :func:`_leave` gives it back. On a device with graph capture, the plan learns whether this call
    is captured."""
    probe = plan.probe
    capturing = probe is not None and bool(probe())
    if not state.lock.acquire(False):
        raise _refused(plan.label, state)
    if state.error is not None or (state.group is not None and state.group not in _c10d._world.pg_map):
        state.lock.release()
        raise _dead_again(plan.label, state) if state.error is not None else _destroyed(plan.label, state)
    state.busy = (plan.label, threading.get_ident())
    state.told = None
    state.lane = which = lane()
    seq = state.now = state.take(which[1])
    if capturing:
        plan.capturing = True
    return seq


def _leave(plan: Plan, state: GroupState) -> None:
    plan.capturing = False
    state.busy = None
    state.lock.release()


def _capture_refusal(plan: Plan, state: GroupState) -> CommfuseValueError:
    """Why a call that must check its fingerprint cannot be captured in a device graph, and what to do."""
    if plan.check == "always":
        why = "COMMFUSE_CHECK=always (or check='always') checks every call"
    elif state.dirty:
        why = "an earlier call on the group failed, so the next call checks that the ranks agree again"
    else:
        why = "this is the first call of its signature on the group"
    return CommfuseValueError(
        f"rank {plan.rank}: {plan.label} ({plan.schedule.describe()}) on {state.name} is being captured in a "
        f"device graph, but this call must first check that every rank calls the same op ({why}), and the "
        "check compares the ranks' fingerprints on the host, which a capture cannot do. Run the call eagerly "
        "before capturing (warm-up: commfuse.graphs.capture does it), with the default check mode, not "
        "COMMFUSE_CHECK=always"
    )


def _dead_again(label: str, state: GroupState) -> BaseException:
    """What a call on a group declared dead raises: the error that ended it, of the same class, saying which
    call it refused (the error itself names the call that found it)."""
    error = state.error
    try:
        return type(error)(f"rank {state.rank}: {label} cannot run on {state.name}, which was declared dead "
                           f"before this call:\n  {error}")
    except Exception:  # noqa: BLE001 - an error class that takes no message: the error itself
        return error


def _destroyed(label: str, state: GroupState) -> GroupDeadError:
    return GroupDeadError(
        f"rank {state.rank}: {label} on {state.name}: the process group was destroyed "
        "(torch.distributed.destroy_process_group) after commfuse planned calls on it. Calls with group=None "
        "follow the default group in place now; a module or a call given the old group object must be given "
        "the new one"
    )


def _refused(label: str, state: GroupState) -> ConcurrentUseError:
    """A call refused while another op is in flight on the group: it still takes its thread's call number,
    announced on the board like any call that fails before communicating (a rank whose peers ran that call
    tells them so), and the error to raise."""
    error = _busy_label(label, state)
    if state.rank is not None and state.world_size > 1:
        announce_left(state, label, error)
    return error


def _busy_label(label: str, state: GroupState) -> ConcurrentUseError:
    busy = state.busy
    who = f"{busy[0]} (thread {busy[1]})" if busy else "another op"
    return ConcurrentUseError(
        f"rank {state.rank}: {label} cannot start on {state.name}: {who} is in flight on it. commfuse "
        f"ops on one process group must not overlap: call them from one thread, or give each thread its "
        f"own group (torch.distributed.new_group)"
    )


def _profiler_on() -> bool:
    return torch.autograd.profiler._is_profiler_enabled


def _run(plan: Plan, program: Program, seq: int) -> None:
    """The steps, with nothing observed: the lean loop every plain call takes."""
    backend, timeout, overlap, state = plan.backend, plan.timeout, plan.overlap, plan.state
    post = skipping_empty(backend.post) if program.sparse else backend.post
    payload, buffer, land, compute = program.payload, program.buffer, program.land, program.compute
    i = -1
    for st in plan.steps:
        i += 1
        if st.p2p:
            recvs = [(t, buffer(s)) for t, s in st.recvs]
            try:
                handle = post([(t, payload(s)) for t, s in st.sends], recvs)
            except Exception as e:
                raise _posting_error(plan, st, None, e) from e
            if st.collectives:
                pending = [(handle, None, st.recvs)]
                _post_collectives(plan, st, program, backend.collective, pending)
            elif overlap:
                if st.compute:
                    try:
                        compute(st.compute)
                    except Exception as e:
                        raise _compute_failed(plan, seq, i, e, _finisher(plan, program, seq, st), st,
                                              ((handle, None, st.recvs),), land)
                try:
                    got = handle.wait(timeout)
                except BaseException as e:
                    raise _waiting_error(plan, st, None, e) from e
                for (t, s), tensor in zip(st.recvs, got):
                    land(s, tensor)
                if state.told is not None:
                    raise _told(plan, seq, i, _finisher(plan, program, seq, None))
                pending = None
            else:
                pending = [(handle, None, st.recvs)]
        elif st.collectives:
            pending = []
            _post_collectives(plan, st, program, backend.collective, pending)
        else:
            pending = None
            if st.compute:
                try:
                    compute(st.compute)
                except Exception as e:
                    raise _compute_failed(plan, seq, i, e, _finisher(plan, program, seq, st))
        if pending is not None:
            if overlap and st.compute:
                try:
                    compute(st.compute)
                except Exception as e:
                    raise _compute_failed(plan, seq, i, e, _finisher(plan, program, seq, st), st, pending, land)
            _wait_all(plan, st, pending, land, timeout)
            if state.told is not None:
                raise _told(plan, seq, i, _finisher(plan, program, seq, None if overlap else st))
            if not overlap and st.compute:
                try:
                    compute(st.compute)
                except Exception as e:
                    raise _compute_failed(plan, seq, i, e, _finisher(plan, program, seq, st))
        for s in st.accumulate:
            program.add(s)
        for s in st.release:
            program.release(s)


def _post_step(plan: Plan, st: CStep, program: Program, post, run_collective, run_into=None) -> list:
    """Post one step's point-to-point transfers and whole collectives; their pending handles, as
    :func:`_wait_all` takes them."""
    pending = []
    if st.p2p:
        recvs = [(t, program.buffer(s)) for t, s in st.recvs]
        try:
            pending.append((post([(t, program.payload(s)) for t, s in st.sends], recvs), None, st.recvs))
        except Exception as e:
            raise _posting_error(plan, st, None, e) from e
    if st.collectives:
        _post_collectives(plan, st, program, run_collective, pending, run_into)
    return pending


def _post_collectives(plan: Plan, st: CStep, program: Program, run_collective, pending: list,
                      run_into=None) -> None:
    """Post the step's whole collectives; a program that gives single tensors (not lists) runs them with
    the backend's ``collective_into``."""
    for call in st.collectives:
        inputs, outputs, finish = program.collective_io(call)
        try:
            if isinstance(outputs, torch.Tensor):
                into = run_into or plan.backend.collective_into
                pending.append((into(call.collective, inputs, outputs), finish, call))
            else:
                pending.append((run_collective(call.collective, inputs, outputs), finish, call))
        except Exception as e:
            _drain(pending, plan.timeout)
            raise _posting_error(plan, st, call, e) from e


def _wait_all(plan: Plan, st: CStep, pending, land, timeout: float) -> None:
    for i, (handle, finish, what) in enumerate(pending):
        try:
            got = handle.wait(timeout)
        except BaseException as e:
            _drain(pending[i + 1:], timeout)
            raise _waiting_error(plan, st, what if finish is not None else None, e) from e
        if finish is None:
            for (t, s), tensor in zip(what, got):
                land(s, tensor)
        else:
            finish(got)


def _drain(pending, timeout: float) -> None:
    """Wait (bounded, errors ignored) for transfers already posted, so that the transport can reuse its
    connections: gloo gives up on a pair whose posted transfer is never waited on."""
    for handle, _, _ in pending or ():
        try:
            handle.wait(timeout)
        except BaseException:  # noqa: BLE001 - the original error is what the caller sees
            pass


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
                    return _failed_waiting(plan, st, call, detail)
                return str(_waiting_error(plan, st, call, TimeoutError(detail)))
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
                    what = f"step {st.index} of {plan.label} ({plan.schedule.describe()}), {_what(st.step, call)}"
    else:
        what = f"hop {post_no} of the call check of {checking.label}"
    number = state.current()  # the call in progress (one op per group at a time); ``seq`` is its tag base
    signature = list(which.signature or ())
    position = {"seq": number, "lane": state.lane[1], "thread": state.lane[0], "digest": which.digest,
                "label": which.label, "check": plan is None, "waits": sorted(set(peers)), "what": what,
                "fp": [_MAGIC, number % SEQUENCE_WRAP, *signature] if signature else []}
    return position, what


def _posting_error(plan: Plan, st: CStep, call, e: Exception) -> CommunicationError:
    if isinstance(e, CommunicationError):  # the backend named it already (what the group's board said)
        return e
    return CommunicationError(
        f"rank {plan.rank} failed posting step {st.index} of {plan.label} ({plan.schedule.describe()}), "
        f"{_what(st.step, call)}: {type(e).__name__}: {e}"
    )


def _waiting_error(plan: Plan, st: CStep, call, e: BaseException) -> BaseException:
    if isinstance(e, CommfuseError):  # named already (a verdict of the group's board, a refusal)
        return e
    if isinstance(e, TimeoutError):
        hint = ""
        if plan.check != "always":
            hint = (" (if the ranks may have called different ops or shapes, COMMFUSE_CHECK=always compares "
                    "them on every call and names the difference)")
        return CommfuseTimeoutError(
            f"rank {plan.rank} timed out after {plan.timeout:g} s in step {st.index} of {plan.label} "
            f"({plan.schedule.describe()}) waiting for {_what(st.step, call)}{hint}: {e}"
        )
    if isinstance(e, CommunicationError):
        return e
    if not isinstance(e, Exception):
        return e
    return CommunicationError(_failed_waiting(plan, st, call, f"{type(e).__name__}: {e}"))


def _failed_waiting(plan: Plan, st: CStep, call, detail: str) -> str:
    return (f"rank {plan.rank} failed in step {st.index} of {plan.label} ({plan.schedule.describe()}) while "
            f"waiting for {_what(st.step, call)}: {detail}")


def _run_observed(plan: Plan, program: Program, mode: str | None, events: list | None, seq: int) -> None:
    """:func:`_run`'s loop with measurement modes, profiler annotations, per-step timings and the trace log."""
    backend, state = plan.backend, plan.state
    post = backend.post if mode != "compute_only" else _done_post
    if program.sparse:
        post = skipping_empty(post)
    run_collective = backend.collective if mode != "compute_only" else _done_collective
    compute = program.compute if mode != "comm_only" else program.skip
    prof = _profiler_on()
    name, rank, timeout, overlap = plan.name, plan.rank, plan.timeout, plan.overlap
    sched = plan.schedule  # the algorithm as a user writes it: ring:2, sliced:4, serial
    shown = AlgorithmSpec(sched.algorithm.value if overlap else "serial", sched.parts, sched.chunks).shown
    tags = {"label": plan.label, "algorithm": shown}
    trace = plan.trace
    clock = time.perf_counter
    i = -1
    for st in plan.compiled.steps:
        i += 1
        with (record_function(f"{name}.step{st.index}") if prof else _NULL):
            t0 = clock()
            pending = _post_step(plan, st, program, post, run_collective,
                                 _done_into if mode == "compute_only" else None)
            t1 = clock()
            if not overlap:
                _wait_all(plan, st, pending, program.land, timeout)
                pending = []
                if state.told is not None:
                    raise _told(plan, seq, i, _finisher(plan, program, seq, st))
            t2 = clock()
            if st.compute:
                try:
                    with (record_function(f"{name}.step{st.index}.compute") if prof else _NULL):
                        compute(st.compute)
                except Exception as e:
                    raise _compute_failed(plan, seq, i, e, _finisher(plan, program, seq, st), st, pending,
                                          program.land)
            t3 = clock()
            _wait_all(plan, st, pending, program.land, timeout)
            if state.told is not None:
                raise _told(plan, seq, i, _finisher(plan, program, seq, None))
            for s in st.accumulate:
                program.add(s)
            for s in st.release:
                program.release(s)
            t4 = clock()
        # overlapped: post, compute, wait (t1..t2 is empty); serial: post, wait (t1..t2), compute
        wait = (t3, t4) if overlap else (t1, t2)
        if events is not None:
            step = st.step
            events.append(
                {
                    "step": st.index,
                    "post": (t0, t1),
                    "compute": (t2, t3),
                    "wait": wait,
                    "sends": [(t.peer, t.channel) for t in step.sends],
                    "recvs": [(t.peer, t.channel) for t in step.recvs],
                    "collectives": [f"{c.collective.value}[{c.part}]" for c in step.collectives],
                    **tags,
                }
            )
        if trace:
            print(
                f"[commfuse rank {rank}] {name} step {st.index}: post {1e3 * (t1 - t0):.3f} ms, "
                f"compute {1e3 * (t3 - t2):.3f} ms, wait {1e3 * (wait[1] - wait[0]):.3f} ms ({_what(st.step, None)})",
                file=sys.stderr,
                flush=True,
            )


def _what(step: Step, call) -> str:
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


# -- the fingerprint check ---------------------------------------------------------------------------------------


def _check_fingerprint(plan: Plan, program: Program, seq: int) -> None:
    """All-gather every rank's fingerprint around the ring, then compare them all, on every rank.

    Messages are fixed-size (:data:`FINGERPRINT_LEN` int64) on their own tag, so
    ranks that disagree still exchange them safely: a wrong-sized data message
    must never reach a transport (gloo aborts the receiving process when a
    message is larger than its buffer). Every rank ends with every rank's
    fingerprint, so every rank names a mismatch, not only the two beside it.
    A rank that is not in the op at all leaves its neighbours' ring stalled:
    they time out naming the rank they waited for.
    """
    backend = plan.backend
    state = plan.state
    rank, ring, n, timeout = plan.rank, plan.schedule.ring, plan.schedule.world_size, plan.timeout
    # the fingerprint, then the thread's lane (compared too)
    mine_values = _fit(plan.fingerprint(program, seq), FINGERPRINT_LEN - 1) + [state.lane[1]]
    rows: list[torch.Tensor | None] = [None] * n
    rows[rank] = torch.tensor(mine_values, dtype=torch.int64, device=backend.device)
    nxt, prv = ring.next(rank), ring.prev(rank)
    for k in range(n - 1):
        send_row, recv_row = ring.prev(rank, k), ring.prev(rank, k + 1)  # what came k and k + 1 hops
        buf = backend.empty((FINGERPRINT_LEN,), torch.int64)
        try:
            handle = backend.post([(Transfer(SliceId(send_row), nxt, 1, FINGERPRINT_CHANNEL), rows[send_row])],
                                  [(Transfer(SliceId(recv_row), prv, 1, FINGERPRINT_CHANNEL), buf)])
            (got,) = handle.wait(timeout)
        except TimeoutError as e:
            if isinstance(e, CommfuseError):
                raise
            raise CommfuseTimeoutError(
                f"rank {rank} timed out after {timeout:g} s in the call check of {plan.label} "
                f"({plan.schedule.describe()}, call #{seq} on {plan.state.name}), waiting for rank {prv} to pass on "
                f"rank {recv_row}'s fingerprint (hop {k + 1} of {n - 1}): a rank did not enter the same op (ranks "
                "that had checked their call's signature before do not check it again: COMMFUSE_CHECK=always "
                "makes every call compare)"
            ) from e
        except CommfuseError:
            raise
        except Exception as e:
            raise CommunicationError(
                f"rank {rank} failed in the call check of {plan.label} ({plan.schedule.describe()}) exchanging "
                f"fingerprints with ranks {prv} and {nxt}: {type(e).__name__}: {e}"
            ) from e
        rows[recv_row] = got
    table = [row.tolist() for row in torch.stack(rows).cpu()]
    if all(row == mine_values for row in table):
        return
    groups: dict[tuple, list[int]] = {}
    for r, row in enumerate(table):
        groups.setdefault(tuple(row), []).append(r)
    mine_key = tuple(mine_values)
    lines = []
    for row, ranks in sorted(groups.items(), key=lambda item: item[1]):
        who = "rank" if len(ranks) == 1 else "ranks"
        tag = " (this rank)" if row == mine_key else ""
        lines.append(f"  {who} {', '.join(map(str, ranks))}{tag}: {describe_fingerprint(_strip(list(row[:-1])))}"
                     + ("" if row[-1] == mine_values[-1] else f", from another thread (lane {row[-1]})"))
    seqs = {row[1] for row in table if len(row) > 1 and row[0] == _MAGIC}
    hint = ""
    if len(seqs) > 1:
        hint = (" The ranks are at different calls on this group: one of them skipped or added a call (a call "
                "that failed before communicating still counts as one on its rank).")
    if len({row[-1] for row in table}) > 1:
        hint += (f" The ranks call from different threads (this rank from {state.lane[0]!r}): commfuse ops on one "
                 "group must come from one thread in the same order on every rank, or each thread needs its own "
                 "group.")
    error = MismatchError(
        f"rank {rank}: the ranks of {plan.state.name} called different ops (checked before the first transfer of "
        f"{plan.label}, nothing was sent):\n" + "\n".join(lines) + hint
    )
    if len(seqs) > 1:
        # the ranks' call numbers differ, and stay apart for every later call: the group is dead, and the
        # board may say which rank left a call (a producer or a policy that raised before its transfers)
        board = board_of(state)
        said = [note for note in board.news() if note.get("kind") == "fail"] if board is not None else []
        if said:
            error = MismatchError(str(error) + " What the group's board says: " + "; ".join(
                f"rank {n['rank']} left call #{n['seq']} ({n.get('label')}) before completing it: {n.get('exc')}: "
                f"{n.get('message')}" for n in said[-3:]) + ".")
        error = MismatchError(f"{error} The ranks' calls stay apart from now on, so the group is dead: {RECOVER}")
        raise declare_dead(state, error, getattr(backend, "poison", None))
    raise error


# torch.compile's eager fallback runs these as plain Python (see commfuse.runtime.eager)
from commfuse.runtime.eager import eager_only  # noqa: E402

eager_only(execute, execute_into, execute_one_by_one)
