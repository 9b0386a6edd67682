"""Layers built on the fused ops: TP with sequence parallelism, query-split attention, Ulysses, ring attention
(context parallelism), FSDP, MoE.

Every layer takes ``group`` (a process group, a 1-D ``DeviceMesh`` such as
``mesh["tp"]``, or None for the default group) and ``algorithm``, and wraps
``nn.Linear`` weights both ways (``from_linear(s)`` / ``to_linear(s)``).

With more than one rank the parameters are DTensors on the group's mesh, with
the placements torch's styles give (``clip_grad_norm_``, ``state_dict``,
checkpoints and optimizers see the whole layer). To combine a TP layer with
``fully_shard`` on ``mesh["dp"]``, give it ``group=mesh["tp"]`` (the sub-mesh,
not its process group): FSDP2 composes DTensors of sub-meshes of one mesh only.
"""

from commfuse.nn.attention import ParallelAttention, UlyssesAttention, attend, ulysses_attention
from commfuse.nn.linear import ColumnParallelLinear, ParallelMLP, RowParallelLinear
from commfuse.nn.moe import MoE, moe_reference
from commfuse.nn.ring_attention import RingAttention
from commfuse.nn.sharded import ShardedLinear

__all__ = [
    "ColumnParallelLinear",
    "MoE",
    "ParallelAttention",
    "ParallelMLP",
    "RingAttention",
    "RowParallelLinear",
    "ShardedLinear",
    "UlyssesAttention",
    "attend",
    "moe_reference",
    "ulysses_attention",
]
