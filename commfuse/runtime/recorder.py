"""The flight recorder: per group and rank, the last N calls, and the dump that outlives a failure.

A recorder belongs to one process group on one rank (``GroupState.recorder``).
It keeps the last :data:`DEFAULT_SIZE` (``COMMFUSE_RECORDER``) calls in a
bounded deque, whose records are reused or replaced in place, so the
recorder never grows, however long the job runs.

What the step loop (``runtime.walks``) writes, per call: the plan (op, algorithm
and signature digest are read from it only when a dump is written), the
call number and thread lane, the site (``runtime.sites``) and the start
(``time.perf_counter_ns``). The recorder's entries are a ``deque`` bounded at
N, oldest first. Where the host blocks in waits (gloo: ``Plan.stamps``), the
entry is a reused :class:`Call` record that also gets the end and, per step
that communicates, three integers appended to the call's flat list: the
step's index, the time the host began to wait for it, and the time the wait
returned. The step's post time is the previous entry's completion (or the
call's start): between the two there is only bookkeeping. A step whose wait
has not returned is the last entry with two integers: the dump says the rank
waits there. Where it does not (a stream-ordered device, torch's ``fake``
group), the entry is one tuple, ``(plan, call number, lane, site, start)``,
appended in C: the host's enqueue has no end worth a second clock, so its end
is its start, and its status is read when asked (failed: :func:`failed` kept
its error by lane and call number; in progress: it is the newest entry and
the group's call in progress). That is the whole per-call cost on a device's
fast path: one tuple and one clock read (measured with
``benchmarks/host_overhead.py --recorder``; the reused record's four
attribute writes and second clock cost about 0.3 us more per call on a 2-core
CPU host). The peers and bytes of each step are the plan's, the same on
every call of a signature, learned on its first call (``Plan.sizes``).
Nothing is formatted and no dict is built while a call runs; the record's
strings are made when a dump is written.

On a stream-ordered backend (NCCL, HCCL) the host neither blocks in a post
nor in a wait, so host stamps would time nothing: there are none by default.
With ``COMMFUSE_DEVICE_TIMING=1`` each step's wait is bracketed instead by two
of the device's timing events (:class:`DeviceStamps`), recorded on the stream
that waits: the time between them is how long that stream stalled for the
step's transfers, the exposed communication. Recording an event queues it and
returns; nothing blocks the host. The events are read only when asked (a
metrics snapshot, a dump), and only once completed (``query()``): a call whose
events the device has not reached yet is not counted, and in a dump it is the
call the device is in, at the first step whose wait has not ended.

A dump is one JSON file per group and rank in :func:`trace_dir`
(``COMMFUSE_TRACE_DIR``, default ``./commfuse-traces``), written on a
failure (:func:`failed`: a timeout, a ``CommunicationError``, a
``MismatchError``, Ctrl-C in a wait), on SIGTERM and SIGHUP when the
program has not installed its own handler (:func:`install_signal_handlers`),
when the watchdog ends the process, and on demand (:func:`dump_all`).
``commfuse trace analyze`` (``commfuse.traces``) merges the ranks' files.

Every dump names its job (:func:`job_identity`), so that the dumps of two runs
written into one folder are never read as one: the first rank of the job to
make a recorder proposes an identity in the default group's store
(``compare_set``: the store keeps the first proposal and gives every later
rank that one), once per recorder, when the group's first call is planned;
nothing is added to a call.
"""

from __future__ import annotations

import collections
import itertools
import json
import os
import secrets
import signal
import socket
import sys
import threading
import time
import weakref

from commfuse.errors import first_line
from commfuse.runtime.env import flag, number, text

__all__ = ["DEFAULT_SIZE", "DEVICE", "FORMAT", "Call", "DeviceStamps", "Recorder", "device_timing", "device_waits",
           "dump_all", "failed", "group_name", "install_signal_handlers", "job_identity", "recorder_for", "recorders",
           "size_from_env", "stamper", "trace_dir"]

