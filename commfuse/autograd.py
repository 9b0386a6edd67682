"""Autograd for the fused ops: every backward pass is itself a decomposed ring.

The dgrad of an all-gather + GEMM is a GEMM + reduce-scatter, and the dgrad of
a GEMM + reduce-scatter is an all-gather + GEMM: each backward runs the
opposite ring with the same overlap as the forward. Weight gradients ride in
the ring steps too, so they add compute behind the same hops.

This module is the public name for them; each now lives beside its block in
``commfuse.fused``, with the block's planner and forward:

- ``all_gather_matmul_fn``, ``all_gather_matmul_backward`` (and the Function
  ``_AllGatherMatmul``): ``commfuse.fused.all_gather_matmul``;
- ``matmul_reduce_scatter_fn``, ``matmul_reduce_scatter_backward`` (and
  ``_MatmulReduceScatter``): ``commfuse.fused.matmul_reduce_scatter``;
- ``produce_reduce_scatter_fn`` (and ``_ProduceReduceScatter``), ``recomputed``
  and ``Replay``: ``commfuse.fused.produce_reduce_scatter``;
- ``WGRAD_SINK``, where weight gradients go while they are deferred (one list,
  the same object): ``commfuse.fused.matmul``, which both matmul blocks share.
"""

from __future__ import annotations

# the ``X as X`` imports: names this module held before the Functions moved, which callers may still read here
from commfuse.fused.all_gather_matmul import _AllGatherMatmul as _AllGatherMatmul
from commfuse.fused.all_gather_matmul import all_gather_matmul_backward, all_gather_matmul_fn
from commfuse.fused.matmul import WGRAD_SINK as WGRAD_SINK
from commfuse.fused.matmul_reduce_scatter import _MatmulReduceScatter as _MatmulReduceScatter
from commfuse.fused.matmul_reduce_scatter import matmul_reduce_scatter_backward, matmul_reduce_scatter_fn
from commfuse.fused.produce_reduce_scatter import Replay as Replay
from commfuse.fused.produce_reduce_scatter import _ProduceReduceScatter as _ProduceReduceScatter
from commfuse.fused.produce_reduce_scatter import produce_reduce_scatter_fn
from commfuse.fused.produce_reduce_scatter import recomputed as recomputed

__all__ = [
    "all_gather_matmul_backward", "all_gather_matmul_fn", "matmul_reduce_scatter_backward",
    "matmul_reduce_scatter_fn", "produce_reduce_scatter_fn",
]
