"""The fused functional ops: a collective decomposed into ring steps, each hop
paired with one shard of the computation that needs it.

Every op takes ``algorithm`` in the grammar of ``commfuse.schedule.parse_algorithm``
(``auto``, ``ring[:m]``, ``bidirectional``, ``serial[:m]``, ``sliced[:c]``,
``vanilla``). ``timeout`` bounds every wait in seconds (default:
``COMMFUSE_TIMEOUT_S``, else 300; finite, at least 1 ms). ``check`` controls
the fingerprint check (``COMMFUSE_CHECK``): by default the ranks compare a
fingerprint of the call (op, shapes, dtypes, algorithm, call number) before
the first transfer of each new call signature and after any failed call, so
ranks that disagree fail with an error naming every side instead of sending
a wrong-sized message (which gloo answers by aborting the process); ``True``
is that, ``"always"`` checks every call, ``False`` never. ``report``, a dict,
receives the algorithm taken and why (what ran: a ``ring:m`` whose slices
would be smaller than one row of the smallest shard is capped, see
``commfuse.planning.derive.capped``). ``backend`` picks a backend by name or
passes a Backend object; by default the one that fits the tensors' device.
Without an initialised process group and with ``group=None`` the ops run as
world size 1 (unless ``WORLD_SIZE`` > 1, which raises). ``config`` (the
fused ops and ``produce_reduce_scatter``; layers pass it): a layer's options
that every rank must share, from ``commfuse.planning.derive.layer_config``,
added to the call's fingerprint so that a rank whose layer differs is named
on every rank (eager calls; under ``torch.compile`` the custom ops take none).

Under ``torch.autocast`` the fused ops cast their floating-point inputs (but
float64) to the autocast dtype at entry, as torch's matmul does there: the
GEMMs run in it and the activations travel in it, and the gradients come
back in the inputs' own dtypes (:func:`autocast_dtype`). Outside autocast
mixed dtypes are refused, as torch's matmul refuses them.

This module is validation plus dispatch. The first call of a signature
(shapes, dtypes, devices, group, dims, options) validates its arguments and
resolves the call; later calls with the same signature skip straight to the
ring (``commfuse.planning.gather``, ``scatter``, ``all_to_all``). Gradients go
through each block's autograd Function, beside it in ``commfuse.fused``
(``commfuse.autograd`` re-exports their public names).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch

from commfuse import backends
from commfuse.errors import CommfuseTypeError, CommfuseValueError
from commfuse.fused import ring_attention as _ring
from commfuse.fused.all_gather_matmul import plan_all_gather_matmul
from commfuse.fused.matmul import check_dim, check_same, check_tensor, grad_wanted, report_taken
from commfuse.fused.once import note_failed, plan_once
from commfuse.fused.matmul_reduce_scatter import plan_matmul_reduce_scatter
from commfuse.fused.produce_reduce_scatter import produce_reduce_scatter_fn
from commfuse.planning import table
from commfuse.planning.calls import C10D_WORLD, MIN_SLICE_BYTES, choose_algorithm, resolve_call
from commfuse.planning.all_to_all import all_to_all_consume_core, exchange_sizes, produce_all_to_all_core
from commfuse.planning.consumers import StandIn, collect
from commfuse.planning.derive import configured
from commfuse.planning.gather import all_gather_consume_core
from commfuse.planning.scatter import produce_reduce_scatter_core
from commfuse.runtime.checkpointing import as_custom_op, aside_call, atomic, selective
from commfuse.runtime.checkpointing import depth as _modes
from commfuse.runtime import sites as _sites
from commfuse.runtime.programs import sum_dtype
from commfuse.schedule import Collective, parse_algorithm

__all__ = [
    "MIN_SLICE_BYTES",
    "StandIn",
    "all_gather_consume",
    "all_gather_matmul",
    "all_to_all_consume",
    "autocast_dtype",
    "choose_algorithm",
    "collect",
    "matmul_reduce_scatter",
    "produce_all_to_all",
    "produce_reduce_scatter",
    "ring_attention",
]

log = logging.getLogger("commfuse")

#: ``torch.compiler.is_compiling``, bound once (the attribute lookups cost a hot call about 0.1 us); Dynamo
#: knows the function, however it is reached, and takes it as True while it traces
_compiling = torch.compiler.is_compiling

#: the planning table's one look-up, bound once (the fast path of a planned signature); :func:`_watched` while
#: a site watches its forward
_planned = table.get
#: torch.distributed's world: its default group goes into every key (see commfuse.planning.table)
_WORLD = C10D_WORLD
#: the plain tensor type, bound once: a call whose tensors are not of it may be a traced backend's, which runs
#: the op whole (``Capabilities.whole_ops``); the check costs a global read (``torch.Tensor`` goes through the
#: torch module's ``__getattr__`` path, about three times the instructions)
_TENSOR = torch.Tensor


def _watched(key):
    """The fast path's look-up while a site watches its forward (``commfuse.runtime.sites``): an entry found
    tells this thread's site what its call takes, as planning the entry told the site that planned it."""
    run = table.get(key)
    if run is not None:
        site = _sites.here.site
        resolved = getattr(run, "resolved", None)
        if site is not None and resolved is not None:
            _sites.saw(site, *resolved)
    return run


