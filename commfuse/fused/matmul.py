"""The fused matmul ops' plans: each call signature of ``all_gather_matmul`` and ``matmul_reduce_scatter``
validated once, resolved once (backend, algorithm, native kernel), and kept as one runnable entry in the
planning table (``commfuse.planning.table``).

The public ops (``commfuse.ops``) and their ``torch.library`` forms (``commfuse.library``) both find their
entries here, under keys that begin with the op's name (the library's then say ``"op"``), so an eager call
and a compiled one never share an entry. The argument checks every op uses live here too.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch

from commfuse import backends
from commfuse.autograd import all_gather_matmul_fn, matmul_reduce_scatter_fn
from commfuse.errors import CommfuseTypeError, CommfuseValueError
from commfuse.planning import table
from commfuse.planning.calls import Call, resolve_call
from commfuse.planning.pipelined import (
    capped,
    configured,
    gather_matmul_meta,
    join,
    matmul_rows,
    prepare_gather,
    prepare_scatter,
    rows_of,
    run_gather,
    run_scatter,
    scatter_runners,
    scatters_whole,
    write_rows,
)
from commfuse.runtime import sites
from commfuse.runtime.groups import group_state, state_of_group
from commfuse.runtime.programs import dtype_code, held_slots, sum_dtype
from commfuse.runtime.admission import announce_left
from commfuse.runtime.walks import execute_one_by_one, may_skip_program, ring_walk
from commfuse.schedule import Collective, parse_algorithm, split_sizes

__all__ = [
    "check_dim", "check_same", "check_tensor", "grad_wanted", "is_dtensor", "note_failed", "plan_all_gather_matmul",
    "plan_matmul_reduce_scatter", "plan_once", "report_taken",
]

log = logging.getLogger("commfuse")


def plan_once(key, make: Callable[[], Any], label: str, group, backend):
    """``make()`` (validate, resolve, plan one signature), kept in the planning table under ``key`` (None:
    not kept), as long as the plans it runs (``run.plans``) are kept. A call whose planning fails still takes
    its call number on the group (:func:`note_failed`)."""
    try:
        run = make()
    except BaseException as e:
        note_failed(group, backend, e, label)
        raise
    if key is None:
        return run
    run = table.remember(key, run, follows=getattr(run, "plans", ()))
    sites.planned()  # every site watches its next forward: those that find this entry say what it takes
    return run


def check_tensor(name: str, value) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise CommfuseTypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if type(value) is not torch.Tensor and is_dtensor(value):
        raise CommfuseTypeError(
            f"{name} is a DTensor (placements {tuple(value.placements)} on {value.device_mesh}): commfuse's "
            f"functional ops take this rank's local shard; pass {name}.to_local(), or parallelize the module "
            f"with commfuse.tp's styles, which take DTensors"
        )
    return value


def is_dtensor(value) -> bool:
    """Whether ``value`` is a DTensor (without importing torch.distributed.tensor when nothing has)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)


def check_dim(name: str, dim, ndim: int) -> int:
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise CommfuseTypeError(f"{name} must be an int, got {dim!r}")
    if not -ndim <= dim < ndim:
        raise CommfuseValueError(f"{name}={dim} is out of range for a tensor with {ndim} dims")
    return dim % ndim


def check_same(name: str, tensors: Sequence[tuple[str, torch.Tensor]], config: tuple | None = None) -> None:
    """One dtype and one device for ``tensors``; a fused GEMM's mixed dtypes are refused as torch's matmul
    refuses them outside autocast, in the words of the layer (``config``'s name) when a layer called."""
    first_name, first = tensors[0]
    for other_name, t in tensors[1:]:
        if t.dtype != first.dtype:
            if config is not None:
                raise CommfuseValueError(
                    f"{config[0]}: its input has dtype {first.dtype} but its weight has {t.dtype} ({name}'s "
                    f"{first_name} and {other_name}); torch's nn.Linear and tensor-parallel styles refuse mixed "
                    "dtypes too (mat1 and mat2 must have the same dtype): run the model under torch.autocast, "
                    "which casts both to its dtype, or cast the input or the module to one dtype"
                )
            raise CommfuseValueError(
                f"{name}: {other_name} has dtype {t.dtype} but {first_name} has {first.dtype}; torch.matmul "
                "refuses mixed dtypes too: cast one to the other's dtype, or call it under torch.autocast, which "
                "casts both to its dtype"
            )
        if t.device != first.device:
            raise CommfuseValueError(f"{name}: {other_name} is on {t.device} but {first_name} is on {first.device}")


