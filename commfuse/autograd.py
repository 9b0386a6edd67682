"""Autograd for the fused ops: every backward pass is itself a decomposed ring.

The dgrad of an all-gather + GEMM is a GEMM + reduce-scatter, and the dgrad of
a GEMM + reduce-scatter is an all-gather + GEMM: each backward runs the
opposite ring with the same overlap as the forward. Weight gradients ride in
the ring steps too, so they add compute behind the same hops.

Private ``_CamelCase`` Functions and public snake_case entry points (the
fused ops, ``commfuse.fused``, call these when a gradient is wanted). A
Function's forward is the one its op planned for the call's signature
(``commfuse.fused.matmul``), handed in, so a call with gradients runs the same
plan as one without. Built on the pipelined primitives of
``commfuse.planning.pipelined``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch

from commfuse.planning.calls import Call
from commfuse.planning.pipelined import (
    all_gather_consume_core,
    gather_matmul_meta,
    gather_spans,
    join,
    matmul_rows,
    produce_reduce_scatter_core,
    rows_of,
    scatter_spans,
)
from commfuse.runtime.checkpointing import TOP_HOOKS
from commfuse.runtime.programs import dtype_code, rounded, sum_dtype, sum_zeros
from commfuse.schedule import split_sizes

__all__ = [
    "all_gather_matmul_backward", "all_gather_matmul_fn", "matmul_reduce_scatter_backward",
    "matmul_reduce_scatter_fn", "produce_reduce_scatter_fn",
]


def _flat(t: torch.Tensor) -> torch.Tensor:
    """All leading dims folded into rows: (..., C) -> (rows, C)."""
    return t.reshape(-1, t.shape[-1])


#: Where weight gradients go while they are deferred (``commfuse.strands``, as Zero Bubble pipelines split a
#: backward into its input and weight halves). While this list holds a callable, the backward of
#: :func:`all_gather_matmul_fn` (with the gathered input kept) and of :func:`matmul_reduce_scatter_fn` hands it
#: each weight-gradient GEMM as a closure, instead of running it in the ring's step, and returns no gradient
#: for that weight to autograd: the closure adds into the weight's ``.grad`` itself. Only for a leaf weight
#: without gradient hooks (DDP's and FSDP's hooks must see their gradients), saved without saved-tensor hooks:
#: under activation checkpointing (or offloading) the weight a backward unpacks is a new tensor that only
#: shares the parameter's gradient accumulator, whose ``.grad`` nobody reads. Any other weight's gradient is
#: computed in the ring as always.
WGRAD_SINK: list = []


def _deferred(weight: torch.Tensor):
    """The sink a weight gradient of ``weight`` goes to, or None (computed now)."""
    if not WGRAD_SINK or not (weight.is_leaf and weight.requires_grad):
        return None
    if weight._backward_hooks or getattr(weight, "_post_accumulate_grad_hooks", None):
        return None
    return WGRAD_SINK[-1]


def _add_grad(weight: torch.Tensor, x: torch.Tensor, dy: torch.Tensor) -> None:
    """``weight.grad += x^T @ dy`` (rows folded), as autograd's accumulation would leave it."""
    with torch.no_grad():
        g = (_flat(x).t() @ _flat(dy)).to(weight.dtype)
        if weight.grad is None:
            weight.grad = g
        else:
            weight.grad.add_(g)