def _watch(on: bool) -> None:
    global _planned
    _planned = _watched if on else table.get


_sites.on_watch(_watch)


# -- autocast ----------------------------------------------------------------
# Under torch.autocast the fused ops do what torch's matmul does there: their floating-point inputs (but
# float64) are cast to the autocast dtype at entry, so every GEMM runs in it and every activation travels in it
# (half the bytes of float32 on the ring). The casts are differentiable: gradients come back in the inputs'
# own dtypes. Compiled, the custom ops cast the same way (commfuse.library registers their autocast rules).

#: torch's one C call that says whether autocast is on for any device type: outside autocast (the common
#: case) the ops pay this call and nothing more
_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", None) or (lambda: True)


def autocast_dtype(t) -> torch.dtype | None:
    """The dtype ``torch.autocast`` casts the GEMM input ``t`` to: the autocast dtype of ``t``'s device type
    while autocast is enabled there and ``t`` is floating point but not float64; else None (``t`` is used as
    it is).

    What the fused ops, the ``commfuse.nn`` layers and the ``commfuse.tp`` styles cast their inputs with."""
    if not (_compiling() or _any_autocast()):
        return None
    if not t.is_floating_point() or t.dtype == torch.float64:
        return None
    device_type = t.device.type
    if _compiling():  # Dynamo folds is_autocast_enabled; torch 2.9's cannot trace is_autocast_available
        enabled = torch.is_autocast_enabled(device_type)
    else:
        enabled = torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type)
    return torch.get_autocast_dtype(device_type) if enabled else None


def _autocast(t):
    """``t`` as autocast casts a GEMM input (anything else, or a tensor autocast leaves alone, unchanged)."""
    if not isinstance(t, torch.Tensor):
        return t
    dtype = autocast_dtype(t)
    return t if dtype is None or t.dtype == dtype else t.to(dtype)


def _autocast_weights(b):
    """``b`` (one weight or a list of them) cast as :func:`_autocast` casts."""
    if isinstance(b, torch.Tensor):
        return _autocast(b)
    if isinstance(b, (list, tuple)):
        return [_autocast(x) for x in b]
    return b


def _as_op(group, *options) -> bool:
    """Whether a call under selective activation checkpointing runs as its custom op (``torch.ops.commfuse``),
    one op the policy saves or recomputes as it does when compiled (``as_custom_op``). The op takes the group
    by name and nothing of ``timeout``, ``check``, ``backend`` and ``report``; a call that gives one runs as one
    op the policy cannot see instead (recomputed whole)."""
    return (all(o is None for o in options) and (group is None or isinstance(getattr(group, "group_name", None), str))
            and as_custom_op())


def _library():
    """``commfuse.library``, the custom ops (registered when this module is imported: see its end)."""
    return sys.modules["commfuse.library"]


# -- all_gather_matmul -------------------------------------------------------


