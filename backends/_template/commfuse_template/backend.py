"""The backend object: moves tensors for the executor (the Backend protocol, commfuse.runtime.protocol).

As shipped it *is* the c10d backend on a gloo group, so the conformance suite
passes out of the box. To bring up a device, either

* keep subclassing :class:`~commfuse.plugins.base.C10dBackend` if your device
  has a torch.distributed backend (as commfuse-npu does with HCCL), adding
  what is yours (streams, fused kernels), or
* implement the four members yourself: ``post(sends, recvs) -> Handle``,
  ``Handle.wait(timeout) -> received tensors`` (raise ``TimeoutError`` after
  ``timeout`` seconds), ``collective(kind, inputs, outputs) -> Handle`` and
  ``empty(shape, dtype)``, plus ``name``, ``rank``, ``world_size``, ``device``.
  A traced transport returns its results from ``wait`` (see commfuse-xla).
"""

from __future__ import annotations

from commfuse.plugins.base import C10dBackend


class TemplateBackend(C10dBackend):
    """Delegates every transfer to torch.distributed on the group's (gloo) backend."""

    def __init__(self, group=None, device=None) -> None:
        super().__init__(group=group, device=device if device is not None else "cpu", name="template")
