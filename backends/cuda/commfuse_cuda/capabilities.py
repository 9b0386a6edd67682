"""What the ``cuda`` backend declares it can do: its :class:`~commfuse.plugins.Capabilities`.

A module of its own, importing nothing but ``commfuse.plugins``, so that both
the plugin record (:mod:`commfuse_cuda.plugin`, which must stay cheap to import)
and :class:`~commfuse_cuda.backend.CudaBackend` (whose objects carry it even when made
directly, without the registry) can read it without importing each other.
"""

from __future__ import annotations

from commfuse.plugins import Capabilities

# What reads each field: commfuse/plugins/types.py.
CAPABILITIES = Capabilities(
    # NVLink and PCIe carry both directions at once (nothing in commfuse acts on it yet).
    bidirectional_links=True,
    # CudaBackend.native_op: torch's symmetric-memory kernels where torch has them, the call qualifies and the
    # user opted in (commfuse_cuda.native); commfuse.ops asks once per call signature for "native" and "auto".
    native_fused_ops=("all_gather_matmul", "matmul_reduce_scatter"),
    execution="eager",
    # NCCL runs on its own streams: waits are stream-ordered (the compute stream waits; the host does not) and
    # C10dBackend hands the timeout to its watchdog.
    streams=True,
    # Transfers progress on the device while the compute stream runs the GEMMs.
    overlap=True,
    # A planned call (every call of a signature after its first) issues from the communication stream, which
    # CommStream.leave joins back into a capture, waits without blocking the host, and takes its buffers from the
    # caching allocator: torch.cuda.graph, make_graphed_callables and torch.compile(mode="reduce-overhead") can
    # capture it; commfuse.graphs.capture is the helper. UNVERIFIED on a GPU: the conformance suite's capture
    # tier is the check.
    capturable=True,
)
