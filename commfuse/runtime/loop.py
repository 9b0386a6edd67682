"""The loop: walks one rank's compiled steps of a call on a backend.

Per step, in the order of the contract in ``commfuse.schedule._ir``: post the
step's transfers and collectives, run the caller's compute on the slices the
step names while they fly, wait (bounded by the timeout), hand what arrived
to the program, add where the schedule says, and drop slices whose last use
has passed. Observation (:mod:`commfuse.runtime.observe`: measurement modes,
per-step events, profiler ranges, ``COMMFUSE_TRACE``) is a switch read once
per call inside the same loop.

Every call takes its group first (:func:`take_group`: one op per group at a
time, the next call number of the calling thread's :func:`lane`), whether
the loop walks it or a producer holds a :class:`Ticket` before it does.

Entry points: :func:`execute` (any plan, with a :class:`Program`);
:func:`execute_into` (a whole-collective plan, straight into one tensor) and
:func:`execute_one_by_one` (a ring plan computing one slot per step, no
program, receive buffers from the pool directly: per step one ``post``, the
caller's compute and one ``wait``), both only once ``may_skip_program(plan)``.

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
  receive buffers kept apart from eager calls' (``programs.BufferPool``) and, on a
  stream-ordered backend, its steps kept from the watchdog. A call that would
  check its fingerprint (a signature's first call, the call after a failure,
  ``COMMFUSE_CHECK=always``) is refused instead, by name: the check compares
  values on the host.
"""

from __future__ import annotations

import sys
import threading
import time
import zlib
from time import perf_counter_ns as _clock_ns
from collections.abc import Callable

import torch
from torch.profiler import record_function

try:  # a build without torch.distributed has no groups: GroupState.group is then always None
    import torch.distributed.distributed_c10d as _c10d
except ImportError:  # pragma: no cover
    _c10d = None

from commfuse.errors import (
    CommfuseTimeoutError,
    CommfuseValueError,
    CommunicationError,
    ConcurrentUseError,
    GroupDeadError,
    PeerFailedError,
    first_line,
)
from commfuse.runtime.board import RECOVER, board_of, declare_dead
from commfuse.runtime.checkpointing import TOP_HOOKS as _top_hooks
from commfuse.runtime.checkpointing import lane_of, recomputing, stopped
from commfuse.runtime.drain import account, drain_call
from commfuse.runtime.compiled import (
    CompiledStep,
    Plan,
    Program,
    describe_traffic,
    posting_error,
    waiting_error,
)
from commfuse.runtime.groups import (
    SEQUENCE_WRAP,
    GroupState,
    check_fingerprint,
    group_state,
    left_call,
    resolve_timeout,
    state_of_group,
)
from commfuse.runtime.observe import NULL_SCOPE, events_of, mode_of, observers, profiler_on
from commfuse.runtime.recorder import failed as _recorded_failure
from commfuse.runtime.recorder import stamper
from commfuse.runtime import sites as _sites
from commfuse.schedule import AlgorithmSpec, Collective


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



# -- taking a group for a call ----------------------------------------------------------------------------------
# Every call takes its group here, and with it the next call number of its thread's lane (groups.GroupState
# holds the numbers); the ring's walk does it without leaving this module.


_graph_task = getattr(torch._C, "_current_graph_task_id", None)
_AUTOGRAD_LANE = ("autograd", zlib.crc32(b"autograd") & 0xFFFF)


#: each thread's lane, made on its first call (a thread-local: one attribute read per call)
_LANES = threading.local()


def lane() -> tuple[str, int]:
    """The thread a call comes from, as every rank can name it: ``(name, code)``. The code goes into every
    tag and fingerprint, so a call from one thread never pairs with a peer's call from another (two threads
    that share a group and reach it in different orders on different ranks). Autograd's backward (on
    whatever thread the engine runs it) is the lane ``autograd``; a thread Python did not start (a C++
    thread) is ``native``; any other thread goes by its name (``MainThread``, ``Thread-2 (worker)``), as it
    was at the thread's first call: threads that call commfuse must be started in the same order on every
    rank, or be named."""
    if _graph_task is not None and _graph_task() != -1:
        return _AUTOGRAD_LANE
    try:
        return _LANES.lane
    except AttributeError:
        t = threading.current_thread()
        name = "native" if isinstance(t, threading._DummyThread) else t.name
        found = _LANES.lane = (name, zlib.crc32(name.encode()) & 0xFFFF)
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
        self.seq = take_group(self.state, self.label)
        return self

    def __exit__(self, kind, error, tb) -> bool:
        state = self.state
        try:
            if error is not None and not self.used and not stopped(error):
                left_call(state, self.seq, self.label, None, error)
        finally:
            give_group(state)
        return False