#: Calls each group keeps on each rank, unless ``COMMFUSE_RECORDER`` says otherwise (0: off).
DEFAULT_SIZE = 64
#: The most a ``COMMFUSE_RECORDER`` may ask for.
MAX_SIZE = 1 << 16
#: Where dumps go when ``COMMFUSE_TRACE_DIR`` is not set (relative to the working directory).
DEFAULT_DIR = "commfuse-traces"
#: The ``format`` field of every dump; ``commfuse trace analyze`` refuses files without it.
FORMAT = "commfuse-flight-recorder/1"

_clock = time.perf_counter_ns
_RECORDERS: "weakref.WeakSet[Recorder]" = weakref.WeakSet()
_LOCK = threading.Lock()


def size_from_env() -> int:
    """``COMMFUSE_RECORDER`` (calls kept per group, 0 to :data:`MAX_SIZE`; 0 turns the recorder off), else
    :data:`DEFAULT_SIZE`."""
    return number("COMMFUSE_RECORDER", DEFAULT_SIZE, 0, MAX_SIZE, kind=int, unit="calls (0: off)")


#: ``Plan.stamps`` where the device's timing events bracket each wait (``COMMFUSE_DEVICE_TIMING=1`` on a
#: stream-ordered device backend); True where the host's clock does (the host blocks in waits)
DEVICE = "device"


def device_timing() -> bool:
    """Whether ``COMMFUSE_DEVICE_TIMING`` asks for device timing events on stream-ordered backends (off by
    default: each step then records two events, a few microseconds of host time on a GPU)."""
    return flag("COMMFUSE_DEVICE_TIMING", False)


def trace_dir() -> str:
    """Where dumps go: ``COMMFUSE_TRACE_DIR``, else ``./commfuse-traces``."""
    return text("COMMFUSE_TRACE_DIR", DEFAULT_DIR)


class Call:
    """One call's record (reused: the ring's records are made once). ``head`` is (plan, call number, thread
    lane, site). The call has ended when ``end >= start``; it failed when ``error`` (the exception's class and
    first line, when, and the ``start`` of the call it concerns) is this call's; else it runs. ``steps`` is
    flat: per step that communicates its index, the wait's start and the wait's end (absent while the rank
    waits there), where the plan stamps (``Plan.stamps``: the host blocks in waits)."""

    __slots__ = ("head", "start", "end", "steps", "error", "dev")

    def __init__(self) -> None:
        self.head = (None, -1, ("", 0), None)
        self.start = 0  # 0: never used
        self.end = -1
        self.steps: list = []  # ints; with device stamps, each wait's start and end are the device's events
        self.error: tuple[str, int, int] | None = None
        self.dev: DeviceStamps | None = None  # made on the first device-stamped call this record holds

    @property
    def status(self) -> str:
        error = self.error
        if error is not None and error[2] == self.start:
            return "failed"
        return "ok" if self.end >= self.start else "in progress"


class DeviceStamps:
    """The stamp function of a call on a stream-ordered device (``Plan.stamps == DEVICE``): the step loop calls
    it as it calls a host-stamped call's ``steps.append``, three times per waited step (the step's index, then
    the wait's start and end, each read from the host's clock), and this keeps the index and records, in place
    of each time, a timing event on the device's current stream. The events are the record's own, made once
    by ``make`` (the backend's ``timing_event``) and recorded again on each call the record holds."""

    __slots__ = ("flat", "pool", "make")

    def __init__(self, flat: list, make) -> None:
        self.flat, self.pool, self.make = flat, [], make

    def __call__(self, value: int) -> None:
        flat = self.flat
        k = len(flat)
        if k % 3 == 0:  # the step's index
            flat.append(value)
            return
        pool = self.pool
        while len(pool) <= k:
            pool.append(None)
        event = pool[k]
        if event is None:
            event = pool[k] = self.make()
        event.record()
        flat.append(event)


