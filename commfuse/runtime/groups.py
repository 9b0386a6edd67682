"""Group state and the fingerprint check: what every call on one process group shares.

Rules every call follows, whatever the backend (see ``docs/reliability.md``):

* **One op per group at a time.** A second op on a group while one is in
  flight (another thread, or a consumer calling an op) raises
  :class:`~commfuse.errors.ConcurrentUseError` naming the group and the op in
  flight, instead of mixing the two calls' messages.
* **Calls are numbered.** Every call on a group takes the group's next
  sequence number, on every rank, before any code of the caller's runs for it,
  also a call that fails validation before it communicates. Backends that
  match tags (gloo) fold it, with a digest of the call's signature and the
  calling thread's lane, into them (``begin_call``), so a message can only
  pair with the same call of the same signature from the same thread on its
  peer; the fingerprint carries the number, so a rank that skipped or added a
  call is named. NCCL does not match tags: there the check after a failed call
  does this work.
* **Check once.** The fingerprint (collective, algorithm, shapes, dtypes,
  sequence number) is all-gathered around the ring (:func:`check_fingerprint`)
  on the first call of each signature, on the first call after any call on
  the group failed, and on every call with ``COMMFUSE_CHECK=always``;
  ``COMMFUSE_CHECK=0`` turns it off. Every rank sees every rank's
  fingerprint, so every rank names a mismatch within one ring's latency.

:class:`GroupState` holds a group's numbers, lock and board; taking the group
for a call, numbering it by lane and announcing a call that left early
(``take_group``, ``lane``, ``Ticket``, ``announce_left``, ``op_calls``) are
in ``commfuse.runtime.admission``. The timeouts every wait is bounded by
(:func:`resolve_timeout`) and the tag layout of a call's messages are defined
here too. How a fingerprint's integers read back in words (``describe_fingerprint``, ``register_format``
and every op's describer) is ``commfuse.runtime.fingerprints``.
"""

from __future__ import annotations

import math
import sys
import threading
from collections.abc import Callable

import torch

from commfuse.errors import (
    CommfuseError,
    CommfuseTimeoutError,
    CommfuseValueError,
    CommunicationError,
    MismatchError,
    first_line,
)
from commfuse.runtime.board import RECOVER, board_of, declare_dead
from commfuse.runtime.env import FALSE_WORDS, TRUE_WORDS, choice, number
from commfuse.runtime.fingerprints import (  # noqa: F401 - the fingerprint's words live there; kept here for their callers
    ALGORITHMS,
    COLLECTIVES,
    FINGERPRINT_MAGIC,
    describe_fingerprint,
    format_code,
    register_format,
)
from commfuse.schedule import Collective, SliceId, Transfer

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
#: The channel of the per-call digest a call's point-to-point steps carry beside their data on gloo
#: (``commfuse.runtime.c10d``'s rider, ``commfuse.planning.agreement.carry``).
RIDER_CHANNEL = 1_002
FINGERPRINT_LEN = 48


def resolve_timeout(timeout: float | None) -> float:
    """``timeout`` if given, else ``COMMFUSE_TIMEOUT_S``, else :data:`DEFAULT_TIMEOUT_S`; checked."""
    if timeout is None:
        return number("COMMFUSE_TIMEOUT_S", DEFAULT_TIMEOUT_S, MIN_TIMEOUT_S, MAX_TIMEOUT_S)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise CommfuseValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    if not math.isfinite(timeout) or not MIN_TIMEOUT_S <= timeout <= MAX_TIMEOUT_S:
        raise CommfuseValueError(
            f"timeout={timeout!r} is out of range: give seconds between {MIN_TIMEOUT_S:g} and {MAX_TIMEOUT_S:g}; "
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
#: ``COMMFUSE_CHECK``'s words and the mode each gives: the modes, and a switch's words (off; on is once).
CHECK_WORDS = {**{m: m for m in CHECK_MODES}, **dict.fromkeys(FALSE_WORDS, "off"), **dict.fromkeys(TRUE_WORDS, "once")}


def check_mode(check: bool | str | None) -> str:
    """The fingerprint check mode: ``check`` if given (True = "once"), else ``COMMFUSE_CHECK``.

    ``COMMFUSE_CHECK`` (:data:`CHECK_WORDS`): ``off`` (or ``0``, ``false``, ``no``) turns it off, ``always``
    checks every call, ``once`` (or ``1``, ``true``, ``yes``, ``on``; the default) checks once per signature;
    any other word is refused by name.
    """
    if check is None:
        return choice("COMMFUSE_CHECK", "once", CHECK_WORDS)
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
                 "world_size", "board", "told", "lane", "recorder", "incarnation", "__weakref__")

    def __init__(self, name: str, group=None, incarnation: int = 1) -> None:
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
        #: the flight recorder of this group on this rank (``runtime.recorder``): None until the first plan on
        #: the group asks for it, False when ``COMMFUSE_RECORDER=0``
        self.recorder = None
        #: how many states this process has made for a group of this name, this one included: every rank
        #: makes them in step (after each ``commfuse.backends.release()``, for each group made again under
        #: the name), so the board's notes are kept apart per incarnation and no call reads a note written
        #: before its own numbering began
        self.incarnation = incarnation

    def current(self) -> int:
        """The number of the call in progress."""
        return self.now


