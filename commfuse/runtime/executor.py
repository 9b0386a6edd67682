"""The executor: walks one rank's schedule on a backend.

Per step, in the order of the contract in ``commfuse.schedule._ir``: post the
step's transfers and collectives, run the caller's compute on the slices the
step names while they fly, wait (bounded by the timeout), hand what arrived
to the program, add where the schedule says, and recycle buffers whose last
use has passed. What the data *is* lives in a :class:`Program` (one per kind
of op, see ``programs``); the executor only knows steps.

Every step is annotated with ``torch.profiler.record_function`` so it shows up
in the profiler people already use; ``COMMFUSE_TRACE=1`` also prints a
per-rank step log to stderr. ``events`` (a list) collects the executor's own
timeline for the benchmark's traces.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import sys
import time
from collections.abc import Sequence

import torch
from torch.profiler import record_function

from commfuse.errors import CommfuseTimeoutError, CommfuseValueError, CommunicationError, MismatchError
from commfuse.schedule import Collective, Schedule, SliceId, Step, Transfer, build

#: Default bound on every wait, in seconds, when neither ``timeout=`` nor
#: ``COMMFUSE_TIMEOUT_S`` says otherwise. A ring step that has not completed in
#: five minutes is broken, not slow; NCCL's own watchdog default is ten.
DEFAULT_TIMEOUT_S = 300.0

#: Channels (message tags) of the fingerprint exchange: never a data channel.
FINGERPRINT_CHANNELS = (1_000, 1_001)


def resolve_timeout(timeout: float | None) -> float:
    """``timeout`` if given, else ``COMMFUSE_TIMEOUT_S``, else :data:`DEFAULT_TIMEOUT_S`."""
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
    return float(timeout)


def check_enabled(check: bool | None) -> bool:
    """Whether ops exchange a fingerprint before their first transfer (``COMMFUSE_CHECK``, default on)."""
    if check is not None:
        return bool(check)
    return os.environ.get("COMMFUSE_CHECK", "1").strip().lower() not in ("0", "false", "no", "off")


@functools.lru_cache(maxsize=256)
def cached_schedule(collective: str, world_size: int, algorithm: str, parts: int, chunks: int) -> Schedule:
    return build(collective, world_size, algorithm=algorithm, parts=parts, chunks=chunks)


@functools.lru_cache(maxsize=1024)
def _plan(schedule: Schedule, rank: int) -> tuple[tuple[Step, ...], dict[int, tuple[SliceId, ...]]]:
    """One rank's steps, and per step the slices whose last use is in that step."""
    steps = schedule.steps(rank)
    last: dict[SliceId, int] = {}
    n = schedule.world_size
    for step in steps:
        for x in step.compute + step.accumulate:
            last[x] = step.index
        for t in step.sends:
            last[t.slice] = step.index
        for call in step.collectives:  # a whole collective reads this rank's slices of its chunk
            j = call.part
            if schedule.collective is Collective.ALL_TO_ALL:
                used = [SliceId(d, j, 0, rank) for d in range(n)] + [SliceId(rank, j, 0, q) for q in range(n)]
            else:
                used = [SliceId(d, j) for d in range(n)]
            for x in used:
                last[x] = max(last.get(x, -1), step.index)
    done: dict[int, list[SliceId]] = {}
    for x, i in last.items():
        done.setdefault(i, []).append(x)
    return steps, {i: tuple(xs) for i, xs in done.items()}


class Program:
    """What one op's data is; the executor asks it for tensors slice by slice.

    Subclasses (``programs``) implement the methods for all-gather,
    reduce-scatter and all-to-all.
    """

    collective: Collective

    def payload(self, x: SliceId) -> torch.Tensor:  # what to send for x
        raise NotImplementedError

    def buffer(self, x: SliceId) -> torch.Tensor:  # where x may be received
        raise NotImplementedError

    def land(self, x: SliceId, tensor: torch.Tensor) -> None:  # x arrived
        raise NotImplementedError

    def compute(self, slices: tuple[SliceId, ...]) -> None:
        raise NotImplementedError

    def add(self, x: SliceId) -> None:  # reduce-scatter: partial(x) += received(x)
        raise NotImplementedError

    def collective_io(self, call) -> tuple[list[torch.Tensor], list[torch.Tensor], object]:
        """Inputs and outputs of one whole collective, and a function taking what arrived."""
        raise NotImplementedError

    def release(self, x: SliceId) -> None:  # x's last use has passed
        pass

    def skip(self, slices: tuple[SliceId, ...]) -> None:
        """Stand-in for ``compute`` in ``comm_only`` measurements: leave what sends need, compute nothing."""
        self.compute(slices)

    def fingerprint(self) -> list[int]:
        """Integers that every rank of one call must agree on (see ``fingerprint``)."""
        raise NotImplementedError

    def describe_fingerprint(self, values: Sequence[int]) -> str:
        raise NotImplementedError


