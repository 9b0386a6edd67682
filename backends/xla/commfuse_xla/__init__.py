"""commfuse-xla: the traced commfuse backend for XLA devices.

A ring step's transfers on one channel are one permutation of the ranks, so
the backend lowers them to a single ``xm.collective_permute`` whose
source-target pairs come from the schedule's :class:`~commfuse.schedule.Ring`;
the compute stays ordinary lazy tensor ops, and XLA's latency-hiding
scheduler overlaps each asynchronous permute with the dots that do not
depend on it. Nothing here imports torch_xla at import time:
:mod:`commfuse_xla.backend` does so when a backend is made, and
:mod:`commfuse_xla.hlo` (the HLO parser the checks use) needs no torch at all.
"""

from __future__ import annotations

__version__ = "0.1.0"
