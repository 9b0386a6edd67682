"""The built-in torch.distributed (c10d) backend: gloo on CPU, and the generic
accelerator path (CUDA + NCCL, NPU + HCCL, XPU ...) through the same code.

On gloo a step's sends and receives are posted one by one on the process
group (``ProcessGroup.send``/``recv``: the ring cannot deadlock, every send has
its receive in the same step, see ``commfuse.schedule``), and completion is
``work.wait(timeout)``, which blocks the host until the bytes are there while
transfers progress in gloo's own threads. On a device (NCCL, HCCL, ...) the
step's messages are coalesced with ``batch_isend_irecv`` (NCCL needs a
step's sends and receives in one group), and when the backend declares
``Capabilities.streams`` a wait is ``work.wait()`` with no timeout: it only
makes the current (compute) stream wait for the communication stream, so the
host never blocks. The timeout is then kept by the watchdog
(``commfuse.runtime.watchdog``), which polls each step's works.

Tags: ``begin_call(seq)`` sets the call number that every following message's
tag carries (``channel + TAG_STRIDE * seq``), so on gloo, which matches
messages by tag, a call can only pair with the same call on its peers. NCCL
ignores tags; there the fingerprint check after a failed call does that work.

UNVERIFIED here (no accelerator on the development machines): the accelerator
path has not been run. It is this same code with device tensors; what it
relies on is documented c10d behaviour (stream-ordered ``wait`` on
NCCL/HCCL, ``batch_isend_irecv`` coalescing). The vendor distributions in
``backends/`` add dedicated high-priority streams and native fused kernels.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from commfuse.errors import BackendUnavailableError
from commfuse.runtime.executor import TAG_STRIDE, group_state
from commfuse.runtime.watchdog import watchdog
from commfuse.schedule import Collective, Transfer

_LAST_DELTA = (0.0, datetime.timedelta(0))
_SUM = dist.ReduceScatterOptions()  # the default reduction, a sum; made once
# torch 2.13 renamed the single-tensor collectives (the old names warn); older torch has only the old ones
_ALL_GATHER_SINGLE = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER_SINGLE = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _delta(timeout: float) -> datetime.timedelta:
    """``timeout`` as the timedelta c10d wants, remembering the last one (calls repeat one timeout); the pair
    is replaced as one tuple, so a thread never reads one call's timeout with another's delta."""
    global _LAST_DELTA
    seconds, delta = _LAST_DELTA
    if seconds != timeout:
        delta = datetime.timedelta(seconds=timeout)
        _LAST_DELTA = (timeout, delta)
    return delta


class _Handle:
    """Works of one step plus the tensors they touch, kept alive until waited; the host waits."""

    __slots__ = ("works", "outputs", "inflight")

    def __init__(self, works, outputs: list[torch.Tensor], inflight) -> None:
        self.works = works
        self.outputs = outputs
        self.inflight = inflight

    def wait(self, timeout: float) -> list[torch.Tensor]:
        delta = _delta(timeout)
        for work in self.works:
            try:
                work.wait(delta)
            except RuntimeError as e:  # gloo reports a timeout as a RuntimeError
                if "timed out" in str(e).lower() or "timeout" in str(e).lower():
                    raise TimeoutError(str(e)) from e
                raise
        self.inflight = None
        return self.outputs


class _StreamHandle(_Handle):
    """A step on a stream-ordered backend: ``wait`` orders the current stream after the works and hands
    them to the watchdog, which enforces the timeout; the host does not block."""

    __slots__ = ("backend", "what")

    def __init__(self, works, outputs, inflight, backend: "C10dBackend", what: str) -> None:
        super().__init__(works, outputs, inflight)
        self.backend, self.what = backend, what

    def wait(self, timeout: float) -> list[torch.Tensor]:
        for work in self.works:
            work.wait()
        if self.works:
            be, what = self.backend, self.what
            watchdog().watch(
                self.works, time.monotonic() + timeout,
                lambda: f"rank {be.rank}: {what} did not complete within {timeout:g} s (a peer died, hung, or "
                        "called another op)",
                be._expired,
            )
        self.inflight = None
        return self.outputs


class C10dBackend:
    """Transfers through a ``torch.distributed`` process group."""

    capabilities = None  # set from the plugin record by ``commfuse.backends.get``

    def __init__(self, group=None, device=None, *, name: str = "gloo") -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise BackendUnavailableError(
                f"backend {name!r} needs an initialised torch.distributed process group: call "
                "torch.distributed.init_process_group(...) first (or run under torchrun)"
            )
        self.name = name
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        if self.rank < 0:
            raise BackendUnavailableError(
                f"this process (global rank {dist.get_rank()}) is not a member of the group it was given"
            )
        self.world_size = dist.get_world_size(self.group)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self._tag_base = 0
        self._seq = None
        self._posts = 0
        # gloo (and any CPU group) posts message by message; devices coalesce a step (NCCL needs it)
        self._coalesce = self.device.type != "cpu"
        self._stream_ordered: bool | None = None  # from capabilities.streams, on the first post

    def begin_call(self, seq: int | None) -> None:
        """The executor's call number for the messages that follow (None: untagged, the fingerprint check)."""
        self._seq = seq
        self._tag_base = 0 if seq is None else TAG_STRIDE * seq
        self._posts = 0

    def _streams(self) -> bool:
        ordered = self._stream_ordered
        if ordered is None:
            ordered = self._stream_ordered = (
                bool(getattr(self.capabilities, "streams", False)) and self.device.type != "cpu"
            )
        return ordered

    def _handle(self, works, outputs, inflight, what):
        if self._streams():
            return _StreamHandle(works, outputs, inflight, self, f"{what} (call #{self._seq}, post {self._posts})")
        return _Handle(works, outputs, inflight)

    def _expired(self, error: BaseException) -> None:
        """The watchdog saw a step outlive its timeout: fail every later call on the group, abort it."""
        group_state(self).error = error
        abort = getattr(self.group, "abort", None)
        if callable(abort):
            abort()
            return
        fallback = getattr(dist.distributed_c10d, "_abort_process_group", None)
        if fallback is not None:
            fallback(self.group)

    def __repr__(self) -> str:
        return f"C10dBackend(name={self.name!r}, rank={self.rank}, world_size={self.world_size}, device={self.device})"

    def post(
        self, sends: Sequence[tuple[Transfer, torch.Tensor]], recvs: Sequence[tuple[Transfer, torch.Tensor]]
    ) -> _Handle:
        base = self._tag_base
        buffers = [x for _, x in recvs]
        self._posts += 1
        if not self._coalesce:
            pg = self.group
            works = [pg.send([x], t.peer, t.channel + base) for t, x in sends]
            works += [pg.recv([x], t.peer, t.channel + base) for t, x in recvs]
            return _Handle(works, buffers, sends)
        g = self.group
        ops = [dist.P2POp(dist.isend, x, group=g, group_peer=t.peer, tag=t.channel + base) for t, x in sends]
        ops += [dist.P2POp(dist.irecv, x, group=g, group_peer=t.peer, tag=t.channel + base) for t, x in recvs]
        works = dist.batch_isend_irecv(ops) if ops else []
        peers = sorted({t.peer for t, _ in sends} | {t.peer for t, _ in recvs})
        return self._handle(works, buffers, (sends, buffers), f"transfers with rank {peers}")

    def collective(
        self, kind: Collective, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]
    ) -> _Handle:
        g = self.group
        if kind is Collective.ALL_GATHER:
            work = dist.all_gather(list(outputs), inputs[0], group=g, async_op=True)
        elif kind is Collective.REDUCE_SCATTER:
            work = dist.reduce_scatter(outputs[0], list(inputs), group=g, async_op=True)
        else:
            work = dist.all_to_all(list(outputs), list(inputs), group=g, async_op=True)
        return self._handle([work], list(outputs), (inputs, outputs), f"the whole {kind.value}")

    def collective_into(self, kind: Collective, input: torch.Tensor, output: torch.Tensor) -> _Handle:
        """One whole all-gather or reduce-scatter over single tensors, rank by rank along dim 0 of the bigger
        one (torch's ``all_gather_into_tensor`` / ``reduce_scatter_tensor``, sum); ``wait`` returns
        ``[output]``."""
        g = self.group
        if not self._coalesce:
            if kind is Collective.ALL_GATHER:
                work = g._allgather_base(output, input)
            else:
                work = g._reduce_scatter_base(output, input, _SUM)
            return _Handle([work], [output], (input, output))
        if kind is Collective.ALL_GATHER:
            work = _ALL_GATHER_SINGLE(output, input, group=g, async_op=True)
        else:
            work = _REDUCE_SCATTER_SINGLE(output, input, group=g, async_op=True)
        return self._handle([work], [output], (input, output), f"the whole {kind.value}")

    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(tuple(shape), dtype=dtype, device=self.device)
