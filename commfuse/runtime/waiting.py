"""Waits the host blocks on (gloo), made interruptible, bounded by commfuse's timeout, and watched.

A gloo transfer's ``work.wait(timeout)`` blocks inside C++: Ctrl-C reaches
Python only when it returns, and when its own timeout fires gloo closes every
connection of the group. So a host-blocking wait runs on a waiter thread
(one per calling thread, made on first use), and the calling thread waits on
a lock, which Python interrupts at once. The handoff costs some tens of
microseconds per wait on a busy CPU: nothing beside a gloo step, and a
stream-ordered backend (NCCL, HCCL) never comes here (its waits do not block
the host; see ``commfuse.runtime.watchdog``).

While it waits, the calling thread:

* past the grace period (``commfuse.runtime.board.grace()``), asks its
  context for a :class:`~commfuse.runtime.board.Stall` and has it read the
  group's board every :data:`~commfuse.runtime.board.POLL_S` (a peer that
  failed, a mismatch, a straggler), which may end the wait with a named
  error;
* at the timeout, has the stall name who never came, and raises;
* on Ctrl-C (or any exception raised into it), tells the context the wait was
  abandoned (the group is declared dead: a gloo transfer that was posted
  cannot be taken back) and lets the exception through.

The gloo wait itself is given the timeout plus :data:`BACKSTOP_S`, so that
commfuse's own timeout, with its diagnosis, always comes first.
"""

from __future__ import annotations

import _thread
import queue
import threading
import time
import weakref
from collections.abc import Callable

from commfuse.runtime.board import POLL_S, grace

__all__ = ["BACKSTOP_S", "wait_blocking"]

#: Seconds a waiter's own transport wait runs past commfuse's timeout (a backstop: the calling thread raises
#: at the timeout and declares the group dead, which ends the transport's wait at once).
BACKSTOP_S = 30.0


class _Job:
    __slots__ = ("fn", "done", "value", "error")

    def __init__(self, fn: Callable[[], object]) -> None:
        self.fn = fn
        self.done = _thread.allocate_lock()
        self.done.acquire()
        self.value = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.value = self.fn()
        except BaseException as e:  # noqa: BLE001 - handed to the thread that waits
            self.error = e
        finally:
            self.fn = None
            self.done.release()

    def result(self):
        if self.error is not None:
            error, self.error = self.error, None
            raise error
        return self.value


#: Seconds an idle waiter waits for its next job before it checks whether the thread it serves still lives.
IDLE_S = 30.0


class _Waiter:
    """A daemon thread that runs blocking waits handed to it, one at a time, for one calling thread; it
    ends once that thread has ended (checked every :data:`IDLE_S` while idle), or when told to."""

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        #: a job its caller stopped waiting for may still be running: then the next wait takes a new waiter
        self.abandoned = False
        owner = weakref.ref(threading.current_thread())
        thread = threading.Thread(target=self._loop, args=(owner,), name="commfuse-waiter", daemon=True)
        thread.start()

    def _loop(self, owner) -> None:
        while True:
            try:
                job = self.jobs.get(timeout=IDLE_S)
            except queue.Empty:
                thread = owner()
                if thread is None or not thread.is_alive():
                    return
                continue
            if job is None:
                return
            job.run()


_local = threading.local()


def _waiter() -> _Waiter:
    waiter = getattr(_local, "waiter", None)
    if waiter is None or waiter.abandoned:
        if waiter is not None:
            waiter.jobs.put(None)  # it ends once its abandoned job does
        waiter = _local.waiter = _Waiter()
    return waiter


def wait_blocking(block: Callable[[], object], timeout: float, context) -> object:
    """``block()`` (a transport's blocking wait, bounded by ``timeout`` + :data:`BACKSTOP_S`) on this thread's
    waiter; returns what it returns or raises what it raises.

    ``context`` says what the wait is, when asked (never on the fast path):
    ``context.stall()`` makes a :class:`~commfuse.runtime.board.Stall` or
    returns None; ``context.timeout_text(timeout)`` says who waited on what;
    ``context.abandon(why)`` is told when the wait is left unfinished.
    """
    waiter = _waiter()
    job = _Job(block)
    start = time.monotonic()
    waiter.jobs.put(job)
    first = grace()
    stall = None
    deadline = start + timeout
    try:
        done = job.done.acquire(timeout=min(first, timeout))
        while not done:
            now = time.monotonic()
            if now >= deadline:
                if stall is None:
                    stall = context.stall()
                text = context.timeout_text(timeout)
                if stall is None:
                    raise TimeoutError(text)
                stall.timed_out(timeout, text)  # raises
            if now - start >= first:
                if stall is None:
                    stall = context.stall()
                if stall is not None:
                    stall.poll()  # may raise, having declared the group dead
            done = job.done.acquire(timeout=max(0.0, min(POLL_S, deadline - time.monotonic())))
    except BaseException as e:
        waiter.abandoned = True  # its job still runs: the next wait takes a new waiter
        if not _named(e):  # Ctrl-C, or a timeout with no board: the posted transfer cannot be taken back
            try:
                context.abandon(f"{type(e).__name__} while waiting" + (f": {e}" if str(e) else ""))
            except Exception:  # noqa: BLE001 - the original exception is what the caller sees
                pass
        raise
    finally:
        if stall is not None:
            stall.finished()
    return job.result()


def _named(error: BaseException) -> bool:
    """Whether ``error`` is one of commfuse's own verdicts (the stall already declared what it had to)."""
    from commfuse.errors import CommfuseError

    return isinstance(error, CommfuseError)
