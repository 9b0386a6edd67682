"""FSDP2 around commfuse's own data-parallel layers.

:class:`commfuse.nn.ShardedLinear` shards its weight over the data-parallel
group itself and fuses the parameter all-gather and the gradient
reduce-scatter into its GEMMs. torch's ``fully_shard`` must leave such a layer
alone: sharding its shards again gives wrong gradients (and with its DTensor
parameters torch stops with an error of its own). :func:`fully_shard` is
torch's, with every such parameter passed as ``ignored_params`` for you;
:func:`sharded_params` gives the set for callers of torch's function.
"""

from __future__ import annotations

from torch import nn

__all__ = ["fully_shard", "sharded_params"]


def sharded_params(module: nn.Module) -> set[nn.Parameter]:
    """Every parameter of ``module`` (itself included) that a commfuse layer shards over data-parallel ranks
    by itself: what ``fully_shard`` must ignore."""
    from commfuse.nn import ShardedLinear

    found: set[nn.Parameter] = set()
    for m in module.modules():
        if isinstance(m, ShardedLinear):
            found.update(p for p in m.parameters(recurse=False))
    return found


def fully_shard(module: nn.Module, *, ignored_params: set[nn.Parameter] | None = None, **kwargs):
    """torch's ``fully_shard(module, **kwargs)`` with commfuse's self-sharded parameters ignored (added to
    ``ignored_params``). Each such layer keeps fusing its own all-gather and reduce-scatter, FSDP2 shards
    the rest, and the optimizer, ``clip_grad_norm_`` and checkpoints see DTensors on the mesh for both: a
    1-D ``mesh`` over the layers' own ranks becomes their parameters' mesh too (see
    :meth:`ShardedLinear.use_mesh`). Call it before making the optimizer, as for torch's."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from commfuse.nn import ShardedLinear

    mesh = kwargs.get("mesh")
    if mesh is not None and mesh.ndim == 1:
        for m in module.modules():
            if isinstance(m, ShardedLinear):
                m.use_mesh(mesh)  # one mesh for every DTensor parameter, or clip_grad_norm_ cannot stack norms
    ignored = set(ignored_params or ()) | sharded_params(module)
    return torch_fully_shard(module, ignored_params=ignored or None, **kwargs)