def stamper(call: Call, plan):
    """The stamp function for one call of ``plan`` (``plan.stamps`` true), the record's steps cleared: the list's
    ``append`` where the host's clock stamps, a :class:`DeviceStamps` where the device's events do."""
    flat = call.steps
    flat.clear()
    if plan.stamps is not DEVICE:
        return flat.append
    dev = call.dev
    if dev is None or dev.flat is not flat:
        dev = call.dev = DeviceStamps(flat, plan.backend.timing_event)
    return dev


def device_waits(flat: list) -> list[int] | None:
    """A device-stamped call's steps as the host's are kept (index, 0, the wait in ns; flat), once the device
    has passed every event; None while it has not (an event is asked, never waited on)."""
    out = []
    for j in range(0, len(flat) - 2, 3):
        ns = _stalled_ns(flat[j + 1], flat[j + 2])
        if ns is None:
            return None
        out += (flat[j], 0, ns)
    return out


def _stalled_ns(began, done) -> int | None:
    """How long the stream stalled between two of a step's events, in ns; None until the device has passed
    ``done``, or where it never recorded them (a call that failed before)."""
    try:
        return int(began.elapsed_time(done) * 1e6) if done.query() else None
    except RuntimeError:
        return None


#: The key, in the default group's store, under which the ranks of a job agree on its identity.
JOB_KEY = "commfuse/job"


