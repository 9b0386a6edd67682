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

import contextlib

from torch import nn

__all__ = ["fully_shard", "no_sync", "set_requires_gradient_sync", "sharded_params"]


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
    :meth:`ShardedLinear.use_mesh`), and an ``mp_policy`` (``MixedPrecisionPolicy``) sets their
    ``param_dtype`` and ``reduce_dtype`` as it sets FSDP2's. Call it before making the optimizer, as for
    torch's."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from commfuse.nn import ShardedLinear

    mesh, policy = kwargs.get("mesh"), kwargs.get("mp_policy")
    for m in module.modules():
        if isinstance(m, ShardedLinear):
            if mesh is not None and mesh.ndim == 1:
                m.use_mesh(mesh)  # one mesh for every DTensor parameter, or clip_grad_norm_ cannot stack norms
            if policy is not None:  # FSDP2's MixedPrecisionPolicy: the same compute and reduce dtypes
                m.param_dtype, m.reduce_dtype = policy.param_dtype, policy.reduce_dtype
    ignored = set(ignored_params or ()) | sharded_params(module)
    return torch_fully_shard(module, ignored_params=ignored or None, **kwargs)



def set_requires_gradient_sync(module: nn.Module, requires_gradient_sync: bool) -> None:
    """Whether backward passes reduce gradients (True) or accumulate them unreduced (False), for FSDP2's
    modules (their ``set_requires_gradient_sync``) and commfuse's self-sharded layers alike."""
    from torch.distributed.fsdp import FSDPModule

    from commfuse.nn import ShardedLinear

    for m in module.modules():
        if isinstance(m, ShardedLinear):
            m.set_requires_gradient_sync(requires_gradient_sync)
        elif isinstance(m, FSDPModule):
            m.set_requires_gradient_sync(requires_gradient_sync, recurse=False)


@contextlib.contextmanager
def no_sync(module: nn.Module):
    """Gradient accumulation: backward passes inside accumulate unreduced gradients (FSDP2's and commfuse's
    layers alike); the first backward after the block reduces the sum, as ``DDP.no_sync`` does."""
    set_requires_gradient_sync(module, False)
    try:
        yield module
    finally:
        set_requires_gradient_sync(module, True)
