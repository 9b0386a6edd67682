"""Finishing a call after a failure: a failure on one rank is told to every rank.

An exception in the caller's compute first waits (bounded) for the step's
posted transfers; then the rank notes the failure on the group's board and
completes the call's transfers without computing, sending only to peers that
know (:func:`compute_failed`, :func:`gate`), and raises its exception. A peer
whose wait stalls reads the board, stops computing, completes the call the
same way and raises ``PeerFailedError`` (:func:`told`). The group stays
usable. What cannot be completed (a failure before the first transfer,
Ctrl-C, a broken transport) ends the group on every rank, by name
(:func:`after_failure`, ``board.declare_dead``).

A finisher walks the rest of a call's steps with no compute: :func:`finisher`
for a walk with a program, :func:`ring_finisher` for a ring walk without one
(``commfuse.runtime.walks``).
"""

from __future__ import annotations

import time

from commfuse.errors import CommfuseTimeoutError, GroupDeadError, PeerFailedError, first_line
from commfuse.runtime.admission import add_note
from commfuse.runtime.board import RECOVER, board_of, declare_dead
from commfuse.runtime.compiled import CompiledStep, Plan, Program, posting_error
from commfuse.runtime.groups import GroupState, left_call
from commfuse.runtime.steps import RingStep, land_ring, post_step, skipping_empty, wait_all
from commfuse.schedule import Collective


def after_failure(plan: Plan, state: GroupState, seq: int, error: BaseException, posted: bool) -> None:
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
    """Mark ``error`` as one this rank settled for call #seq (see :func:`after_failure`)."""
    try:
        error._commfuse_settled = (id(state), seq)
    except AttributeError:  # an exception that takes no attributes: the group is marked for a check
        pass
    return error


# -- a failure on one rank: told, and the call's transfers completed ---------------------------------------------


def compute_failed(plan: Plan, seq: int, index: int, error: BaseException, finish, st: CompiledStep | None = None,
                    pending=None, land=None) -> BaseException:
    """This rank's compute (or code of the caller's) failed in step ``index`` of call #seq. First the step's
    posted transfers are waited for and what arrived is landed (``pending``, as ``steps.wait_all`` takes
    them). Then, when the group has a board: note the failure there (op, step, exception), acknowledge it,
    complete the call's remaining transfers with ``finish(index + 1)``, which sends only to peers that know
    (so none of them computes on what this rank sends from now on), and return ``error`` to raise, marked
    settled: the group stays usable. Without a board, or for an exception that is not an ``Exception``
    (Ctrl-C), return ``error`` as it is (:func:`after_failure` decides)."""
    state = plan.state
    if pending:
        try:
            wait_all(plan, st, pending, land, plan.timeout)
        except BaseException as e:  # noqa: BLE001 - the transport failed too: the group is dead, say both
            add_note(error, f"commfuse: rank {plan.rank} could not complete step {index} of call #{seq} after "
                             f"this failure: {type(e).__name__}: {first_line(e)}")
            return error
    board = board_of(state) if plan.schedule.world_size > 1 and not plan.traced else None
    if board is None or not isinstance(error, Exception) or getattr(plan.backend, "_stream_ordered", False):
        # a stream-ordered backend's peers never stall on the host, so they could not learn before what this
        # rank would send reached their device: it ends the group instead (after_failure)
        return error
    name, code = state.lane
    board.log("fail", seq=seq, lane=code, thread=name, label=plan.label, step=index, exc=type(error).__name__,
              message=first_line(error), continuing=True)
    board.ack(code, seq)
    try:
        finish(index + 1)
    except BaseException as e:  # noqa: BLE001 - the group is dead (declared by whoever found out)
        add_note(error, f"commfuse: rank {plan.rank} could not complete call #{seq} after this failure: "
                         f"{type(e).__name__}: {first_line(e)}")
        return error
    add_note(error, f"commfuse: rank {plan.rank}'s peers were told that {plan.label} (call #{seq}) failed here "
                     f"in step {index}, and the call's transfers were completed: the group stays usable")
    return _settled(error, state, seq)


def told(plan: Plan, seq: int, index: int, finish) -> BaseException:
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


def gate(plan: Plan, seq: int, peers) -> None:
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


def step_peers(plan: Plan, st: CompiledStep) -> list[int]:
    if st.collectives:
        return [q for q in range(plan.schedule.world_size) if q != plan.rank]
    return sorted({t.peer for t, _ in st.sends})


def _ghost_compute(program: Program, slots) -> None:
    """Stand in for ``program.compute(slots)`` once the call failed: a program whose compute makes what later
    steps send (a reduce-scatter's partials, a produced block) gets tensors of the right shape (its
    ``skip``); a consuming program needs nothing (what it sends is what it received)."""
    if slots and program.collective in (Collective.REDUCE_SCATTER, Collective.PRODUCE_ALL_TO_ALL):
        program.skip(slots)


def finisher(plan: Plan, program: Program, seq: int, failed_step: CompiledStep | None):
    """``finish(start)``: walk steps ``start..`` of ``plan`` with no compute (see :func:`compute_failed`)."""

    def finish(start: int) -> None:
        backend, timeout = plan.backend, plan.timeout
        post = skipping_empty(backend.post) if program.sparse else backend.post
        if failed_step is not None:
            _ghost_compute(program, failed_step.compute)
        for st in plan.steps[start:]:
            peers = step_peers(plan, st)
            if peers:
                gate(plan, seq, peers)
            pending = post_step(plan, st, program, post, backend.collective)
            _ghost_compute(program, st.compute)
            wait_all(plan, st, pending, program.land, timeout)
            for s in st.accumulate:
                program.add(s)
            for s in st.release:
                program.release(s)

    return finish


def ring_finisher(plan: Plan, seq: int, walk: tuple, held: list, pool, inbox: list | None, failed: int | None):
    """:func:`finisher` for ``walks.execute_one_by_one``'s walk: a reduce-scatter's partials that were not made
    are buffers of their shape (``failed``: the step whose compute raised)."""

    def finish(start: int) -> None:
        post, get = plan.backend.post, pool.get
        landing = held if inbox is None else inbox
        if failed is not None and inbox is not None:
            for s, _, _, k in RingStep(*walk[failed]).compute:  # the partials the failed step did not make
                if held[s] is None:
                    held[s] = get(k)
        for st, pair, sends, recvs, compute, accumulate, release in walk[start:]:
            peers = step_peers(plan, st)
            if peers:
                gate(plan, seq, peers)
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
                land_ring(plan, st, handle, recvs, landing)
            for s, k in accumulate:
                received = inbox[s]
                inbox[s] = None
                held[s].add_(received)
            for s, k in release:
                held[s] = None

    return finish

