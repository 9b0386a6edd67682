"""The capabilities file for the conformance suite on GPU hosts (UNVERIFIED here: no GPU).

``commfuse conformance --backend cuda --world-size N --capabilities commfuse_cuda.conformance:Capabilities``
"""

from __future__ import annotations

import commfuse.testing


class Capabilities(commfuse.testing.Capabilities):
    dtypes = ("float32", "bfloat16", "float16")
    device = "cuda"
    dist_backend = "nccl"
    # NCCL over NVLink/PCIe with compute on the SMs: the ring should hide most of its communication.
    overlap_threshold = 0.5
    # A stream-ordered backend ends the group when one rank's compute fails mid-call, by name
    # (docs/reliability.md); UNVERIFIED on a device.
    group_survives_one_rank_failure = False
