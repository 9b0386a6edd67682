"""commfuse-tpu: commfuse's eager ring on TorchTPU's ``tpu`` c10d backend (UNVERIFIED without a TPU).

TorchTPU (the ``torch-tpu`` distribution, module ``torch_tpu``) registers the
c10d backends ``tpu`` and ``tpu_dist`` with send/recv, all-gather,
reduce-scatter and all-to-all; this backend runs commfuse's step loop on the
first, as ``commfuse-cuda`` does on NCCL. Nothing here imports ``torch_tpu``:
on a machine without a TPU, starting its device makes libtpu query a cloud
metadata server over the network, so the availability check
(:mod:`commfuse_tpu.plugin`) only looks for the package and for TPU device
nodes, and the backend object is made only where both are there.
"""

from __future__ import annotations

__version__ = "0.1.0"
