"""commfuse-cuda: the commfuse backend for NVIDIA GPUs.

- :mod:`commfuse_cuda.backend`: :class:`CudaBackend`, the c10d backend with
  NCCL transfers issued from a dedicated high-priority communication stream,
  ordered against the compute stream with CUDA events;
- :mod:`commfuse_cuda.native`: an optional lowering of whole fused ops to
  torch's symmetric-memory kernels (``torch.ops.symm_mem.fused_all_gather_matmul``,
  ``fused_matmul_reduce_scatter``) where they exist and the shapes qualify;
- :mod:`commfuse_cuda.plugin`: the ``cuda`` backend record and its availability check.

Nothing here initialises CUDA at import time.
"""

from __future__ import annotations

__version__ = "0.1.0"
