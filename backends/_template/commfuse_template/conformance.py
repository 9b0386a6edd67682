"""The capabilities file: what the conformance suite may expect of this backend.

Tests skip by these attributes, never by the backend's name. Override only
what differs from the defaults (``commfuse.testing.Capabilities`` documents
each one). Used by tests/conftest.py and by
``commfuse conformance --capabilities commfuse_template.conformance:Capabilities``.
"""

from __future__ import annotations

import commfuse.testing


class Capabilities(commfuse.testing.Capabilities):
    dtypes = ("float32", "bfloat16")
    # gloo on a 2-core loopback: copies compete with the GEMMs, so report the overlap figure only.
    overlap_threshold = 0.0
    device = "cpu"  # the torch device type tensors are made on
    dist_backend = "gloo"  # the torch.distributed backend the suite's ranks initialise
