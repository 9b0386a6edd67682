"""The walks: one rank's steps of a call, walked on a backend.

What one ring call does on one rank, in plain code (the step contract is in
``commfuse.schedule._ir``)::

    for st in plan.steps:                           # world size - 1 steps (ring:m: more)
        handle = post(sends=[(to_next, held[s]) for to_next, s in st.sends],
                      recvs=[(from_prev, pool.get()) for from_prev, _ in st.recvs])
        for s in st.compute:                        # while they fly: a slice this rank holds
            held[s] = on_slice(held[s]) or held[s]
        got = handle.wait(timeout)                  # bounded; a stalled wait reads the board
        for (_, s), tensor in zip(st.recvs, got):   # land what arrived
            held[s] = tensor                        # (a reduce-scatter: into its inbox)
        for s in st.accumulate:                     # a reduce-scatter adds it to its partial
            held[s] += inbox.pop(s)
        for s in st.release:                        # a slice whose last use has passed
            pool.give(held.pop(s))

The real walks are that loop in three forms, kept side by side here:

- :func:`execute` (its loop is :func:`_walk`): any plan, with a
  :class:`Program` that holds the call's data (point-to-point steps, whole
  collectives, several slices per step; a serial plan waits before it
  computes). Observation (:mod:`commfuse.runtime.observe`: measurement modes,
  per-step events, profiler ranges, ``COMMFUSE_TRACE``) is a switch read once
  per call inside the same loop.
- :func:`execute_one_by_one`: the loop above with no program, for a ring plan
  that computes at most one slot per step (``plan.one_by_one``: ring,
  ring:m). Its steps are resolved once into ``steps.RingStep`` records
  (:func:`ring_walk`) and receive buffers come from the pool's free lists
  directly: per step one ``post``, the caller's compute and one ``wait``.
- :func:`execute_into`: a whole-collective plan, straight into one tensor.

The last two run only once ``may_skip_program(plan)``: the first call of a
signature, a check and an observed call take :func:`execute`. After a
failure each walk hands the rest of its call to a finisher
(``commfuse.runtime.finishing``), which walks the remaining steps without
computing, so the peers' transfers still find their other end. The walks stay
side by side, each written out whole, and every change to the step order must
be made in all of them at once.

**Why not one loop.** Folding them into :func:`_walk` over its program would
put a program's method calls on every step of the repeated ring call, the
hot path. Measured on one ring all-gather signature walked both ways
(``benchmarks/call_instructions.py --ops walk_program walk_one_by_one``, the
fake group, instructions a call): 140,231 with a program against 103,093
without at world size 2 (+36%), 606,841 against 455,593 at 8 (+33%); the
whole repeated ``all_gather_matmul`` is 130,088 at 2. The other way round,
:func:`execute_one_by_one`'s records cannot hold what only the program
walk does: whole collectives, several slices computed in one step, a serial
plan's wait before its compute, the first call's fingerprint check, and
observation. So the three loops differ in what they take, not in the order
of a step:

================== =============== ========================= ================
                   ``_walk``       ``execute_one_by_one``    ``execute_into``
================== =============== ========================= ================
plans              any             ``one_by_one`` rings      whole collective
the call's data    a ``Program``   held slots, free list     one tensor
per step           program methods one post, one wait        one collective
first call, check, yes             no (``may_skip_program``) no
observed call
================== =============== ========================= ================
"""

from __future__ import annotations

import time
from time import perf_counter_ns as _clock_ns
from collections.abc import Callable

import torch
from torch.profiler import record_function

from commfuse.errors import CommfuseValueError
from commfuse.runtime import steps as _steps
from commfuse.runtime.admission import Ticket, give_plan_group, take_plan_group
from commfuse.runtime.compiled import (
    CompiledStep,
    Plan,
    Program,
    posting_error,
    waiting_error,
)
from commfuse.runtime.finishing import after_failure, compute_failed, finisher, gate, ring_finisher, step_peers, told
from commfuse.runtime.groups import SEQUENCE_WRAP, GroupState, check_fingerprint
from commfuse.runtime.observe import NULL_SCOPE, events_of, mode_of, observers, profiler_on
from commfuse.runtime.recorder import failed as _recorded_failure
from commfuse.runtime.recorder import stamper
from commfuse.runtime import sites as _sites
from commfuse.runtime.steps import (
    FILLERS,
    RingStep,
    done_collective,
    done_into,
    done_post,
    observe_step,
    post_step,
    skipping_empty,
    wait_all,
)
from commfuse.schedule import Collective


