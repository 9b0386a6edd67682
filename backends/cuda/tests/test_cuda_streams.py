"""Tier (a), no processes, no GPU: the CUDA stream path's call sequence, with stand-ins for the CUDA calls.

What this proves: per post exactly one switch to the communication stream and back, the current stream
resolved once by the device's integer index, events reused from the pool (never one made per step), no
host synchronisation, the transfers issued while the communication stream is current, the join under graph
capture, the slow path when another device is current, and the stream restored when issuing raises. What it
cannot prove: that CUDA and c10d behave as the stand-ins assume (UNVERIFIED here: no GPU).
"""

from __future__ import annotations

import threading

import pytest

from commfuse.runtime.c10d import C10dBackend
from commfuse.schedule import Collective
from commfuse_cuda.backend import CommStream, CudaBackend, EventPool


class FakeStream:
    def __init__(self, name: str, device: int) -> None:
        self.name, self.device = name, device

    def __repr__(self) -> str:
        return self.name


class FakeApi:
    """torch.cuda as CommStream uses it, logging every call; the events refuse to synchronise the host."""

    def __init__(self, device: int = 0, current_device: int | None = None) -> None:
        self.log: list[tuple] = []
        self.device = device
        self.current = {device: FakeStream("compute", device)}
        self.device_now = device if current_device is None else current_device
        self.current.setdefault(self.device_now, FakeStream(f"compute{self.device_now}", self.device_now))
        self.capturing = False
        api = self

        class Event:
            made = 0

            def __init__(self) -> None:
                Event.made += 1
                self.name = f"e{Event.made}"

            def record(self, stream) -> None:
                api.log.append(("record", self.name, stream.name))

            def wait(self, stream) -> None:
                api.log.append(("wait", self.name, stream.name))

            def synchronize(self):  # pragma: no cover - must never be called
                raise AssertionError("host sync")

            query = synchronize

        class StreamContext:
            def __init__(self, stream) -> None:
                self.stream = stream

            def __enter__(self):
                api.log.append(("context-enter", self.stream.name))
                self.prev_device, self.prev = api.device_now, api.current[self.stream.device]
                api.current[self.stream.device] = self.stream

            def __exit__(self, *exc):
                api.log.append(("context-exit", self.stream.name))
                api.current[self.stream.device] = self.prev
                api.device_now = self.prev_device

        self.new_event = Event
        self.stream_context = StreamContext

    def priority_range(self):
        return (0, -5)

    def new_stream(self, index, priority):
        self.log.append(("new-stream", index, priority))
        return FakeStream("comm", index)

    def current_stream(self, index):
        assert isinstance(index, int), "the current stream is looked up by the device's int index"
        self.log.append(("current-stream", index))
        return self.current[index]

    def current_device(self):
        return self.device_now

    def set_stream(self, stream) -> None:
        self.log.append(("set-stream", stream.name))
        self.device_now = stream.device  # as torch's: setting a stream of another device switches the device
        self.current[stream.device] = stream

    def is_current_stream_capturing(self):
        return self.capturing


def made_streams(api: FakeApi, index: int = 0) -> CommStream:
    streams = CommStream(index, api=api)
    assert api.log == [("new-stream", index, -5)]  # the highest priority of (0, -5)
    api.log.clear()
    return streams


def test_event_pool_reuses_and_bounds():
    made = []
    pool = EventPool(lambda: made.append(object()) or made[-1], keep=2)
    a = pool.take()
    pool.give(a)
    assert pool.take() is a and pool.made == 1
    b, c, d = pool.take(), pool.take(), pool.take()
    assert len({id(a), id(b), id(c), id(d)}) == 4 and pool.made == 4
    for e in (a, b, c, d):
        pool.give(e)
    assert pool.free == [a, b]  # keeps at most 2


def test_event_pool_never_hands_one_event_to_two_threads():
    pool = EventPool(object, keep=8)
    held: list = []
    lock = threading.Lock()

    def worker():
        for _ in range(2000):
            e = pool.take()
            with lock:
                assert e not in held
                held.append(e)
            with lock:
                held.remove(e)
            pool.give(e)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert pool.made <= 8 and len(pool.free) == pool.made


def test_one_switch_per_post_and_events_reused():
    api = FakeApi()
    streams = made_streams(api)
    for _ in range(3):
        token = streams.enter()
        assert api.current[0].name == "comm"  # issued from here
        api.log.append(("issue",))
        streams.leave(token)
        assert api.current[0].name == "compute" and api.device_now == 0
    step = [("current-stream", 0), ("record", "e1", "compute"), ("wait", "e1", "comm"), ("set-stream", "comm"),
            ("issue",), ("set-stream", "compute")]
    assert api.log == step * 3  # one event, made once, recorded and waited on per step; nothing else
    assert api.new_event.made == 1 and streams.events.made == 1


def test_the_current_stream_is_resolved_on_every_post():
    api = FakeApi()
    streams = made_streams(api)
    streams.leave(streams.enter())
    api.current[0] = FakeStream("user", 0)  # a user's stream context between two calls
    api.log.clear()
    streams.leave(streams.enter())
    assert ("record", "e1", "user") in api.log and api.log[-1] == ("set-stream", "user")


def test_capture_joins_the_comm_stream_back():
    api = FakeApi()
    streams = made_streams(api)
    api.capturing = True
    streams.leave(streams.enter())
    assert api.log[-3:] == [("set-stream", "compute"), ("record", "e1", "comm"), ("wait", "e1", "compute")]
    assert api.new_event.made == 1


def test_another_current_device_takes_the_context_and_restores_it():
    api = FakeApi(device=1, current_device=0)
    streams = made_streams(api, index=1)
    token = streams.enter()
    assert api.current[1].name == "comm"
    streams.leave(token)
    assert api.device_now == 0 and api.current[1].name == "compute"
    assert ("context-enter", "comm") in api.log and ("context-exit", "comm") in api.log
    assert api.log[-2:] == [("record", "e1", "comm"), ("wait", "e1", "compute")]  # joined: always, here


@pytest.mark.parametrize("method, args", [
    ("post", ([], [])),
    ("collective", (Collective.ALL_GATHER, ["in"], ["out0", "out1"])),
    ("collective_into", (Collective.REDUCE_SCATTER, "in", "out")),
])
def test_backend_issues_every_transfer_from_the_comm_stream(monkeypatch, method, args):
    api = FakeApi()
    be = CudaBackend.__new__(CudaBackend)  # no process group needed: c10d's method is a stand-in below
    be.streams = made_streams(api)
    seen = []

    def issue(self, *got):
        seen.append((api.current[0].name, got))
        return "handle"

    monkeypatch.setattr(C10dBackend, method, issue)
    assert getattr(be, method)(*args) == "handle"
    assert seen == [("comm", args)] and api.current[0].name == "compute"
    assert [e[0] for e in api.log].count("set-stream") == 2


def test_stream_restored_when_issuing_raises(monkeypatch):
    api = FakeApi()
    be = CudaBackend.__new__(CudaBackend)
    be.streams = made_streams(api)

    def fail(self, *args):
        raise RuntimeError("NCCL error")

    monkeypatch.setattr(C10dBackend, "post", fail)
    with pytest.raises(RuntimeError, match="NCCL error"):
        be.post([], [])
    assert api.current[0].name == "compute"
    assert be.streams.events.free  # the event went back
