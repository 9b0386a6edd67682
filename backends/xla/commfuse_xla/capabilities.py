"""What the ``xla`` backend declares it can do: its :class:`~commfuse.plugins.Capabilities`.

A module of its own, importing nothing but ``commfuse.plugins``, so that both
the plugin record (:mod:`commfuse_xla.plugin`, which must stay cheap to import)
and :class:`~commfuse_xla.backend.XlaBackend` (whose objects carry it even when made
directly, without the registry) can read it without importing each other.
"""

from __future__ import annotations

from commfuse.plugins import Capabilities

# What reads each field: commfuse/plugins/types.py.
CAPABILITIES = Capabilities(
    # TPU ICI and NVLink links carry both directions at once (nothing in commfuse acts on it yet).
    bidirectional_links=True,
    # No native_op: XLA fuses what it fuses on its own, from the lowered graph.
    native_fused_ops=(),
    # The schedule is lowered into the graph; XLA's scheduler, not the host, overlaps. The executor skips its
    # host-side fingerprint check for traced backends (comparing values would execute the graph mid-trace).
    execution="traced",
    # Nothing to order on the host: XlaBackend's wait returns the permutes' lazy tensors at once.
    streams=False,
    # xm.all_gather / reduce_scatter / all_to_all lower the vanilla and sliced baselines.
    collectives=("all_gather", "reduce_scatter", "all_to_all"),
    # No host-side progress to measure: overlap is the compiler's, UNVERIFIED on TPU here.
    overlap=False,
    # Traced: XLA compiles and replays the whole graph itself; a device graph (torch.cuda.graph) does not apply.
    capturable=False,
)
