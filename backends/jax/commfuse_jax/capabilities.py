"""What the ``jax`` backend declares it can do: its :class:`~commfuse.plugins.Capabilities`.

A module of its own, importing nothing but ``commfuse.plugins``, so that the
plugin record (cheap to import: no jax, no torchax) and the backend object
both read it.
"""

from __future__ import annotations

from commfuse.plugins import Capabilities

# What reads each field: commfuse/plugins/types.py.
CAPABILITIES = Capabilities(
    # TPU ICI links carry both directions at once: auto's hardware model may consider bidirectional.
    bidirectional_links=True,
    # No native_op: XLA fuses what it fuses from the lowered graph.
    native_fused_ops=(),
    # The schedule is lowered into the graph; XLA's scheduler overlaps the permutes with the dots.
    execution="traced",
    streams=False,
    # lax.all_gather, psum_scatter and all_to_all run vanilla and sliced.
    collectives=("all_gather", "reduce_scatter", "all_to_all"),
    # No host-side progress to measure: the overlap is the compiler's (UNVERIFIED without a TPU).
    overlap=False,
    # jax.jit compiles and replays the whole graph itself; a device graph (torch.cuda.graph) does not apply.
    capturable=False,
    # The rank is the device's axis_index, a value of the graph: commfuse's step loop cannot walk with it,
    # so these ops are handed to JaxBackend.run_op whole (commfuse_jax.ops walks the schedule itself).
    whole_ops=("all_gather_matmul", "matmul_reduce_scatter", "all_gather_consume", "produce_reduce_scatter",
               "all_to_all_consume", "ring_attention"),
)