class _AllGatherMatmul(torch.autograd.Function):
    """``y_i = all_gather(a, d) @ b_i`` for every weight ``b_i``.

    ======== ===================================== ==========================================
    pass     computes                              shapes (N ranks, L rows per shard at dim d)
    ======== ===================================== ==========================================
    forward  y_i = AG(a) @ b_i                     a (.., L, .., K), b_i (K, M_i) -> y_i (.., N*L, .., M_i)
    dgrad    da = RS(sum_i dy_i @ b_i^T) along d   dy_i (.., N*L, .., M_i) -> da (.., L, .., K)
    wgrad    db_i = AG(a)^T @ dy_i                 -> db_i (K, M_i), this rank's dy only
    ======== ===================================== ==========================================

    The dgrad reduce-scatter ring computes, per step, the partial of one
    destination's rows; with the gathered ``a`` kept from the forward
    (``keep``) the wgrad GEMM of the same rows runs in that step too, adding
    compute behind the hop. Without it ``a`` is gathered again in a ring whose
    steps each run the wgrad GEMM of the shard that just arrived.
    """

    @staticmethod
    def forward(ctx, forward: Callable, call: Call, gd: int, sizes, keep: bool, a: torch.Tensor, *bs: torch.Tensor):
        gathered, outs = forward(a, bs)
        ctx.call, ctx.gd, ctx.sizes, ctx.keep = call, gd, list(sizes), keep
        ctx.defer = TOP_HOOKS(False) is None  # see _deferred
        ctx.save_for_backward(gathered if keep else a, *bs)
        if keep:
            ctx.mark_non_differentiable(gathered)
        return (gathered if keep else a.new_empty(0), *outs)

    @staticmethod
    def backward(ctx, _dgathered, *douts):
        x, *bs = ctx.saved_tensors
        da, dbs = all_gather_matmul_backward(ctx.call, x, bs, douts, ctx.gd, ctx.sizes, ctx.keep,
                                             ctx.needs_input_grad[5], ctx.needs_input_grad[6:], ctx.defer)
        return (None, None, None, None, None, da, *dbs)


def all_gather_matmul_backward(call: Call, x: torch.Tensor, bs: Sequence[torch.Tensor], douts, gd: int, sizes,
                               keep: bool, need_a: bool, need_b: Sequence[bool], defer: bool = True):
    """The gradients ``(da or None, [db_i or None])`` of :func:`commfuse.all_gather_matmul` (see
    :class:`_AllGatherMatmul`): ``x`` is the gathered input when ``keep``, else this rank's shard. ``defer``
    False: no weight gradient goes to :data:`WGRAD_SINK` (a custom op's backward must return them all)."""
    pairs = [(b, d) for b, d in zip(bs, douts) if d is not None]
    sinks = [_deferred(b) if defer and keep and need and d is not None else None
             for b, d, need in zip(bs, douts, need_b)]
    # a weight gradient sums one GEMM per ring step: in float32 for half weights (programs.sum_dtype), cast
    # back once at the end, as torch's one GEMM over the gathered rows accumulates
    dbs = [sum_zeros(b) if need and d is not None and sink is None else None
           for b, d, need, sink in zip(bs, douts, need_b, sinks)]
    k = bs[0].shape[0]

    def wgrad(x_rows, spans_rows_of_dy):
        for b, db, d, sink in zip(bs, dbs, douts, sinks):
            if db is not None:
                db.add_(_flat(x_rows).t() @ _flat(spans_rows_of_dy(d)))
            elif sink is not None:
                dy_rows = spans_rows_of_dy(d)
                sink(lambda b=b, x_rows=x_rows, dy_rows=dy_rows: _add_grad(b, x_rows, dy_rows))

    da = None
    full = list(x.shape) if keep else list(x.shape[:gd]) + [sum(sizes)] + list(x.shape[gd + 1:])
    if not keep and any(db is not None for db in dbs):
        # gather a again; every arriving shard's wgrad GEMM hides the next hop
        gather_spans(call, x, gd, sizes, lambda spans: wgrad(join(spans, gd), lambda d: rows_of(d, spans, gd)),
                     label="all_gather_matmul.wgrad", meta=gather_matmul_meta(x, bs, gd, sum(sizes)))
    if need_a and pairs:
        # the weights detached: torch.matmul folds a 3-D input by whether the weight requires a gradient, and a
        # saved weight may or may not (checkpointing's recomputed ones do not): the same GEMMs either way
        pairs = [(b.detach(), d) for b, d in pairs]

        def produce(spans):
            part = None
            for b, d in pairs:
                t = rows_of(d, spans, gd) @ b.t()
                part = t if part is None else part.add_(t)
            if keep:
                wgrad(rows_of(x, spans, gd), lambda d: rows_of(d, spans, gd))
            lens = [size for _, size in spans]
            return [part] if len(spans) == 1 else list(torch.split(part, lens, dim=gd))

        full[-1] = k
        da = scatter_spans(call, full, gd, x.dtype, produce, label="all_gather_matmul.dgrad",
                           meta=lambda: [dtype_code(x.dtype), gd, *full])
    elif keep and any(db is not None or sink is not None for db, sink in zip(dbs, sinks)):
        wgrad(x, lambda d: d)
    return da, [db if db is None else rounded(db, b.dtype) for b, db in zip(bs, dbs)]