def all_gather_matmul(
    a_shard: torch.Tensor,
    b: torch.Tensor | Sequence[torch.Tensor],
    *,
    group=None,
    gather_dim: int = 0,
    algorithm: str = "auto",
    return_gathered: bool = False,
    gathered_size: int | None = None,
    keep_gathered: bool = True,
    timeout: float | None = None,
    check: bool | str | None = None,
    backend=None,
    report: dict | None = None,
    config: tuple | None = None,
):
    """``all_gather(a_shard, gather_dim) @ b``, with the gather decomposed into ring hops.

    Equals torch's ``fused_all_gather_matmul`` reference. ``b`` may be a list
    (one gather serving several GEMMs, as for Q, K and V), and then a list is
    returned. With ``return_gathered`` the result is ``(gathered_a, result)``
    (the gathered a carries no gradient). ``gather_dim`` may be the last dim
    (the contraction dim): every shard then contributes a partial product
    that is summed in ring order (forward only), in float32 for float16 and
    bfloat16 inputs (as torch's matmul accumulates; the result is rounded to
    the input's type once, at the end). Shards must all have the
    same size along ``gather_dim`` unless ``gathered_size`` (the size of the
    gathered dim) is given, in which case rank r's shard must have the
    ``torch.tensor_split`` size for rank r.

    Differentiable: the backward of the input is a matmul + reduce-scatter
    decomposed the same way, and the weight gradient uses the gathered input,
    kept from the forward (``keep_gathered=True``, memory) or gathered again in
    a ring that overlaps with the weight-gradient GEMMs (``False``, time); see
    ``commfuse.autograd``.

    Shapes: ``a_shard`` (..., L, ..., K) with L at ``gather_dim``; each ``b``
    (K, N) (``(N*L, N)`` when gathering the last dim); result (..., N*L, ..., N).

    Under ``torch.compile`` this is ``torch.ops.commfuse.all_gather_matmul``
    (``commfuse.library``), one op in the graph.
    """
    if _compiling():
        return _library().all_gather_matmul(a_shard, b, group=group, gather_dim=gather_dim, algorithm=algorithm,
                                            return_gathered=return_gathered, gathered_size=gathered_size,
                                            keep_gathered=keep_gathered, timeout=timeout, check=check,
                                            backend=backend, report=report)
    count = _modes()
    if count and selective(count):  # one op to selective checkpointing (commfuse.runtime.checkpointing)
        if _as_op(group, timeout, check, backend, report):  # the custom op, on which the policy decides
            return _library().all_gather_matmul(a_shard, b, group=group, gather_dim=gather_dim, algorithm=algorithm,
                                                return_gathered=return_gathered, gathered_size=gathered_size,
                                                keep_gathered=keep_gathered)
        return aside_call(all_gather_matmul, a_shard, b, group=group, gather_dim=gather_dim, algorithm=algorithm,
                          return_gathered=return_gathered, gathered_size=gathered_size,
                          keep_gathered=keep_gathered, timeout=timeout, check=check, backend=backend,
                          report=report, config=config)
    if _any_autocast():
        a_shard, b = _autocast(a_shard), _autocast_weights(b)
    try:
        if type(b) is torch.Tensor or isinstance(b, torch.Tensor):  # one weight: a flat key
            key = ("all_gather_matmul", type(a_shard), a_shard.shape, a_shard.dtype, a_shard.device, type(b), b.shape,
                   b.dtype, b.device, group, gather_dim, algorithm, return_gathered, gathered_size, keep_gathered,
                   timeout, check, backend, config, _WORLD._default_pg)
        else:
            key = ("all_gather_matmul", type(a_shard), a_shard.shape, a_shard.dtype, a_shard.device,
                   tuple((type(x), x.shape, x.dtype, x.device) for x in b), group, gather_dim, algorithm, return_gathered,
                   gathered_size, keep_gathered, timeout, check, backend, config, _WORLD._default_pg)
        run = _planned(key)
    except (AttributeError, TypeError):  # not tensors, or unhashable options: the slow path names what is wrong
        key, run = None, None
    if run is None:
        run = plan_once(key, "all_gather_matmul", group, backend, plan_all_gather_matmul,
                        a_shard, b, group=group, gather_dim=gather_dim, algorithm=algorithm,
                        return_gathered=return_gathered, gathered_size=gathered_size, keep_gathered=keep_gathered,
                        timeout=timeout, check=check, backend=backend, config=config)
    if report is not None:
        report.update(run.report)
    direct = run.one_weight_no_grad
    if direct is not None and not (torch.is_grad_enabled() and (a_shard.requires_grad or b.requires_grad)):
        return direct(a_shard, b)  # the common call: one weight, no gradient, no native kernel
    return run(a_shard, b)


# -- matmul_reduce_scatter ---------------------------------------------------


def matmul_reduce_scatter(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    group=None,
    scatter_dim: int = 0,
    reduce_op: str = "sum",
    algorithm: str = "auto",
    timeout: float | None = None,
    check: bool | str | None = None,
    backend=None,
    report: dict | None = None,
    config: tuple | None = None,
) -> torch.Tensor:
    """``reduce_scatter(a @ b, scatter_dim)`` with the reduce-scatter decomposed into ring hops.

    Equals ``reduce_scatter_tensor(a @ b)`` along ``scatter_dim`` (rank r gets
    the ``torch.tensor_split`` piece r when the size does not divide), up to
    the order of the sum, which follows the ring. ``reduce_op`` is ``"sum"``
    or ``"avg"``. Differentiable (scatter dims other than the last): the
    backward of ``a`` is an all-gather + matmul decomposed the same way, with
    the weight-gradient GEMM of every arriving slice overlapping the next hop.

    float16 and bfloat16: every algorithm sums the ranks' partials in float32
    and rounds the result to the input's type once. Each partial ``a @ b`` is
    rounded once, as torch's own matmul rounds it before its reduce-scatter;
    the running sums travel as float32 (twice the bytes of the partials).
    torch's ``reduce_scatter_tensor`` (gloo, NCCL) sums in the input's type
    and rounds on every hop, so where a shard's running sum passes through a
    value the type cannot hold, torch's own path gives inf (float16 partials
    40000, 30000, -30000 summed in that order) or loses a term (bfloat16 256,
    1, -256 gives 0), though the unsharded product is finite and exact; this
    op gives 40000 and 1 there. A sum whose float32 value is beyond the
    type's range is inf, as the unsharded matmul's is. ``avg`` divides the
    rounded sum. The weight gradient sums one GEMM per arriving slice (each
    rounded once) in float32 too, rounded once.

    Shapes: ``a`` (..., K); ``b`` (K, N); result: ``(..., N)`` with the dim at
    ``scatter_dim`` cut to this rank's shard.

    Under ``torch.compile`` this is ``torch.ops.commfuse.matmul_reduce_scatter``.
    """
    if _compiling():
        return _library().matmul_reduce_scatter(a, b, group=group, scatter_dim=scatter_dim, reduce_op=reduce_op,
                                                algorithm=algorithm, timeout=timeout, check=check, backend=backend,
                                                report=report)
    count = _modes()
    if count and selective(count):  # one op to selective checkpointing (commfuse.runtime.checkpointing)
        if _as_op(group, timeout, check, backend, report):  # the custom op, on which the policy decides
            return _library().matmul_reduce_scatter(a, b, group=group, scatter_dim=scatter_dim, reduce_op=reduce_op,
                                                    algorithm=algorithm)
        return aside_call(matmul_reduce_scatter, a, b, group=group, scatter_dim=scatter_dim, reduce_op=reduce_op,
                          algorithm=algorithm, timeout=timeout, check=check, backend=backend, report=report,
                          config=config)
    if _any_autocast():
        a, b = _autocast(a), _autocast(b)
    try:
        key = ("matmul_reduce_scatter", type(a), a.shape, a.dtype, a.device, type(b), b.shape, b.dtype, b.device,
               group, scatter_dim, reduce_op, algorithm, timeout, check, backend, config, _WORLD._default_pg)
        run = _planned(key)
    except (AttributeError, TypeError):
        key, run = None, None
    if run is None:
        run = plan_once(key, "matmul_reduce_scatter", group, backend, plan_matmul_reduce_scatter,
                        a, b, group=group, scatter_dim=scatter_dim, reduce_op=reduce_op, algorithm=algorithm,
                        timeout=timeout, check=check, backend=backend, config=config)
    if report is not None:
        report.update(run.report)
    return run(a, b)