_get_ident = threading.get_ident


#: whether torch.distributed's map of live groups (``_world.pg_map``, a property) is its module's ``_pg_map``:
#: then a call reads that module attribute instead of calling the property (read on every call, never kept, so a
#: map torch makes anew is seen)
_PG_MAP_GLOBAL = _c10d is not None and getattr(_c10d, "_pg_map", None) is _c10d._world.pg_map


def _number(state: GroupState, code: int) -> int:
    """The next call number of lane ``code`` on ``state``'s group, taken."""
    seq = state.seqs.get(code, 0)
    state.seqs[code] = seq + 1
    return seq


def take_group(state: GroupState, label: str) -> int:
    """Take the group for one call of ``label`` and return the call's number in its thread's lane: refused,
    by name, while another op is in flight on it; a group declared dead raises its error, and so does one
    torch.distributed destroyed. :func:`give_group` gives it back."""
    if not state.lock.acquire(False):
        raise _refused(label, state)
    group = state.group
    if state.error is not None or (group is not None and group not in (
            _c10d._pg_map if _PG_MAP_GLOBAL else _c10d._world.pg_map)):
        state.lock.release()
        raise _dead_again(label, state) if state.error is not None else _destroyed(label, state)
    state.busy = (label, _get_ident())
    state.told = None
    state.lane = which = lane()
    seq = state.now = _number(state, which[1])
    found = _top_hooks(False)
    if found is not None:  # activation checkpointing: a recomputed call goes in its region's lane
        state.lane = lane_of(state, which, seq, found)
    return seq


def give_group(state: GroupState) -> None:
    """Give back the group :func:`take_group` took."""
    state.busy = None
    state.lock.release()


def enter_call(backend, label: str) -> Ticket:
    """A :class:`Ticket` for one call of ``label`` on ``backend``'s group."""
    return Ticket(group_state(backend), label)


def announce_left(state: GroupState, label: str, error: BaseException) -> None:
    """A call failed on this rank before it reached the loop (its validation, its policy): it still takes
    its call number on the group, its failure goes on the board for the peers waiting on it, and the group's
    next call is checked, so it cannot pair with the peers' copy of this call. No lock: the op may have
    failed inside another op's consumer on this group, on this thread."""
    which = lane()
    left_call(state, _number(state, which[1]), label, None, error, which)


def autograd_lane() -> tuple[str, int]:
    """The lane of the calls autograd's backward makes (see :func:`lane`), for code that counts or leaves
    them from outside the backward."""
    return _AUTOGRAD_LANE


def leave_calls(state: GroupState, label: str, error: BaseException, count: int, which=None) -> bool:
    """This rank leaves its next ``count`` calls on the group after ``error``: each is announced as
    :func:`announce_left` does. When ``error`` is this rank's own (raised between two calls, in code of the
    caller's), the first of them, the one the peers wait in, is served (``commfuse.runtime.drain``): this rank
    gives every message they posted in it its other end, and returns once it is drained, the group usable.
    The peers fail in that call, naming this rank, and leave the rest as this rank does. Where that cannot be
    done (a peer waits in a whole collective, or never came) the group is declared dead and ``error`` gets
    a note saying so; the caller raises it. A group other than gloo's, whose waits alone stall on the host
    and read the board, is only told, as before: its peers declare it dead. An ``error`` that is a commfuse verdict (this rank was told in a call of its own)
    is only announced: every rank leaves those calls alike, and none waits in them. ``which``: the lane of
    the calls (default: this thread's). Returns whether the call was drained."""
    if count < 1 or state.world_size <= 1:
        return False
    which = which or lane()
    first = state.seqs.get(which[1], 0)
    serves = not isinstance(error, CommunicationError) and _servable(state)
    for i in range(count):
        left_call(state, _number(state, which[1]), label, None, error, which, serves=serves and i == 0)
    if serves:
        try:
            drain_call(state, state.group, which[1], first, account({}, []), resolve_timeout(None),
                       f"serving call #{first}, which it left after {type(error).__name__} ({label})")
        except CommunicationError as dead:  # declared dead (said why); the caller raises its own error
            _add_note(error, f"commfuse: rank {state.rank} could not serve call #{first}, which it left after "
                             f"this error: {first_line(dead)}")
            return False
        return True
    return False


