"""The NPU backend: HCCL through torch_npu on commfuse's c10d path.

torch_npu registers the ``npu`` device and the ``hccl`` process-group
backend with torch; c10d's ``batch_isend_irecv`` then runs HCCL on its own
stream and ``Work.wait()`` makes the current (compute) stream wait for it, the
same stream-ordered contract as NCCL. So the executor's post / compute / wait
overlaps on the device with the generic code, which this class reuses as is,
adding only the device default and the MC2 kernels (:mod:`commfuse_npu.mc2`)
through the plugin contract's ``native_op``: ``commfuse.ops`` asks once per
call signature when ``algorithm`` is "native" or "auto".

UNVERIFIED here: no NPU is lent to this project's development machines and
torch_npu cannot be imported without CANN. Verify on an Ascend host with the
conformance suite (README.md).
"""

from __future__ import annotations

import torch

from commfuse.plugins.base import C10dBackend
from commfuse_npu import mc2
from commfuse_npu.capabilities import CAPABILITIES


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

    #: Which HCCL group MC2 has been used on (one per process, see :class:`~commfuse_npu.mc2.DomainTracker`).
    domains = mc2.DOMAINS

    def native_op(self, op: str, **signature):
        """The MC2 kernel for ``op`` on this call signature: ``(runner, reason)`` where the environment (an NPU,
        an HCCL group, Atlas A2 or A3), every documented constraint (:func:`~commfuse_npu.mc2.signature_verdict`)
        and the one-communication-domain rule hold, else ``(None, the first thing that does not)``.

        Decided once per signature; gradients are ``commfuse.ops``'s per-call business (MC2 has no backward).
        The runner calls the kernel with ``x1.contiguous()`` (a no-op for contiguous x1) and x2 as MC2 takes it
        (:func:`~commfuse_npu.mc2.x2_layout`), and checks nothing else. UNVERIFIED on an NPU here: the decision
        and the argument/result mapping are tested on CPU, the latter with reference kernels of the documented
        signatures on gloo ranks.
        """
        if op not in mc2.OPS:
            return None, f"MC2 has no kernel for {op!r}; it has {mc2.OPS}"
        env, family, hcom, n = self._mc2_environment()
        if not env:
            return None, env.reason
        verdict = mc2.signature_verdict(op, signature, world_size=n, family=family)
        if not verdict:
            return None, verdict.reason
        domain = self.domains.admit(hcom)  # last: only a call that runs MC2 claims the domain
        if not domain:
            return None, domain.reason
        all_gather_base_mm, mm_reduce_scatter_base = self._mc2_kernels()
        x2_layout = mc2.x2_layout
        reason = f"{verdict.reason}; {domain.reason}"
        if op == "all_gather_matmul":
            return_gathered = bool(signature.get("return_gathered", False))

            def run_all_gather_matmul(a_shard, bs):
                out, gathered = all_gather_base_mm(a_shard.contiguous(), x2_layout(bs[0]), hcom, n, bias=None,
                                                   gather_index=0, gather_output=return_gathered, comm_turn=0)
                return (gathered if return_gathered else None), [out]

            return run_all_gather_matmul, reason

        def run_matmul_reduce_scatter(a, b):
            return mm_reduce_scatter_base(a.contiguous(), x2_layout(b), hcom, n, reduce_op="sum", bias=None,
                                          comm_turn=0)

        return run_matmul_reduce_scatter, reason

    def _mc2_environment(self):
        """(verdict, product family, hcom name, world size) of this backend's device and group (the CPU tests
        substitute an Atlas node's)."""
        return mc2.environment(self.device, self.group)

    def _mc2_kernels(self):
        """``(npu_all_gather_base_mm, npu_mm_reduce_scatter_base)`` from torch_npu (the CPU tests give
        reference implementations of the same signatures)."""
        import torch_npu

        return torch_npu.npu_all_gather_base_mm, torch_npu.npu_mm_reduce_scatter_base