# -- consume / produce forms -------------------------------------------------


def _not_compiled(op: str) -> None:
    raise CommfuseValueError(
        f"{op} takes a Python callable, so it is not a custom op and cannot be part of a torch.compile graph: "
        "with fullgraph=False torch.compile runs it eagerly (a graph break); the ops that compile are "
        "all_gather_matmul, matmul_reduce_scatter and the commfuse.nn layers (see commfuse.library)"
    )


def _checked(what: str, call):
    if not callable(call):
        raise CommfuseTypeError(f"{what} must be callable, got {type(call).__name__}")


@atomic
def all_gather_consume(
    shard: torch.Tensor,
    consumer: Callable[[torch.Tensor, int], Any],
    *,
    group=None,
    dim: int = 0,
    algorithm: str = "auto",
    timeout: float | None = None,
    check: bool | str | None = None,
    backend=None,
    report: dict | None = None,
) -> list[Any]:
    """Call ``consumer(shard_of_rank_s, s)`` once for every rank s, each while the next shard travels.

    Every rank passes a shard of the same shape. Returns the consumer's
    results, indexed by source rank. With several slices per shard
    (``ring:m``, ``bidirectional``) the shard is cut along ``dim`` and the
    consumer is called once its last slice has arrived. Not differentiable
    itself: the layers build their backward passes from it
    (``commfuse.autograd``). Under ``commfuse.runtime.measure("comm_only")``
    the consumer is not called: the results are None, or a :class:`StandIn`'s
    stand-ins (:data:`collect` collects in every mode).

    The tensors the consumer is given are its own: it may keep them and
    change them in place, as after a plain all-gather into fresh buffers.
    The caller's ``shard`` is never changed, and no rank computes on what
    another rank's consumer changed. Where the schedule hands the consumer a
    tensor that a transfer still reads (a ring forwards the shard it computes
    on, in the same step) or the caller's own shard, the consumer gets a copy:
    N - 1 shard copies per ``ring`` call, one for ``vanilla`` on a backend
    without a whole collective into one tensor, none with several slices per
    shard (their join is a fresh tensor), decided once per call signature.
    """
    if _compiling():
        _not_compiled("all_gather_consume")
    try:
        shard = check_tensor("shard", shard)
        _checked("consumer", consumer)
        if shard.ndim == 0:
            raise CommfuseValueError("shard is a 0-d tensor; give it at least one dim")
        d = check_dim("dim", dim, shard.ndim)
        if type(shard) is not _TENSOR:  # a tensor subclass: perhaps a traced backend's, which runs it whole
            be = backends.resolve(backend, group, shard.device)
            if backends.whole_op(be, "all_gather_consume"):
                return be.run_op("all_gather_consume", shard=shard, consumer=consumer, group=group, dim=d,
                                 algorithm=algorithm)
        call = resolve_call(Collective.ALL_GATHER, algorithm, group=group, backend=backend, device=shard.device,
                            slice_bytes=shard.numel() * shard.element_size(), timeout=timeout, check=check,
                            report=report)
    except BaseException as e:
        note_failed(group, backend, e, "all_gather_consume")
        raise
    if call is None:
        return [consumer(shard, 0)]
    report_taken(report, call, shard.shape[d], "all_gather_consume")
    return all_gather_consume_core(call, shard, consumer, d, private=True)