def _servable(state: GroupState) -> bool:
    """Whether a call this rank leaves on the group can be drained: a gloo group with a board."""
    group = state.group
    if group is None or board_of(state) is None:
        return False
    try:
        return str(_c10d.get_backend(group)) == "gloo"
    except Exception:  # noqa: BLE001 - not a registered group
        return False


class op_calls:
    """A composite op's calls on one group, counted: ``with op_calls(backend, "MoE.forward", 3): ...`` (the op
    makes three calls). When an exception escapes the op before it made all of them (its router raised on
    this rank, or a call failed and the op gives up on the rest), the calls it did not make are announced on
    the board as this rank leaving them, one call number each, as :func:`announce_left` does for one: the
    peers that wait in them hear of it and say why, instead of waiting out the timeout, and this rank's
    call numbers stay those of the peers that completed the op. ``backend`` None (a single process): nothing."""

    __slots__ = ("state", "label", "planned", "start", "code", "which", "left")

    def __init__(self, backend, label: str, planned: int) -> None:
        self.state = None if backend is None else group_state(backend)
        self.label, self.planned, self.which = label, planned, None

    def __enter__(self) -> "op_calls":
        if self.state is not None:
            if self.which is None:
                self.which = lane()
            self.code = self.which[1]
            self.start = self.state.seqs.get(self.code, 0)
        return self

    def __exit__(self, kind, error, tb) -> bool:
        state = self.state
        if state is None:
            return False
        made = state.seqs.get(self.code, 0) - self.start
        if error is not None and stopped(error):  # a recompute ended early: every rank makes no more calls
            return False
        planned = self._planned(made, error)
        if error is not None and state.rank is not None and state.world_size > 1 and planned > made:
            self.left = planned - made  # read by a caller that announces more (commfuse.strands); unset otherwise
            leave_calls(state, self.label, error, planned - made, self.which)
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

    def __init__(self, group, label: str, key, which: tuple[str, int] | None = None) -> None:
        self.state = state_of_group(group) if group is not None else None
        self.label, self.key, self.planned, self.which = label, key, 0, which

    def _planned(self, made: int, error) -> int:
        learned = self._LEARNED
        if error is None:
            if recomputing():  # a selective policy's saved ops are not run again: not the forward's count
                return made
            if len(learned) > 4096:
                learned.clear()
            learned[self.key] = made
            return made
        return learned.get(self.key, 0)


