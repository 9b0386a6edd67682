"""The built-in torch.distributed (c10d) backend: gloo on CPU, and the generic
accelerator path (CUDA + NCCL, NPU + HCCL, XPU ...) through the same code.

A step's sends and receives are posted together with ``batch_isend_irecv``
(the ring cannot deadlock: every send has its receive in the same step, see
``commfuse.schedule``); completion is ``work.wait(timeout)``. On gloo that
blocks the host until the bytes are there, and transfers progress in gloo's
own threads while the host computes. On NCCL/HCCL c10d runs the transfers on
its internal communication stream and ``wait`` makes the current (compute)
stream wait for it, so the host never blocks and compute queued between post
and wait overlaps on the device.

Buffer lifetimes: a handle holds a reference to every tensor in flight (the
sent payloads and the receive buffers) until its ``wait`` returns, so nothing
in flight can be freed or recycled early; callers recycle buffers only after
``wait``. On NCCL, c10d additionally stashes tensors of async work until it
completes on the communication stream.

UNVERIFIED here (no accelerator on the development machines): the accelerator
path has not been run. It is this same code with device tensors; what it
relies on is documented c10d behaviour (stream-ordered ``wait`` on
NCCL/HCCL, ``batch_isend_irecv`` coalescing). The vendor distributions in
``backends/`` add dedicated high-priority streams and native fused kernels.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence

import torch
import torch.distributed as dist

from commfuse.errors import BackendUnavailableError
from commfuse.schedule import Collective, Transfer

class _Handle:
    """Works of one step plus the tensors they touch, kept alive until waited."""

    __slots__ = ("works", "outputs", "inflight")

    def __init__(self, works, outputs: list[torch.Tensor], inflight: list[torch.Tensor]) -> None:
        self.works = works
        self.outputs = outputs
        self.inflight = inflight

    def wait(self, timeout: float) -> list[torch.Tensor]:
        delta = datetime.timedelta(seconds=timeout)
        for work in self.works:
            try:
                work.wait(timeout=delta)
            except RuntimeError as e:  # gloo reports a timeout as a RuntimeError
                if "timed out" in str(e).lower() or "timeout" in str(e).lower():
                    raise TimeoutError(str(e)) from e
                raise
        self.inflight = []
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

    def __repr__(self) -> str:
        return f"C10dBackend(name={self.name!r}, rank={self.rank}, world_size={self.world_size}, device={self.device})"

    def post(
        self, sends: Sequence[tuple[Transfer, torch.Tensor]], recvs: Sequence[tuple[Transfer, torch.Tensor]]
    ) -> _Handle:
        ops = [dist.P2POp(dist.isend, x, group=self.group, group_peer=t.peer, tag=t.channel) for t, x in sends]
        ops += [dist.P2POp(dist.irecv, x, group=self.group, group_peer=t.peer, tag=t.channel) for t, x in recvs]
        works = dist.batch_isend_irecv(ops) if ops else []
        buffers = [x for _, x in recvs]
        return _Handle(works, buffers, [x for _, x in sends] + buffers)

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
        return _Handle([work], list(outputs), list(inputs) + list(outputs))

    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(tuple(shape), dtype=dtype, device=self.device)