@atomic
def produce_reduce_scatter(
    producer: Callable[..., torch.Tensor],
    *,
    inputs: Sequence[torch.Tensor] | None = None,
    group=None,
    dim: int = 0,
    algorithm: str = "auto",
    timeout: float | None = None,
    check: bool | str | None = None,
    backend=None,
    report: dict | None = None,
    config: tuple | None = None,
) -> torch.Tensor:
    """Sum over ranks of ``producer(this_rank)``, with each ``producer(d)`` computed while sums travel.

    ``producer(d)`` returns this rank's partial of rank d's output shard; every
    call must return the same shape and dtype. It is called once per
    destination, in the ring's order (own shard last). Returns this rank's
    output shard. Slices for ``ring:m``/``bidirectional`` are cut along ``dim``.
    The producer's tensors are never modified.

    With ``inputs`` the producer is called as ``producer(d, *inputs)`` and the
    result is differentiable with respect to ``inputs``: the backward
    all-gathers the output's gradient in a ring and back-propagates each
    arriving shard through the partial that made it (the query-split
    attention of ``commfuse.nn`` is built on this).

    ``auto`` decides on the size of the first partial (every rank's partials
    have one shape), which is produced before the ring starts.

    float16 and bfloat16 partials are summed in float32: each is cast up as it
    is made, the running sums travel as float32 (twice the partials' bytes),
    and the result is rounded to the partials' type once. So a shard whose
    running sum passes through a value the type cannot hold (float16: 40000 +
    30000, where torch's ``reduce_scatter`` in float16 gives inf; bfloat16:
    256 + 1) still comes out as the float32 sum rounded once (40000; 256 + 1 -
    256 = 1). With ``inputs``, the gradient of each input sums the pieces that
    arrive in the backward in float32 as well.
    """
    if _compiling():
        _not_compiled("produce_reduce_scatter")
    try:
        _checked("producer", producer)
        inputs = tuple(inputs) if inputs is not None else None
        if inputs is not None:
            for i, t in enumerate(inputs):
                check_tensor(f"inputs[{i}]", t)
        device = inputs[0].device if inputs else None
        be = backends.resolve(backend, group, device)
        # a traced backend, which runs it whole, has tensors of a subclass; without inputs only be can say
        if (not inputs or type(inputs[0]) is not _TENSOR) and backends.whole_op(be, "produce_reduce_scatter"):
            return be.run_op("produce_reduce_scatter", producer=producer, inputs=inputs, group=group, dim=dim,
                             algorithm=algorithm)
        n = 1 if be is None else be.world_size
        call_producer = producer if inputs is None else (lambda d: producer(d, *inputs))
        if n == 1:
            resolve_call(Collective.REDUCE_SCATTER, algorithm, group=group, backend=backend, device=device,
                         timeout=timeout, check=check, report=report)  # validates the options
            return check_tensor("producer(0)", call_producer(0))
        early: dict[int, torch.Tensor] = {}
        slice_bytes = 0
        if parse_algorithm(algorithm, Collective.REDUCE_SCATTER).name == "auto":
            src = (be.rank - 1) % n  # the partial the ring needs first: its size is every rank's slice size
            first = check_tensor(f"producer({src})", call_producer(src))
            early[src] = first
            slice_bytes = first.numel() * sum_dtype(first.dtype).itemsize  # as they travel
        call = resolve_call(Collective.REDUCE_SCATTER, algorithm, group=group, backend=be, device=device,
                            slice_bytes=slice_bytes, timeout=timeout, check=check, report=report)
        call = configured(call, config)
    except BaseException as e:
        note_failed(group, backend, e, "produce_reduce_scatter")
        raise
    if inputs is not None and grad_wanted(*inputs):
        out = produce_reduce_scatter_fn(call, producer, inputs, dim)
    else:
        out = produce_reduce_scatter_core(call, call_producer, dim, early)
    report_taken(report, call, out.shape[dim], "produce_reduce_scatter")  # the partials' rows: this rank's shard's
    return out