def refuse_dead(state: GroupState, label: str) -> None:
    """Raise, naming ``label``, what a call on a group commfuse declared dead raises (nothing if it is not)."""
    if state.error is not None:
        raise _dead_again(label, state)


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
    rec, call = plan.recorder, None
    try:
        mode = None
        if observers[0]:
            mode = mode_of()
            if events is None:
                events = events_of()
        begin = plan.begin
        if plan.digest is None:
            plan.learn_signature(program)
        if rec is not None:  # the flight recorder's entry for this call (runtime.recorder)
            if plan.stamps:
                call = rec.begin((plan, seq, state.lane, _sites.active))
            else:
                call = (plan, seq, state.lane, _sites.active, _clock_ns())
                rec.append(call)
        code = state.lane[1]
        if plan.checks and mode is None and (not plan.checked or state.dirty or plan.check == "always"):
            signature = plan.signature
            if state.dirty or plan.check == "always" or signature not in state.checked:
                if plan.capturing:
                    raise _capture_refusal(plan, state)
                if begin is not None:
                    begin(None, plan)
                check_fingerprint(plan, program, seq)
                state.checked.add(signature)
                state.dirty = False
            plan.checked = True
        if begin is not None:
            begin((seq + plan.digest + code) % SEQUENCE_WRAP, plan)
        if not plan.settled:
            plan.settled = not plan.trace and (not plan.checks or (plan.checked and plan.check != "always"))
        posted = True
        _walk(plan, program, seq, mode is not None or events is not None or plan.trace or profiler_on(), mode,
              events, call)
        if call is not None and plan.stamps:
            call.end = _clock_ns()
    except BaseException as e:
        _after_failure(plan, state, seq, e, posted)
        if rec is not None:
            _recorded_failure(call, state, e)
        raise
    finally:
        if ticket is None:
            _leave(plan, state)
        else:
            plan.capturing = False
            plan.used = True


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
    if getattr(error, "_commfuse_drained", False):  # a peer left the call and served it: drained, usable
        state.dirty = True
        return
    if not posted or plan.schedule.world_size <= 1 or plan.traced:
        state.dirty = True
        return
    if isinstance(error, Exception) and board_of(state) is None:
        state.dirty = True
        return
    left_call(state, seq, plan.label, None, error)
    declare_dead(state, GroupDeadError(
        f"rank {plan.rank}: {plan.label} (call #{seq}, {plan.schedule.describe()}) was left unfinished on this "
        f"rank by {type(error).__name__}: {first_line(error)}; the group is dead: {RECOVER}"),
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


def _compute_failed(plan: Plan, seq: int, index: int, error: BaseException, finish, st: CompiledStep | None = None,
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
                             f"this failure: {type(e).__name__}: {first_line(e)}")
            return error
    board = board_of(state) if plan.schedule.world_size > 1 and not plan.traced else None
    if board is None or not isinstance(error, Exception) or getattr(plan.backend, "_stream_ordered", False):
        # a stream-ordered backend's peers never stall on the host, so they could not learn before what this
        # rank would send reached their device: it ends the group instead (_after_failure)
        return error
    name, code = state.lane
    board.log("fail", seq=seq, lane=code, thread=name, label=plan.label, step=index, exc=type(error).__name__,
              message=first_line(error), continuing=True)
    board.ack(code, seq)
    try:
        finish(index + 1)
    except BaseException as e:  # noqa: BLE001 - the group is dead (declared by whoever found out)
        _add_note(error, f"commfuse: rank {plan.rank} could not complete call #{seq} after this failure: "
                         f"{type(e).__name__}: {first_line(e)}")
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


def _step_peers(plan: Plan, st: CompiledStep) -> list[int]:
    if st.collectives:
        return [q for q in range(plan.schedule.world_size) if q != plan.rank]
    return sorted({t.peer for t, _ in st.sends})


def _ghost_compute(program: Program, slots) -> None:
    """Stand in for ``program.compute(slots)`` once the call failed: a program whose compute makes what later
    steps send (a reduce-scatter's partials, a produced block) gets tensors of the right shape (its
    ``skip``); a consuming program needs nothing (what it sends is what it received)."""
    if slots and program.collective in (Collective.REDUCE_SCATTER, Collective.PRODUCE_ALL_TO_ALL):
        program.skip(slots)


def _finisher(plan: Plan, program: Program, seq: int, failed_step: CompiledStep | None):
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
    ``may_skip_program(plan)``: the first call of a signature, a check, or an observed call take
    :func:`execute`."""
    state = plan.state
    seq = _enter(plan, state)
    rec, record, entry = plan.recorder, None, None
    try:
        if rec is not None:  # the flight recorder's entry (runtime.recorder): a record where the host stamps
            if plan.stamps:
                record = rec.begin((plan, seq, state.lane, _sites.active))
            else:
                entry = (plan, seq, state.lane, _sites.active, _clock_ns())
                rec.append(entry)
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
        _into(plan, st, call, input, output, record)
        if state.told is not None:
            raise _told(plan, seq, 0, lambda start: None)
        if record is not None:
            record.end = _clock_ns()
    except BaseException as e:
        _after_failure(plan, state, seq, e, True)
        if rec is not None:
            _recorded_failure(record or entry, state, e)
        raise
    finally:
        _leave(plan, state)


def _into(plan: Plan, st: CompiledStep, call, input: torch.Tensor, output: torch.Tensor, record=None) -> None:
    try:
        handle = plan.backend.collective_into(call.collective, input, output)
    except Exception as e:
        raise posting_error(plan, st, call, e) from e
    if FILLERS:
        run_filler(handle)
    if record is not None:
        stamp = stamper(record, plan)
        stamp(st.index)
        stamp(_clock_ns())
    try:
        handle.wait(plan.timeout)
    except BaseException as e:
        raise waiting_error(plan, st, call, e) from e
    if record is not None:
        stamp(_clock_ns())


def may_skip_program(plan: Plan) -> bool:
    """Whether the next call of ``plan`` may be walked without a program (:func:`execute_into`,
    :func:`execute_one_by_one`): the plan is ``settled`` (its signature known, and agreed or never checked,
    with no check on every call and no trace), its group clean, and nothing observes the call (a measurement
    mode, the profiler)."""
    # the profiler's flag read here, not through observe.profiler_on: a repeated ring call leaves this module
    # only for the backend
    if not plan.settled or observers[0] or torch.autograd.profiler._is_profiler_enabled:
        return False
    return not (plan.checks and plan.state.dirty)


def held_slots(layout, shard: torch.Tensor) -> list:
    """A gather's tensors by slot at the start of a call: this rank's shard (cut into its slices), nothing
    else yet."""
    held: list = [None] * len(layout.size)
    own = layout.own
    if len(own) == 1:
        held[own[0]] = shard if shard.is_contiguous() else shard.contiguous()
    else:
        for s, p in zip(own, torch.tensor_split(shard, layout.cuts, dim=layout.dim)):
            held[s] = p.contiguous()
    return held


def ring_walk(plan: Plan, start: list, size: list, key: list, own: frozenset) -> tuple:
    """``plan``'s steps as :func:`execute_one_by_one` walks them, with what each step reads resolved once,
    per step ``(st, pair, sends, recvs, compute, accumulate, release)``:

    - ``pair``: a step of exactly one send and one receive (every ring step) as ``(send's Transfer, its
      slot, receive's Transfer, the receive buffer's pool key)``, posted with no comprehension; else None;
    - ``sends``: ``(Transfer, slot)`` pairs of any other step with point-to-point transfers, else None;
    - ``recvs``: ``(Transfer, slot, key)``, ``key`` the receive buffer's pool key (for a ``pair`` too);
    - ``compute``: ``(slot, start, size, key)`` of each slice the step computes, in order (one in a ring
      step; two where ``ring:m`` computes a slice beside the one that arrived, or the two halves of
      ``bidirectional``), or None;
    - ``accumulate``, ``release``: ``(slot, key)`` pairs (``release`` less this rank's ``own`` slots).

    Plans with ``one_by_one`` only."""
    walk = []
    for st in plan.steps:
        compute = tuple((s, start[s], size[s], key[s]) for s in st.compute) or None
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


class _NoFree(dict):
    """The free lists a captured call sees: always empty, and what it gives back is dropped (see
    ``programs.BufferPool``: a captured call's buffers come from, and go back to, the graph's memory pool)."""

    def __missing__(self, key):
        return []


_NO_FREE = _NoFree()


def execute_one_by_one(plan: Plan, walk: tuple, held: list, on_slice: Callable, pool,
                       inbox: list | None = None) -> None:
    """One call of a point-to-point plan whose steps each compute at most one slot (``plan.one_by_one``:
    ring, ring:m), walked with no program; ``walk`` is the plan's :func:`ring_walk`. A ring step costs one
    ``post``, the caller's ``on_slice`` and one ``wait``: receive buffers come from ``pool``'s free lists
    (a ``programs.BufferPool``) without a call.

    Slices are sent from ``held`` (by slot); a step posts, computes ``on_slice(start, size, held[slot])``,
    then waits. What ``on_slice`` returns, when not None, becomes the slot's tensor (a reduce-scatter's
    partial). A received slice lands in ``held`` for a gather (``inbox`` None); for a reduce-scatter it
    lands in ``inbox`` and is added, in place, into the slot's partial where the step accumulates, its
    buffer going back to the pool. A slot the step releases goes back to the pool (this rank's own slots are
    not in the walk's releases: a reduce-scatter's result stays in ``held``).

    :func:`execute`'s rules hold (one op per group at a time, the call number in the tags, a failure on one
    rank told to every rank, transfers already posted drained when the compute fails). Only when
    ``may_skip_program(plan)``."""
    state = plan.state
    seq = _enter(plan, state)
    rec, call, stamp, entry = plan.recorder, None, None, None
    try:
        if rec is not None:  # the flight recorder's entry (runtime.recorder): a record where the host stamps
            if plan.stamps:
                call = rec.begin((plan, seq, state.lane, _sites.active))
                stamp = stamper(call, plan)
            else:
                entry = (plan, seq, state.lane, _sites.active, _clock_ns())
                rec.append(entry)
        begin = plan.begin
        if begin is not None:
            begin((seq + plan.digest + state.lane[1]) % SEQUENCE_WRAP, plan)
        post, empty, most = plan.backend.post, pool.backend.empty, pool.MAX_FREE
        free = _NO_FREE if plan.capturing else pool.free
        landing = held if inbox is None else inbox
        i = -1
        for st, pair, sends, recvs, compute, accumulate, release in walk:
            i += 1
            handle = None
            if pair is not None:
                t, s, r, k = pair
                stack = free[k]
                try:
                    handle = post(((t, held[s]),), ((r, stack.pop() if stack else empty(*k)),))
                except Exception as e:
                    raise posting_error(plan, st, None, e) from e
            elif sends is not None:
                try:
                    handle = post([(t, held[s]) for t, s in sends],
                                  [(t, free[k].pop() if free[k] else empty(*k)) for t, _, k in recvs])
                except Exception as e:
                    raise posting_error(plan, st, None, e) from e
            if compute is not None:
                for s, at, length, _ in compute:
                    try:
                        made = on_slice(at, length, held[s])
                    except Exception as e:
                        pending = None if handle is None else ((handle, None, [(t, q) for t, q, _ in recvs]),)
                        raise _compute_failed(plan, seq, i, e,
                                              _ring_finisher(plan, seq, walk, held, pool, inbox, i), st, pending,
                                              landing.__setitem__)
                    if made is not None:
                        held[s] = made
            if handle is not None:
                if FILLERS:
                    run_filler(handle)
                if stamp is not None:
                    stamp(i)
                    stamp(_clock_ns())
                try:
                    got = handle.wait(plan.timeout)
                except BaseException as e:
                    raise waiting_error(plan, st, None, e) from e
                if stamp is not None:
                    stamp(_clock_ns())
                for (_, s, _), tensor in zip(recvs, got):
                    landing[s] = tensor
                if state.told is not None:
                    raise _told(plan, seq, i, _ring_finisher(plan, seq, walk, held, pool, inbox, None))
            for s, k in accumulate:
                received = inbox[s]
                inbox[s] = None
                held[s].add_(received)
                stack = free[k]
                if len(stack) < most:
                    stack.append(received)
            for s, k in release:
                t = held[s]
                held[s] = None
                if t is not None:
                    stack = free[k]
                    if len(stack) < most:
                        stack.append(t)
        if call is not None:
            call.end = _clock_ns()
    except BaseException as e:
        _after_failure(plan, state, seq, e, True)
        if rec is not None:
            _recorded_failure(call or entry, state, e)
        raise
    finally:
        _leave(plan, state)


def _land_ring(plan: Plan, st: CompiledStep, handle, recvs, landing: list) -> None:
    """Wait for a ring step's transfers and put what arrived in ``landing``, by slot."""
    if FILLERS:
        run_filler(handle)
    try:
        got = handle.wait(plan.timeout)
    except BaseException as e:
        raise waiting_error(plan, st, None, e) from e
    for (_, s, _), tensor in zip(recvs, got):
        landing[s] = tensor


