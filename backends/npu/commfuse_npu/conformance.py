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