@atomic
def all_to_all_consume(
    chunks: Sequence[torch.Tensor],
    consumer: Callable[[torch.Tensor, int], Any],
    *,
    group=None,
    dim: int = 0,
    algorithm: str = "auto",
    output_splits: Sequence[int] | None = None,
    uneven: bool = False,
    timeout: float | None = None,
    check: bool | str | None = None,
    backend=None,
    report: dict | None = None,
) -> list[Any]:
    """Send ``chunks[d]`` to rank d and call ``consumer(chunk_from_s, s)`` for every source s as it arrives.

    Returns the consumer's results indexed by source rank. The pairwise ring
    computes on the chunk from r - k while the next exchange is in flight.
    ``comm_only`` measurements call no consumer, as for
    :func:`all_gather_consume` (a :class:`StandIn` gives stand-ins).

    Even (the default): every chunk of every rank has one shape, as in
    Ulysses. Uneven (``uneven=True`` or ``output_splits`` given): chunks may
    differ along ``dim`` (MoE's dispatch: the tokens for each rank's experts);
    the sizes are exchanged first (one small all-to-all of counts), and the
    chunks travel with the sizes their senders really have. ``output_splits``
    (the rows expected from each rank), when given, are verified against that
    exchange, which is what they cost: a rank whose ``output_splits[s]`` differs
    from what rank s sent raises ``CommfuseValueError`` naming s, both sizes and
    the dim, after the exchange (its consumer is not called; nothing
    uninitialised is returned; the other ranks' calls complete normally and
    the group stays in step). Empty chunks are legal and cost no transfer;
    the consumer gets an empty tensor for them. ``auto`` over uneven chunks can
    only decide on what every rank shares (a row's bytes), which takes
    ``vanilla`` unless the backend's profile says otherwise: name the algorithm
    to overlap.

    As for :func:`all_gather_consume`, the consumer's tensors are its own and
    it may change them in place; ``chunks`` are never changed. Only this
    rank's chunk for itself is copied (for ``ring``, ``vanilla``: chunks that
    arrived are never sent on), none with several slices per chunk.
    """
    if _compiling():
        _not_compiled("all_to_all_consume")
    try:
        chunks, be, n, d = _a2a_chunks(chunks, group, backend, dim, uneven or output_splits is not None)
        _checked("consumer", consumer)
        if type(chunks[0]) is not _TENSOR and backends.whole_op(be, "all_to_all_consume"):  # traced: run whole
            return be.run_op("all_to_all_consume", chunks=chunks, consumer=consumer, group=group, dim=d,
                             algorithm=algorithm, output_splits=output_splits, uneven=uneven)
        uneven = uneven or output_splits is not None
        row_bytes = chunks[0].element_size() * (chunks[0].numel() // max(chunks[0].shape[d], 1)) if uneven else 0
        call = resolve_call(Collective.ALL_TO_ALL, algorithm, group=group, backend=be if be is not None else backend,
                            device=chunks[0].device,
                            slice_bytes=row_bytes if uneven else chunks[0].numel() * chunks[0].element_size(),
                            timeout=timeout, check=check, report=report)
        if uneven and call is not None and output_splits is not None:
            output_splits = _splits("output_splits", output_splits, n, call.be.rank)
    except BaseException as e:
        note_failed(group, backend, e, "all_to_all_consume")
        raise
    if call is None:
        return [consumer(chunks[0], 0)]
    if uneven:
        sent = torch.tensor([[c.shape[d]] for c in chunks], dtype=torch.int64, device=chunks[0].device)
        actual = exchange_sizes(call, sent).flatten().tolist()
        wrong = None if output_splits is None else _lying("output_splits", output_splits, actual, call.be.rank, d,
                                                          "chunk")
        # the exchange runs with the true sizes on every rank, so the group stays in step; a rank whose splits
        # were wrong computes nothing on it and raises once it is done
        got = all_to_all_consume_core(call, chunks, consumer if wrong is None else _discard, d, recv_sizes=actual,
                                      label="all_to_all_consume.uneven", private=True)
        if wrong is not None:
            raise wrong
        return got
    report_taken(report, call, chunks[0].shape[d], "all_to_all_consume")
    return all_to_all_consume_core(call, chunks, consumer, d, private=True)


@atomic
def produce_all_to_all(
    producer: Callable[[int], torch.Tensor],
    *,
    group=None,
    dim: int = 0,
    algorithm: str = "auto",
    output_splits: Sequence[int] | None = None,
    input_splits: Sequence[int] | None = None,
    device: torch.device | str | None = None,
    timeout: float | None = None,
    check: bool | str | None = None,
    backend=None,
    report: dict | None = None,
) -> list[torch.Tensor]:
    """Send ``producer(d)`` to rank d, each block made while the one before flies; return the block from
    every rank, by source: the produce side of :func:`all_to_all_consume` (MoE's combine).

    ``producer(d)`` makes this rank's block for rank d; it is called once per
    destination, in the ring's order: rank + 1 first (before any transfer:
    nothing can hide it), this rank's own block last. The ring's step k sends
    the block for rank + k while the block for rank + k + 1 is made.

    Even (both splits None): every block of every rank has the shape of the
    first one made. Uneven (either given): the sizes are exchanged first (one
    small all-to-all of counts) and the blocks travel with the sizes their
    senders really have. ``input_splits`` (the rows ``producer(d)`` returns)
    let the ring make each block in its step; without them every block is
    made before the exchange (no overlap for the first one). A block that
    does not have its declared rows raises ``CommfuseValueError`` on the rank
    that made it, naming both sizes, before it is sent (the ranks waiting for
    it fail too, after a bounded wait that names the step). ``output_splits``
    (the rows expected from each rank: the return trip of a dispatch knows
    them) are verified against the exchange, which is what they cost: a rank
    whose ``output_splits[s]`` differs from what rank s sent raises
    ``CommfuseValueError`` naming s, both sizes and the dim, once its blocks
    are sent and the exchange is done; nothing uninitialised is returned, and
    the other ranks' calls complete normally. Empty blocks are legal and cost
    no transfer. ``device`` places the sizes' exchange (default: the
    backend's device).
    """
    if _compiling():
        _not_compiled("produce_all_to_all")
    try:
        _checked("producer", producer)
        be = backends.resolve(backend, group, device)
        n = 1 if be is None else be.world_size
        if isinstance(dim, bool) or not isinstance(dim, int):
            raise CommfuseTypeError(f"dim must be an int, got {dim!r}")
        uneven = output_splits is not None or input_splits is not None
        first = None
        if n > 1 and not uneven and parse_algorithm(algorithm, Collective.PRODUCE_ALL_TO_ALL).name == "auto":
            # the ring's first block, made now: its size is every block's, which auto decides on
            first = check_tensor(f"producer({(be.rank + 1) % n})", producer((be.rank + 1) % n))
        call = resolve_call(Collective.PRODUCE_ALL_TO_ALL, algorithm, group=group,
                            backend=be if be is not None else backend, device=device,
                            slice_bytes=0 if first is None else first.numel() * first.element_size(),
                            timeout=timeout, check=check, report=report)
        rank = 0 if call is None else call.be.rank
        if output_splits is not None:
            output_splits = _splits("output_splits", output_splits, n, rank)
        if input_splits is not None:
            input_splits = _splits("input_splits", input_splits, n, rank)
        made = None
        if call is not None and uneven and input_splits is None:  # the rows sent are the blocks': made now
            made, input_splits = _blocks_first(producer, dim, rank, n)
    except BaseException as e:
        note_failed(group, backend, e, "produce_all_to_all")
        raise
    if call is None:
        return [check_tensor("producer(0)", producer(0))]
    if not uneven:
        got = produce_all_to_all_core(call, producer, dim, first=first)
        report_taken(report, call, got[0].shape[dim], "produce_all_to_all")
        return got
    sent = torch.tensor([[x] for x in input_splits], dtype=torch.int64, device=getattr(call.be, "device", None))
    actual = exchange_sizes(call, sent).flatten().tolist()
    # the exchange runs with the true sizes on every rank, so the group stays in step; a rank whose output_splits
    # were wrong raises once it is done
    got = produce_all_to_all_core(call, producer if made is None else made.pop, dim, recv_sizes=actual,
                                  send_sizes=input_splits)
    if output_splits is not None:
        wrong = _lying("output_splits", output_splits, actual, rank, dim % got[0].ndim, "block")
        if wrong is not None:
            raise wrong
    return got


@atomic
def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group=None,
    causal: bool = True,
    scale: float | None = None,
    layout: str = "contiguous",
    algorithm: str = "auto",
    document_lengths=None,
    timeout: float | None = None,
    ulysses_group=None,
) -> torch.Tensor:
    """This rank's shard of softmax attention over a sequence sharded over ``group`` (context parallelism),
    with K/V passed around the ring: docs/ring_attention.md.

    ``q`` (batch, L, Hq, d) and ``k``, ``v`` (batch, L, Hkv, d) hold this rank's L positions of the
    sequence, cut as ``layout`` says (``commfuse.context``: "contiguous", or "zigzag", chunks r and 2N-1-r of
    2N, equal causal work on every rank in every step); returns (batch, L, Hq, d) in q's dtype. Only the
    Hkv K/V heads travel (grouped-query: never expanded); each block's attention is merged with the
    log-sum-exp in float32. ``causal``: query position p sees keys up to p (fully masked blocks are
    skipped). ``document_lengths`` (ints, or a 1-D integer tensor, summing to the whole sequence's length,
    the same for every batch row; or one such list per batch row, for packed rows whose documents differ):
    a query sees the keys of its own document only; every rank must pass the same lengths, which are
    compared on every call (a digest exchanged before any block is computed; where they differ every rank
    raises ``MismatchError`` naming the ranks and both values). ``scale``: the scores'
    factor (None: ``1 / sqrt(d)``). ``algorithm``: the all-gather's (forward) and reduce-scatter's
    (backward) ``ring[:m]``, ``bidirectional``, ``vanilla`` (one all-gather of K/V, then attention) or
    ``auto``.

    Differentiable: dQ stays on this rank; the float32 partials of dK/dV travel back around the ring (the
    produce form of a reduce-scatter). The K/V blocks of the forward are kept for the backward (N times
    this rank's K/V). Every rank must pass the same options (they join the rings' fingerprint).

    ``ulysses_group`` (the 2-D form, a cp x ulysses mesh: Ulysses inside, ring across): each rank holds the
    ``u``-th of U equal pieces of its cp rank's shard (``commfuse.fused.ring_attention.ulysses_positions``);
    a pairwise all-to-all over ``ulysses_group`` gives each rank the whole cp shard for Hq/U and Hkv/U heads
    (both must divide by U), the ring runs over ``group`` on those heads, and a last all-to-all brings the
    output back. ``document_lengths``, ``layout`` and the sizes refer to the cp ring as before.

    Under ``torch.autocast`` q, k and v are cast to the autocast dtype at entry (as SDPA is there): K/V travel
    in it, the blocks are still computed and merged in float32, and the result is in the autocast dtype.

    Not a custom op: under ``torch.compile`` it raises (``fullgraph=True`` fails with that message) and with
    ``fullgraph=False`` the graph breaks there and the call runs eagerly.
    """
    if _compiling():
        raise CommfuseValueError(
            "ring_attention (and commfuse.nn.RingAttention) consumes K/V blocks with a Python callable (the "
            "consume form of an all-gather) and cannot be part of a torch.compile graph: compile with "
            "fullgraph=False (torch.compile then runs it eagerly at a graph break)"
        )
    if _any_autocast():  # as SDPA under autocast: q, k, v in its dtype (K/V travel in it); blocks merge in float32
        q, k, v = _autocast(q), _autocast(k), _autocast(v)
    if type(q) is not _TENSOR and isinstance(q, torch.Tensor):  # perhaps a traced backend's, which runs it whole
        be = backends.resolve(None, group, q.device)
        if backends.whole_op(be, "ring_attention"):
            return be.run_op("ring_attention", q=q, k=k, v=v, group=group, causal=causal, scale=scale, layout=layout,
                             algorithm=algorithm, document_lengths=document_lengths, ulysses_group=ulysses_group)
    return _ring.ring_attention(q, k, v, group=group, causal=causal, scale=scale, layout=layout,
                                algorithm=algorithm, document_lengths=document_lengths, timeout=timeout,
                                ulysses_group=ulysses_group)