def _ring_finisher(plan: Plan, seq: int, walk: tuple, held: list, pool, inbox: list | None, failed: int | None):
    """:func:`_finisher` for :func:`execute_one_by_one`'s walk: a reduce-scatter's partials that were not made
    are buffers of their shape (``failed``: the step whose compute raised)."""

    def finish(start: int) -> None:
        post, get = plan.backend.post, pool.get
        landing = held if inbox is None else inbox
        if failed is not None and inbox is not None:
            for s, _, _, k in walk[failed][4]:  # the partials the failed step did not make
                if held[s] is None:
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
                    raise posting_error(plan, st, None, e) from e
            if compute is not None and inbox is not None:
                for s, _, _, k in compute:
                    held[s] = get(k)
            if handle is not None:
                _land_ring(plan, st, handle, recvs, landing)
            for s, k in accumulate:
                received = inbox[s]
                inbox[s] = None
                held[s].add_(received)
            for s, k in release:
                held[s] = None

    return finish


def _enter(plan: Plan, state: GroupState) -> int:
    """Take the group for one call of ``plan`` (:func:`take_group`) and return the call's number; on a
    device with graph capture, the plan learns whether this call is captured. :func:`_leave` gives it back."""
    probe = plan.probe
    capturing = probe is not None and bool(probe())
    seq = take_group(state, plan.label)
    if capturing:
        plan.capturing = True
    return seq


