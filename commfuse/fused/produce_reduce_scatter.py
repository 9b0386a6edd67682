"""Autograd of ``commfuse.produce_reduce_scatter`` (the op is in ``commfuse.ops``): each rank makes every
rank's partial, the partials go round a reduce-scatter ring, and the backward all-gathers the output gradient
in a ring and back-propagates each arriving piece through the partial that made it. The attention block
(``commfuse.fused.attention``) runs its query slices through it too.

Under activation checkpointing (:func:`recomputed`) the partials are made again in the backward, each under
the random-number state and autocast its forward had (:class:`Replay`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch

from commfuse.planning.calls import Call
from commfuse.planning.gather import all_gather_consume_core
from commfuse.planning.scatter import produce_reduce_scatter_core
from commfuse.runtime.checkpointing import TOP_HOOKS
from commfuse.runtime.programs import rounded, sum_dtype

__all__ = ["Replay", "produce_reduce_scatter_fn", "recomputed"]


def recomputed() -> bool:
    """Whether saved-tensor hooks are active (``torch.autograd.graph.saved_tensors_hooks``): non-reentrant
    activation checkpointing (``torch.utils.checkpoint``, ``checkpoint_wrapper``, torch's composable
    ``checkpoint``) and offloading install them. What a Function saves then goes through them, and a graph
    kept some other way would keep its tensors or be recomputed where the Function cannot choose."""
    return TOP_HOOKS(False) is not None


class Replay:
    """What each call of a producer was made under in a forward, so that a backward can make it again: the
    random-number state (the CPU's, and the device's of the first input that is not on the CPU) and autocast.
    :meth:`record` runs ``fn(d, *inputs)`` and keeps them; :meth:`replay` runs it again under them."""

    __slots__ = ("device", "autocast", "states")

    def __init__(self, inputs) -> None:
        self.device = next((t.device for t in inputs if t.device.type != "cpu"), None)
        self.autocast: list = []
        self.states: dict[int, tuple] = {}

    def _rng(self) -> tuple:
        device = self.device
        if device is None:
            return (torch.get_rng_state(), None)
        return (torch.get_rng_state(), torch.get_device_module(device.type).get_rng_state(device))

    def record(self, d: int, fn: Callable, inputs) -> torch.Tensor:
        kinds = ("cpu",) if self.device is None else ("cpu", self.device.type)
        self.autocast = [(kind, torch.get_autocast_dtype(kind)) for kind in kinds if torch.is_autocast_enabled(kind)]
        self.states[d] = self._rng()
        return fn(d, *inputs)

    def replay(self, d: int, fn: Callable, inputs) -> torch.Tensor:
        cpu, dev = self.states[d]
        device = self.device
        devices = [] if device is None else [device]
        with torch.random.fork_rng(devices=devices, device_type="cpu" if device is None else device.type):
            torch.set_rng_state(cpu)
            if device is not None:
                torch.get_device_module(device.type).set_rng_state(dev, device)
            with contextlib.ExitStack() as stack:
                for kind, dtype in self.autocast:
                    stack.enter_context(torch.autocast(kind, dtype=dtype))
                return fn(d, *inputs)


class _ProduceReduceScatter(torch.autograd.Function):
    """``out = sum over ranks of fn(this_rank, *inputs)`` where each rank makes every rank's partial.

    ======== ============================================ ================================
    pass     computes                                     communication
    ======== ============================================ ================================
    forward  partial p_d = fn(d, *inputs) per destination reduce-scatter ring of the p_d
    backward d inputs += vjp(p_d, dout_d) per arrival     all-gather ring of dout shards
    ======== ============================================ ================================

    The partials' graphs are built in the forward (under ``enable_grad`` on
    detached copies of ``inputs``) and kept; the backward back-propagates each
    destination's output gradient through its partial as that gradient
    arrives, hiding the next hop. Shapes: every p_d and dout_d alike.

    Under saved-tensor hooks (activation checkpointing, offloading: see
    :func:`recomputed`), nothing of the partials is kept: the forward makes
    them without graphs and saves ``inputs`` through the hooks, and the
    backward makes each destination's partial again, with its graph, as its
    gradient arrives (with the forward's random-number state and autocast).
    A kept graph would be back-propagated in a graph task of its own, in
    which non-reentrant checkpointing recomputes the region again, inside
    this ring.
    """

    @staticmethod
    def forward(ctx, call: Call, fn: Callable, dim: int, *inputs: torch.Tensor):
        ctx.call, ctx.fn = call, fn
        if recomputed():
            states = Replay(inputs)
            out = produce_reduce_scatter_core(call, lambda d: states.record(d, fn, inputs), dim, early=None)
            ctx.states, ctx.graphs = states, None
            ctx.save_for_backward(*inputs)
            return out
        leaves = [t.detach().requires_grad_(t.requires_grad) for t in inputs]
        graphs: dict[int, torch.Tensor] = {}

        def producer(d: int) -> torch.Tensor:
            with torch.enable_grad():
                p = fn(d, *leaves)
            graphs[d] = p
            return p.detach()

        out = produce_reduce_scatter_core(call, producer, dim, early=None)
        ctx.graphs, ctx.leaves = graphs, leaves
        return out

    @staticmethod
    def backward(ctx, dout):
        graphs = ctx.graphs
        if graphs is None:
            # unpacked before the ring takes the group: non-reentrant checkpointing recomputes the region here
            inputs = ctx.saved_tensors
            leaves = [t.detach().requires_grad_(need) for t, need in zip(inputs, ctx.needs_input_grad[3:])]
            states, fn = ctx.states, ctx.fn

            def partial(d: int) -> torch.Tensor:
                with torch.enable_grad():
                    return states.replay(d, fn, leaves)
        else:
            leaves = ctx.leaves
            partial = graphs.pop
        wanted = [i for i, leaf in enumerate(leaves) if leaf.requires_grad]
        grads: list[torch.Tensor | None] = [None] * len(leaves)

        def consume(g: torch.Tensor, d: int) -> None:
            p = partial(d)
            got = torch.autograd.grad(p, [leaves[i] for i in wanted], g, allow_unused=True)
            for i, gi in zip(wanted, got):
                if gi is not None:  # one gradient per arriving piece, summed in float32 for half inputs
                    grads[i] = gi.to(sum_dtype(gi.dtype)) if grads[i] is None else grads[i].add_(gi)

        all_gather_consume_core(ctx.call, dout.contiguous(), consume, 0, keep=False,
                                label="produce_reduce_scatter.backward")
        grads = [g if g is None else rounded(g, leaf.dtype) for g, leaf in zip(grads, leaves)]
        return (None, None, None, *grads)


def produce_reduce_scatter_fn(call: Call, fn: Callable, inputs: Sequence[torch.Tensor], dim: int) -> torch.Tensor:
    """Differentiable :func:`commfuse.produce_reduce_scatter` with respect to ``inputs``.

    A partial produced early to choose the algorithm is discarded (it has no
    graph on the detached inputs); the ring produces it again.
    """
    return _ProduceReduceScatter.apply(call, fn, dim, *inputs)
