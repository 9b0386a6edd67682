"""Tier (a), one process, real threads: commfuse.runtime.waiting's host-blocking waits are bounded,
interruptible at once, say who they waited on, and leave no thread behind."""

from __future__ import annotations

import _thread
import threading
import time

import pytest

from commfuse.runtime import waiting


class Context:
    """What a wait asks of its caller (the c10d handle, in the library): no board here."""

    def __init__(self) -> None:
        self.abandoned: list[str] = []

    def stall(self):
        return None

    def timeout_text(self, timeout: float) -> str:
        return f"rank 0 timed out after {timeout:g} s in step 3 of a test op, waiting for rank 1"

    def abandon(self, why: str) -> None:
        self.abandoned.append(why)


def test_a_wait_returns_what_the_transport_returned_and_raises_what_it_raised():
    assert waiting.wait_blocking(lambda: 42, 5.0, Context()) == 42

    def broken():
        raise RuntimeError("Connection closed by peer")

    with pytest.raises(RuntimeError, match="closed by peer"):
        waiting.wait_blocking(broken, 5.0, Context())


def test_a_wait_past_its_timeout_names_what_it_waited_on_and_is_abandoned():
    context = Context()
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="step 3 of a test op, waiting for rank 1"):
        waiting.wait_blocking(lambda: time.sleep(3), 0.3, context)
    assert time.monotonic() - t0 < 2.5  # the timeout ended it, not the transport's own wait
    assert context.abandoned and "TimeoutError" in context.abandoned[0]


@pytest.mark.usefixtures("sigint_handled")
def test_ctrl_c_reaches_python_while_the_transport_still_blocks():
    context = Context()
    sent = []

    def interrupt():
        sent.append(time.monotonic())
        _thread.interrupt_main()

    timer = threading.Timer(0.8, interrupt)
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        waiting.wait_blocking(lambda: time.sleep(4), 30.0, context)
    assert time.monotonic() - sent[0] < 1.0  # the block (4 s) had not returned
    assert context.abandoned and "KeyboardInterrupt" in context.abandoned[0]


def test_a_waiter_ends_once_the_thread_it_served_has_ended(monkeypatch):
    monkeypatch.setattr(waiting, "IDLE_S", 0.05)

    def names():
        return [t for t in threading.enumerate() if t.name == "commfuse-waiter"]

    before = len(names())
    workers = [threading.Thread(target=waiting.wait_blocking, args=(lambda: 1, 5.0, Context())) for _ in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(5)
    deadline = time.monotonic() + 5
    while len(names()) > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(names()) <= before, names()