def _leave(plan: Plan, state: GroupState) -> None:
    plan.capturing = False
    plan.used = True  # the planning table's second chance: this plan ran since the table last looked
    give_group(state)


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



def _walk(plan: Plan, program: Program, seq: int, observed: bool, mode: str | None, events: list | None,
          call=None) -> None:
    """Walk the steps of one call with ``program``'s data. ``observed``: something watches the call (a
    measurement ``mode``, an ``events`` list, ``COMMFUSE_TRACE``, the profiler): then each step is timed, and
    is a ``record_function`` range while the profiler runs; otherwise the same loop reads no clock. ``call``:
    the flight recorder's entry for the call (``runtime.recorder``): a record, which gets each wait's start
    and end, where the plan stamps, else a tuple; the plan's bytes per step are learned on its first one."""
    stamp = sizes = None
    if call is not None:
        if plan.stamps:
            stamp = stamper(call, plan)
        sizes = plan.sizes
        if sizes is None:
            sizes = plan.sizes = {}
        elif sizes:
            sizes = None  # learned
    backend, timeout, overlap, state = plan.backend, plan.timeout, plan.overlap, plan.state
    post, run_collective, run_into, compute = backend.post, backend.collective, None, program.compute
    if mode == "compute_only":
        post, run_collective, run_into = _done_post, _done_collective, _done_into
    elif mode == "comm_only":
        compute = program.skip
    elif mode == "outside_only":  # neither: what the caller does around commfuse's ops is all that runs
        post, run_collective, run_into, compute = _done_post, _done_collective, _done_into, program.skip
    if program.sparse:
        post = skipping_empty(post)
    land = program.land
    prof = observed and profiler_on()
    clock = time.perf_counter
    t0 = t1 = t2 = t3 = 0.0
    i = -1
    for st in plan.steps:
        i += 1
        scope = record_function(f"{plan.name}.step{st.index}") if prof else None
        if scope is not None:
            scope.__enter__()
        try:
            if observed:
                t0 = clock()
            pending = _post_step(plan, st, program, post, run_collective, run_into, sizes)
            if observed:
                t1 = clock()
            if not overlap and pending:
                if stamp is not None:
                    stamp(i)
                    stamp(_clock_ns())
                _wait_all(plan, st, pending, land, timeout)
                if stamp is not None:
                    stamp(_clock_ns())
                pending = ()
                if state.told is not None:
                    raise _told(plan, seq, i, _finisher(plan, program, seq, st))
            if observed:
                t2 = clock()
            if st.compute:
                try:
                    with (record_function(f"{plan.name}.step{st.index}.compute") if prof else NULL_SCOPE):
                        compute(st.compute)
                except Exception as e:
                    raise _compute_failed(plan, seq, i, e, _finisher(plan, program, seq, st), st, pending, land)
            if observed:
                t3 = clock()
            if pending:
                if stamp is not None:
                    stamp(i)
                    stamp(_clock_ns())
                _wait_all(plan, st, pending, land, timeout)
                if stamp is not None:
                    stamp(_clock_ns())
                if state.told is not None:
                    raise _told(plan, seq, i, _finisher(plan, program, seq, None))
            for s in st.accumulate:
                program.add(s)
            for s in st.release:
                program.release(s)
        finally:
            if scope is not None:
                scope.__exit__(None, None, None)
        if observed:
            _observe_step(plan, st, events, t0, t1, t2, t3, clock())


