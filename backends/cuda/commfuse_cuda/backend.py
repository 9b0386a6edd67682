"""The CUDA backend: c10d/NCCL transfers issued from a dedicated high-priority communication stream.

Ordering, per step (the executor posts, computes, then waits)::

    compute stream:  ... payloads ─record(ready)─► GEMM on this step's shard ─► wait(NCCL end) ─► add / next
    comm stream:                  wait(ready) ─► issue the coalesced send/recv           ▲
    NCCL's stream (c10d's own):              (after comm) ─► send/recv kernels ─► end ──┘

* ``post`` resolves the current (compute) stream once, records a pooled
  event on it, makes the communication stream wait for that event, and
  issues the step's transfers (one coalesced group of sends and receives, see
  :meth:`~commfuse.runtime.c10d.C10dBackend.post`) or whole collective with the
  communication stream current: ONE stream switch per post (two
  ``set_stream`` calls, not a ``torch.cuda.stream`` context). c10d orders
  its NCCL stream after the stream current at issue time, the communication
  stream, never the compute one, so the GEMM the executor enqueues next is
  not held back by the transfers.
* ``Handle.wait`` is :class:`~commfuse.runtime.c10d.C10dBackend`'s
  stream-ordered wait, unchanged: ``work.wait()`` with no timeout, with the
  compute stream current, makes the compute stream wait for NCCL's end event
  (the host does not block), and the works go to the watchdog, which keeps
  the timeout. No second event and no stream switch: the compute stream
  waits for NCCL directly instead of through the communication stream.
* Events come from a small per-backend pool (:class:`EventPool`) and go back
  to it as soon as the wait on them is enqueued: CUDA's
  ``cudaStreamWaitEvent`` captures the event's most recent record at call
  time, so the event may be recorded again right away. The pool holds one
  event per thread posting at the same moment, no more.
* Nothing synchronises the host: no ``Event.synchronize``, ``query``,
  ``Stream.synchronize`` or ``.item()`` anywhere on this path.
* The communication stream has the highest priority the device offers. Note
  that it carries no kernels itself (NCCL's kernels run on c10d's internal
  streams, whose priority comes from the process group's options: see
  :func:`high_priority_options`); it is where transfers are issued from.
  ``CudaBackend(comm_stream=False)`` issues from the compute stream instead,
  relying on c10d's own ordering alone (fewer calls per step; measure both).

Buffer lifetime: the tensors in flight are kept alive by references, not by
``record_stream``. The handle that ``post`` returns holds every payload and
receive buffer until ``wait`` has enqueued the compute stream's wait on
NCCL's end event. After that, a tensor freed by Python goes back to the
caching allocator's pool of the stream it was allocated on, and the executor
allocates payloads and buffers on the compute stream, the stream that waited:
any later kernel that reuses the block is enqueued on that stream after the
wait, so it runs after NCCL is done with the memory. ``record_stream`` on the
communication stream (the earlier design) protected nothing more: that
stream runs no kernels, so a block recorded on it was released as soon as the
stream passed its event waits, not when NCCL finished; and each call costs a
trip into the allocator per tensor per step. A step that is posted and never
waited (an error path) is covered by c10d itself, which records NCCL's stream
on (or stashes) the tensors it sends and receives.

CUDA graph capture: the communication stream joins a capture through its
wait on ``ready``; when ``post`` finds the current stream capturing it makes
the current stream wait for the communication stream right after issuing, so
the capture can end (every forked stream joined). That join orders nothing
new (the communication stream holds only waits on the compute stream's own
past), so it costs no overlap.

The current stream is resolved on every post with the device's integer index
(``torch.cuda.current_stream(index)``), never cached across calls: it may
legitimately change between calls (a user's ``torch.cuda.stream`` context,
graph capture on a side stream).

On a CPU device (``device="cpu"``) the same object runs without streams:
exactly the c10d path, which is what the tests exercise on gloo ranks.

Verified on an H100 (torch 2.11, NCCL 2.28.9; see docs/benchmarks.md and
docs/reliability.md):
- every algorithm of both matmul ops is right on two NCCL ranks, fp32 and
  bf16;
- the conformance suite passes under torchrun, and its robustness tier
  passes outside it;
- with torch's fake group at n = 8 (bf16, 8192 x 8192 x 28672), the ring
  takes about 1.23x the unsliced GEMM and vanilla about 1.03x.
``COMMFUSE_CUDA_COMM_STREAM=0`` (or ``comm_stream=False``) issues from the
compute stream instead. That measured within noise of the default: c10d
orders its NCCL stream after whichever stream is current at issue time.
The native fused kernels (:meth:`native_op`) have not been run on a GPU.
Neither has CUDA-graph capture of these ops, which the plugin declares
(``Capabilities.capturable``): the conformance suite's capture tier is the
check, and ``commfuse.graphs`` the helper.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import torch

from commfuse.plugins.base import C10dBackend
from commfuse.schedule import Collective, Transfer
from commfuse_cuda import native
from commfuse_cuda.capabilities import CAPABILITIES


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


class EventPool:
    """Reusable events: ``take`` one (made by ``make`` when none is free), ``give`` it back.

    An event may go back as soon as every wait on its last record has been
    *enqueued* (``cudaStreamWaitEvent`` captures the record at call time, and a
    later record does not affect it). ``list.pop`` and ``list.append`` are
    atomic under the GIL, so two threads never get the same event; the pool
    keeps at most ``keep`` free events (one per thread posting at once is all
    it ever needs) and drops the rest.
    """

    __slots__ = ("make", "keep", "free", "made")

    def __init__(self, make: Callable[[], object], keep: int = 4) -> None:
        self.make = make
        self.keep = keep
        self.free: list = []
        self.made = 0  # events made so far (tests read it)

    def take(self):
        try:
            return self.free.pop()
        except IndexError:
            self.made += 1
            return self.make()

    def give(self, event) -> None:
        if len(self.free) < self.keep:
            self.free.append(event)


class CommStream:
    """The communication stream of one device, and the switch to it around one issue.

    ``enter()`` orders the communication stream after the current stream and
    makes it current; it returns what ``leave(token)`` needs to switch back.
    The CUDA calls are bound once here (``api`` replaces them in the CPU tests).
    """

    def __init__(self, index: int, priority: int | None = None, api=None) -> None:
        api = api if api is not None else _TorchCuda()
        if priority is None:
            priority = comm_priority(api.priority_range())
        self.index = index
        self.priority = priority
        self.comm = api.new_stream(index, priority)
        self.events = EventPool(api.new_event)
        self._current_stream = api.current_stream
        self._current_device = api.current_device
        self._set_stream = api.set_stream
        self._capturing = api.is_current_stream_capturing
        self._context = api.stream_context

    def enter(self):
        """Before an issue: the communication stream waits for everything enqueued so far on the current stream
        of this device, and becomes current. Returns the token for :meth:`leave`."""
        index, comm, events = self.index, self.comm, self.events
        current = self._current_stream(index)  # once per post, by int index: cheap, and never stale
        ready = events.take()
        ready.record(current)
        ready.wait(comm)
        events.give(ready)  # the wait above captured this record: the event is free again
        if self._current_device() == index:
            self._set_stream(comm)
            return current
        # The current device is another one: torch.cuda.set_stream would switch the device too. The stream
        # context restores both (the slow path; a backend is normally used on its own device).
        context = self._context(comm)
        context.__enter__()
        return context

    def leave(self, token) -> None:
        """After the issue: the current stream again (``token`` from :meth:`enter`); under graph capture the
        current stream also waits for the communication stream, which joins it back into the capture."""
        if type(token) is self._context:
            token.__exit__(None, None, None)
            self._join(self._current_stream(self.index))
            return
        self._set_stream(token)
        if self._capturing():
            self._join(token)

    def _join(self, stream) -> None:
        events = self.events
        joined = events.take()
        joined.record(self.comm)
        joined.wait(stream)
        events.give(joined)


class _TorchCuda:
    """The CUDA calls :class:`CommStream` makes, from ``torch.cuda``."""

    def __init__(self) -> None:
        cuda = torch.cuda
        self.priority_range = cuda.Stream.priority_range
        self.current_stream = cuda.current_stream
        self.current_device = cuda.current_device
        self.set_stream = cuda.set_stream
        self.is_current_stream_capturing = cuda.is_current_stream_capturing
        self.stream_context = cuda.StreamContext
        self.new_event = cuda.Event  # no timing, not blocking: the cheapest kind

    @staticmethod
    def new_stream(index: int, priority: int):
        return torch.cuda.Stream(device=index, priority=priority)


class CudaBackend(C10dBackend):
    """:class:`~commfuse.runtime.c10d.C10dBackend` with a dedicated high-priority communication stream.

    ``device`` defaults to the current CUDA device; ``priority`` to the
    highest the device offers. ``comm_stream=False`` issues transfers from
    the compute stream (c10d's ordering only); None reads
    ``COMMFUSE_CUDA_COMM_STREAM`` (default on). ``enable_native`` is the opt-in
    to torch's symmetric-memory fused kernels (:meth:`native_op`): None reads
    ``COMMFUSE_CUDA_NATIVE`` when a call signature is first seen. With a CPU
    device it is the plain c10d backend (and the native kernels decline).
    """

    capabilities = CAPABILITIES

    def __init__(self, group=None, device=None, *, name: str = "cuda", priority: int | None = None,
                 comm_stream: bool | None = None, enable_native: bool | None = None) -> None:
        device = torch.device(device) if device is not None else torch.device("cuda")
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        super().__init__(group=group, device=device, name=name)
        self.enable_native = enable_native
        if comm_stream is None:
            comm_stream = os.environ.get("COMMFUSE_CUDA_COMM_STREAM", "1") not in ("0", "false", "no", "off")
        self.streams = CommStream(self.device.index, priority) if comm_stream and uses_streams(self.device) else None

    def __repr__(self) -> str:
        streams = f", comm stream priority {self.streams.priority}" if self.streams else ", no streams"
        return f"CudaBackend(rank={self.rank}, world_size={self.world_size}, device={self.device}{streams})"

    # -- transfers: c10d's calls, issued from the communication stream ---------------------------------------

    def post(self, sends: Sequence[tuple[Transfer, torch.Tensor]], recvs: Sequence[tuple[Transfer, torch.Tensor]]):
        return self._from_comm_stream(C10dBackend.post, sends, recvs)

    def collective(self, kind: Collective, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]):
        return self._from_comm_stream(C10dBackend.collective, kind, inputs, outputs)

    def collective_into(self, kind: Collective, input: torch.Tensor, output: torch.Tensor):
        """c10d's ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` (what ``vanilla`` over even shards
        runs), issued from the communication stream like every other transfer."""
        return self._from_comm_stream(C10dBackend.collective_into, kind, input, output)

    def _from_comm_stream(self, issue, *args):
        """``issue(self, *args)``, one of c10d's issues, with the communication stream current (one switch
        there and back; see :class:`CommStream`); from the current stream when there is none."""
        streams = self.streams
        if streams is None:
            return issue(self, *args)
        token = streams.enter()
        try:
            return issue(self, *args)
        finally:
            streams.leave(token)

    # -- native fused kernels (commfuse.ops asks once per call signature) ----------------------------------------

    def native_op(self, op: str, **signature):
        """torch's symmetric-memory kernel for ``op`` on this call signature: ``(runner, reason)`` when the call
        and the environment qualify (:mod:`commfuse_cuda.native`'s verdicts), else ``(None, why not)``.

        Decided once per signature: the call's shapes, dtypes and dims, then the environment (a CUDA device,
        the op's CUDA kernel registered, an NCCL group, and the user's opt-in, ``enable_native`` or
        ``COMMFUSE_CUDA_NATIVE``, read now). The kernel runs on this backend's group (``signature["group"]``
        is the one the user passed, which resolved to this backend). Gradients are not judged here: ``commfuse.ops`` decides per
        call (the kernels have no backward). The runner maps arguments and results through
        ``native.call_fused_*`` with the group's name resolved here, and checks nothing.
        UNVERIFIED on a GPU here: the decision and the mapping are tested on CPU (the latter with torch's
        reference implementation of the same op schemas).
        """
        if op == "all_gather_matmul":
            a, bs, gd = signature["a_shard"], list(signature["bs"]), signature["gather_dim"]
            with torch.no_grad():
                verdict = native.all_gather_matmul_verdict(
                    a, bs, gather_dim=gd, world_size=self.world_size, gathered_size=signature.get("gathered_size"))
            kernel_name = "fused_all_gather_matmul"
        elif op == "matmul_reduce_scatter":
            a, b, sd, reduce_op = signature["a"], signature["b"], signature["scatter_dim"], signature["reduce_op"]
            with torch.no_grad():
                verdict = native.matmul_reduce_scatter_verdict(a, b, scatter_dim=sd, world_size=self.world_size,
                                                               reduce_op=reduce_op)
            kernel_name = "fused_matmul_reduce_scatter"
        else:
            return None, f"commfuse-cuda has no native kernel for {op!r}"
        if not verdict:
            return None, verdict.reason
        env = native.environment_verdict(self._native_environment(kernel_name), kernel_name)
        if not env:
            return None, env.reason
        kernel = self._native_kernel(kernel_name)
        group_name = native._group_name(self.group)
        reason = f"{verdict.reason}; {env.reason}"
        if op == "all_gather_matmul":
            call_ag = native.call_fused_all_gather_matmul
            return_gathered = bool(signature.get("return_gathered", False))

            def run_all_gather_matmul(a_shard, bs):
                return call_ag(kernel, a_shard, bs, gd, group_name, return_gathered)

            return run_all_gather_matmul, reason
        call_rs = native.call_fused_matmul_reduce_scatter

        def run_matmul_reduce_scatter(a, b):
            return call_rs(kernel, a, b, sd, reduce_op, group_name)

        return run_matmul_reduce_scatter, reason

    def _native_environment(self, kernel_name: str) -> native.Environment:
        """The facts outside the call (probed for real; the CPU tests substitute a GPU node's)."""
        return native.probe_environment(self.device, self.group, kernel_name, self.enable_native)

    def _native_kernel(self, kernel_name: str):
        """The op to run (``torch.ops.symm_mem.<kernel_name>``; the CPU tests give torch's reference of it)."""
        return getattr(torch.ops.symm_mem, kernel_name)
