"""The CUDA backend: c10d/NCCL transfers issued from a dedicated high-priority communication stream.

Ordering, per step (the executor posts, computes, then waits)::

    compute stream:  ... produce payloads ──record(ready)──► GEMM on this step's shard ──wait(done)──► add / next step
    comm stream:              wait(ready) ─► batch_isend_irecv ─► work.wait() ─record(done)─┘

* ``post`` records an event on the current (compute) stream once the payloads
  are enqueued, makes the communication stream wait for it, and issues the
  step's ``batch_isend_irecv`` from the communication stream. c10d runs NCCL
  kernels on its own internal stream, which it orders after the stream that
  was current at issue time: the communication stream, never the compute one.
  The GEMM the executor then enqueues is not held back by the transfers.
* ``Handle.wait`` calls ``work.wait()`` with the communication stream current
  (stream-ordered: the host does not block), records ``done`` there, and makes
  the compute stream wait for it: received buffers are used only after they
  have landed. Every tensor in flight is ``record_stream``-ed on the
  communication stream so the caching allocator cannot reuse its memory early.
* The communication stream has the highest priority the device offers, so
  when compute and communication kernels compete for SMs, the copy engine
  work is scheduled first (the NCCL streams of a group made with
  :func:`high_priority_options` are high-priority too).

On a CPU device (``device="cpu"``) the same object runs without streams:
exactly the c10d path, which is what the tests exercise on gloo ranks.

UNVERIFIED here: no GPU is lent to this project's development machines, so
the stream path has not been run; it uses only documented torch APIs
(``torch.cuda.Stream(priority=...)``, ``Event.record``, ``Stream.wait_event``,
``Tensor.record_stream``, c10d's stream-ordered ``Work.wait``). Run the
conformance suite on a GPU host to verify it (see README.md).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from commfuse.runtime.c10d import C10dBackend
from commfuse.schedule import Collective, Transfer
from commfuse_cuda.plugin import CAPABILITIES


def comm_priority(priority_range: tuple[int, int]) -> int:
    """The highest stream priority of a device, from ``torch.cuda.Stream.priority_range()``.

    CUDA counts priorities downwards: the range is ``(least, greatest)`` with
    greatest <= least (e.g. ``(0, -5)``); the numerically smallest wins.
    """
    least, greatest = priority_range
    return min(least, greatest)


def uses_streams(device: torch.device) -> bool:
    """Whether transfers on ``device`` go through a communication stream (CUDA devices only)."""
    return device.type == "cuda"


def high_priority_options():
    """``ProcessGroupNCCL.Options`` asking for high-priority NCCL streams, or None where NCCL is absent.

    Pass it to ``torch.distributed.init_process_group(backend="nccl", pg_options=...)``
    or ``new_group(..., pg_options=...)``. UNVERIFIED on a GPU here.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_nccl_available()) or not hasattr(dist, "ProcessGroupNCCL"):
        return None
    options = dist.ProcessGroupNCCL.Options()
    options.is_high_priority_stream = True
    return options


class _Streams:
    """The communication stream of one device and the events that order it against compute."""

    def __init__(self, device: torch.device, priority: int | None) -> None:
        if priority is None:
            priority = comm_priority(torch.cuda.Stream.priority_range())
        self.device = device
        self.priority = priority
        self.comm = torch.cuda.Stream(device=device, priority=priority)

    def ready(self) -> torch.cuda.Event:
        """An event on the current (compute) stream after everything enqueued so far."""
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event


class _StreamHandle:
    """One step in flight on the communication stream."""

    __slots__ = ("inner", "streams")

    def __init__(self, inner, streams: _Streams) -> None:
        self.inner = inner
        self.streams = streams

    def wait(self, timeout: float) -> list[torch.Tensor]:
        comm = self.streams.comm
        with torch.cuda.stream(comm):
            outputs = self.inner.wait(timeout)  # comm stream waits for NCCL's stream; the host does not block
        done = torch.cuda.Event()
        done.record(comm)
        torch.cuda.current_stream(self.streams.device).wait_event(done)
        return outputs


class CudaBackend(C10dBackend):
    """:class:`~commfuse.runtime.c10d.C10dBackend` with a dedicated high-priority communication stream.

    ``device`` defaults to the current CUDA device; ``priority`` to the
    highest the device offers. With a CPU device it is the plain c10d backend.
    """

    capabilities = CAPABILITIES

    def __init__(self, group=None, device=None, *, name: str = "cuda", priority: int | None = None) -> None:
        device = torch.device(device) if device is not None else torch.device("cuda")
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        super().__init__(group=group, device=device, name=name)
        self.streams = _Streams(self.device, priority) if uses_streams(self.device) else None

    def __repr__(self) -> str:
        streams = f", comm stream priority {self.streams.priority}" if self.streams else ", no streams"
        return f"CudaBackend(rank={self.rank}, world_size={self.world_size}, device={self.device}{streams})"

    def _on_comm(self, start, tensors: Sequence[torch.Tensor]):
        streams = self.streams
        ready = streams.ready()
        with torch.cuda.stream(streams.comm):
            streams.comm.wait_event(ready)
            for t in tensors:
                t.record_stream(streams.comm)
            handle = start()
        return _StreamHandle(handle, streams)

    def post(self, sends: Sequence[tuple[Transfer, torch.Tensor]], recvs: Sequence[tuple[Transfer, torch.Tensor]]):
        if self.streams is None:
            return super().post(sends, recvs)
        tensors = [x for _, x in sends] + [x for _, x in recvs]
        return self._on_comm(lambda: C10dBackend.post(self, sends, recvs), tensors)

    def collective(self, kind: Collective, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]):
        if self.streams is None:
            return super().collective(kind, inputs, outputs)
        return self._on_comm(lambda: C10dBackend.collective(self, kind, inputs, outputs), [*inputs, *outputs])
