"""The watchdog that bounds waits the host does not block on.

On a stream-ordered backend (NCCL, HCCL) a step's wait only makes the
compute stream wait for the communication: the host goes on queueing work,
and a ``Work.wait(timeout=...)`` would instead spin the host until the
transfer is done (measured on an H100 with NCCL 2.28: 56.7 ms of host time
for a 64 MiB exchange, against 0.3 ms without a timeout). So the promise that
no wait hangs forever is kept here instead: each posted step registers its
works with a deadline; one daemon thread polls ``work.is_completed()``
(non-blocking on every c10d backend) and,

* when a deadline passes first: records a
  :class:`~commfuse.errors.CommfuseTimeoutError` naming the rank, step,
  peers and op on the group, so every later commfuse call on that group
  raises it at once; prints it to stderr (the host may be blocked in a
  device sync by then); and aborts the process group where torch can
  (``ProcessGroup.abort()``), so that the kernels stuck on the dead peer
  end instead of hanging the device: a host sync then returns, and the next
  call raises the error;
* when a work fails first (NCCL saw the peer's sockets close): the same,
  with the transport's cause, and the error is fatal (below). c10d's own
  watchdog takes such a process down too, by default, after dumping its
  debug state (a minute on the H100 testbed): the device may have run later
  kernels on incomplete data. commfuse ends it at once, with the rank, step
  and peer named.

The host itself can also be held: NCCL sets up the communicator of a pair
of ranks on their first transfer, and that set-up blocks the host until the
peer joins; a peer that never calls holds it forever. So a stream-ordered
backend also tells the watchdog when it enters and leaves the transport's
post (:meth:`Watchdog.posting`: two attribute writes per step). A post still
in progress at its deadline cannot be interrupted from Python (the thread is
inside C++), so this too is fatal.

Fatal: the watchdog records and prints the named error, gives it to the
``on_fatal`` hooks (``commfuse.launch`` reports it to its parent that way),
and ends the process with exit code :data:`EXIT_CODE`.
``COMMFUSE_WATCHDOG_EXIT=0`` keeps the process: the group is poisoned and
aborted as on a timeout, and a held post waits for the process group's own
timeout.

Per step the cost on the host is one ``time.monotonic()`` and one deque
append. The poll interval is ``COMMFUSE_WATCHDOG_POLL_S`` (default 0.05 s, from
0.001 to 60).

Device-graph capture: a poll asks the device about works, and a query from
this thread while another thread captures a CUDA graph in the default
("global") capture mode invalidates the capture (torch.cuda.graph docs,
``capture_error_mode``; pytorch/pytorch#104487 is the same trouble with c10d's
own watchdog). :meth:`Watchdog.paused` holds the polls, waiting for one in
progress to end, and moves every deadline on by the pause when it ends;
``commfuse.graphs`` holds it around its captures. The steps of a captured
call are never handed to the watchdog at all (``runtime.c10d``).
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable

from commfuse.errors import CommfuseTimeoutError, CommunicationError, first_line
from commfuse.runtime.board import grace
from commfuse.runtime.env import flag, number
from commfuse.runtime.recorder import dump_all

__all__ = ["EXIT_CODE", "Posting", "Watchdog", "watchdog"]

#: The exit code of a process the watchdog ends because its host was held inside a post past the deadline.
EXIT_CODE = 75
#: How often the watchdog polls, in seconds, unless ``COMMFUSE_WATCHDOG_POLL_S`` (0.001 to 60) says otherwise.
POLL_S = 0.05
#: How long :meth:`Watchdog.paused` waits for a poll in progress to end, in seconds.
DRAIN_S = 2.0


class Posting:
    """One backend's post in progress, as the watchdog sees it: ``since`` (``time.monotonic()`` at entry, or
    None between posts), the ``timeout`` of the current call, and ``describe(timeout)`` for the message."""

    __slots__ = ("since", "timeout", "describe", "on_expiry", "__weakref__")

    def __init__(self, describe: Callable[[float], str], on_expiry: Callable[[BaseException], None]) -> None:
        self.since: float | None = None
        self.timeout = 0.0
        self.describe = describe
        self.on_expiry = on_expiry


class Watchdog:
    """Polls registered works against their deadlines in one daemon thread."""

    def __init__(self, poll_s: float | None = None) -> None:
        self.poll_s = poll_s if poll_s is not None else number("COMMFUSE_WATCHDOG_POLL_S", POLL_S, 0.001, 60)
        self.grace = grace()
        self.pending: collections.deque = collections.deque()
        self.fired: list[CommfuseTimeoutError] = []
        self.postings: weakref.WeakSet = weakref.WeakSet()
        #: called with the error before the watchdog ends a process whose host is held in a post
        self.on_fatal: list[Callable[[BaseException], None]] = []
        self.exit = flag("COMMFUSE_WATCHDOG_EXIT", True)
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._poll_lock = threading.Lock()  # held by a poll in progress
        self._count_lock = threading.Lock()  # guards the count of holds (paused())
        self._pauses = 0
        self._paused_at = 0.0
        self._stopped = threading.Event()  # set by stop(): the thread leaves its loop

    def watch(self, works, deadline: float, describe: Callable[[str | None], str],
              on_expiry: Callable[[BaseException], None],
              stalled: Callable[[], BaseException | None] | None = None) -> None:
        """Watch ``works`` until they complete. Past ``deadline`` (``time.monotonic()``) report
        ``describe(None)`` as a :class:`CommfuseTimeoutError` through ``on_expiry(error)``; a work that fails
        first is reported at once, as ``describe(cause)`` in a :class:`CommunicationError`, and is fatal
        (see the module). ``stalled()``, asked on every poll once the works have been pending longer than the
        grace period (``commfuse.runtime.board.grace()``), reads the group's board: an error it returns (a
        peer of the call failed, the group was declared dead) is reported the same way, and is fatal too."""
        self.pending.append((works, deadline, describe, on_expiry, stalled, time.monotonic()))
        if self._thread is None:
            self._start()

    def posting(self, describe: Callable[[float], str], on_expiry: Callable[[BaseException], None]) -> Posting:
        """A :class:`Posting` for one backend, watched from now on (while the backend keeps it)."""
        entry = Posting(describe, on_expiry)
        self.postings.add(entry)
        if self._thread is None:
            self._start()
        return entry

    def _start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="commfuse-watchdog", daemon=True)
                self._thread.start()
                atexit.register(self.stop)

    def _loop(self) -> None:
        stopped = self._stopped
        while not stopped.wait(self.poll_s):
            self.poll()

    def stop(self) -> None:
        """End the polling thread and wait for it, at most :data:`DRAIN_S` (registered to run at interpreter
        exit). Python ends a daemon thread that wakes after finalisation began by unwinding it, and an unwind
        through C++ that released the GIL (c10d's ``work.wait()`` or ``is_completed()`` in a poll) aborts the
        process after the job's work is done: "terminate called without an active exception", exit code 134
        (every ``commfuse bench --fake-pg`` run on an H100 ended so). So the thread must be out of its polls
        before finalisation starts. A poll held inside a transport call cannot be waited out: the join gives
        up then."""
        self._stopped.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(DRAIN_S)

    @contextlib.contextmanager
    def paused(self):
        """Hold the polls for the duration (nested holds count), so that nothing queries the device while a
        device graph is captured (see the module). Entering waits for a poll in progress to end (at most
        :data:`DRAIN_S`: a poll held inside a transport call cannot be waited out). When the last hold ends,
        every pending step's deadline moves on by the time the polls were held, so that a pause is not
        counted against a step's timeout. (A post in progress keeps its deadline: the host thread inside a
        post writes its start, and this must not race with it.)"""
        with self._count_lock:
            if self._pauses == 0:
                self._paused_at = time.monotonic()
            self._pauses += 1
        # no poll starts from now on; acquiring the poll lock once proves the one in progress, if any, ended
        if self._poll_lock.acquire(timeout=DRAIN_S):
            self._poll_lock.release()
        try:
            yield self
        finally:
            with self._count_lock:
                last = self._pauses == 1
                held = time.monotonic() - self._paused_at
            if last:  # still counted as paused: no poll runs while the deadlines move
                self._shift(held)
            with self._count_lock:
                self._pauses -= 1

    def _shift(self, seconds: float) -> None:
        """Move every pending step's deadline on by ``seconds`` (while paused, so no poll runs)."""
        moved = []
        while True:
            try:
                works, deadline, describe, on_expiry, stalled, since = self.pending.popleft()
            except IndexError:
                break
            moved.append((works, deadline + seconds, describe, on_expiry, stalled, since + seconds))
        self.pending.extendleft(reversed(moved))

    def poll(self) -> None:
        """One pass: drop what completed, report what failed or expired (called by the thread; callable in
        tests). Nothing while :meth:`paused` is held, or while another thread's poll is in progress (that one
        covers this one)."""
        if self._pauses or not self._poll_lock.acquire(blocking=False):
            return
        try:
            if not self._pauses:  # a hold may have begun between the check and the lock
                self._poll()
        finally:
            self._poll_lock.release()

    def _poll(self) -> None:
        now = time.monotonic()
        keep = []
        failure = None
        while True:
            try:
                entry = self.pending.popleft()
            except IndexError:
                break
            works, deadline, describe, on_expiry, stalled, since = entry
            pending = False
            failed = None
            for work in works:
                # c10d's NCCL work raises the transport's error from is_completed (its Work.exception() is
                # deprecated, and on NCCL with torch 2.11 it cannot even return its value to Python), and,
                # once a failed work counts as completed, from wait(), which on a completed work returns at
                # once or raises the error it ended with
                try:
                    if not work.is_completed():
                        pending = True
                    else:
                        work.wait()
                except Exception as e:  # noqa: BLE001
                    failed = e
                    break
            if failed is not None:
                # NCCL fails every work of a communicator once it has an error, older steps not yet
                # polled too: the newest one is the step that met the fault
                failure = (failed, describe, on_expiry)
                continue
            if not pending:
                continue
            if now > deadline:
                self._report(CommfuseTimeoutError(describe(None)), on_expiry)
                continue
            if stalled is not None and now - since > self.grace:
                try:
                    told = stalled()
                except Exception as e:  # noqa: BLE001 - a board that cannot be read tells nothing
                    told = None
                    print(f"commfuse watchdog: reading the board failed: {type(e).__name__}: {e}", file=sys.stderr,
                          flush=True)
                if told is not None:
                    failure = failure or (told, None, on_expiry)
                    continue
            keep.append(entry)
        if failure is not None:
            failed, describe, on_expiry = failure
            if describe is None:  # the board told of a peer's failure: the named error itself
                error = failed
            else:
                error = CommunicationError(describe(first_line(failed, None, named=True)))
            self._report(error, on_expiry)
            self._end(error)
        self.pending.extendleft(reversed(keep))
        for entry in list(self.postings):
            since = entry.since
            if since is not None and now > since + entry.timeout:
                entry.since = None  # fire once
                error = CommfuseTimeoutError(entry.describe(entry.timeout))
                self._report(error, entry.on_expiry)
                self._end(error)

    def _report(self, error: BaseException, on_expiry: Callable[[BaseException], None]) -> None:
        self.fired.append(error)
        print(f"commfuse watchdog: {error}", file=sys.stderr, flush=True)
        try:
            on_expiry(error)
        except Exception as e:  # noqa: BLE001 - the watchdog must keep watching
            print(f"commfuse watchdog: acting on the expiry failed: {type(e).__name__}: {e}", file=sys.stderr,
                  flush=True)

    def _end(self, error: BaseException) -> None:
        """End the process after a fatal error (see the module), unless ``COMMFUSE_WATCHDOG_EXIT=0``."""
        if not self.exit:
            return
        dump_all(f"the watchdog ends the process: {type(error).__name__}")  # the flight recorder's last word
        for hook in list(self.on_fatal):
            try:
                hook(error)
            except Exception:  # noqa: BLE001 - the process ends anyway
                pass
        print(f"commfuse watchdog: ending the process (exit code {EXIT_CODE}); COMMFUSE_WATCHDOG_EXIT=0 keeps "
              "it", file=sys.stderr, flush=True)
        os._exit(EXIT_CODE)


_WATCHDOG: Watchdog | None = None


def watchdog() -> Watchdog:
    """The process's watchdog (made on first use)."""
    global _WATCHDOG
    if _WATCHDOG is None:
        _WATCHDOG = Watchdog()
    return _WATCHDOG
