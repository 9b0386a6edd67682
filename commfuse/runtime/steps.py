"""The step primitives every walk is made of.

Post a step's point-to-point transfers and whole collectives
(:func:`post_step`), wait for them and land what arrived (:func:`wait_all`;
:func:`land_ring` for a ring step), and, while an op waits, run the work
another strand handed its thread (:data:`FILLERS`, :func:`run_filler`). A
measurement mode posts handles that are already complete instead
(:func:`done_post`, :func:`done_collective`, :func:`done_into`); a sparse
program leaves out its messages of no elements (:func:`skipping_empty`). What
was posted before a failure is drained so the transport can reuse its
connections, and an observed step's timings go into the events and the trace
log (:func:`observe_step`). A ring walk's step is a :class:`RingStep`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import NamedTuple

import torch

from commfuse.errors import CommunicationError
from commfuse.runtime.compiled import (
    CompiledStep,
    Plan,
    Program,
    describe_traffic,
    posting_error,
    waiting_error,
)
from commfuse.schedule import AlgorithmSpec


class RingStep(NamedTuple):
    """One step of a ring walk (``walks.ring_walk``), with what it reads resolved once.

    - ``st``: the compiled step (for its index, and its transfers after a failure);
    - ``pair``: a step of exactly one send and one receive (every ring step) as ``(send's Transfer, its
      slot, receive's Transfer, the receive buffer's pool key)``, posted with no comprehension; else None;
    - ``sends``: ``(Transfer, slot)`` pairs of any other step with point-to-point transfers, else None;
    - ``recvs``: ``(Transfer, slot, key)``, ``key`` the receive buffer's pool key (for a ``pair`` too);
    - ``compute``: ``(slot, start, size, key)`` of each slice the step computes, in order (one in a ring
      step; two where ``ring:m`` computes a slice beside the one that arrived, or the two halves of
      ``bidirectional``), or None;
    - ``accumulate``, ``release``: ``(slot, key)`` pairs (``release`` less this rank's ``own`` slots).

    The walk keeps each step as the plain tuple of its fields (``tuple(RingStep(...))``), which
    :func:`execute_one_by_one` unpacks by position: CPython unpacks an exact tuple on its fast path but a
    tuple subclass through an iterator, which cost a ring call at world size 2 about 900 instructions (0.7%)
    more. ``RingStep(*walk[i])`` names a step's fields again off the hot path."""

    st: CompiledStep
    pair: tuple | None
    sends: tuple | None
    recvs: tuple
    compute: tuple | None
    accumulate: tuple
    release: tuple


class _Done:
    """A handle that is already complete: what ``compute_only`` posts return."""

    __slots__ = ("outputs",)

    def __init__(self, outputs) -> None:
        self.outputs = list(outputs)

    def wait(self, timeout: float):
        return self.outputs


def done_post(sends, recvs):
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


def done_collective(kind, inputs, outputs):
    return _Done(outputs)


def done_into(kind, input, output):
    return _Done([output])


def post_step(plan: Plan, st: CompiledStep, program: Program, post, run_collective, run_into=None,
               sizes: dict | None = None) -> list:
    """Post one step's point-to-point transfers and whole collectives; their pending handles, as
    :func:`wait_all` takes them. ``sizes``: the step's bytes sent and received go there, by step index."""
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


def wait_all(plan: Plan, st: CompiledStep, pending, land, timeout: float) -> None:
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


def land_ring(plan: Plan, st: CompiledStep, handle, recvs, landing: list) -> None:
    """Wait for a ring step's transfers and put what arrived in ``landing``, by slot."""
    if FILLERS:
        run_filler(handle)
    try:
        got = handle.wait(plan.timeout)
    except BaseException as e:
        raise waiting_error(plan, st, None, e) from e
    for (_, s, _), tensor in zip(recvs, got):
        landing[s] = tensor


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


def observe_step(plan: Plan, st: CompiledStep, events: list | None, t0: float, t1: float, t2: float,
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

