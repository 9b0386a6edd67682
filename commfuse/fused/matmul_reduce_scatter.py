"""The GEMM + reduce-scatter block, whole: ``z = reduce_scatter(a @ b, d)`` (sum, or average over the ranks).

Each call signature of ``matmul_reduce_scatter`` is validated once, resolved once (backend, algorithm,
native kernel) and planned once (:func:`plan_matmul_reduce_scatter`), into one
:class:`MatmulReduceScatterPlan` the planning table keeps. A call that wants gradients hands the planned
forward to the autograd Function :class:`_MatmulReduceScatter`, whose backward
(:func:`matmul_reduce_scatter_backward`) runs the opposite ring: an all-gather of the output gradient, each
arriving slice's dgrad and wgrad GEMMs behind the next hop. The compiled op (``commfuse.library``) runs the
same plan and backward.
"""

from __future__ import annotations

from collections.abc import Callable

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
from commfuse.planning.gather import gather_spans
from commfuse.planning.scatter import prepare_scatter, run_scatter, scatter_runners, scatters_whole
from commfuse.planning.spans import join, matmul_rows, rows_of
from commfuse.runtime.fingerprints import gather_matmul_meta
from commfuse.runtime.checkpointing import TOP_HOOKS
from commfuse.runtime.programs import dtype_code, rounded, sum_dtype, sum_zeros
from commfuse.runtime.walks import may_skip_program
from commfuse.schedule import Collective, split_sizes

__all__ = [
    "MatmulReduceScatterPlan", "matmul_reduce_scatter_backward", "matmul_reduce_scatter_fn",
    "plan_matmul_reduce_scatter",
]


class MatmulReduceScatterPlan:
    """One signature of ``matmul_reduce_scatter``, planned: call it as ``plan(a, b)`` for this rank's shard.

    ``report`` and ``resolved`` say what was taken (for the caller's ``report`` and for a site that finds the
    entry); ``call`` is what the compiled op's backward runs on (``commfuse.library``); ``plans`` the ring's
    plans the table entry goes with. ``call`` None: a single process, a plain GEMM.
    """

    __slots__ = ("report", "resolved", "call", "plans", "world_size", "sd", "reduce_op", "avg", "last", "native",
                 "forward")

    def __init__(self, *, report: dict, resolved: tuple, call: Call | None, plans: tuple, world_size: int,
                 sd: int, reduce_op: str, last: bool, native: Callable | None, forward: Callable | None) -> None:
        self.report, self.resolved, self.call, self.plans = report, resolved, call, plans
        self.world_size, self.sd, self.reduce_op, self.last = world_size, sd, reduce_op, last
        self.avg = reduce_op == "avg"
        self.native, self.forward = native, forward

    def __call__(self, a, b):
        if self.call is None:
            return torch.matmul(a, b)
        native = self.native
        got = None if native is None else native(a, b)  # None: gradients wanted, the ring runs
        if got is not None:
            return got
        if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad):
            if self.last:
                raise CommfuseValueError(
                    "matmul_reduce_scatter has no backward when scatter_dim is the last (output feature) dim; "
                    "scatter another dim or run it under torch.no_grad()"
                )
            return matmul_reduce_scatter_fn(self.forward, self.call, a, b, self.sd, self.reduce_op)
        out = self.forward(a, b)
        return out.div_(self.world_size) if self.avg else out