def execute(plan: Plan, program: Program, *, events: list | None = None, ticket: Ticket | None = None) -> None:
    """Run one call of ``plan`` with ``program``'s data on ``plan.backend`` (``ticket``: the call's number,
    taken already by ``admission.enter_call``)."""
    state = plan.state
    if ticket is None:
        seq = take_plan_group(plan, state)
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
        after_failure(plan, state, seq, e, posted)
        if rec is not None:
            _recorded_failure(call, state, e)
        raise
    finally:
        if ticket is None:
            give_plan_group(plan, state)
        else:
            plan.capturing = False
            plan.used = True


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
        post, run_collective, run_into = done_post, done_collective, done_into
    elif mode == "comm_only":
        compute = program.skip
    elif mode == "outside_only":  # neither: what the caller does around commfuse's ops is all that runs
        post, run_collective, run_into, compute = done_post, done_collective, done_into, program.skip
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
            pending = post_step(plan, st, program, post, run_collective, run_into, sizes)
            if observed:
                t1 = clock()
            if not overlap and pending:
                if stamp is not None:
                    stamp(i)
                    stamp(_clock_ns())
                wait_all(plan, st, pending, land, timeout)
                if stamp is not None:
                    stamp(_clock_ns())
                pending = ()
                if state.told is not None:
                    raise told(plan, seq, i, finisher(plan, program, seq, st))
            if observed:
                t2 = clock()
            if st.compute:
                try:
                    with (record_function(f"{plan.name}.step{st.index}.compute") if prof else NULL_SCOPE):
                        compute(st.compute)
                except Exception as e:
                    raise compute_failed(plan, seq, i, e, finisher(plan, program, seq, st), st, pending, land)
            if observed:
                t3 = clock()
            if pending:
                if stamp is not None:
                    stamp(i)
                    stamp(_clock_ns())
                wait_all(plan, st, pending, land, timeout)
                if stamp is not None:
                    stamp(_clock_ns())
                if state.told is not None:
                    raise told(plan, seq, i, finisher(plan, program, seq, None))
            for s in st.accumulate:
                program.add(s)
            for s in st.release:
                program.release(s)
        finally:
            if scope is not None:
                scope.__exit__(None, None, None)
        if observed:
            observe_step(plan, st, events, t0, t1, t2, t3, clock())


def execute_into(plan: Plan, input, output: torch.Tensor) -> None:
    """One call of a whole-collective plan (``plan.whole``, vanilla) straight into ``output``: the
    collective over single tensors (``collective_into``) and its wait, with :func:`execute`'s rules (one op
    per group at a time, the call number in the tags, a failure on one rank told to every rank) and no
    program. ``input`` is a tensor, or a function making it once the call has its number (a producer's
    partial: when it fails, the collective still runs, on zeros, once every peer knows). Only when
    ``may_skip_program(plan)``: the first call of a signature, a check, or an observed call take
    :func:`execute`."""
    state = plan.state
    seq = take_plan_group(plan, state)
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
                gate(plan, seq, step_peers(plan, st))
                _into(plan, st, call, input, output)

            raise compute_failed(plan, seq, 0, failed, finish)
        _into(plan, st, call, input, output, record)
        if state.told is not None:
            raise told(plan, seq, 0, lambda start: None)
        if record is not None:
            record.end = _clock_ns()
    except BaseException as e:
        after_failure(plan, state, seq, e, True)
        if rec is not None:
            _recorded_failure(record or entry, state, e)
        raise
    finally:
        give_plan_group(plan, state)


def _into(plan: Plan, st: CompiledStep, call, input: torch.Tensor, output: torch.Tensor, record=None) -> None:
    try:
        handle = plan.backend.collective_into(call.collective, input, output)
    except Exception as e:
        raise posting_error(plan, st, call, e) from e
    if FILLERS:
        _steps.run_filler(handle)
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


def ring_walk(plan: Plan, start: list, size: list, key: list, own: frozenset) -> tuple:
    """``plan``'s steps as :func:`execute_one_by_one` walks them: one ``steps.RingStep`` per step, kept as a
    plain tuple. Plans with ``one_by_one`` only."""
    walk = []
    for st in plan.steps:
        compute = tuple((s, start[s], size[s], key[s]) for s in st.compute) or None
        sends, pair = (st.sends if st.p2p else None), None
        if sends is not None and len(sends) == 1 and len(st.recvs) == 1:
            (t, s), (r, q) = sends[0], st.recvs[0]
            sends, pair = None, (t, s, r, key[q])
        walk.append(tuple(RingStep(
            st=st,
            pair=pair,
            sends=sends,
            recvs=tuple((t, s, key[s]) for t, s in st.recvs),
            compute=compute,
            accumulate=tuple((s, key[s]) for s in st.accumulate),
            release=tuple((s, key[s]) for s in st.release if s not in own),
        )))
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
    seq = take_plan_group(plan, state)
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
                        raise compute_failed(plan, seq, i, e,
                                              ring_finisher(plan, seq, walk, held, pool, inbox, i), st, pending,
                                              landing.__setitem__)
                    if made is not None:
                        held[s] = made
            if handle is not None:
                if FILLERS:
                    _steps.run_filler(handle)
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
                    raise told(plan, seq, i, ring_finisher(plan, seq, walk, held, pool, inbox, None))
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
        after_failure(plan, state, seq, e, True)
        if rec is not None:
            _recorded_failure(call or entry, state, e)
        raise
    finally:
        give_plan_group(plan, state)


# torch.compile's eager fallback runs these as plain Python (see commfuse.runtime.eager)
from commfuse.runtime.eager import eager_only  # noqa: E402

eager_only(execute, execute_into, execute_one_by_one)
