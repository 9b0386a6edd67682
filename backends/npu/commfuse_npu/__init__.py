"""commfuse-npu: the commfuse backend for Ascend NPUs.

- :mod:`commfuse_npu.plugin`: the ``npu`` backend record; its availability
  check says which of torch_npu, CANN's ``libhccl.so`` and a visible NPU is
  missing, and how to fix it, without importing torch_npu where it would fail;
- :mod:`commfuse_npu.backend`: :class:`NpuBackend`, HCCL through torch_npu on
  the c10d path (stream-ordered ``batch_isend_irecv`` on NPU streams);
- :mod:`commfuse_npu.mc2`: the constraint checker for Ascend's MC2 fused
  kernels (``torch_npu.npu_all_gather_base_mm``, ``npu_mm_reduce_scatter_base``)
  and the optional lowering to them. Pure Python where it decides.
"""

from __future__ import annotations

__version__ = "0.1.0"
