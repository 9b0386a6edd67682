"""Autograd for the fused ops: every backward pass is itself a decomposed ring.

The dgrad of an all-gather + GEMM is a GEMM + reduce-scatter, and the dgrad of
a GEMM + reduce-scatter is an all-gather + GEMM: each backward runs the
opposite ring with the same overlap as the forward. Weight gradients ride in
the ring steps too, so they add compute behind the same hops.

Private ``_CamelCase`` Functions, public snake_case entry points (the ops in
``commfuse.ops`` call these when a gradient is wanted), and the forward
computations the ops run when none is (``*_forward``). Built on the
pipelined primitives of ``commfuse.planning.pipelined``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from commfuse.planning.calls import Call
from commfuse.planning.pipelined import (
    all_gather_consume_core,
    gather_spans,
    join,
    matmul_rows,
    prepare_gather,
    prepare_scatter,
    produce_reduce_scatter_core,
    rows_of,
    run_gather,
    run_scatter,
    run_scatter_one_by_one,
    run_scatter_whole,
    scatter_spans,
    scatters_whole,
    write_rows,
)
from commfuse.runtime.loop import may_skip_program
from commfuse.runtime.programs import dtype_code
from commfuse.schedule import split_sizes

__all__ = [
    "all_gather_matmul_backward", "all_gather_matmul_fn", "all_gather_matmul_forward", "all_gather_matmul_planned",
    "matmul_reduce_scatter_backward", "matmul_reduce_scatter_fn", "matmul_reduce_scatter_forward",
    "matmul_reduce_scatter_planned", "produce_reduce_scatter_fn",
]


def _ag_meta(a: torch.Tensor, bs, gd: int, total: int):
    """The fingerprint integers of an all-gather + matmul (read back by ``all_gather_matmul``'s format)."""
    def meta():
        full = list(a.shape)
        full[gd] = total
        return [dtype_code(a.dtype), gd, a.ndim, *full, len(bs)] + [d for bi in bs for d in bi.shape]

    return meta


def all_gather_matmul_forward(call: Call, a: torch.Tensor, bs, gd: int, sizes, return_gathered: bool):
    """The forward of :func:`commfuse.all_gather_matmul` on ``call``'s backend; returns (gathered or None, outputs)."""
    return all_gather_matmul_planned(call, a, bs, gd, sizes, return_gathered)(a, bs)


def all_gather_matmul_planned(call: Call, a: torch.Tensor, bs, gd: int, sizes, return_gathered: bool):
    """:func:`all_gather_matmul_forward` planned for the signature of ``a`` and ``bs``: what does not change
    from call to call (output shapes, the ring's plan and layout) is decided here, once; the function
    returned runs one call ``(a, bs) -> (gathered or None, outputs)``."""
    total = sum(sizes)
    contraction = gd == a.ndim - 1
    lead = list(a.shape[:-1])
    if not contraction:
        lead[gd] = total
    make = torch.zeros if contraction else torch.empty
    out_shapes = [tuple(lead + [bi.shape[1]]) for bi in bs]
    full_a = list(a.shape)
    full_a[gd] = total
    dtype, device = a.dtype, a.device
    direct = all(d == 1 for d in lead[:gd])  # blocks of rows along gd are contiguous in the outputs
    planned = prepare_gather(call, a.shape, dtype, gd, tuple(sizes), "all_gather_matmul", _ag_meta(a, bs, gd, total))

    def forward(a, bs):
        if not contraction and not return_gathered and len(bs) == 1:
            return None, [_matmul_one_weight(a, bs[0])]
        outs = [make(shape, dtype=dtype, device=device) for shape in out_shapes]
        gathered = torch.empty(full_a, dtype=dtype, device=device) if return_gathered else None
        if contraction:
            def consume(spans):
                piece = join(spans, gd)
                if gathered is not None:
                    write_rows(gathered, spans, gd, piece)
                for bi, out in zip(bs, outs):
                    out.add_(torch.matmul(piece, rows_of(bi, spans, 0)))
        else:
            def consume(spans):
                piece = join(spans, gd)
                if gathered is not None:
                    write_rows(gathered, spans, gd, piece)
                for bi, out in zip(bs, outs):
                    matmul_rows(out, spans, gd, piece, bi, direct)

        run_gather(planned, a, consume)
        return gathered, outs

    def _matmul_one_weight(a, b0):
        """One weight, no gathered copy: the common case, with the output made by the first GEMM that
        covers it all (vanilla) or allocated once the ring's first slice arrives."""
        result = [None]  # the output, made by the first slice's GEMM

        def on_slice(start, size, t):
            if size == total:  # every row at once (vanilla): the GEMM makes the output
                result[0] = torch.matmul(t, b0)
                return
            out0 = result[0]
            if out0 is None:
                out0 = result[0] = t.new_empty(out_shapes[0])
            if gd == 0:
                torch.matmul(t, b0, out=out0[start:start + size])  # slicing costs less than narrow
            elif direct:
                torch.matmul(t, b0, out=out0.narrow(gd, start, size))
            else:
                matmul_rows(out0, [(start, size, t)], gd, t, b0)

        def consume(spans):
            if len(spans) == 1:
                on_slice(*spans[0])
                return
            out0 = result[0]
            if out0 is None:
                out0 = result[0] = torch.empty(out_shapes[0], dtype=dtype, device=device)
            matmul_rows(out0, spans, gd, join(spans, gd), b0, direct)

        run_gather(planned, a, consume, consume_one=on_slice)
        return result[0]

    # one weight, no gathered copy, a gathered dim that is not the contraction: (a, b) -> result, directly;
    # commfuse.fused.matmul walks a ring along dim 0 on this plan itself once its signature is agreed
    forward.single = None if contraction or return_gathered else _matmul_one_weight
    forward.planned, forward.out_shape = planned, out_shapes[0]
    return forward


def matmul_reduce_scatter_forward(call: Call, a: torch.Tensor, b: torch.Tensor, sd: int) -> torch.Tensor:
    """The forward of :func:`commfuse.matmul_reduce_scatter` (a sum) on ``call``'s backend."""
    return matmul_reduce_scatter_planned(call, a, b, sd)(a, b)


def matmul_reduce_scatter_planned(call: Call, a: torch.Tensor, b: torch.Tensor, sd: int):
    """:func:`matmul_reduce_scatter_forward` planned once for the signature of ``a`` and ``b``; the function
    returned runs one call ``(a, b) -> this rank's summed shard``."""
    out_shape = [*a.shape[:-1], b.shape[1]]
    last = sd == len(out_shape) - 1

    def meta():
        return [dtype_code(a.dtype), sd, a.ndim, *a.shape, *b.shape]

    planned = prepare_scatter(call, out_shape, sd, a.dtype, "matmul_reduce_scatter", meta)
    plan = planned.plan
    whole = scatters_whole(planned)

    ring = plan.one_by_one

    def forward(a, b):
        if (whole or ring) and may_skip_program(plan):  # signature agreed: no program
            if whole:  # vanilla: one GEMM, one reduce-scatter
                return run_scatter_whole(planned, lambda: torch.matmul(a, b))
            if last:
                def part(start, size, _):
                    return torch.matmul(a, b[:, start:start + size])
            elif sd == 0:
                def part(start, size, _):
                    return torch.matmul(a[start:start + size], b)
            else:
                def part(start, size, _):
                    return torch.matmul(a.narrow(sd, start, size), b)
            return run_scatter_one_by_one(planned, part)  # a ring: this rank's partial of each slice
        if last:
            def produce(spans):
                y = torch.matmul(a, rows_of(b, spans, 1))
                return [y] if len(spans) == 1 else list(torch.split(y, [size for _, size in spans], dim=sd))
        else:
            def produce(spans):
                if len(spans) == 1:
                    start, size = spans[0]
                    return [torch.matmul(a.narrow(sd, start, size), b)]
                y = torch.matmul(rows_of(a, spans, sd), b)
                return list(torch.split(y, [size for _, size in spans], dim=sd))

        return run_scatter(planned, produce, produce_whole=lambda: torch.matmul(a, b))

    return forward


def _flat(t: torch.Tensor) -> torch.Tensor:
    """All leading dims folded into rows: (..., C) -> (rows, C)."""
    return t.reshape(-1, t.shape[-1])


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
    def forward(ctx, call: Call, gd: int, sizes, keep: bool, a: torch.Tensor, *bs: torch.Tensor):
        gathered, outs = all_gather_matmul_forward(call, a, bs, gd, sizes, return_gathered=keep)
        ctx.call, ctx.gd, ctx.sizes, ctx.keep = call, gd, list(sizes), keep
        ctx.save_for_backward(gathered if keep else a, *bs)
        if keep:
            ctx.mark_non_differentiable(gathered)
        return (gathered if keep else a.new_empty(0), *outs)

    @staticmethod
    def backward(ctx, _dgathered, *douts):
        x, *bs = ctx.saved_tensors
        da, dbs = all_gather_matmul_backward(ctx.call, x, bs, douts, ctx.gd, ctx.sizes, ctx.keep,
                                             ctx.needs_input_grad[4], ctx.needs_input_grad[5:])
        return (None, None, None, None, da, *dbs)


def all_gather_matmul_backward(call: Call, x: torch.Tensor, bs: Sequence[torch.Tensor], douts, gd: int, sizes,
                               keep: bool, need_a: bool, need_b: Sequence[bool]):
    """The gradients ``(da or None, [db_i or None])`` of :func:`commfuse.all_gather_matmul` (see
    :class:`_AllGatherMatmul`): ``x`` is the gathered input when ``keep``, else this rank's shard."""
    pairs = [(b, d) for b, d in zip(bs, douts) if d is not None]
    dbs = [torch.zeros_like(b) if need and d is not None else None for b, d, need in zip(bs, douts, need_b)]
    k = bs[0].shape[0]

    def wgrad(x_rows, spans_rows_of_dy):
        for db, d in zip(dbs, douts):
            if db is not None:
                db.add_(_flat(x_rows).t() @ _flat(spans_rows_of_dy(d)))

    da = None
    full = list(x.shape) if keep else list(x.shape[:gd]) + [sum(sizes)] + list(x.shape[gd + 1:])
    if not keep and any(db is not None for db in dbs):
        # gather a again; every arriving shard's wgrad GEMM hides the next hop
        gather_spans(call, x, gd, sizes, lambda spans: wgrad(join(spans, gd), lambda d: rows_of(d, spans, gd)),
                     label="all_gather_matmul.wgrad", meta=_ag_meta(x, bs, gd, sum(sizes)))
    if need_a and pairs:
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
    elif keep and any(db is not None for db in dbs):
        wgrad(x, lambda d: d)
    return da, dbs


def all_gather_matmul_fn(call: Call, a: torch.Tensor, bs: Sequence[torch.Tensor], gd: int, sizes, keep: bool):
    """Differentiable :func:`commfuse.all_gather_matmul`; returns (gathered or None, outputs)."""
    gathered, *outs = _AllGatherMatmul.apply(call, gd, sizes, keep, a, *bs)
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
    def forward(ctx, call: Call, sd: int, reduce_op: str, a: torch.Tensor, b: torch.Tensor):
        z = matmul_reduce_scatter_forward(call, a, b, sd)
        if reduce_op == "avg":
            z = z.div_(call.world_size)
        ctx.call, ctx.sd, ctx.avg = call, sd, reduce_op == "avg"
        ctx.save_for_backward(a, b)
        return z

    @staticmethod
    def backward(ctx, dz):
        a, b = ctx.saved_tensors
        da, db = matmul_reduce_scatter_backward(ctx.call, a, b, dz, ctx.sd, ctx.avg, ctx.needs_input_grad[3],
                                                ctx.needs_input_grad[4])
        return None, None, None, da, db


def matmul_reduce_scatter_backward(call: Call, a: torch.Tensor, b: torch.Tensor, dz: torch.Tensor, sd: int,
                                   avg: bool, need_a: bool, need_b: bool):
    """The gradients ``(da or None, db or None)`` of :func:`commfuse.matmul_reduce_scatter` (see
    :class:`_MatmulReduceScatter`)."""
    if avg:
        dz = dz / call.world_size
    da = torch.empty(a.shape, dtype=a.dtype, device=a.device) if need_a else None
    db = torch.zeros_like(b) if need_b else None
    sizes = split_sizes(a.shape[sd], call.world_size)
    bt = b.t()

    def consume(spans):
        piece = join(spans, sd)
        if da is not None:
            matmul_rows(da, spans, sd, piece, bt)
        if db is not None:
            db.add_(_flat(rows_of(a, spans, sd)).t() @ _flat(piece))

    if need_a or need_b:
        gather_spans(call, dz.contiguous(), sd, sizes, consume, label="matmul_reduce_scatter.dgrad",
                     meta=_ag_meta(dz, [bt], sd, a.shape[sd]))
    return da, db


def matmul_reduce_scatter_fn(call: Call, a: torch.Tensor, b: torch.Tensor, sd: int, reduce_op: str) -> torch.Tensor:
    """Differentiable :func:`commfuse.matmul_reduce_scatter`."""
    return _MatmulReduceScatter.apply(call, sd, reduce_op, a, b)


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
    """

    @staticmethod
    def forward(ctx, call: Call, fn: Callable, dim: int, *inputs: torch.Tensor):
        leaves = [t.detach().requires_grad_(t.requires_grad) for t in inputs]
        graphs: dict[int, torch.Tensor] = {}

        def producer(d: int) -> torch.Tensor:
            with torch.enable_grad():
                p = fn(d, *leaves)
            graphs[d] = p
            return p.detach()

        out = produce_reduce_scatter_core(call, producer, dim, early=None)
        ctx.call, ctx.graphs, ctx.leaves = call, graphs, leaves
        return out

    @staticmethod
    def backward(ctx, dout):
        leaves, graphs = ctx.leaves, ctx.graphs
        wanted = [i for i, leaf in enumerate(leaves) if leaf.requires_grad]
        grads: list[torch.Tensor | None] = [None] * len(leaves)

        def consume(g: torch.Tensor, d: int) -> None:
            p = graphs.pop(d)
            got = torch.autograd.grad(p, [leaves[i] for i in wanted], g, allow_unused=True)
            for i, gi in zip(wanted, got):
                if gi is not None:
                    grads[i] = gi if grads[i] is None else grads[i].add_(gi)

        all_gather_consume_core(ctx.call, dout.contiguous(), consume, 0, keep=False,
                                label="produce_reduce_scatter.backward")
        return (None, None, None, *grads)


def produce_reduce_scatter_fn(call: Call, fn: Callable, inputs: Sequence[torch.Tensor], dim: int) -> torch.Tensor:
    """Differentiable :func:`commfuse.produce_reduce_scatter` with respect to ``inputs``.

    A partial produced early to choose the algorithm is discarded (it has no
    graph on the detached inputs); the ring produces it again.
    """
    return _ProduceReduceScatter.apply(call, fn, dim, *inputs)