def job_identity() -> tuple[str | None, str | None]:
    """This job's identity and where it came from: ``(id, "store")``, agreed in the default group's store (the
    first rank to ask proposes the UTC time and 8 random hex digits, and every rank reads back that one
    proposal, so the ranks of one job share it and another job, with a store of its own, does not); else
    ``(TORCHELASTIC_RUN_ID.restart, "TORCHELASTIC_RUN_ID")`` where torchrun set a run id; else ``(None,
    None)``. One store round trip, made when a group's recorder is made (its first planned call), never in a
    call; a store that cannot be reached gives the fallback."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            import torch.distributed.distributed_c10d as c10d

            store = c10d._get_process_group_store(c10d._get_default_group())
            proposal = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + secrets.token_hex(4)
            agreed = store.compare_set(JOB_KEY, "", proposal)
            text = agreed.decode("utf-8", "replace") if isinstance(agreed, bytes) else str(agreed)
            if text:
                return text[:200], "store"
    except Exception:  # noqa: BLE001 - a store without compare_set (torch's fake one) or one that is gone
        pass
    run = os.environ.get("TORCHELASTIC_RUN_ID", "").strip()
    if run and run.lower() != "none":
        return f"{run[:160]}.{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0').strip()[:20]}", "TORCHELASTIC_RUN_ID"
    return None, None


class Recorder:
    """The ring of one group's last ``size`` calls on this rank (see the module)."""

    __slots__ = ("state", "size", "entries", "append", "ring", "next", "errors", "dumps", "job", "__weakref__")

    def __init__(self, state, size: int) -> None:
        self.state = state
        self.size = size
        #: (the job's identity, where it came from): see :func:`job_identity`; written into every dump
        self.job = job_identity()
        #: the last ``size`` calls, oldest first: :class:`Call` records (calls that stamp) and tuples
        #: ``(plan, seq, lane, site, start)`` (calls that do not); ``append`` is the deque's own, which the step
        #: loop calls with the tuple it builds in place (a method of ours there would cost a measurable share
        #: of the +1 us budget)
        self.entries: collections.deque = collections.deque(maxlen=size)
        self.append = self.entries.append
        # The records that stamping calls reuse, taken in turn: one is taken again only after ``size`` more
        # calls were appended, so it has left ``entries`` by then.
        self.ring = [Call() for _ in range(size)]
        self.next = itertools.cycle(self.ring).__next__
        #: the errors of failed calls that have no record (tuple entries), by (lane code, call number)
        self.errors: dict[tuple[int, int], tuple[str, int, int]] = {}
        self.dumps = 0

    def begin(self, head: tuple) -> Call:
        """A stamping call's record (the host blocks in its waits, so a method call here costs nothing that
        shows): the oldest reused :class:`Call`, its ``head`` (plan, seq, lane, site) and start written, and
        appended to the entries."""
        call = self.next()
        call.head, call.start, call.end, call.error = head, _clock(), -1, None
        self.append(call)
        return call

    def calls(self) -> list[Call]:
        """The calls kept, oldest first, each as a :class:`Call` (a tuple entry is read into a new one: its
        status decided now)."""
        entries = list(self.entries)
        state = self.state
        last = len(entries) - 1
        out = []
        for i, e in enumerate(entries):
            if type(e) is not tuple:
                out.append(e)
                continue
            plan, seq, lane, site, start = e
            c = Call()
            c.head, c.start, c.end = (plan, seq, lane, site), start, start
            error = self.errors.get((lane[1], seq))
            if error is not None and error[2] == start:
                c.error = error
            elif i == last and state.busy is not None and state.now == seq and state.lane == lane:
                c.end = -1  # the group's call in progress
            out.append(c)
        return out

    # -- dumps --------------------------------------------------------------------------------------------------

    def to_dict(self, reason: str, error: BaseException | None = None) -> dict:
        state = self.state
        wall, mono = time.time_ns(), _clock()
        calls = [_call_dict(c, wall - mono) for c in self.calls()]
        out = {
            "format": FORMAT,
            "group": group_name(state),
            "rank": state.rank,
            "global_rank": _global_rank(),
            "world_size": state.world_size,
            "job": self.job[0],
            "job_from": self.job[1],
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "reason": reason,
            "written_ns": wall,
            "kept": self.size,
            "dead": None if state.error is None else f"{type(state.error).__name__}: {state.error}",
            "calls": calls,
        }
        if error is not None:
            out["error"] = {"type": type(error).__name__, "message": str(error)}
        return out

    def dump(self, reason: str, error: BaseException | None = None, directory: str | None = None) -> str | None:
        """Write this recorder's JSON file (replacing the one it wrote before); its path, or None when it could
        not be written (said on stderr: a dump never raises over the error that caused it)."""
        if self.state.rank is None:
            return None
        folder = directory or trace_dir()
        name = f"commfuse-trace-{_safe(group_name(self.state))}-rank{self.state.rank}.json"
        path = os.path.join(folder, name)
        try:
            data = self.to_dict(reason, error)
            os.makedirs(folder, exist_ok=True)
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump(data, f, indent=1, default=str)
            os.replace(tmp, path)
        except Exception as e:  # noqa: BLE001 - the failure being dumped is what the user must see
            print(f"commfuse: could not write the flight recorder's dump {path}: {type(e).__name__}: {e}",
                  file=sys.stderr, flush=True)
            return None
        self.dumps += 1
        return path


def _call_dict(c: Call, to_wall: int) -> dict:
    plan, seq, lane, site = c.head
    steps_out = []
    stamps = getattr(plan, "stamps", False)
    stamped = stamps is True
    flat = list(c.steps) if stamped else []
    prev = c.start
    sizes = getattr(plan, "sizes", None) or {}
    steps = {st.index: st for st in plan.steps} if plan is not None else {}
    waiting = None
    status = c.status
    for j in range(0, len(flat), 3):
        entry = flat[j:j + 3]
        index, began = entry[0], entry[1]
        done = entry[2] if len(entry) == 3 else None
        send_to, recv_from = _peers(plan, steps.get(index))
        sent, received = sizes.get(index, (-1, -1))
        steps_out.append({"step": index, "send_to": send_to, "recv_from": recv_from, "bytes_sent": sent,
                          "bytes_received": received, "post_ns": prev + to_wall, "wait_ns": began + to_wall,
                          "done_ns": None if done is None else done + to_wall})
        if done is None:
            # a wait covers the step's sends too (gloo completes a send once the peer has taken it)
            waiting = {"step": index, "since_ns": began + to_wall, "waits_for": sorted({*send_to, *recv_from})}
        else:
            prev = done
    if status == "in progress" and waiting is None and plan is not None and not stamps:
        waiting = _posted(plan)  # no stamps (the host does not block): the backend's last post in the call
    schedule = getattr(plan, "schedule", None)
    error = c.error if status == "failed" else None
    out = {
        "seq": seq,
        "lane": lane[0],
        "lane_code": lane[1],
        "op": getattr(plan, "label", None),
        "algorithm": _shown(plan),
        "schedule": schedule.describe() if schedule is not None else None,
        "digest": getattr(plan, "digest", None),
        "site": None if site is None else site.label,
        "status": status,
        "error": None if error is None else error[0],
        "start_ns": c.start + to_wall,
        "end_ns": (c.end + to_wall) if status == "ok" else (error[1] + to_wall if error is not None else None),
        "steps_total": len(plan.steps) if plan is not None else None,
        "stamped": stamped,
        "waiting": waiting,
        "steps": steps_out,
    }
    if stamps is DEVICE and plan is not None:
        _device_steps(out, list(c.steps), plan)
    return out


