"""Admission: every call takes its group before anything of it runs.

A call takes its group first (:func:`take_group`: one op per group at a time,
the next call number of the calling thread's :func:`lane`), whether a walk
(``commfuse.runtime.walks``) takes it or a producer holds a :class:`Ticket`
before it does. A call that cannot start (another op in flight, a group
declared dead or destroyed) is refused here, by name. A call a rank leaves
without taking part, or a composite op's calls it never makes, are announced
on the board (:func:`announce_left`, :func:`leave_calls`, :class:`op_calls`,
:class:`counted_calls`), so the peers that wait in them say why instead of
timing out.
"""

from __future__ import annotations

import threading
import zlib

import torch

try:  # a build without torch.distributed has no groups: GroupState.group is then always None
    import torch.distributed.distributed_c10d as _c10d
except ImportError:  # pragma: no cover
    _c10d = None

from commfuse.errors import CommunicationError, ConcurrentUseError, GroupDeadError, first_line
from commfuse.runtime.board import board_of
from commfuse.runtime.checkpointing import TOP_HOOKS as _top_hooks
from commfuse.runtime.checkpointing import lane_of, recomputing, stopped
from commfuse.runtime.compiled import Plan
from commfuse.runtime.drain import account, drain_call
from commfuse.runtime.groups import (
    GroupState,
    group_state,
    left_call,
    resolve_timeout,
    state_of_group,
)

# Every call takes its group here, and with it the next call number of its thread's lane (groups.GroupState
# holds the numbers).


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
    An exception before ``walks.execute`` takes the ticket over is announced on the board as this rank
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


def take_plan_group(plan: Plan, state: GroupState) -> int:
    """Take the group for one call of ``plan`` (:func:`take_group`) and return the call's number; on a
    device with graph capture, the plan learns whether this call is captured. :func:`give_plan_group` gives it back."""
    probe = plan.probe
    capturing = probe is not None and bool(probe())
    seq = take_group(state, plan.label)
    if capturing:
        plan.capturing = True
    return seq


def give_plan_group(plan: Plan, state: GroupState) -> None:
    plan.capturing = False
    plan.used = True  # the planning table's second chance: this plan ran since the table last looked
    give_group(state)


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
            add_note(error, f"commfuse: rank {state.rank} could not serve call #{first}, which it left after "
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


def add_note(error: BaseException, text: str) -> None:
    add = getattr(error, "add_note", None)  # Python 3.11+
    if add is not None:
        try:
            add(text)
        except Exception:  # noqa: BLE001
            pass


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

