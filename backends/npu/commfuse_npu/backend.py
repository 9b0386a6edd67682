"""The NPU backend: HCCL through torch_npu on commfuse's c10d path.

torch_npu registers the ``npu`` device and the ``hccl`` process-group
backend with torch; c10d's ``batch_isend_irecv`` then runs HCCL on its own
stream and ``Work.wait()`` makes the current (compute) stream wait for it, the
same stream-ordered contract as NCCL. So the executor's post / compute / wait
overlaps on the device with the generic code, which this class reuses as is,
adding only the device default and the MC2 lowering (:mod:`commfuse_npu.mc2`).

UNVERIFIED here: no NPU is lent to this project's development machines and
torch_npu cannot be imported without CANN. Verify on an Ascend host with the
conformance suite (README.md).
"""

from __future__ import annotations

import torch

from commfuse.runtime.c10d import C10dBackend
from commfuse_npu.plugin import CAPABILITIES


class NpuBackend(C10dBackend):
    """:class:`~commfuse.runtime.c10d.C10dBackend` on NPU devices (``device`` defaults to the current NPU)."""

    capabilities = CAPABILITIES

    def __init__(self, group=None, device=None, *, name: str = "npu") -> None:
        if device is None:
            import torch_npu  # noqa: F401 - registers torch.npu

            device = torch.device("npu", torch.npu.current_device())
        super().__init__(group=group, device=device, name=name)

    def __repr__(self) -> str:
        return f"NpuBackend(rank={self.rank}, world_size={self.world_size}, device={self.device})"