def _observe_step(plan: Plan, st: CompiledStep, events: list | None, t0: float, t1: float, t2: float,
                  t3: float, t4: float) -> None:
    """One observed step's timings into ``events`` and, with ``COMMFUSE_TRACE``, the step log."""
    # overlapped: post, compute, wait (t1..t2 is empty); serial: post, wait (t1..t2), compute
    wait = (t3, t4) if plan.overlap else (t1, t2)
    if events is not None:
        sched = plan.schedule  # the algorithm as a user writes it: ring:2, sliced:4, serial
        shown = AlgorithmSpec(sched.algorithm.value if plan.overlap else "serial", sched.parts, sched.chunks).shown
        step = st.step
        events.append({
            "step": st.index,
            "post": (t0, t1),
            "compute": (t2, t3),
            "wait": wait,
            "sends": [(t.peer, t.channel) for t in step.sends],
            "recvs": [(t.peer, t.channel) for t in step.recvs],
            "collectives": [f"{c.collective.value}[{c.part}]" for c in step.collectives],
            "label": plan.label,
            "algorithm": shown,
        })
    if plan.trace:
        print(
            f"[commfuse rank {plan.rank}] {plan.name} step {st.index}: post {1e3 * (t1 - t0):.3f} ms, "
            f"compute {1e3 * (t3 - t2):.3f} ms, wait {1e3 * (wait[1] - wait[0]):.3f} ms "
            f"({describe_traffic(st.step, None)})",
            file=sys.stderr,
            flush=True,
        )