def _device_steps(out: dict, flat: list, plan) -> None:
    """A device-stamped call's steps into its record ``out``: per waited step, the time the device's stream
    stalled in its wait (``device_wait_ns``, None until the device has passed it). A call the host completed
    but the device has not is in progress, waiting at its first step whose wait the device has not passed."""
    sizes = getattr(plan, "sizes", None) or {}
    steps = {st.index: st for st in plan.steps}
    waiting = None
    for j in range(0, len(flat), 3):
        entry = flat[j:j + 3]
        index = entry[0]
        wait_ns = _stalled_ns(entry[1], entry[2]) if len(entry) == 3 else None
        send_to, recv_from = _peers(plan, steps.get(index))
        sent, received = sizes.get(index, (-1, -1))
        out["steps"].append({"step": index, "send_to": send_to, "recv_from": recv_from, "bytes_sent": sent,
                             "bytes_received": received, "post_ns": None, "wait_ns": None, "done_ns": None,
                             "device_wait_ns": wait_ns})
        if wait_ns is None and waiting is None:
            waiting = {"step": index, "since_ns": None, "waits_for": sorted({*send_to, *recv_from}),
                       "device": True}
    if waiting is not None and out["status"] != "failed":
        out["status"], out["waiting"] = "in progress", waiting
    out["stamped"] = DEVICE


def _posted(plan) -> dict | None:
    """Where a call without stamps stands: the step of the backend's last post in it (a c10d backend counts
    its posts per call), as a waiting entry; None when the backend does not say."""
    posts = getattr(plan.backend, "_posts", None)
    if not posts:
        return None
    n = 0
    for st in plan.steps:
        n += (1 if st.p2p else 0) + len(st.collectives)
        if n >= posts:
            send_to, recv_from = _peers(plan, st)
            return {"step": st.index, "since_ns": None, "waits_for": sorted({*send_to, *recv_from}),
                    "posted_only": True}
    return None


def _peers(plan, st) -> tuple[list[int], list[int]]:
    if st is None:
        return [], []
    if st.collectives:
        others = [q for q in range(plan.schedule.world_size) if q != plan.rank]
        return others, others
    return sorted({t.peer for t, _ in st.sends}), sorted({t.peer for t, _ in st.recvs})


def _shown(plan) -> str | None:
    schedule = getattr(plan, "schedule", None)
    if schedule is None:
        return None
    from commfuse.schedule import AlgorithmSpec

    return AlgorithmSpec(schedule.algorithm.value if plan.overlap else "serial", schedule.parts,
                         schedule.chunks).shown


def group_name(state) -> str:
    group = getattr(state, "group", None)
    name = getattr(group, "group_name", None)
    return str(name) if name else state.name


def _global_rank():
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except Exception:  # noqa: BLE001
        pass
    return None


def _safe(text: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in text)[:80] or "group"


# -- making recorders, dumping them ------------------------------------------------------------------------------


