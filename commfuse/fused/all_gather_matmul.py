"""The all-gather + GEMM block, whole: ``y_i = all_gather(a, d) @ b_i`` for one or more weights.

Each call signature of ``all_gather_matmul`` is validated once, resolved once (backend, algorithm, native
kernel) and planned once (:func:`plan_all_gather_matmul`), into one :class:`AllGatherMatmulPlan` the planning
table keeps. Its forward is planned there too; a call that wants gradients hands that same forward to the
autograd Function :class:`_AllGatherMatmul`, whose backward (:func:`all_gather_matmul_backward`) runs the
opposite ring: a GEMM + reduce-scatter for the input, with the weight-gradient GEMMs behind the same hops.
The compiled op (``commfuse.library``) runs the same plan and backward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from commfuse import backends
from commfuse.errors import CommfuseValueError
from commfuse.fused.matmul import (
    HandedWholePlan,
    add_deferred,
    check_dim,
    check_same,
    check_tensor,
    deferred_sink,
    flat_rows,
    native_kernel,
    report_taken,
)
from commfuse.planning.calls import Call, resolve_call
from commfuse.planning.derive import configured
from commfuse.planning.gather import gather_spans, gather_walk, prepare_gather, run_gather, run_gather_one_by_one
from commfuse.planning.scatter import scatter_spans
from commfuse.planning.spans import join, matmul_rows, rows_of, write_rows
from commfuse.runtime.fingerprints import gather_matmul_meta
from commfuse.runtime.checkpointing import TOP_HOOKS
from commfuse.runtime.programs import dtype_code, rounded, sum_dtype, sum_zeros
from commfuse.runtime.walks import may_skip_program
from commfuse.schedule import Collective, split_sizes

__all__ = [
    "AllGatherMatmulPlan", "all_gather_matmul_backward", "all_gather_matmul_fn", "plan_all_gather_matmul",
]


class AllGatherMatmulPlan:
    """One signature of ``all_gather_matmul``, planned: call it as ``plan(a, b)`` (``b`` one weight or a list,
    as the signature had it) for ``outputs`` or ``(gathered, outputs)``.

    ``report`` and ``resolved`` say what was taken (for the caller's ``report`` and for a site that finds the
    entry); ``call``, ``sizes`` and ``gd`` are what the compiled op's backward runs on (``commfuse.library``);
    ``one_weight_no_grad`` is what ``commfuse.all_gather_matmul`` calls instead for one weight, no gradient
    and no native kernel (None where that does not apply); ``plans`` the ring's plans the table entry goes with.
    ``call`` None: a single process, plain GEMMs.
    """

    __slots__ = ("report", "resolved", "call", "sizes", "gd", "one_weight_no_grad", "plans", "single",
                 "return_gathered", "keep", "contraction", "native", "forward", "grad_forward")

    def __init__(self, *, report: dict, resolved: tuple, call: Call | None, sizes: list, gd: int,
                 one_weight_no_grad: Callable | None, plans: tuple, single: bool, return_gathered: bool,
                 keep: bool, contraction: bool, native: Callable | None, forward: Callable | None,
                 grad_forward: Callable | None) -> None:
        self.report, self.resolved, self.call, self.sizes, self.gd = report, resolved, call, sizes, gd
        self.one_weight_no_grad, self.plans = one_weight_no_grad, plans
        self.single, self.return_gathered, self.keep = single, return_gathered, keep
        self.contraction = contraction
        self.native, self.forward = native, forward
        #: the forward a call with gradients runs (it gives the gathered input when ``keep``): the plain
        #: forward where that one does, else planned by the first such call
        self.grad_forward = grad_forward

    def __call__(self, a, b):
        single = self.single
        if self.call is None:
            outs = [torch.matmul(a, bi) for bi in ([b] if single else b)]
            results = outs[0] if single else list(outs)
            return (a, results) if self.return_gathered else results
        bs = [b] if single else list(b)
        native = self.native
        got = None if native is None else native(a, bs)  # None: gradients wanted, the ring runs
        if got is not None:
            results = got[1][0] if single else list(got[1])
            return (got[0], results) if self.return_gathered else results
        if torch.is_grad_enabled() and (a.requires_grad or any(bi.requires_grad for bi in bs)):
            if self.contraction:
                raise CommfuseValueError(
                    "all_gather_matmul has no backward when gather_dim is the contraction (last) dim; "
                    "gather another dim or run it under torch.no_grad()"
                )
            keep = self.keep
            grad_forward = self.grad_forward
            if grad_forward is None:
                grad_forward = self.grad_forward = _all_gather_matmul_forward(self.call, a, bs, self.gd, self.sizes,
                                                                              keep)[0]
            gathered, outs = all_gather_matmul_fn(grad_forward, self.call, a, bs, self.gd, self.sizes, keep)
            gathered = gathered if self.return_gathered else None
        else:
            gathered, outs = self.forward(a, bs)
        results = outs[0] if single else list(outs)
        return (gathered, results) if self.return_gathered else results


def plan_all_gather_matmul(a, b, *, group, gather_dim: int, algorithm, return_gathered: bool, gathered_size,
                           keep_gathered: bool, timeout=None, check=None, backend=None, config=None):
    """Validate one signature of ``commfuse.all_gather_matmul`` and plan it: an :class:`AllGatherMatmulPlan`,
    or a :class:`~commfuse.fused.matmul.HandedWholePlan` where the backend runs the op whole."""
    a = check_tensor("a_shard", a)
    single = isinstance(b, torch.Tensor)
    bs = [b] if single else list(b)
    if not bs:
        raise CommfuseValueError("b is an empty list: give at least one weight")
    for i, bi in enumerate(bs):
        check_tensor("b" if single else f"b[{i}]", bi)
        if bi.ndim != 2:
            raise CommfuseValueError(f"{'b' if single else f'b[{i}]'} must be 2-D (K, N), got shape {list(bi.shape)}")
    if a.ndim < 2:
        raise CommfuseValueError(f"a_shard must have at least 2 dims, got shape {list(a.shape)}")
    check_same("all_gather_matmul", [("a_shard", a)] + [("b" if single else f"b[{i}]", bi) for i, bi in enumerate(bs)],
               config)
    gd = check_dim("gather_dim", gather_dim, a.ndim)
    contraction = gd == a.ndim - 1
    be = backends.resolve(backend, group, a.device)
    if backends.whole_op(be, "all_gather_matmul"):
        return HandedWholePlan(backend=be, op="all_gather_matmul", tensors=("a_shard", "b"), options=dict(
            group=group, gather_dim=gd, algorithm=algorithm, return_gathered=return_gathered,
            gathered_size=gathered_size, keep_gathered=keep_gathered))
    n = 1 if be is None else be.world_size
    rank = 0 if be is None else be.rank
    length = a.shape[gd]
    if gathered_size is None:
        sizes = [length] * n
    else:
        if isinstance(gathered_size, bool) or not isinstance(gathered_size, int) or gathered_size < 0:
            raise CommfuseValueError(f"gathered_size must be a non-negative int, got {gathered_size!r}")
        sizes = split_sizes(gathered_size, n)
        if sizes[rank] != length:
            raise CommfuseValueError(
                f"rank {rank}: a_shard has size {length} along gather_dim {gd}, but tensor_split of the gathered "
                f"size {gathered_size} over world size {n} gives rank {rank} a shard of {sizes[rank]}"
            )
    total = sum(sizes)
    k_needed = total if contraction else a.shape[-1]
    for i, bi in enumerate(bs):
        if bi.shape[0] != k_needed:
            raise CommfuseValueError(
                f"{'b' if single else f'b[{i}]'} has {bi.shape[0]} rows but the gathered a has K = {k_needed}"
                + (" (gather_dim is the contraction dim)" if contraction else "")
            )
    # auto decides on the largest shard, which every rank knows, never on this rank's own
    slice_bytes = a.element_size() * sizes[0]
    for i, d in enumerate(a.shape):
        slice_bytes *= 1 if i == gd else d
    flops = 2.0 * slice_bytes / a.element_size() * sum(bi.shape[1] for bi in bs)
    taken: dict = {}
    native, algorithm = native_kernel(be, "all_gather_matmul", algorithm, taken, a_shard=a, bs=bs, gather_dim=gd,
                                      return_gathered=return_gathered, gathered_size=gathered_size, group=group)
    call = resolve_call(Collective.ALL_GATHER, algorithm, group=group, backend=be if be is not None else backend,
                        device=a.device, slice_bytes=slice_bytes, flops=flops, timeout=timeout, check=check,
                        report=None if native else taken)
    resolved = (Collective.ALL_GATHER, algorithm, slice_bytes, call)  # what a site that finds the entry took
    call = configured(call, config)
    if not native:
        report_taken(taken, call, min(sizes), "all_gather_matmul")
    keep = keep_gathered or return_gathered
    forward = one_weight = planned = None
    if call is not None:
        forward, one_weight, planned, out_shape = _all_gather_matmul_forward(call, a, bs, gd, sizes, return_gathered)
    # what all_gather_matmul calls instead of the plan for one weight, no gradient and no native kernel
    direct = one_weight if single and native is None else None
    if direct is not None and gd == 0 and planned.plan.one_by_one:
        direct = _ring_rows(planned, out_shape, direct)
    return AllGatherMatmulPlan(
        report=taken, resolved=resolved, call=call, sizes=sizes, gd=gd, one_weight_no_grad=direct,
        # the ring's plan, which the entry goes with in the planning table (not a native kernel's: it runs none)
        plans=(planned.plan,) if planned is not None and native is None else (),
        single=single, return_gathered=return_gathered, keep=keep, contraction=contraction, native=native,
        forward=forward, grad_forward=forward if keep == return_gathered else None)


def _ring_rows(planned, out_shape, otherwise: Callable):
    """``(a, b) -> all_gather(a) @ b`` for a ring along dim 0, one weight, no gradient: once the signature
    is agreed (``walks.may_skip_program``), the output is made up front and each arriving slice's GEMM writes
    its rows, on the gather's walk with no program (``planning.gather.run_gather_one_by_one``); before that (and
    while something observes the call), ``otherwise``."""
    plan = planned.plan
    gather_walk(planned)  # made with the plan, not by the first call that walks it

    def ring_rows(a, b):
        if not may_skip_program(plan):
            return otherwise(a, b)
        out = a.new_empty(out_shape)

        def on_slice(start, size, t):
            torch.matmul(t, b, out=out[start:start + size])  # slicing costs less than narrow

        run_gather_one_by_one(planned, a, on_slice)
        return out

    return ring_rows


def _all_gather_matmul_forward(call: Call, a: torch.Tensor, bs, gd: int, sizes, return_gathered: bool):
    """The forward of :func:`commfuse.all_gather_matmul` on ``call``'s backend, planned for the signature of
    ``a`` and ``bs``: what does not change from call to call (output shapes, the ring's plan and layout) is
    decided here, once. Returns ``(forward, one_weight, planned, out_shape)``: ``forward`` runs one call ``(a,
    bs) -> (gathered or None, outputs)``; ``one_weight`` one call ``(a, b) -> output`` for one weight and no
    gathered copy along a dim that is not the contraction (None otherwise); ``planned`` is the ring's
    ``SignaturePlan`` and ``out_shape`` the first output's shape."""
    total = sum(sizes)
    contraction = gd == a.ndim - 1
    lead = list(a.shape[:-1])
    if not contraction:
        lead[gd] = total
    make = torch.zeros if contraction else torch.empty
    # a gather along the contraction dim sums one partial product per shard: in float32 for half types, as
    # torch's own matmul accumulates (summed in fp16, partials of a finite result can overflow to inf)
    acc = sum_dtype(a.dtype) if contraction else a.dtype
    out_shapes = [tuple(lead + [bi.shape[1]]) for bi in bs]
    full_a = list(a.shape)
    full_a[gd] = total
    dtype, device = a.dtype, a.device
    direct = all(d == 1 for d in lead[:gd])  # blocks of rows along gd are contiguous in the outputs
    planned = prepare_gather(call, a.shape, dtype, gd, tuple(sizes), "all_gather_matmul",
                             gather_matmul_meta(a, bs, gd, total))

    def forward(a, bs):
        if not contraction and not return_gathered and len(bs) == 1:
            return None, [_matmul_one_weight(a, bs[0])]
        outs = [make(shape, dtype=acc, device=device) for shape in out_shapes]
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
        if acc is not dtype:
            outs = [out.to(dtype) for out in outs]
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

    return forward, (None if contraction or return_gathered else _matmul_one_weight), planned, out_shapes[0]


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
        ctx.defer = TOP_HOOKS(False) is None  # see deferred_sink
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
    False: no weight gradient goes to ``fused.matmul.WGRAD_SINK`` (a custom op's backward must return them
    all)."""
    pairs = [(b, d) for b, d in zip(bs, douts) if d is not None]
    sinks = [deferred_sink(b) if defer and keep and need and d is not None else None
             for b, d, need in zip(bs, douts, need_b)]
    # a weight gradient sums one GEMM per ring step: in float32 for half weights (programs.sum_dtype), cast
    # back once at the end, as torch's one GEMM over the gathered rows accumulates
    dbs = [sum_zeros(b) if need and d is not None and sink is None else None
           for b, d, need, sink in zip(bs, douts, need_b, sinks)]
    k = bs[0].shape[0]

    def wgrad(x_rows, spans_rows_of_dy):
        for b, db, d, sink in zip(bs, dbs, douts, sinks):
            if db is not None:
                db.add_(flat_rows(x_rows).t() @ flat_rows(spans_rows_of_dy(d)))
            elif sink is not None:
                add_deferred(sink, b, x_rows, spans_rows_of_dy(d))

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
