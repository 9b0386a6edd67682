"""What the ``npu`` backend declares it can do: its :class:`~commfuse.plugins.Capabilities`.

A module of its own, importing nothing but ``commfuse.plugins``, so that both
the plugin record (:mod:`commfuse_npu.plugin`, which must stay cheap to import)
and :class:`~commfuse_npu.backend.NpuBackend` (whose objects carry it even when made
directly, without the registry) can read it without importing each other.
"""

from __future__ import annotations

from commfuse.plugins import Capabilities

# What reads each field: commfuse/plugins/types.py.
CAPABILITIES = Capabilities(
    # HCCS links carry both directions at once (nothing in commfuse acts on it yet).
    bidirectional_links=True,
    # NpuBackend.native_op: the MC2 kernels, exactly where their documented constraints hold (commfuse_npu.mc2);
    # commfuse.ops asks once per call signature for "native" and "auto".
    native_fused_ops=("all_gather_matmul", "matmul_reduce_scatter"),
    execution="eager",
    # HCCL runs on its own stream: waits are stream-ordered and C10dBackend hands the timeout to its watchdog.
    streams=True,
    # Transfers progress on the device while the compute stream runs the GEMMs.
    overlap=True,
    # Through torch_npu's graph API (torch.npu.NPUGraph, torch.npu.graph, torch.npu.make_graphed_callables), which
    # mirrors torch.cuda's: a planned call issues HCCL from the compute stream (c10d joins HCCL's stream back),
    # waits without blocking the host and allocates from the caching allocator. UNVERIFIED without Ascend
    # hardware: the conformance suite's capture tier checks it there (commfuse.graphs.capture is CUDA-only).
    capturable=True,
)
