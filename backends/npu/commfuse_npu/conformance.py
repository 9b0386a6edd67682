"""The capabilities file for the conformance suite on Ascend hosts (UNVERIFIED here: no NPU).

``commfuse conformance --backend npu --world-size N --capabilities commfuse_npu.conformance:Capabilities``
"""

from __future__ import annotations

import commfuse.testing


class Capabilities(commfuse.testing.Capabilities):
    dtypes = ("float32", "bfloat16", "float16")
    device = "npu"
    dist_backend = "hccl"
    overlap_threshold = 0.5
    # HCCL is stream-ordered: the group ends when one rank's compute fails mid-call, by name
    # (docs/reliability.md); UNVERIFIED on a device.
    group_survives_one_rank_failure = False
