"""The fused functional ops: a collective decomposed into ring steps, each hop
paired with one shard of the computation that needs it.

Every op takes ``algorithm`` = ``"auto"``, ``"ring"``, ``"bidirectional"``,
``"sliced"`` or ``"vanilla"``; ``"ring:m"`` / ``"bidirectional:m"`` cut every
shard into m slices (the paper's m), ``"sliced:c"`` slices the data into c
collectives (default 2). ``timeout`` bounds every wait in seconds (default:
``COMMFUSE_TIMEOUT_S``, else 300). ``check`` exchanges a fingerprint of the
call with the ring neighbours before the first transfer (default on;
``COMMFUSE_CHECK=0`` turns it off) so that ranks that disagree on shapes,
dtypes or algorithm fail with an error showing both sides instead of sending
a wrong-sized message (which gloo answers by aborting the process).
``report``, a dict, receives the algorithm taken and why. ``backend`` picks a
backend by name or passes a Backend object; by default the one that fits the
tensors' device. Without an initialised process group and with ``group=None``
the ops run as world size 1.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from commfuse.errors import CommfuseTypeError, CommfuseValueError
from commfuse.runtime.executor import cached_schedule, check_enabled, execute, resolve_timeout
from commfuse.runtime.programs import (
    AllToAllProgram,
    GatherProgram,
    Layout,
    ReduceScatterProgram,
    dtype_code,
    dtype_name,
    split_sizes,
)
from commfuse.schedule import Algorithm, Collective

__all__ = [
    "MIN_SLICE_BYTES",
    "all_gather_consume",
    "all_gather_matmul",
    "all_to_all_consume",
    "choose_algorithm",
    "matmul_reduce_scatter",
    "produce_reduce_scatter",
]

#: ``auto`` takes ``vanilla`` when one ring slice would carry fewer bytes than
#: this: below it a hop costs about its fixed latency whatever its size, so N
#: hops cost more than one collective and there is little compute to hide.
MIN_SLICE_BYTES = 64 * 1024


# -- argument handling -------------------------------------------------------


def _tensor(name: str, value) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise CommfuseTypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def _dim(name: str, dim, ndim: int) -> int:
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise CommfuseTypeError(f"{name} must be an int, got {dim!r}")
    if not -ndim <= dim < ndim:
        raise CommfuseValueError(f"{name}={dim} is out of range for a tensor with {ndim} dims")
    return dim % ndim


def _same(name: str, tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
    first_name, first = tensors[0]
    for other_name, t in tensors[1:]:
        if t.dtype != first.dtype:
            raise CommfuseValueError(f"{name}: {other_name} has dtype {t.dtype} but {first_name} has {first.dtype}")
        if t.device != first.device:
            raise CommfuseValueError(f"{name}: {other_name} is on {t.device} but {first_name} is on {first.device}")


def _parse_algorithm(algorithm: str | Algorithm, collective: Collective) -> tuple[str, int, int]:
    """``"ring:2"`` -> ("ring", parts=2, chunks=1); ``"sliced"`` -> ("sliced", 1, 2); ``"auto"`` passes."""
    text = algorithm.value if isinstance(algorithm, Algorithm) else algorithm
    if not isinstance(text, str):
        raise CommfuseTypeError(f"algorithm must be a string such as 'ring' or 'sliced:4', got {algorithm!r}")
    name, _, count = text.partition(":")
    names = ("auto", "ring", "bidirectional", "sliced", "vanilla")
    if name not in names:
        raise CommfuseValueError(f"unknown algorithm {text!r}; expected one of {', '.join(names)} (optionally ':N')")
    if collective is Collective.ALL_TO_ALL and name == "bidirectional":
        raise CommfuseValueError("algorithm 'bidirectional' is not defined for all_to_all; it has ring, sliced, vanilla")
    k = 0
    if count:
        if not count.isdigit() or int(count) < 1 or name in ("auto", "vanilla"):
            raise CommfuseValueError(f"bad algorithm {text!r}: only ring, bidirectional and sliced take ':N' with N >= 1")
        k = int(count)
    if name == "sliced":
        return name, 1, k or 2
    return name, k or 1, 1


def choose_algorithm(collective: str | Collective, world_size: int, slice_bytes: int, capabilities=None) -> tuple[str, str]:
    """What ``algorithm="auto"`` takes, and why.

    ``slice_bytes`` is what one ring hop would carry. World size 1, or slices
    under :data:`MIN_SLICE_BYTES`, take ``vanilla``; otherwise ``ring``.
    (The simulator-backed planner of a later release refines this.)
    """
    if world_size == 1:
        return "vanilla", "world size 1: nothing to communicate"
    if slice_bytes < MIN_SLICE_BYTES:
        return "vanilla", (
            f"a ring hop would carry {slice_bytes} bytes, under {MIN_SLICE_BYTES}: per-step latency would "
            f"outweigh the overlap, so one collective is cheaper"
        )
    return "ring", f"a ring hop carries {slice_bytes} bytes: each of the {world_size - 1} hops hides behind one shard of compute"


_BACKENDS: dict[tuple, Any] = {}


def _backend(backend, group, device: torch.device):
    """The Backend object for this call, or None for a single process without torch.distributed."""
    if backend is not None and not isinstance(backend, str):
        return backend
    if backend is None and group is None and not (dist.is_available() and dist.is_initialized()):
        return None
    key = (backend, group if group is not None else dist.group.WORLD, str(device))
    found = _BACKENDS.get(key)
    if found is None:
        from commfuse import backends as registry

        found = registry.get(backend, device=device, group=group)
        if len(_BACKENDS) > 64:
            _BACKENDS.clear()
        _BACKENDS[key] = found
    return found


def _resolve(collective: Collective, algorithm, world_size: int, slice_bytes: int, backend, report) -> tuple[str, int, int]:
    name, parts, chunks = _parse_algorithm(algorithm, collective)
    reason = "asked for"
    if name == "auto":
        name, reason = choose_algorithm(collective, world_size, slice_bytes, getattr(backend, "capabilities", None))
    if report is not None:
        count = chunks if name == "sliced" else parts
        shown = name if count == (2 if name == "sliced" else 1) else f"{name}:{count}"
        report.update(algorithm=shown, reason=reason, world_size=world_size)
    return name, parts, chunks


def _run(collective, name, parts, chunks, be, program_factory, timeout, check, label):
    schedule = cached_schedule(collective.value, be.world_size, name, parts, chunks)
    program = program_factory(schedule)
    execute(schedule, program, be, timeout=resolve_timeout(timeout), check=check_enabled(check), label=label)
    return schedule, program


def _shape_text(dtype: int, shape: Sequence[int]) -> str:
    return f"{dtype_name(dtype)}{list(shape)}"


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
    timeout: float | None = None,
    check: bool | None = None,
    backend=None,
    report: dict | None = None,
):
    """``all_gather(a_shard, gather_dim) @ b``, with the gather decomposed into ring hops.

    Equals torch's ``fused_all_gather_matmul`` reference. ``b`` may be a list
    (one gather serving several GEMMs, as for Q, K and V), and then a list is
    returned. With ``return_gathered`` the result is ``(gathered_a, result)``.
    ``gather_dim`` may be the last dim (the contraction dim): every shard then
    contributes a partial product that is summed in ring order. Shards must all
    have the same size along ``gather_dim`` unless ``gathered_size`` (the size
    of the gathered dim) is given, in which case rank r's shard must have the
    ``torch.tensor_split`` size for rank r.

    Shapes: ``a_shard`` (..., L, ..., K) with L at ``gather_dim``; each ``b``
    (K, N) (``(N*L, N)`` when gathering the last dim); result (..., N*L, ..., N).
    """
    a = _tensor("a_shard", a_shard)
    single = isinstance(b, torch.Tensor)
    bs = [b] if single else list(b)
    if not bs:
        raise CommfuseValueError("b is an empty list: give at least one weight")
    for i, bi in enumerate(bs):
        _tensor("b" if single else f"b[{i}]", bi)
        if bi.ndim != 2:
            raise CommfuseValueError(f"{'b' if single else f'b[{i}]'} must be 2-D (K, N), got shape {list(bi.shape)}")
    if a.ndim < 2:
        raise CommfuseValueError(f"a_shard must have at least 2 dims, got shape {list(a.shape)}")
    _same("all_gather_matmul", [("a_shard", a)] + [("b" if single else f"b[{i}]", bi) for i, bi in enumerate(bs)])
    gd = _dim("gather_dim", gather_dim, a.ndim)
    contraction = gd == a.ndim - 1
    be = _backend(backend, group, a.device)
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

    def finish(gathered, results):
        results = results[0] if single else results
        return (gathered, results) if return_gathered else results

    if n == 1:
        _resolve(Collective.ALL_GATHER, algorithm, 1, 0, be, report)  # validates `algorithm`
        return finish(a, [torch.matmul(a, bi) for bi in bs])

    slice_bytes = a.numel() * a.element_size()
    name, parts, chunks = _resolve(Collective.ALL_GATHER, algorithm, n, slice_bytes, be, report)
    full_a = list(a.shape)
    full_a[gd] = total
    out_shapes = []
    for bi in bs:
        shape = list(a.shape[:-1]) + [bi.shape[1]]
        if not contraction:
            shape[gd] = total
        out_shapes.append(shape)
    make = torch.zeros if contraction else torch.empty
    outs = [make(shape, dtype=a.dtype, device=a.device) for shape in out_shapes]
    gathered = torch.empty(full_a, dtype=a.dtype, device=a.device) if return_gathered else None
    layout_box: list[Layout] = []

    def consume(slices, tensors):
        layout = layout_box[0]
        spans = sorted(
            ((layout.start(x.shard, x), layout.size(x.shard, x), t) for x, t in zip(slices, tensors)),
            key=lambda s: s[0],
        )
        lens = [length for _, length, _ in spans]
        piece = spans[0][2] if len(spans) == 1 else torch.cat([t for _, _, t in spans], dim=gd)
        if gathered is not None:
            for start, size, t in spans:
                gathered.narrow(gd, start, size).copy_(t)
        for bi, out in zip(bs, outs):
            if contraction:
                rows = bi.narrow(0, spans[0][0], lens[0]) if len(spans) == 1 else torch.cat(
                    [bi.narrow(0, start, size) for start, size, _ in spans], dim=0)
                out.add_(torch.matmul(piece, rows))
                continue
            contiguous = all(spans[i][0] + spans[i][1] == spans[i + 1][0] for i in range(len(spans) - 1))
            if contiguous:
                region = out.narrow(gd, spans[0][0], sum(lens))
                if region.is_contiguous():
                    torch.matmul(piece, bi, out=region)
                else:
                    region.copy_(torch.matmul(piece, bi))
                continue
            y = torch.matmul(piece, bi)
            for (start, size, _), part in zip(spans, torch.split(y, lens, dim=gd)):
                out.narrow(gd, start, size).copy_(part)

    meta = [dtype_code(a.dtype), gd, a.ndim, *full_a, len(bs)] + [d for bi in bs for d in bi.shape]

    def describe(v):
        ndim = v[2]
        shape, rest = v[3 : 3 + ndim], v[3 + ndim :]
        ws = [rest[1 + 2 * i : 3 + 2 * i] for i in range(rest[0])] if rest else []
        return f"a gathered along dim {v[1]} to {_shape_text(v[0], shape)} times weights {ws}"

    def program(schedule):
        layout_box.append(Layout(schedule, sizes))
        return GatherProgram(schedule, be, a, gd, layout_box[0], consume, keep=False, meta=meta, describe=describe)

    _run(Collective.ALL_GATHER, name, parts, chunks, be, program, timeout, check, "all_gather_matmul")
    return finish(gathered, outs)


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
    check: bool | None = None,
    backend=None,
    report: dict | None = None,
) -> torch.Tensor:
    """``reduce_scatter(a @ b, scatter_dim)`` with the reduce-scatter decomposed into ring hops.

    Equals ``reduce_scatter_tensor(a @ b)`` along ``scatter_dim`` (rank r gets
    the ``torch.tensor_split`` piece r when the size does not divide), up to
    the order of the sum, which follows the ring. ``reduce_op`` is ``"sum"``
    or ``"avg"``.

    Shapes: ``a`` (..., K); ``b`` (K, N); result: ``(..., N)`` with the dim at
    ``scatter_dim`` cut to this rank's shard.
    """
    a = _tensor("a", a)
    b = _tensor("b", b)
    if a.ndim < 2:
        raise CommfuseValueError(f"a must have at least 2 dims, got shape {list(a.shape)}")
    if b.ndim != 2:
        raise CommfuseValueError(f"b must be 2-D (K, N), got shape {list(b.shape)}")
    if a.shape[-1] != b.shape[0]:
        raise CommfuseValueError(f"a has K = {a.shape[-1]} columns but b has {b.shape[0]} rows")
    _same("matmul_reduce_scatter", [("a", a), ("b", b)])
    if reduce_op not in ("sum", "avg"):
        raise CommfuseValueError(f"reduce_op must be 'sum' or 'avg', got {reduce_op!r}")
    if reduce_op == "avg" and not (a.is_floating_point() or a.is_complex()):
        raise CommfuseValueError(f"reduce_op 'avg' needs a floating dtype, got {a.dtype}")
    out_shape = [*a.shape[:-1], b.shape[1]]
    sd = _dim("scatter_dim", scatter_dim, len(out_shape))
    last = sd == len(out_shape) - 1
    be = _backend(backend, group, a.device)
    n = 1 if be is None else be.world_size
    if n == 1:
        _resolve(Collective.REDUCE_SCATTER, algorithm, 1, 0, be, report)  # validates `algorithm`
        return torch.matmul(a, b)
    sizes = split_sizes(out_shape[sd], n)
    per_rank = 1
    for i, d in enumerate(out_shape):
        per_rank *= sizes[0] if i == sd else d
    name, parts, chunks = _resolve(Collective.REDUCE_SCATTER, algorithm, n, per_rank * a.element_size(), be, report)
    layout_box: list[Layout] = []

    def spans_of(slices):
        layout = layout_box[0]
        return [(layout.start(x.shard, x), layout.size(x.shard, x)) for x in slices]

    def produce(slices):
        spans = spans_of(slices)
        lens = [size for _, size in spans]
        consecutive = all(spans[i][0] + spans[i][1] == spans[i + 1][0] for i in range(len(spans) - 1))
        if not last:
            if consecutive:
                piece = a.narrow(sd, spans[0][0], sum(lens))
            else:
                piece = torch.cat([a.narrow(sd, start, size) for start, size in spans], dim=sd)
            y = torch.matmul(piece, b)
        else:
            if consecutive:
                cols = b.narrow(1, spans[0][0], sum(lens))
            else:
                cols = torch.cat([b.narrow(1, start, size) for start, size in spans], dim=1)
            y = torch.matmul(a, cols)
        return [y] if len(slices) == 1 else list(torch.split(y, lens, dim=sd))

    def shape(x):
        out = list(out_shape)
        out[sd] = layout_box[0].size(x.shard, x)
        return out

    meta = [dtype_code(a.dtype), sd, a.ndim, *a.shape, *b.shape]

    def describe(v):
        ndim = v[2]
        return (f"a {_shape_text(v[0], v[3 : 3 + ndim])} times b {v[3 + ndim :]} scattered along dim {v[1]}")

    def program(schedule):
        layout_box.append(Layout(schedule, sizes))
        return ReduceScatterProgram(schedule, be, produce, shape, lambda: a.dtype, inplace=True, meta=meta,
                                    describe=describe)

    _, prog = _run(Collective.REDUCE_SCATTER, name, parts, chunks, be, program, timeout, check,
                   "matmul_reduce_scatter")
    pieces = prog.result()
    out = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=sd)
    if reduce_op == "avg":
        out = out.div_(n)
    return out


# -- consume / produce forms -------------------------------------------------


class _Assembler:
    """Calls ``consumer(shard, source)`` once per shard, once all of its slices are there."""

    def __init__(self, schedule, dim: int, consumer: Callable, n: int, key: Callable) -> None:
        self.schedule, self.dim, self.consumer, self.key = schedule, dim, consumer, key
        self.pending: dict[int, dict[int, torch.Tensor]] = {}
        self.results: list[Any] = [None] * n

    def __call__(self, slices, tensors) -> None:
        pieces = self.schedule.pieces
        for x, t in zip(slices, tensors):
            source = self.key(x)
            if pieces == 1:
                self.results[source] = self.consumer(t, source)
                continue
            got = self.pending.setdefault(source, {})
            got[self.schedule.piece(x)] = t
            if len(got) == pieces:
                whole = torch.cat([got[i] for i in range(pieces)], dim=self.dim)
                del self.pending[source]
                self.results[source] = self.consumer(whole, source)


def all_gather_consume(
    shard: torch.Tensor,
    consumer: Callable[[torch.Tensor, int], Any],
    *,
    group=None,
    dim: int = 0,
    algorithm: str = "auto",
    timeout: float | None = None,
    check: bool | None = None,
    backend=None,
    report: dict | None = None,
) -> list[Any]:
    """Call ``consumer(shard_of_rank_s, s)`` once for every rank s, each while the next shard travels.

    Every rank passes a shard of the same shape. Returns the consumer's
    results, indexed by source rank. With several slices per shard
    (``ring:m``, ``bidirectional``) the shard is cut along ``dim`` and the
    consumer is called once its last slice has arrived. The consumer may keep
    the tensors it is given.
    """
    shard = _tensor("shard", shard)
    if not callable(consumer):
        raise CommfuseTypeError(f"consumer must be callable, got {type(consumer).__name__}")
    if shard.ndim == 0:
        raise CommfuseValueError("shard is a 0-d tensor; give it at least one dim")
    d = _dim("dim", dim, shard.ndim)
    be = _backend(backend, group, shard.device)
    n = 1 if be is None else be.world_size
    if n == 1:
        _resolve(Collective.ALL_GATHER, algorithm, 1, 0, be, report)  # validates `algorithm`
        return [consumer(shard, 0)]
    name, parts, chunks = _resolve(Collective.ALL_GATHER, algorithm, n, shard.numel() * shard.element_size(), be, report)
    meta = [dtype_code(shard.dtype), d, shard.ndim, *shard.shape]

    def describe(v):
        return f"shards {_shape_text(v[0], v[3 : 3 + v[2]])} cut along dim {v[1]}"

    box = []

    def program(schedule):
        box.append(_Assembler(schedule, d, consumer, n, key=lambda x: x.shard))
        layout = Layout(schedule, [shard.shape[d]] * n)
        return GatherProgram(schedule, be, shard, d, layout, box[0], keep=True, meta=meta, describe=describe)

    _run(Collective.ALL_GATHER, name, parts, chunks, be, program, timeout, check, "all_gather_consume")
    return box[0].results


def produce_reduce_scatter(
    producer: Callable[[int], torch.Tensor],
    *,
    group=None,
    dim: int = 0,
    algorithm: str = "auto",
    timeout: float | None = None,
    check: bool | None = None,
    backend=None,
    report: dict | None = None,
) -> torch.Tensor:
    """Sum over ranks of ``producer(this_rank)``, with each ``producer(d)`` computed while sums travel.

    ``producer(d)`` returns this rank's partial of rank d's output shard; every
    call must return the same shape and dtype. It is called once per
    destination, in the ring's order (own shard last). Returns this rank's
    output shard. Slices for ``ring:m``/``bidirectional`` are cut along ``dim``.
    The producer's tensors are never modified.
    """
    if not callable(producer):
        raise CommfuseTypeError(f"producer must be callable, got {type(producer).__name__}")
    be = _backend(backend, group, None)
    n = 1 if be is None else be.world_size
    if n == 1:
        _resolve(Collective.REDUCE_SCATTER, algorithm, 1, 0, be, report)  # validates `algorithm`
        return _tensor("producer(0)", producer(0))
    name, parts, chunks = _parse_algorithm(algorithm, Collective.REDUCE_SCATTER)
    first: dict[str, Any] = {}
    early: dict[int, torch.Tensor] = {}  # partials produced before the schedule was chosen
    cache: dict[int, list[torch.Tensor]] = {}
    box = []

    def call(d: int) -> torch.Tensor:
        t = early.pop(d) if d in early else _tensor(f"producer({d})", producer(d))
        if t.ndim == 0:
            raise CommfuseValueError(f"rank {be.rank}: producer({d}) returned a 0-d tensor; partials need a dim")
        if not first:
            first.update(shape=list(t.shape), dtype=t.dtype, dim=_dim("dim", dim, t.ndim))
        elif list(t.shape) != first["shape"] or t.dtype != first["dtype"]:
            raise CommfuseValueError(
                f"rank {be.rank}: producer({d}) returned {t.dtype}{list(t.shape)} but an earlier call returned "
                f"{first['dtype']}{first['shape']}; every partial must have the same shape and dtype"
            )
        return t

    def produce(slices):
        schedule, out = box[0], []
        for x in slices:
            if x.shard not in cache:
                t = call(x.shard)
                cache[x.shard] = list(torch.tensor_split(t, schedule.pieces, dim=first["dim"]))
            out.append(cache[x.shard][schedule.piece(x)])
        return out

    def shape(x):
        s = list(first["shape"])
        s[first["dim"]] = split_sizes(s[first["dim"]], box[0].pieces)[box[0].piece(x)]
        return s

    def meta():
        return [dtype_code(first["dtype"]), first["dim"], len(first["shape"]), *first["shape"]]

    def describe(v):
        return f"partials {_shape_text(v[0], v[3 : 3 + v[2]])} cut along dim {v[1]}"

    if name == "auto":  # the slice size is known only from a partial: produce the first one now
        src = (be.rank - 1) % n
        early[src] = call(src)
        t = early[src]
        name, reason = choose_algorithm(Collective.REDUCE_SCATTER, n, t.numel() * t.element_size())
        if report is not None:
            report.update(algorithm=name, reason=reason, world_size=n)
    elif report is not None:
        report.update(algorithm=algorithm, reason="asked for", world_size=n)

    def program(schedule):
        box.append(schedule)
        return ReduceScatterProgram(schedule, be, produce, shape, lambda: first["dtype"], inplace=False,
                                    meta=meta, describe=describe)

    _, prog = _run(Collective.REDUCE_SCATTER, name, parts, chunks, be, program, timeout, check,
                   "produce_reduce_scatter")
    pieces = prog.result()
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=first["dim"])


def all_to_all_consume(
    chunks: Sequence[torch.Tensor],
    consumer: Callable[[torch.Tensor, int], Any],
    *,
    group=None,
    dim: int = 0,
    algorithm: str = "auto",
    timeout: float | None = None,
    check: bool | None = None,
    backend=None,
    report: dict | None = None,
) -> list[Any]:
    """Send ``chunks[d]`` to rank d and call ``consumer(chunk_from_s, s)`` for every source s as it arrives.

    All chunks have one shape (as in Ulysses, where heads are split evenly).
    Returns the consumer's results indexed by source rank. The pairwise ring
    computes on the chunk from r - k while the next exchange is in flight.
    """
    if isinstance(chunks, torch.Tensor) or not isinstance(chunks, Sequence):
        raise CommfuseTypeError(f"chunks must be a list of tensors, one per rank, got {type(chunks).__name__}")
    chunks = [_tensor(f"chunks[{i}]", c) for i, c in enumerate(chunks)]
    if not callable(consumer):
        raise CommfuseTypeError(f"consumer must be callable, got {type(consumer).__name__}")
    if not chunks:
        raise CommfuseValueError("chunks is empty: give one tensor per rank")
    device = chunks[0].device
    be = _backend(backend, group, device)
    n = 1 if be is None else be.world_size
    if len(chunks) != n:
        raise CommfuseValueError(f"chunks has {len(chunks)} tensors but the world size is {n}: give one per rank")
    _same("all_to_all_consume", [(f"chunks[{i}]", c) for i, c in enumerate(chunks)])
    for i, c in enumerate(chunks):
        if c.shape != chunks[0].shape:
            raise CommfuseValueError(
                f"chunks[{i}] has shape {list(c.shape)} but chunks[0] has {list(chunks[0].shape)}; all chunks must match"
            )
    if n == 1:
        _resolve(Collective.ALL_TO_ALL, algorithm, 1, 0, be, report)  # validates `algorithm`
        return [consumer(chunks[0], 0)]
    if chunks[0].ndim == 0:
        raise CommfuseValueError("chunks are 0-d tensors; give them at least one dim")
    d = _dim("dim", dim, chunks[0].ndim)
    name, parts, nchunks = _resolve(Collective.ALL_TO_ALL, algorithm, n, chunks[0].numel() * chunks[0].element_size(),
                                    be, report)
    meta = [dtype_code(chunks[0].dtype), d, chunks[0].ndim, *chunks[0].shape]

    def describe(v):
        return f"chunks {_shape_text(v[0], v[3 : 3 + v[2]])} cut along dim {v[1]}"

    box = []

    def program(schedule):
        box.append(_Assembler(schedule, d, consumer, n, key=lambda x: x.source))
        sizes = split_sizes(chunks[0].shape[d], schedule.pieces)

        def recv_shape(source, x):
            s = list(chunks[0].shape)
            s[d] = sizes[schedule.piece(x)]
            return s

        return AllToAllProgram(schedule, be, chunks, d, recv_shape, box[0], keep=True, meta=meta, describe=describe)

    _run(Collective.ALL_TO_ALL, name, parts, nchunks, be, program, timeout, check, "all_to_all_consume")
    return box[0].results