def grad_wanted(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def report_taken(report: dict | None, call, rows: int, label: str) -> None:
    """Let ``report`` say what the plan runs: ``call``'s algorithm as :func:`capped` leaves it for shards whose
    smallest has ``rows`` along the dim (the planning code caps with the same helper)."""
    if report is None or call is None:
        return
    taken = capped(call, rows, label)
    if taken is not call:
        report.update(algorithm=taken.spec.shown, reason=taken.reason)


def note_failed(group, backend, error: BaseException, label: str) -> None:
    """A call failed on this rank before it reached the executor (its validation, its policy, a producer it
    called first): it still takes its call number on the group, the failure goes on the group's board for
    the peers that wait on this rank in that call (they say why, instead of waiting out the timeout), and
    the group's next call is checked, so it cannot pair with the peers' copy of this call."""
    try:
        if backend is not None and not isinstance(backend, str):
            state = group_state(backend)
        else:
            import torch.distributed as dist

            if group is None and not (dist.is_available() and dist.is_initialized()):
                return
            pg = backends.process_group(group) if group is not None else dist.group.WORLD
            if isinstance(pg, dist.ProcessGroup) and pg not in dist.distributed_c10d._world.pg_map:
                return  # a destroyed group: nothing more to count on it
            state = state_of_group(pg)
            if state.rank is None and isinstance(pg, dist.ProcessGroup):
                state.rank, state.world_size = dist.get_rank(pg), dist.get_world_size(pg)
    except Exception:  # noqa: BLE001 - the caller's own error is what matters
        return
    announce_left(state, label, error)


def plan_all_gather_matmul(a, b, group, gather_dim, algorithm, return_gathered, gathered_size, keep_gathered, timeout,
                    check, backend, config=None):
    """Validate one signature of :func:`all_gather_matmul` and return the function that runs it."""
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
        return _handed_whole(be, "all_gather_matmul", lambda a, b: dict(
            a_shard=a, b=b, group=group, gather_dim=gd, algorithm=algorithm, return_gathered=return_gathered,
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
    forward = None if call is None else _all_gather_matmul_forward(call, a, bs, gd, sizes, return_gathered)
    kept = [forward if keep == return_gathered else None]  # the forward a call with gradients runs, once planned

    if call is None:
        def run(a, b):
            bs = [b] if single else b
            outs = [torch.matmul(a, bi) for bi in bs]
            results = outs[0] if single else list(outs)
            return (a, results) if return_gathered else results
    else:
        def run(a, b):
            bs = [b] if single else list(b)
            got = None if native is None else native(a, bs)  # None: gradients wanted, the ring runs
            if got is not None:
                results = got[1][0] if single else list(got[1])
                return (got[0], results) if return_gathered else results
            if torch.is_grad_enabled() and (a.requires_grad or any(bi.requires_grad for bi in bs)):
                if contraction:
                    raise CommfuseValueError(
                        "all_gather_matmul has no backward when gather_dim is the contraction (last) dim; "
                        "gather another dim or run it under torch.no_grad()"
                    )
                grad_forward = kept[0]
                if grad_forward is None:
                    grad_forward = kept[0] = _all_gather_matmul_forward(call, a, bs, gd, sizes, keep)
                gathered, outs = all_gather_matmul_fn(grad_forward, call, a, bs, gd, sizes, keep)
                gathered = gathered if return_gathered else None
            else:
                gathered, outs = forward(a, bs)
            results = outs[0] if single else list(outs)
            return (gathered, results) if return_gathered else results

    run.report, run.resolved = taken, resolved
    run.call, run.sizes, run.gd = call, sizes, gd  # for the compiled op's backward (commfuse.library)
    # what all_gather_matmul calls instead of run for one weight, no gradient and no native kernel
    direct = forward.single if call is not None and single and native is None else None
    if direct is not None and gd == 0 and forward.planned.plan.one_by_one:
        direct = _ring_rows(forward.planned, forward.out_shape, direct)
    run.one_weight_no_grad = direct
    # the ring's plan, which the entry goes with in the planning table (not a native kernel's: it runs none)
    run.plans = (forward.planned.plan,) if forward is not None and native is None else ()
    return run


def _handed_whole(be, op: str, arguments: Callable):
    """The planned entry of a signature whose backend runs ``op`` whole (``Capabilities.whole_ops``): every
    call hands the backend's ``run_op`` the op's ``arguments(a, b)``."""
    def run(a, b):
        return be.run_op(op, **arguments(a, b))

    run.report = {"algorithm": "whole", "reason": f"handed whole to backend {getattr(be, 'name', be)!r}"}
    run.call, run.sizes, run.gd, run.one_weight_no_grad = None, None, None, None
    return run


def _ring_rows(planned, out_shape, otherwise: Callable):
    """``(a, b) -> all_gather(a) @ b`` for a ring along dim 0, one weight, no gradient: once the signature
    is agreed (``walks.may_skip_program``), the output is made up front and each arriving slice's GEMM writes
    its rows, walked with no program; before that (and while something observes the call), ``otherwise``."""
    plan, layout, pool = planned.plan, planned.layout, planned.pool
    walk = layout.walk
    if walk is None:
        walk = layout.walk = ring_walk(plan, layout.start, layout.size, layout.key, layout.own_set)

    def ring_rows(a, b):
        if not may_skip_program(plan):
            return otherwise(a, b)
        out = a.new_empty(out_shape)

        def on_slice(start, size, t):
            torch.matmul(t, b, out=out[start:start + size])  # slicing costs less than narrow

        execute_one_by_one(plan, walk, held_slots(layout, a), on_slice, pool)
        return out

    return ring_rows


def native_kernel(be, op: str, algorithm, taken: dict, **signature):
    """The backend's own fused kernel for this call signature, if it declares ``op`` and the call qualifies
    (``algorithm`` "native" or "auto"); else None. Returns (runner or None, the algorithm the ring takes:
    ``auto``'s own choice when the kernel is taken, since a call that wants gradients still runs the ring).

    "native" that does not qualify raises, naming why; autograd never takes the kernel (it has none).
    """
    spec = parse_algorithm(algorithm)
    if spec.name not in ("native", "auto"):
        return None, algorithm
    fallback = "auto"
    caps = getattr(be, "capabilities", None)
    declared = be is not None and op in getattr(caps, "native_fused_ops", ()) and hasattr(be, "native_op")
    if be is None or be.world_size == 1 or not declared:
        if spec.name == "native":
            what = "no backend (a single process)" if be is None else (
                f"backend {getattr(be, 'name', be)!r} declares no native {op}")
            raise CommfuseValueError(f"algorithm 'native' for {op}: {what}; use ring, bidirectional or auto")
        return None, algorithm
    runner, reason = be.native_op(op, **signature)
    if runner is None:
        if spec.name == "native":
            raise CommfuseValueError(f"algorithm 'native' for {op}: the call does not qualify: {reason}")
        return None, algorithm
    taken.update(algorithm="native", reason=reason, world_size=be.world_size)
    if spec.name == "auto":
        log.debug("auto chose native for %s: %s [world size %d, backend %r declares it in native_fused_ops and its "
                  "native_op accepted this signature; a call that wants gradients runs auto's ring-side choice]",
                  op, reason, be.world_size, getattr(be, "name", type(be).__name__))

    def run(*tensors):
        if torch.is_grad_enabled() and any(t.requires_grad for t in _flat_tensors(tensors)):
            if spec.name == "native":
                raise CommfuseValueError(
                    f"algorithm 'native' for {op}: the backend's fused kernel has no backward; run it under "
                    "torch.no_grad() or take 'auto' (which runs the ring when gradients are wanted)")
            return None
        return runner(*tensors)

    return run, fallback


def _all_gather_matmul_forward(call: Call, a: torch.Tensor, bs, gd: int, sizes, return_gathered: bool):
    """The forward of :func:`commfuse.all_gather_matmul` on ``call``'s backend, planned for the signature of
    ``a`` and ``bs``: what does not change from call to call (output shapes, the ring's plan and layout) is
    decided here, once; the function returned runs one call ``(a, bs) -> (gathered or None, outputs)``."""
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

    # one weight, no gathered copy, a gathered dim that is not the contraction: (a, b) -> result, directly;
    # a ring along dim 0 is walked on this plan without a program once its signature is agreed (_ring_rows)
    forward.single = None if contraction or return_gathered else _matmul_one_weight
    forward.planned, forward.out_shape = planned, out_shapes[0]
    return forward


def _matmul_reduce_scatter_forward(call: Call, a: torch.Tensor, b: torch.Tensor, sd: int):
    """The forward of :func:`commfuse.matmul_reduce_scatter` (a sum) on ``call``'s backend, planned once for
    the signature of ``a`` and ``b``; the function returned runs one call ``(a, b) -> this rank's summed
    shard``."""
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

    forward.planned = planned
    return forward


def _flat_tensors(items):
    for item in items:
        if isinstance(item, torch.Tensor):
            yield item
        else:
            yield from item


def plan_matmul_reduce_scatter(a, b, group, scatter_dim, reduce_op, algorithm, timeout, check, backend, config=None):
    """Validate one signature of :func:`matmul_reduce_scatter` and return the function that runs it."""
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
        return _handed_whole(be, "matmul_reduce_scatter", lambda a, b: dict(
            a=a, b=b, group=group, scatter_dim=sd, reduce_op=reduce_op, algorithm=algorithm))
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
    avg = reduce_op == "avg"
    last = sd == len(out_shape) - 1
    forward = None if call is None else _matmul_reduce_scatter_forward(call, a, b, sd)

    if call is None:
        def run(a, b):
            return torch.matmul(a, b)
    else:
        def run(a, b):
            got = None if native is None else native(a, b)  # None: gradients wanted, the ring runs
            if got is not None:
                return got
            if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad):
                if last:
                    raise CommfuseValueError(
                        "matmul_reduce_scatter has no backward when scatter_dim is the last (output feature) dim; "
                        "scatter another dim or run it under torch.no_grad()"
                    )
                return matmul_reduce_scatter_fn(forward, call, a, b, sd, reduce_op)
            out = forward(a, b)
            return out.div_(n) if avg else out

    run.report, run.resolved = taken, resolved
    run.call = call  # for the compiled op's backward (commfuse.library)
    run.plans = (forward.planned.plan,) if forward is not None and native is None else ()
    return run