def _discard(tensor: torch.Tensor, source: int) -> None:
    """The consumer of a call that will raise: nothing is computed on what arrived."""
    return None


def _lying(name: str, claimed: Sequence[int], actual: Sequence[int], rank: int, dim: int,
           what: str) -> CommfuseValueError | None:
    """The error for a rank whose ``claimed`` row counts (by source) differ from the ``actual`` ones, or None."""
    wrong = [(q, c, a) for q, (c, a) in enumerate(zip(claimed, actual)) if c != a]
    if not wrong:
        return None
    mismatches = "; ".join(
        f"{name}[{q}] = {c} rows claimed, but this rank's own {what} for itself has {a}" if q == rank else
        f"{name}[{q}] = {c} rows claimed, but rank {q} sent {a}" for q, c, a in wrong)
    return CommfuseValueError(
        f"rank {rank}: {mismatches} (rows along dim {dim}). The exchange ran with the sizes each rank really sent "
        f"(exchanged first), so nothing uninitialised was returned and the other ranks' calls are unaffected; "
        f"fix {name}, or leave it out and let the exchange size the {what}s"
    )


def _blocks_first(producer: Callable, dim: int, rank: int, n: int) -> tuple[dict[int, torch.Tensor], list[int]]:
    """Every block of an uneven :func:`produce_all_to_all` without ``input_splits``, made in the ring's order
    (rank + 1 first, this rank's own last), and the rows each has along ``dim``: what this rank sends."""
    made: dict[int, torch.Tensor] = {}
    for k in range(1, n + 1):
        dest = (rank + k) % n
        block = check_tensor(f"producer({dest})", producer(dest))
        if not -block.ndim <= dim < block.ndim:
            raise CommfuseValueError(f"rank {rank}: dim={dim} is out of range for producer({dest})'s block of shape "
                                     f"{list(block.shape)}")
        made[dest] = block
    return made, [made[d].shape[dim] for d in range(n)]


