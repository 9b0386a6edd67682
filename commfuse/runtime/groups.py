"""Group state, call numbering and the fingerprint check: what every call on one process group shares.

Rules every call follows, whatever the backend (see ``docs/reliability.md``):

* **One op per group at a time.** A second op on a group while one is in
  flight (another thread, or a consumer calling an op) raises
  :class:`~commfuse.errors.ConcurrentUseError` naming the group and the op in
  flight, instead of mixing the two calls' messages (:func:`take_group`).
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
  sequence number) is all-gathered around the ring (:func:`check_fingerprint`)
  on the first call of each signature, on the first call after any call on
  the group failed, and on every call with ``COMMFUSE_CHECK=always``;
  ``COMMFUSE_CHECK=0`` turns it off. Every rank sees every rank's
  fingerprint, so every rank names a mismatch within one ring's latency.

The timeouts every wait is bounded by (:func:`resolve_timeout`) and the tag
layout of a call's messages are defined here too.
"""

from __future__ import annotations

import math
import os
import sys
import threading
import zlib
from collections.abc import Callable, Sequence

import torch

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
)
from commfuse.runtime.board import RECOVER, board_of, declare_dead
from commfuse.schedule import Algorithm, Collective, SliceId, Transfer

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
#: The first integer of every fingerprint: a row that does not start with it was not made by this version.
FINGERPRINT_MAGIC = 0xC0F5

#: The order that codes collectives and algorithms in a fingerprint.
COLLECTIVES = list(Collective)
ALGORITHMS = list(Algorithm)


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



_FORMATS: dict[int, tuple[str, object]] = {}


def format_code(label: str) -> int:
    """A stable small integer for an op label (the same on every rank running this version)."""
    return zlib.crc32(label.encode()) & 0xFFFFFF


def register_format(label: str, describe) -> None:
    """Say how ``describe(meta_values) -> str`` reads the fingerprint integers of op ``label``."""
    _FORMATS[format_code(label)] = (label, describe)


def describe_fingerprint(values: Sequence[int]) -> str:
    """A fingerprint in words, decoded with the format of the op that made it."""
    values = list(values)
    if len(values) < 8 or values[0] != FINGERPRINT_MAGIC:
        return f"an unrecognised fingerprint {values}"
    seq, code, coll, alg, overlap, parts, chunks = values[1:8]
    label, describe = _FORMATS.get(code, (f"op#{code}", None))
    coll_t = COLLECTIVES[coll].value if 0 <= coll < len(COLLECTIVES) else f"collective#{coll}"
    alg_t = ALGORITHMS[alg].value if 0 <= alg < len(ALGORITHMS) else f"algorithm#{alg}"
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


def _pad_fingerprint(values: list[int], length: int = FINGERPRINT_LEN) -> list[int]:
    if len(values) > length:
        values = values[: length - 1] + [hash(tuple(values)) & 0x7FFFFFFFFFFF]
    return values + [-1] * (length - len(values))


def _unpad_fingerprint(values: list[int]) -> list[int]:
    while values and values[-1] == -1:
        values = values[:-1]
    return values


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
        self.seq = take_group(self.state, self.label)
        return self

    def __exit__(self, kind, error, tb) -> bool:
        state = self.state
        try:
            if error is not None and not self.used:
                left_call(state, self.seq, self.label, None, error)
        finally:
            give_group(state)
        return False


def take_group(state: GroupState, label: str) -> int:
    """Take the group for one call of ``label`` and return the call's number in its thread's lane: refused,
    by name, while another op is in flight on it; a group declared dead raises its error, and so does one
    torch.distributed destroyed. :func:`give_group` gives it back."""
    if not state.lock.acquire(False):
        raise _refused(label, state)
    if state.error is not None or (state.group is not None and state.group not in _c10d._world.pg_map):
        state.lock.release()
        raise _dead_again(label, state) if state.error is not None else _destroyed(label, state)
    state.busy = (label, threading.get_ident())
    state.told = None
    state.lane = which = lane()
    seq = state.now = state.take(which[1])
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
    left_call(state, state.take(which[1]), label, None, error, which)


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


def left_call(state: GroupState, seq: int, label: str, step, error: BaseException, which=None) -> None:
    """Note that this rank left call #seq without completing its transfers (``step`` None: before posting
    any), and mark the group for a check."""
    state.dirty = True
    if state.world_size <= 1:
        return
    board = board_of(state)
    if board is not None:
        name, code = which or state.lane
        board.log("fail", seq=seq, lane=code, thread=name, label=label, step=step, exc=type(error).__name__,
                  message=first_line(error), continuing=False)


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return (text.splitlines()[0] if text else "")[:500]


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



# -- the fingerprint check ---------------------------------------------------------------------------------------


def check_fingerprint(plan, program, seq: int) -> None:
    """All-gather every rank's fingerprint around the ring, then compare them all, on every rank
    (``plan``: a ``compiled.Plan``, ``program`` its call's ``Program``).

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
    mine_values = _pad_fingerprint(plan.fingerprint(program, seq), FINGERPRINT_LEN - 1) + [state.lane[1]]
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
        lines.append(f"  {who} {', '.join(map(str, ranks))}{tag}: {describe_fingerprint(_unpad_fingerprint(list(row[:-1])))}"
                     + ("" if row[-1] == mine_values[-1] else f", from another thread (lane {row[-1]})"))
    seqs = {row[1] for row in table if len(row) > 1 and row[0] == FINGERPRINT_MAGIC}
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