def plan_matmul_reduce_scatter(a, b, *, group, scatter_dim: int, reduce_op: str, algorithm, timeout=None, check=None,
                               backend=None, config=None):
    """Validate one signature of ``commfuse.matmul_reduce_scatter`` and plan it: a
    :class:`MatmulReduceScatterPlan`, or a :class:`~commfuse.fused.matmul.HandedWholePlan` where the backend
    runs the op whole."""
    a = check_tensor("a", a)
    b = check_tensor("b", b)
    if a.ndim < 2:
        raise CommfuseValueError(f"a must have at least 2 dims, got shape {list(a.shape)}")
    if b.ndim != 2:
        raise CommfuseValueError(f"b must be 2-D (K, N), got shape {list(b.shape)}")
    if a.shape[-1] != b.shape[0]:
        raise CommfuseValueError(f"a has K = {a.shape[-1]} columns but b has {b.shape[0]} rows")
    check_same("matmul_reduce_scatter", [("a", a), ("b", b)], config)
    if reduce_op not in ("sum", "avg"):
        raise CommfuseValueError(f"reduce_op must be 'sum' or 'avg', got {reduce_op!r}")
    if reduce_op == "avg" and not (a.is_floating_point() or a.is_complex()):
        raise CommfuseValueError(f"reduce_op 'avg' needs a floating dtype, got {a.dtype}")
    out_shape = [*a.shape[:-1], b.shape[1]]
    sd = check_dim("scatter_dim", scatter_dim, len(out_shape))
    be = backends.resolve(backend, group, a.device)
    if backends.whole_op(be, "matmul_reduce_scatter"):
        return HandedWholePlan(backend=be, op="matmul_reduce_scatter", tensors=("a", "b"), options=dict(
            group=group, scatter_dim=sd, reduce_op=reduce_op, algorithm=algorithm))
    n = 1 if be is None else be.world_size
    sizes = split_sizes(out_shape[sd], n)
    per_rank = 1
    for i, d in enumerate(out_shape):
        per_rank *= sizes[0] if i == sd else d
    taken: dict = {}
    native, algorithm = native_kernel(be, "matmul_reduce_scatter", algorithm, taken, a=a, b=b, scatter_dim=sd,
                                      reduce_op=reduce_op, group=group)
    # the partials travel as they are summed: float32 for half inputs (programs.sum_dtype)
    slice_bytes = per_rank * sum_dtype(a.dtype).itemsize
    call = resolve_call(Collective.REDUCE_SCATTER, algorithm, group=group,
                        backend=be if be is not None else backend, device=a.device,
                        slice_bytes=slice_bytes, flops=2.0 * a.numel() * b.shape[1] / n,
                        timeout=timeout, check=check, report=None if native else taken)
    resolved = (Collective.REDUCE_SCATTER, algorithm, slice_bytes, call)
    call = configured(call, config)
    if not native:
        report_taken(taken, call, min(sizes), "matmul_reduce_scatter")
    forward = planned = None
    if call is not None:
        forward, planned = _matmul_reduce_scatter_forward(call, a, b, sd)
    return MatmulReduceScatterPlan(
        report=taken, resolved=resolved, call=call,
        plans=(planned.plan,) if planned is not None and native is None else (),
        world_size=n, sd=sd, reduce_op=reduce_op, last=sd == len(out_shape) - 1, native=native, forward=forward)


def _matmul_reduce_scatter_forward(call: Call, a: torch.Tensor, b: torch.Tensor, sd: int):
    """The forward of :func:`commfuse.matmul_reduce_scatter` (a sum) on ``call``'s backend, planned once for
    the signature of ``a`` and ``b``. Returns ``(forward, planned)``: ``forward`` runs one call ``(a, b) ->
    this rank's summed shard``, ``planned`` is the ring's ``SignaturePlan``."""
    out_shape = [*a.shape[:-1], b.shape[1]]
    last = sd == len(out_shape) - 1
    fingerprint = [dtype_code(a.dtype), sd, a.ndim, *a.shape, *b.shape]
    planned = prepare_scatter(call, out_shape, sd, a.dtype, "matmul_reduce_scatter", fingerprint)
    plan = planned.plan
    whole = scatters_whole(planned)
    ring = plan.one_by_one
    # half partials are summed, and travel, in float32, rounded once at the end (programs.sum_dtype)
    run_ring, run_whole = scatter_runners(planned)

    def forward(a, b):
        if (whole or ring) and may_skip_program(plan):  # signature agreed: no program
            if whole:  # vanilla: one GEMM, one reduce-scatter
                return run_whole(planned, lambda: torch.matmul(a, b))
            if last:
                def part(start, size, _):
                    return torch.matmul(a, b[:, start:start + size])
            elif sd == 0:
                def part(start, size, _):
                    return torch.matmul(a[start:start + size], b)
            else:
                def part(start, size, _):
                    return torch.matmul(a.narrow(sd, start, size), b)
            return run_ring(planned, part)  # a ring: this rank's partial of each slice
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

    return forward, planned


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
        ctx.defer = TOP_HOOKS(False) is None  # see fused.matmul.deferred_sink
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
    :class:`_MatmulReduceScatter`; ``defer`` as for ``all_gather_matmul_backward``)."""
    if avg:
        dz = dz / call.world_size
    da = torch.empty(a.shape, dtype=a.dtype, device=a.device) if need_a else None
    sink = deferred_sink(b) if defer and need_b else None
    # db sums one GEMM per arriving slice of dz: in float32 for a half weight (programs.sum_dtype), cast back once
    db = sum_zeros(b) if need_b and sink is None else None
    sizes = split_sizes(a.shape[sd], call.world_size)
    bt = b.detach().t()  # as all_gather_matmul_backward's dgrad takes its weights

    def consume(spans):
        piece = join(spans, sd)
        if da is not None:
            matmul_rows(da, spans, sd, piece, bt)
        if db is not None:
            db.add_(flat_rows(rows_of(a, spans, sd)).t() @ flat_rows(piece))
        elif sink is not None:
            add_deferred(sink, b, rows_of(a, spans, sd), piece)

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
