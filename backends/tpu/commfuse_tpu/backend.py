"""The ``tpu`` backend object: commfuse's c10d backend on a process group of TorchTPU's ``tpu`` backend.

UNVERIFIED: no TPU was lent to this project. The process group must be made
with ``torch.distributed.init_process_group("tpu")`` (TorchTPU registers the
name when it loads with torch); the transfers are the group's
``batch_isend_irecv`` and whole collectives, as for NCCL. Made only where the
plugin's check found TorchTPU and TPU device nodes.
"""

from __future__ import annotations

import torch

from commfuse.plugins.base import C10dBackend
from commfuse_tpu.capabilities import CAPABILITIES


class TpuBackend(C10dBackend):
    """:class:`~commfuse.runtime.c10d.C10dBackend` on TorchTPU's ``tpu`` process group."""

    capabilities = CAPABILITIES

    def __init__(self, group=None, device=None, *, name: str = "tpu") -> None:
        super().__init__(group=group, device=torch.device(device) if device is not None else torch.device("tpu"),
                         name=name)