_MODES = ("compute_only", "comm_only")
_mode = threading.local()


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
    try:
        yield
    finally:
        _mode.value = previous


@contextlib.contextmanager
def record_events():
    """Collect the per-step timeline of every ``execute`` in this thread into a list.

    Each entry is the per-step dict of ``execute(events=...)`` plus ``label``
    (the op) and ``algorithm``; times are ``time.perf_counter()`` seconds.
    The benchmark builds its traces and Gantt charts from these.
    """
    previous = getattr(_mode, "events", None)
    events: list[dict] = []
    _mode.events = events
    try:
        yield events
    finally:
        _mode.events = previous


class _Done:
    """A handle that is already complete: what ``compute_only`` posts return."""

    def __init__(self, outputs) -> None:
        self.outputs = list(outputs)

    def wait(self, timeout: float):
        return self.outputs


_NULL = contextlib.nullcontext()


def profiling() -> bool:
    """Whether a torch profiler is recording: step annotations cost nothing when none is."""
    return torch.autograd.profiler._is_profiler_enabled


def _trace_enabled() -> bool:
    return os.environ.get("COMMFUSE_TRACE", "").strip() not in ("", "0")


def execute(
    schedule: Schedule,
    program: Program,
    backend,
    *,
    timeout: float,
    check: bool = True,
    events: list | None = None,
    label: str = "",
) -> None:
    """Run ``backend.rank``'s steps of ``schedule`` with ``program``'s data."""
    rank = backend.rank
    steps, releases = _plan(schedule, rank)
    trace = _trace_enabled()
    name = f"commfuse.{label or schedule.collective.value}.{schedule.algorithm.value}"
    mode = getattr(_mode, "value", None)
    recorded = getattr(_mode, "events", None)
    if events is None and recorded is not None:
        events = recorded
    tags = {"label": label or schedule.collective.value, "algorithm": schedule.algorithm.value}
    # A traced backend (XLA) cannot compare values on the host without executing the graph mid-trace.
    traced = getattr(getattr(backend, "capabilities", None), "execution", "eager") == "traced"
    checked = not check or schedule.world_size == 1 or mode is not None or traced
    post = backend.post if mode != "compute_only" else (lambda sends, recvs: _Done(x for _, x in recvs))
    run_collective = backend.collective if mode != "compute_only" else (lambda kind, ins, outs: _Done(outs))
    compute = program.compute if mode != "comm_only" else program.skip
    clock = time.perf_counter
    for step in steps:
        if not checked and step.communicates:
            _check_fingerprint(schedule, program, backend, timeout, step.index)
            checked = True
        with (record_function(f"{name}.step{step.index}") if profiling() else _NULL):
            t0 = clock()
            sends = [(t, program.payload(t.slice)) for t in step.sends]
            recvs = [(t, program.buffer(t.slice)) for t in step.recvs]
            pending = []
            if sends or recvs:
                pending.append((post(sends, recvs), None, None))
            for call in step.collectives:
                inputs, outputs, finish = program.collective_io(call)
                pending.append((run_collective(call.collective, inputs, outputs), finish, call))
            t1 = clock()
            if step.compute:
                if profiling():
                    with record_function(f"{name}.step{step.index}.compute"):
                        compute(step.compute)
                else:
                    compute(step.compute)
            t2 = clock()
            for handle, finish, call in pending:
                try:
                    got = handle.wait(timeout)
                except TimeoutError as e:
                    raise CommfuseTimeoutError(
                        f"rank {rank} timed out after {timeout:g} s in step {step.index} of {schedule.describe()} "
                        f"waiting for {_what(step, call)}: {e}"
                    ) from e
                except Exception as e:
                    raise CommunicationError(
                        f"rank {rank} failed in step {step.index} of {schedule.describe()} "
                        f"while waiting for {_what(step, call)}: {type(e).__name__}: {e}"
                    ) from e
                if finish is None:
                    for (t, _), tensor in zip(recvs, got):
                        program.land(t.slice, tensor)
                else:
                    finish(got)
            for x in step.accumulate:
                program.add(x)
            for x in releases.get(step.index, ()):
                program.release(x)
            t3 = clock()
        if events is not None:
            events.append(
                {
                    "step": step.index,
                    "post": (t0, t1),
                    "compute": (t1, t2),
                    "wait": (t2, t3),
                    "sends": [(t.peer, t.channel) for t in step.sends],
                    "recvs": [(t.peer, t.channel) for t in step.recvs],
                    "collectives": [f"{c.collective.value}[{c.part}]" for c in step.collectives],
                    **tags,
                }
            )
        if trace:
            print(
                f"[commfuse rank {rank}] {name} step {step.index}: post {1e3 * (t1 - t0):.3f} ms, "
                f"compute {1e3 * (t2 - t1):.3f} ms, wait+add {1e3 * (t3 - t2):.3f} ms "
                f"({_what(step, None)})",
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


FINGERPRINT_LEN = 48


def _check_fingerprint(schedule: Schedule, program: Program, backend, timeout: float, index: int) -> None:
    """Exchange the op's fingerprint with both ring neighbours before the first transfer.

    A wrong-sized message must never reach a transport: gloo, for one, aborts
    the receiving process when a message is larger than its buffer. Comparing
    with both neighbours catches any disagreement (if every rank agrees with
    its ring neighbours, all agree); the two ranks beside a disagreement raise
    at once, naming both sides, and the others time out in their first step.
    """
    values = program.fingerprint()
    if len(values) > FINGERPRINT_LEN:
        values = values[: FINGERPRINT_LEN - 1] + [hash(tuple(values)) & 0x7FFFFFFFFFFF]
    mine = torch.full((FINGERPRINT_LEN,), -1, dtype=torch.int64, device=backend.device)
    mine[: len(values)] = torch.tensor(values, dtype=torch.int64)
    ring = schedule.ring
    nxt, prv = ring.next(backend.rank), ring.prev(backend.rank)
    a, b = FINGERPRINT_CHANNELS
    from_prev, from_next = backend.empty((FINGERPRINT_LEN,), torch.int64), backend.empty((FINGERPRINT_LEN,), torch.int64)
    handle = backend.post(
        [(Transfer(SliceId(backend.rank), nxt, 1, a), mine), (Transfer(SliceId(backend.rank), prv, ring.world_size - 1, b), mine)],
        [(Transfer(SliceId(prv), prv, 1, a), from_prev), (Transfer(SliceId(nxt), nxt, ring.world_size - 1, b), from_next)],
    )
    try:
        got_prev, got_next = handle.wait(timeout)
    except TimeoutError as e:
        raise CommfuseTimeoutError(
            f"rank {backend.rank} timed out after {timeout:g} s exchanging the call fingerprint with ranks "
            f"{prv} and {nxt} before step {index} of {schedule.describe()}: they did not enter the same op"
        ) from e
    except Exception as e:
        raise CommunicationError(
            f"rank {backend.rank} failed exchanging the call fingerprint with ranks {prv} and {nxt} before step "
            f"{index} of {schedule.describe()}: {type(e).__name__}: {e}"
        ) from e
    own = mine.tolist()
    for peer, got in ((prv, got_prev), (nxt, got_next)):
        theirs = got.cpu().tolist()
        if theirs != own:
            raise MismatchError(
                f"rank {backend.rank} and rank {peer} called different ops: rank {backend.rank} has "
                f"{program.describe_fingerprint(_strip(own))}; rank {peer} has "
                f"{program.describe_fingerprint(_strip(theirs))}"
            )


def _strip(values: list[int]) -> list[int]:
    while values and values[-1] == -1:
        values = values[:-1]
    return values