def _splits(name: str, value, n: int, rank: int) -> list[int]:
    """A list of ``n`` row counts, checked."""
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise CommfuseTypeError(f"rank {rank}: {name} must be a list of {n} row counts, got {type(value).__name__}")
    out = list(value)
    if len(out) != n:
        raise CommfuseValueError(f"rank {rank}: {name} has {len(out)} sizes but the world size is {n}")
    for i, x in enumerate(out):
        if isinstance(x, bool) or not isinstance(x, int) or x < 0:
            raise CommfuseValueError(f"rank {rank}: {name}[{i}] = {x!r} is not a row count (an int >= 0)")
    return out


def _a2a_chunks(chunks, group, backend, dim, uneven: bool):
    """``chunks`` checked: one tensor per rank, one dtype and device, one shape (uneven: but along ``dim``).
    Returns (chunks, backend, world size, dim)."""
    if isinstance(chunks, torch.Tensor) or not isinstance(chunks, Sequence):
        raise CommfuseTypeError(f"chunks must be a list of tensors, one per rank, got {type(chunks).__name__}")
    chunks = [check_tensor(f"chunks[{i}]", c) for i, c in enumerate(chunks)]
    if not chunks:
        raise CommfuseValueError("chunks is empty: give one tensor per rank")
    be = backends.resolve(backend, group, chunks[0].device)
    n = 1 if be is None else be.world_size
    if len(chunks) != n:
        raise CommfuseValueError(f"chunks has {len(chunks)} tensors but the world size is {n}: give one per rank")
    check_same("all_to_all_consume", [(f"chunks[{i}]", c) for i, c in enumerate(chunks)])
    if n > 1 and chunks[0].ndim == 0:
        raise CommfuseValueError("chunks are 0-d tensors; give them at least one dim")
    d = check_dim("dim", dim, chunks[0].ndim) if n > 1 else 0
    first = list(chunks[0].shape)
    for i, c in enumerate(chunks):
        shape = list(c.shape)
        if uneven and len(shape) == len(first):
            shape[d] = first[d]
        if shape != first:
            raise CommfuseValueError(
                f"chunks[{i}] has shape {list(c.shape)} but chunks[0] has {first}; all chunks must match"
                + (f" but along dim {d}" if uneven else " (pass uneven=True for chunks of different sizes)")
            )
    return chunks, be, n, d


# torch.ops.commfuse.* exist once the functional ops do
import commfuse.library  # noqa: E402,F401
from commfuse.runtime.eager import eager_only  # noqa: E402

# not ops (they take callables): a graph break runs them, and all they call, as plain Python
eager_only(all_gather_consume, produce_reduce_scatter, all_to_all_consume, produce_all_to_all, ring_attention,
           _ring.ring_attention)
