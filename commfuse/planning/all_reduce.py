"""The all-reduce a layer needs (a replicated parameter's gradient, a count every rank must share), as a
reduce-scatter then an all-gather through the runtime, so it is numbered, bounded and told to every rank
like any call.
"""

from __future__ import annotations

import torch

from commfuse.planning.calls import Call, resolve_call
from commfuse.planning.consumers import collect
from commfuse.planning.gather import all_gather_consume_core
from commfuse.planning.scatter import produce_reduce_scatter_core
from commfuse.schedule import Collective

__all__ = ["all_reduce_core", "group_sum"]


def all_reduce_core(call: Call, t: torch.Tensor, *, label: str = "all_reduce") -> torch.Tensor:
    """The sum of ``t`` over the group's ranks, as two calls through the runtime: a reduce-scatter of its flat
    pieces, then an all-gather of the sums (``call``'s algorithm, ``vanilla`` for two whole collectives). So an
    all-reduce a layer needs (a replicated parameter's gradient) is numbered, bounded by commfuse's timeout,
    interruptible, and told to every rank like any call, never a raw collective bounded only by the group's
    own timeout."""
    n = call.be.world_size
    flat = t.reshape(-1)
    k = -(-flat.numel() // n) or 1
    if flat.numel() != n * k:
        flat = torch.cat([flat, flat.new_zeros(n * k - flat.numel())])
    pieces = flat.view(n, k)
    mine = produce_reduce_scatter_core(call, lambda d: pieces[d].clone(), 0, label=f"{label}.reduce", inplace=True)
    whole = all_gather_consume_core(call, mine, collect, 0, label=f"{label}.gather")
    return torch.cat(whole)[: t.numel()].view(t.shape)


def group_sum(t: torch.Tensor, group, *, label: str = "all_reduce") -> torch.Tensor:
    """``t`` summed over ``group``'s ranks by :func:`all_reduce_core` on the group's ``vanilla`` call (two whole
    collectives through the runtime: numbered, bounded by commfuse's timeout, told to every rank); a copy of
    ``t`` where the group has no call to make (one rank)."""
    call = resolve_call(Collective.REDUCE_SCATTER, "vanilla", group=group, device=t.device)
    if call is None:
        return t.clone()
    return all_reduce_core(call, t.contiguous(), label=label)