def recorder_for(state) -> Recorder | None:
    """The recorder of a group's state, made on first use (None when ``COMMFUSE_RECORDER=0``, or for a group
    that has no rank or a single one: nothing to recover from there)."""
    rec = state.recorder
    if rec is not None or state.rank is None or state.world_size <= 1:
        return rec or None
    with _LOCK:
        rec = state.recorder
        if rec is None:
            size = size_from_env()
            rec = state.recorder = Recorder(state, size) if size else False
            if rec:
                _RECORDERS.add(rec)
                install_signal_handlers()
    return rec or None


def recorders() -> list[Recorder]:
    """Every live recorder of this process."""
    return list(_RECORDERS)


def dump_all(reason: str = "on demand", directory: str | None = None) -> list[str]:
    """Dump every group's recorder of this process; the paths written."""
    paths = []
    for rec in recorders():
        path = rec.dump(reason, None, directory)
        if path is not None:
            paths.append(path)
    return paths


def failed(call: Call | tuple | None, state, error: BaseException) -> None:
    """A call failed on this rank: its record says so (a :class:`Call`'s ``error``; a tuple entry's error kept
    by lane and call number) and, for an error that concerns the group (a timeout, a ``CommunicationError``, a
    ``MismatchError``, an interruption), the group's recorder is dumped. An error of the caller's own compute
    that was settled (its peers told, the call completed) is recorded, not dumped."""
    rec = state.recorder
    what = first_line(error, 300, named=True)
    if type(call) is tuple:
        if rec:
            _, seq, lane, _, start = call
            errors = rec.errors
            if (lane[1], seq) not in errors:
                errors[(lane[1], seq)] = (what, _clock(), start)
                while len(errors) > rec.size:  # the oldest first (a dict keeps its insertion order)
                    del errors[next(iter(errors))]
    elif call is not None and call.status == "in progress":
        call.error = (what, _clock(), call.start)
    if not rec:
        return
    from commfuse.errors import CommunicationError

    if isinstance(error, CommunicationError) or not isinstance(error, Exception):
        rec.dump(f"{type(error).__name__} on this rank", error)


# -- signals ----------------------------------------------------------------------------------------------------

#: Signals whose default action ends the process and that a job's scheduler or terminal sends: a handler
#: dumps every recorder, then the signal's default action runs. SIGKILL cannot be caught; SIGSEGV, SIGBUS,
#: SIGILL and an abort() from C end the process before Python could run a handler (faulthandler, in C, can
#: print tracebacks there; it cannot write a dump).
DUMP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))
_installed: dict[int, object] = {}


def install_signal_handlers() -> None:
    """On the main thread, for each of :data:`DUMP_SIGNALS` whose handler is still the default, install one
    that dumps and then lets the default action happen (the signal is sent again with the default handler
    back in place). A program's own handler is left alone (it may call ``commfuse.metrics.dump_trace()``).
    ``COMMFUSE_TRACE_SIGNALS=0`` installs none."""
    if not flag("COMMFUSE_TRACE_SIGNALS", True):
        return
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in DUMP_SIGNALS:
        if sig in _installed:
            continue
        try:
            if signal.getsignal(sig) is not signal.SIG_DFL:
                continue
            signal.signal(sig, _on_signal)
        except (ValueError, OSError):  # not the main interpreter, or a platform that refuses
            continue
        _installed[sig] = signal.SIG_DFL
        _OWNER[0] = os.getpid()


#: The process that installed the handlers: a child forked after (a data loader's worker) inherits them with a
#: copy of the recorders, and must not overwrite its parent's dumps with that copy
_OWNER = [0]


def _on_signal(signum, frame) -> None:
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = str(signum)
    try:
        if os.getpid() == _OWNER[0]:
            for rec in recorders():
                rec.dump(f"{name} received")
    finally:
        # never swallow it: the default action (the end of the process) happens now
        signal.signal(signum, _installed.pop(signum, signal.SIG_DFL))
        os.kill(os.getpid(), signum)