def all_gather_matmul_fn(forward: Callable, call: Call, a: torch.Tensor, bs: Sequence[torch.Tensor], gd: int, sizes,
                         keep: bool):
    """Differentiable :func:`commfuse.all_gather_matmul`; returns (gathered or None, outputs). ``forward(a, bs)
    -> (gathered, outputs)`` is the forward the op planned for this signature, giving the gathered input when
    ``keep``."""
    gathered, *outs = _AllGatherMatmul.apply(forward, call, gd, sizes, keep, a, *bs)
    return (gathered if keep else None), outs


class _MatmulReduceScatter(torch.autograd.Function):
    """``z = reduce_scatter(a @ b, d)`` (sum, or average over the N ranks).

    ======== ===================================== ==========================================
    pass     computes                              shapes
    ======== ===================================== ==========================================
    forward  z = RS(a @ b) along d                 a (.., S, .., K), b (K, M) -> z (.., S/N, .., M)
    dgrad    da = AG(dz) @ b^T along d             dz (.., S/N, .., M) -> da (.., S, .., K)
    wgrad    db = a^T @ AG(dz)                     -> db (K, M)
    ======== ===================================== ==========================================

    The dgrad all-gather ring runs, for every arriving slice of dz, both its
    dgrad GEMM and its wgrad GEMM, so the full dz is never materialised.
    """

    @staticmethod
    def forward(ctx, forward: Callable, call: Call, sd: int, reduce_op: str, a: torch.Tensor, b: torch.Tensor):
        z = forward(a, b)
        if reduce_op == "avg":
            z = z.div_(call.world_size)
        ctx.call, ctx.sd, ctx.avg = call, sd, reduce_op == "avg"
        ctx.defer = TOP_HOOKS(False) is None  # see _deferred
        ctx.save_for_backward(a, b)
        return z

    @staticmethod
    def backward(ctx, dz):
        a, b = ctx.saved_tensors
        da, db = matmul_reduce_scatter_backward(ctx.call, a, b, dz, ctx.sd, ctx.avg, ctx.needs_input_grad[4],
                                                ctx.needs_input_grad[5], ctx.defer)
        return None, None, None, None, da, db


def matmul_reduce_scatter_backward(call: Call, a: torch.Tensor, b: torch.Tensor, dz: torch.Tensor, sd: int,
                                   avg: bool, need_a: bool, need_b: bool, defer: bool = True):
    """The gradients ``(da or None, db or None)`` of :func:`commfuse.matmul_reduce_scatter` (see
    :class:`_MatmulReduceScatter`; ``defer`` as for :func:`all_gather_matmul_backward`)."""
    if avg:
        dz = dz / call.world_size
    da = torch.empty(a.shape, dtype=a.dtype, device=a.device) if need_a else None
    sink = _deferred(b) if defer and need_b else None
    # db sums one GEMM per arriving slice of dz: in float32 for a half weight (programs.sum_dtype), cast back once
    db = sum_zeros(b) if need_b and sink is None else None
    sizes = split_sizes(a.shape[sd], call.world_size)
    bt = b.detach().t()  # as all_gather_matmul_backward's dgrad takes its weights

    def consume(spans):
        piece = join(spans, sd)
        if da is not None:
            matmul_rows(da, spans, sd, piece, bt)
        if db is not None:
            db.add_(_flat(rows_of(a, spans, sd)).t() @ _flat(piece))
        elif sink is not None:
            a_rows = rows_of(a, spans, sd)
            sink(lambda: _add_grad(b, a_rows, piece))

    if need_a or need_b:
        # a deferred weight gradient keeps the pieces that arrived until it runs
        gather_spans(call, dz.contiguous(), sd, sizes, consume, label="matmul_reduce_scatter.dgrad",
                     meta=gather_matmul_meta(dz, [bt], sd, a.shape[sd]), keep=sink is not None)
    return da, (db if db is None else rounded(db, b.dtype))


def matmul_reduce_scatter_fn(forward: Callable, call: Call, a: torch.Tensor, b: torch.Tensor, sd: int,
                             reduce_op: str) -> torch.Tensor:
    """Differentiable :func:`commfuse.matmul_reduce_scatter`; ``forward(a, b)`` is the forward (a sum) the op
    planned for this signature."""
    return _MatmulReduceScatter.apply(forward, call, sd, reduce_op, a, b)


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
