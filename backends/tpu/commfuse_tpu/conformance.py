"""The capabilities file for the conformance suite on a TPU VM (UNVERIFIED here: no TPU).

``commfuse conformance --backend tpu --world-size N --capabilities commfuse_tpu.conformance:Capabilities``
"""

from __future__ import annotations

import commfuse.testing


class Capabilities(commfuse.testing.Capabilities):
    dtypes = ("float32", "bfloat16")
    device = "tpu"
    dist_backend = "tpu"
    # Not claimed until measured on a TPU: report the hidden fraction only.
    overlap_threshold = 0.0