def _post_step(plan: Plan, st: CompiledStep, program: Program, post, run_collective, run_into=None,
               sizes: dict | None = None) -> list:
    """Post one step's point-to-point transfers and whole collectives; their pending handles, as
    :func:`_wait_all` takes them. ``sizes``: the step's bytes sent and received go there, by step index."""
    pending = []
    if st.p2p:
        recvs = [(t, program.buffer(s)) for t, s in st.recvs]
        sends = [(t, program.payload(s)) for t, s in st.sends]
        if sizes is not None:
            _learn(sizes, st.index, [x for _, x in sends], [x for _, x in recvs])
        try:
            pending.append((post(sends, recvs), None, st.recvs))
        except Exception as e:
            raise posting_error(plan, st, None, e) from e
    if st.collectives:
        _post_collectives(plan, st, program, run_collective, pending, run_into, sizes)
    return pending


def _learn(sizes: dict, index: int, sent, received) -> None:
    """Add what a step sends and receives (tensors, or lists of them) to ``sizes[index]``, in bytes."""
    def nbytes(items) -> int:
        if isinstance(items, torch.Tensor):
            return items.numel() * items.element_size()
        return sum(nbytes(x) for x in items)

    before = sizes.get(index, (0, 0))
    sizes[index] = (before[0] + nbytes(sent), before[1] + nbytes(received))


def _post_collectives(plan: Plan, st: CompiledStep, program: Program, run_collective, pending: list,
                      run_into=None, sizes: dict | None = None) -> None:
    """Post the step's whole collectives; a program that gives single tensors (not lists) runs them with
    the backend's ``collective_into``."""
    for call in st.collectives:
        inputs, outputs, finish = program.collective_io(call)
        if sizes is not None:
            _learn(sizes, st.index, inputs, outputs)
        try:
            if isinstance(outputs, torch.Tensor):
                into = run_into or plan.backend.collective_into
                pending.append((into(call.collective, inputs, outputs), finish, call))
            else:
                pending.append((run_collective(call.collective, inputs, outputs), finish, call))
        except Exception as e:
            _drain(pending, plan.timeout)
            raise posting_error(plan, st, call, e) from e


def _wait_all(plan: Plan, st: CompiledStep, pending, land, timeout: float) -> None:
    if FILLERS and pending:
        run_filler(pending[0][0])
    for i, (handle, finish, what) in enumerate(pending):
        try:
            got = handle.wait(timeout)
        except BaseException as e:
            _drain(pending[i + 1:], timeout)
            raise waiting_error(plan, st, what if finish is not None else None, e) from e
        if finish is None:
            for (t, s), tensor in zip(what, got):
                land(s, tensor)
        else:
            finish(got)


#: Work another strand handed this thread (``commfuse.strands``): a stage, or a deferred weight gradient. An op
#: that has posted a step's transfers runs it before waiting for them, so that it computes while they travel.
#: Each entry is a callable that takes no argument and raises nothing (the strand keeps its own error). Empty:
#: one truth test per wait.
FILLERS: list = []


def run_filler(handle=None) -> None:
    """Before waiting on ``handle``: run the last entry of :data:`FILLERS`, then more while the step's transfers
    are still in flight (``handle.done()``, a poll; a handle without it takes one entry per wait)."""
    if FILLERS:
        FILLERS.pop()()
    done = getattr(handle, "done", None)
    if done is not None:
        while FILLERS and not done():
            FILLERS.pop()()


def _drain(pending, timeout: float) -> None:
    """Wait (bounded, errors ignored) for transfers already posted, so that the transport can reuse its
    connections: gloo gives up on a pair whose posted transfer is never waited on."""
    for handle, _, _ in pending or ():
        try:
            handle.wait(timeout)
        except BaseException:  # noqa: BLE001 - the original error is what the caller sees
            pass



# torch.compile's eager fallback runs these as plain Python (see commfuse.runtime.eager)
from commfuse.runtime.eager import eager_only  # noqa: E402

eager_only(execute, execute_into, execute_one_by_one)