_STATES: dict[object, GroupState] = {}
_STATES_LOCK = threading.Lock()
#: how many states were made per group name (:attr:`GroupState.incarnation`); never cleared
_INCARNATIONS: dict[str, int] = {}


def _group_name(group) -> str:
    name = getattr(group, "group_name", None)
    if name:
        return f"group {name!r}"
    return f"group {type(group).__name__}@{id(group):#x}"


def state_of_group(group) -> GroupState:
    """The :class:`GroupState` of a process group (or of a backend object that has no group). A group
    torch.distributed destroyed gets a state that is not kept and counts no incarnation: no call can take it
    (``admission.take_group`` refuses it), and a rank that asked for one must not number the name's later groups
    apart from its peers'."""
    found = _STATES.get(group)
    if found is None:
        with _STATES_LOCK:
            found = _STATES.get(group)
            if found is None:
                name = _group_name(group)
                c10d_group = _c10d_group(group)
                if destroyed(c10d_group):
                    return GroupState(name, c10d_group, _INCARNATIONS.get(name, 0))
                incarnation = _INCARNATIONS[name] = _INCARNATIONS.get(name, 0) + 1
                found = _STATES[group] = GroupState(name, c10d_group, incarnation)
    return found


def destroyed(group) -> bool:
    """Whether ``group`` is a c10d process group torch.distributed no longer knows
    (``destroy_process_group`` destroyed it); False for anything else."""
    c10d = sys.modules.get("torch.distributed.distributed_c10d")  # not imported: no group was ever made
    return c10d is not None and isinstance(group, c10d.ProcessGroup) and group not in c10d._world.pg_map


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


def known_groups() -> list:
    """The c10d process groups that have a state here (for the sweep of destroyed groups,
    ``commfuse.backends.forget_destroyed``)."""
    return [state.group for state in list(_STATES.values()) if state.group is not None]


def forget_group(group) -> bool:
    """Drop the state of ``group``, a process group torch.distributed destroyed, unless a call on it is in
    flight (False: then nothing is dropped, and a later sweep tries again). A call that takes the group
    after this finds it destroyed (``admission.take_group`` refuses it by name), so no call runs on a state that
    was dropped. The group's name keeps its count of incarnations (:data:`_INCARNATIONS`): a group made
    again under the name, on the same store, gets a board of its own."""
    with _STATES_LOCK:
        found = [(key, state) for key, state in _STATES.items() if key is group or state.group is group]
        taken = []
        try:
            for _, state in found:
                if not state.lock.acquire(False):  # a call in flight: it keeps its state until it ends
                    return False
                taken.append(state)
            for key, _ in found:
                del _STATES[key]
        finally:
            for state in taken:
                state.lock.release()
    return True


# -- a fingerprint row's fixed length on the wire -------------------------------------------------------------


def _pad_fingerprint(values: list[int], length: int = FINGERPRINT_LEN) -> list[int]:
    if len(values) > length:
        values = values[: length - 1] + [hash(tuple(values)) & 0x7FFFFFFFFFFF]
    return values + [-1] * (length - len(values))


def _unpad_fingerprint(values: list[int]) -> list[int]:
    while values and values[-1] == -1:
        values = values[:-1]
    return values


def left_call(state: GroupState, seq: int, label: str, step, error: BaseException, which=None,
              serves: bool = False) -> None:
    """Note that this rank left call #seq without completing its transfers (``step`` None: before posting
    any), and mark the group for a check. ``serves``: this rank will complete the call's transfers with the
    peers that wait in it (``commfuse.runtime.drain``)."""
    state.dirty = True
    if state.world_size <= 1:
        return
    board = board_of(state)
    if board is not None:
        name, code = which or state.lane
        board.log("fail", seq=seq, lane=code, thread=name, label=label, step=step, exc=type(error).__name__,
                  message=first_line(error), continuing=False, serves=serves)


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
        failures = [note for note in board.news() if note.get("kind") == "fail"] if board is not None else []
        if failures:
            error = MismatchError(str(error) + " What the group's board says: " + "; ".join(
                f"rank {n['rank']} left call #{n['seq']} ({n.get('label')}) before completing it: {n.get('exc')}: "
                f"{n.get('message')}" for n in failures[-3:]) + ".")
        error = MismatchError(f"{error} The ranks' calls stay apart from now on, so the group is dead: {RECOVER}")
        raise declare_dead(state, error, getattr(backend, "poison", None))
    raise error

