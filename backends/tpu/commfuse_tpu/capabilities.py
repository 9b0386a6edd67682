"""What the ``tpu`` backend declares: its :class:`~commfuse.plugins.Capabilities`. UNVERIFIED without a TPU:
each field says what is known from TorchTPU's documentation and what would change it once measured."""

from __future__ import annotations

from commfuse.plugins import Capabilities

# What reads each field: commfuse/plugins/types.py.
CAPABILITIES = Capabilities(
    # ICI links carry both directions at once.
    bidirectional_links=True,
    native_fused_ops=(),
    execution="eager",
    # Not claimed: whether a TorchTPU work's wait orders streams without blocking the host is unmeasured, so the
    # host blocks in work.wait(timeout), which is correct on any backend.
    streams=False,
    # TorchTPU's tpu backend has all-gather, reduce-scatter and all-to-all.
    collectives=("all_gather", "reduce_scatter", "all_to_all"),
    # Not claimed until measured on a TPU: auto then takes vanilla (algorithm="ring" still runs the ring).
    overlap=False,
    capturable=False,
)
