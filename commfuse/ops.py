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

import time
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
    "StandIn",
    "all_gather_consume",
    "all_gather_matmul",
    "all_to_all_consume",
    "choose_algorithm",
    "collect",
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


def choose_algorithm(collective: str | Collective, world_size: int, slice_bytes: int, capabilities=None, *,
                     flops: float | None = None, backend=None) -> tuple[str, str]:
    """What ``algorithm="auto"`` takes, and why.

    ``slice_bytes`` is what one ring hop would carry; ``flops`` the computation
    on (all-gather) or for (reduce-scatter) one shard, when the op knows it.
    When a hardware profile applies to ``backend`` (``COMMFUSE_PROFILE``, one
    installed by ``commfuse simulate calibrate --install``, or a shipped one
    whose device names match) and ``flops`` is known, the simulator predicts
    vanilla, ring and bidirectional and the fastest is taken
    (:func:`commfuse.sim.plan`, docs/simulator.md). Otherwise world size 1,
    or slices under the backend's ``capabilities.auto_min_slice_bytes``
    (default :data:`MIN_SLICE_BYTES`), take ``vanilla``; else ``ring``.
    """
    if world_size == 1:
        return "vanilla", "world size 1: nothing to communicate"
    if flops is not None:
        from commfuse.sim import plan  # pure Python, imported on first use

        planned = plan(collective, world_size, slice_bytes, flops, backend)
        if planned is not None:
            return planned
    limit = getattr(capabilities, "auto_min_slice_bytes", None)
    limit = MIN_SLICE_BYTES if limit is None else limit
    if slice_bytes < limit:
        return "vanilla", (
            f"a ring hop would carry {slice_bytes} bytes, under {limit}: per-step latency would "
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


def release_backends() -> None:
    """Forget the cached backend objects; call before ``torch.distributed.destroy_process_group()``."""
    _BACKENDS.clear()
    _CHOSEN.clear()


def _shown(name: str, parts: int, chunks: int) -> str:
    """The algorithm as a user writes it: "ring", "ring:2", "sliced" (2 chunks), "sliced:4"."""
    count = chunks if name == "sliced" else parts
    return name if count == (2 if name == "sliced" else 1) else f"{name}:{count}"


#: How long (seconds) ``auto``'s choice for one call signature (collective, world size, bytes, flops,
#: backend) stands before it is made again. Choosing reads the environment and looks for an installed
#: profile, some 10-40 us that an op of a millisecond cannot spare on every call; a profile installed,
#: or ``COMMFUSE_PROFILE`` changed, mid-run is taken into account within this time.
AUTO_RECHECK_S = 1.0
_CHOSEN: dict[tuple, tuple[float, Any, tuple[str, str]]] = {}


def _auto(collective: Collective, world_size: int, slice_bytes: int, backend, flops: float | None) -> tuple[str, str]:
    """:func:`choose_algorithm`, remembered for :data:`AUTO_RECHECK_S` per call signature."""
    key = (collective, world_size, slice_bytes, flops, id(backend))
    now = time.monotonic()
    hit = _CHOSEN.get(key)
    if hit is not None and hit[1] is backend and now - hit[0] < AUTO_RECHECK_S:
        return hit[2]
    chosen = choose_algorithm(collective, world_size, slice_bytes, getattr(backend, "capabilities", None),
                              flops=flops, backend=backend)
    if len(_CHOSEN) > 1024:
        _CHOSEN.clear()
    _CHOSEN[key] = (now, backend, chosen)  # holding the backend keeps its id from being reused while cached
    return chosen


def _resolve(collective: Collective, algorithm, world_size: int, slice_bytes: int, backend, report,
             flops: float | None = None) -> tuple[str, int, int]:
    name, parts, chunks = _parse_algorithm(algorithm, collective)
    reason = "asked for"
    if name == "auto":
        name, reason = _auto(collective, world_size, slice_bytes, backend, flops)
    if report is not None:
        report.update(algorithm=_shown(name, parts, chunks), reason=reason, world_size=world_size)
    return name, parts, chunks


def _run(collective, name, parts, chunks, be, program_factory, timeout, check, label):
    schedule = cached_schedule(collective.value, be.world_size, name, parts, chunks)
    program = program_factory(schedule)
    execute(schedule, program, be, timeout=resolve_timeout(timeout), check=check_enabled(check), label=label)
    return schedule, program


def _shape_text(dtype: int, shape: Sequence[int]) -> str:
    return f"{dtype_name(dtype)}{list(shape)}"


# -- span-level building blocks (shared by the ops and their backward passes) --


class Call:
    """The communication options of one op call, passed through to the executor."""

    __slots__ = ("be", "name", "parts", "chunks", "timeout", "check")

    def __init__(self, be, name: str, parts: int, chunks: int, timeout, check) -> None:
        self.be, self.name, self.parts, self.chunks = be, name, parts, chunks
        self.timeout, self.check = timeout, check

    @property
    def world_size(self) -> int:
        return self.be.world_size

    @property
    def rank(self) -> int:
        return self.be.rank


def gather_spans(call: Call, shard: torch.Tensor, dim: int, sizes: Sequence[int],
                 consume: Callable[[list[tuple[int, int, torch.Tensor]]], None], *, label: str, meta, describe,
                 keep: bool = False) -> None:
    """All-gather ``shard`` along ``dim`` and call ``consume(spans)`` once per step.

    ``spans`` lists ``(start, size, tensor)`` of the slices the step computes
    on, sorted by ``start`` (their offset along ``dim`` of the gathered
    tensor). Ranks' shards have ``sizes`` along ``dim``. ``consume`` must not
    keep the tensors unless ``keep``.
    """
    box: list[Layout] = []

    def on_step(slices, tensors):
        layout = box[0]
        consume(sorted(((layout.start(x.shard, x), layout.size(x.shard, x), t) for x, t in zip(slices, tensors)),
                       key=lambda span: span[0]))

    def program(schedule):
        box.append(Layout(schedule, sizes))
        return GatherProgram(schedule, call.be, shard, dim, box[0], on_step, keep=keep, meta=meta, describe=describe)

    _run(Collective.ALL_GATHER, call.name, call.parts, call.chunks, call.be, program, call.timeout, call.check, label)


def scatter_spans(call: Call, out_shape: Sequence[int], dim: int, dtype: torch.dtype,
                  produce: Callable[[list[tuple[int, int]]], list[torch.Tensor]], *, label: str, meta, describe,
                  inplace: bool = True) -> torch.Tensor:
    """Reduce-scatter partials of a tensor of ``out_shape`` along ``dim``; return this rank's summed shard.

    ``produce(spans)`` gets the ``(start, size)`` ranges along ``dim`` that a
    step computes and returns this rank's partial for each (fresh tensors when
    ``inplace``, which lets the running sums be added into them).
    """
    n = call.world_size
    sizes = split_sizes(out_shape[dim], n)
    box: list[Layout] = []

    def on_step(slices):
        layout = box[0]
        return produce([(layout.start(x.shard, x), layout.size(x.shard, x)) for x in slices])

    def shape(x):
        out = list(out_shape)
        out[dim] = box[0].size(x.shard, x)
        return out

    def program(schedule):
        box.append(Layout(schedule, sizes))
        return ReduceScatterProgram(schedule, call.be, on_step, shape, lambda: dtype, inplace=inplace, meta=meta,
                                    describe=describe)

    _, prog = _run(Collective.REDUCE_SCATTER, call.name, call.parts, call.chunks, call.be, program, call.timeout,
                   call.check, label)
    pieces = prog.result()
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)


def join(spans, dim: int, pick=lambda span: span[2]) -> torch.Tensor:
    """The spans' tensors concatenated along ``dim`` (no copy for one span)."""
    return pick(spans[0]) if len(spans) == 1 else torch.cat([pick(span) for span in spans], dim=dim)


def consecutive(spans) -> bool:
    return all(spans[i][0] + spans[i][1] == spans[i + 1][0] for i in range(len(spans) - 1))


def rows_of(t: torch.Tensor, spans, dim: int) -> torch.Tensor:
    """The rows of ``t`` along ``dim`` that ``spans`` cover, in span order."""
    if consecutive(spans):
        return t.narrow(dim, spans[0][0], sum(span[1] for span in spans))
    return torch.cat([t.narrow(dim, span[0], span[1]) for span in spans], dim=dim)


def write_rows(out: torch.Tensor, spans, dim: int, value: torch.Tensor) -> None:
    """Write ``value`` (the spans' rows, concatenated along ``dim``) into ``out``."""
    if consecutive(spans):
        out.narrow(dim, spans[0][0], value.shape[dim]).copy_(value)
        return
    for (start, size, *_), part in zip(spans, torch.split(value, [span[1] for span in spans], dim=dim)):
        out.narrow(dim, start, size).copy_(part)


def matmul_rows(out: torch.Tensor, spans, dim: int, a: torch.Tensor, b: torch.Tensor) -> None:
    """``out[rows of spans] = a @ b``, straight into ``out`` when the rows are one contiguous block."""
    if consecutive(spans):
        region = out.narrow(dim, spans[0][0], a.shape[dim])
        if region.is_contiguous():
            torch.matmul(a, b, out=region)
            return
    write_rows(out, spans, dim, torch.matmul(a, b))


# -- all_gather_matmul -------------------------------------------------------


def _grad_wanted(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


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
    check: bool | None = None,
    backend=None,
    report: dict | None = None,
):
    """``all_gather(a_shard, gather_dim) @ b``, with the gather decomposed into ring hops.

    Equals torch's ``fused_all_gather_matmul`` reference. ``b`` may be a list
    (one gather serving several GEMMs, as for Q, K and V), and then a list is
    returned. With ``return_gathered`` the result is ``(gathered_a, result)``
    (the gathered a carries no gradient). ``gather_dim`` may be the last dim
    (the contraction dim): every shard then contributes a partial product
    that is summed in ring order (forward only). Shards must all have the
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
        results = results[0] if single else list(results)
        return (gathered, results) if return_gathered else results

    if n == 1:
        _resolve(Collective.ALL_GATHER, algorithm, 1, 0, be, report)  # validates `algorithm`
        return finish(a, [torch.matmul(a, bi) for bi in bs])
    name, parts, chunks = _resolve(Collective.ALL_GATHER, algorithm, n, a.numel() * a.element_size(), be, report,
                                   flops=2.0 * a.numel() * sum(bi.shape[1] for bi in bs))
    call = Call(be, name, parts, chunks, timeout, check)
    if _grad_wanted(a, *bs):
        if contraction:
            raise CommfuseValueError(
                "all_gather_matmul has no backward when gather_dim is the contraction (last) dim; "
                "gather another dim or run it under torch.no_grad()"
            )
        from commfuse.autograd import all_gather_matmul_fn

        gathered, outs = all_gather_matmul_fn(call, a, bs, gd, sizes, keep_gathered or return_gathered)
        return finish(gathered if return_gathered else None, outs)
    gathered, outs = all_gather_matmul_forward(call, a, bs, gd, sizes, return_gathered)
    return finish(gathered, outs)


def _ag_meta(a: torch.Tensor, bs, gd: int, total: int):
    full = list(a.shape)
    full[gd] = total
    meta = [dtype_code(a.dtype), gd, a.ndim, *full, len(bs)] + [d for bi in bs for d in bi.shape]

    def describe(v):
        ndim = v[2]
        shape, rest = v[3 : 3 + ndim], v[3 + ndim :]
        ws = [rest[1 + 2 * i : 3 + 2 * i] for i in range(rest[0])] if rest else []
        return f"a gathered along dim {v[1]} to {_shape_text(v[0], shape)} times weights {ws}"

    return meta, describe


def all_gather_matmul_forward(call: Call, a: torch.Tensor, bs, gd: int, sizes, return_gathered: bool):
    """The forward of :func:`all_gather_matmul` on ``call``'s backend; returns (gathered or None, outputs)."""
    total = sum(sizes)
    contraction = gd == a.ndim - 1
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

    def consume(spans):
        piece = join(spans, gd)
        if gathered is not None:
            write_rows(gathered, spans, gd, piece)
        for bi, out in zip(bs, outs):
            if contraction:
                out.add_(torch.matmul(piece, rows_of(bi, spans, 0)))
            else:
                matmul_rows(out, spans, gd, piece, bi)

    meta, describe = _ag_meta(a, bs, gd, total)
    gather_spans(call, a, gd, sizes, consume, label="all_gather_matmul", meta=meta, describe=describe)
    return gathered, outs


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
    or ``"avg"``. Differentiable (scatter dims other than the last): the
    backward of ``a`` is an all-gather + matmul decomposed the same way, with
    the weight-gradient GEMM of every arriving slice overlapping the next hop.

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
    be = _backend(backend, group, a.device)
    n = 1 if be is None else be.world_size
    if n == 1:
        _resolve(Collective.REDUCE_SCATTER, algorithm, 1, 0, be, report)  # validates `algorithm`
        return torch.matmul(a, b)
    sizes = split_sizes(out_shape[sd], n)
    per_rank = 1
    for i, d in enumerate(out_shape):
        per_rank *= sizes[0] if i == sd else d
    name, parts, chunks = _resolve(Collective.REDUCE_SCATTER, algorithm, n, per_rank * a.element_size(), be, report,
                                   flops=2.0 * a.numel() * b.shape[1] / n)
    call = Call(be, name, parts, chunks, timeout, check)
    if _grad_wanted(a, b):
        if sd == len(out_shape) - 1:
            raise CommfuseValueError(
                "matmul_reduce_scatter has no backward when scatter_dim is the last (output feature) dim; "
                "scatter another dim or run it under torch.no_grad()"
            )
        from commfuse.autograd import matmul_reduce_scatter_fn

        return matmul_reduce_scatter_fn(call, a, b, sd, reduce_op)
    out = matmul_reduce_scatter_forward(call, a, b, sd)
    return out.div_(n) if reduce_op == "avg" else out


def matmul_reduce_scatter_forward(call: Call, a: torch.Tensor, b: torch.Tensor, sd: int) -> torch.Tensor:
    """The forward of :func:`matmul_reduce_scatter` (a sum) on ``call``'s backend."""
    out_shape = [*a.shape[:-1], b.shape[1]]
    last = sd == len(out_shape) - 1

    def produce(spans):
        lens = [size for _, size in spans]
        y = torch.matmul(a, rows_of(b, spans, 1)) if last else torch.matmul(rows_of(a, spans, sd), b)
        return [y] if len(spans) == 1 else list(torch.split(y, lens, dim=sd))

    meta = [dtype_code(a.dtype), sd, a.ndim, *a.shape, *b.shape]

    def describe(v):
        ndim = v[2]
        return f"a {_shape_text(v[0], v[3 : 3 + ndim])} times b {v[3 + ndim :]} scattered along dim {v[1]}"

    return scatter_spans(call, out_shape, sd, a.dtype, produce, label="matmul_reduce_scatter", meta=meta,
                         describe=describe)


# -- consume / produce forms -------------------------------------------------


class StandIn:
    """A consumer with a stand-in for ``measure("comm_only")`` runs, which remove the compute.

    ``consumer(tensor, source)`` runs normally; in a ``comm_only`` run
    ``stand_in(tensor, source)`` runs in its place and should be (nearly) free
    while returning what later code needs: a tensor of the result's shape,
    say, so that a layer built of several ops still runs end to end with its
    compute removed. A consumer without one gives None there.
    """

    __slots__ = ("consumer", "stand_in")

    def __init__(self, consumer: Callable[[torch.Tensor, int], Any],
                 stand_in: Callable[[torch.Tensor, int], Any]) -> None:
        self.consumer, self.stand_in = consumer, stand_in

    def __call__(self, tensor: torch.Tensor, source: int) -> Any:
        return self.consumer(tensor, source)


def _identity(tensor: torch.Tensor, source: int) -> torch.Tensor:
    return tensor


#: The consumer that only collects what arrives: results are the shards
#: themselves, in ``comm_only`` runs too (collecting is not compute).
collect = StandIn(_identity, _identity)


class _Assembler:
    """Calls ``consumer(shard, source)`` once per shard, once all of its slices are there."""

    def __init__(self, schedule, dim: int, consumer: Callable, n: int, key: Callable) -> None:
        self.schedule, self.dim, self.consumer, self.key = schedule, dim, consumer, key
        self.pending: dict[int, dict[int, torch.Tensor]] = {}
        self.results: list[Any] = [None] * n

    def __call__(self, slices, tensors) -> None:
        self._feed(slices, tensors, self.consumer)

    def skip(self, slices, tensors) -> None:
        """The ``comm_only`` stand-in for ``__call__``: the consumer's stand-in, if it has one, else nothing."""
        stand_in = getattr(self.consumer, "stand_in", None)
        if stand_in is not None:
            self._feed(slices, tensors, stand_in)

    def _feed(self, slices, tensors, consumer: Callable) -> None:
        pieces = self.schedule.pieces
        for x, t in zip(slices, tensors):
            source = self.key(x)
            if pieces == 1:
                self.results[source] = consumer(t, source)
                continue
            got = self.pending.setdefault(source, {})
            got[self.schedule.piece(x)] = t
            if len(got) == pieces:
                whole = torch.cat([got[i] for i in range(pieces)], dim=self.dim)
                del self.pending[source]
                self.results[source] = consumer(whole, source)


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
    the tensors it is given. Not differentiable itself: the layers build their
    backward passes from it (``commfuse.autograd``). Under
    ``commfuse.runtime.measure("comm_only")`` the consumer is not called: the
    results are None, or a :class:`StandIn`'s stand-ins (:data:`collect`
    collects in every mode).
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
    return all_gather_consume_core(Call(be, name, parts, chunks, timeout, check), shard, consumer, d)


def all_gather_consume_core(call: Call, shard: torch.Tensor, consumer: Callable, dim: int, *, keep: bool = True,
                            label: str = "all_gather_consume") -> list[Any]:
    """:func:`all_gather_consume` on a resolved ``call``; ``keep=False`` lets buffers be reused (the
    consumer then must not keep what it is given)."""
    n = call.world_size
    meta = [dtype_code(shard.dtype), dim, shard.ndim, *shard.shape]

    def describe(v):
        return f"shards {_shape_text(v[0], v[3 : 3 + v[2]])} cut along dim {v[1]}"

    box = []

    def program(schedule):
        box.append(_Assembler(schedule, dim, consumer, n, key=lambda x: x.shard))
        layout = Layout(schedule, [shard.shape[dim]] * n)
        # with several slices per shard the assembler holds early slices until the last one arrives
        return GatherProgram(schedule, call.be, shard, dim, layout, box[0], keep=keep or schedule.pieces > 1,
                             meta=meta, describe=describe)

    _run(Collective.ALL_GATHER, call.name, call.parts, call.chunks, call.be, program, call.timeout, call.check, label)
    return box[0].results


def produce_reduce_scatter(
    producer: Callable[..., torch.Tensor],
    *,
    inputs: Sequence[torch.Tensor] | None = None,
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

    With ``inputs`` the producer is called as ``producer(d, *inputs)`` and the
    result is differentiable with respect to ``inputs``: the backward
    all-gathers the output's gradient in a ring and back-propagates each
    arriving shard through the partial that made it (the query-split
    attention of ``commfuse.nn`` is built on this).
    """
    if not callable(producer):
        raise CommfuseTypeError(f"producer must be callable, got {type(producer).__name__}")
    inputs = tuple(inputs) if inputs is not None else None
    if inputs is not None:
        for i, t in enumerate(inputs):
            _tensor(f"inputs[{i}]", t)
    be = _backend(backend, group, inputs[0].device if inputs else None)
    n = 1 if be is None else be.world_size
    call_producer = producer if inputs is None else (lambda d: producer(d, *inputs))
    if n == 1:
        _resolve(Collective.REDUCE_SCATTER, algorithm, 1, 0, be, report)  # validates `algorithm`
        return _tensor("producer(0)", call_producer(0))
    name, parts, chunks = _parse_algorithm(algorithm, Collective.REDUCE_SCATTER)
    early: dict[int, torch.Tensor] = {}
    if name == "auto":  # the slice size is known only from a partial: decide on the first one the ring needs
        src = (be.rank - 1) % n
        first = _tensor(f"producer({src})", call_producer(src))
        early[src] = first
        name, reason = _auto(Collective.REDUCE_SCATTER, n, first.numel() * first.element_size(), be, None)
    else:
        reason = "asked for"
    if report is not None:
        report.update(algorithm=_shown(name, parts, chunks), reason=reason, world_size=n)
    call = Call(be, name, parts, chunks, timeout, check)
    if inputs is not None and _grad_wanted(*inputs):
        from commfuse.autograd import produce_reduce_scatter_fn

        return produce_reduce_scatter_fn(call, producer, inputs, dim, early)
    return produce_reduce_scatter_core(call, call_producer, dim, early)


def produce_reduce_scatter_core(call: Call, producer: Callable[[int], torch.Tensor], dim: int,
                                early: dict[int, torch.Tensor] | None = None,
                                label: str = "produce_reduce_scatter", inplace: bool = False) -> torch.Tensor:
    """:func:`produce_reduce_scatter` on a resolved ``call``; ``early`` holds partials already produced.

    ``inplace`` lets the running sums be added into the partials, for
    producers that return fresh tensors nobody else holds (saves one buffer).
    """
    early = dict(early or {})
    first: dict[str, Any] = {}
    cache: dict[int, list[torch.Tensor]] = {}
    box = []
    rank = call.rank

    def get(d: int) -> torch.Tensor:
        t = early.pop(d) if d in early else _tensor(f"producer({d})", producer(d))
        if t.ndim == 0:
            raise CommfuseValueError(f"rank {rank}: producer({d}) returned a 0-d tensor; partials need a dim")
        if not first:
            first.update(shape=list(t.shape), dtype=t.dtype, dim=_dim("dim", dim, t.ndim))
        elif list(t.shape) != first["shape"] or t.dtype != first["dtype"]:
            raise CommfuseValueError(
                f"rank {rank}: producer({d}) returned {t.dtype}{list(t.shape)} but an earlier call returned "
                f"{first['dtype']}{first['shape']}; every partial must have the same shape and dtype"
            )
        return t

    def produce(slices):
        schedule, out = box[0], []
        for x in slices:
            if x.shard not in cache:
                cache[x.shard] = list(torch.tensor_split(get(x.shard), schedule.pieces, dim=first["dim"]))
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

    def program(schedule):
        box.append(schedule)
        return ReduceScatterProgram(schedule, call.be, produce, shape, lambda: first["dtype"], inplace=inplace,
                                    meta=meta, describe=describe)

    _, prog = _run(Collective.REDUCE_SCATTER, call.name, call.parts, call.chunks, call.be, program, call.timeout,
                   call.check, label)
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
    ``comm_only`` measurements call no consumer, as for
    :func:`all_gather_consume` (a :class:`StandIn` gives stand-ins).
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
    return all_to_all_consume_core(Call(be, name, parts, nchunks, timeout, check), chunks, consumer, d)


def all_to_all_consume_core(call: Call, chunks: Sequence[torch.Tensor], consumer: Callable, dim: int, *,
                            label: str = "all_to_all_consume") -> list[Any]:
    """:func:`all_to_all_consume` on a resolved ``call``."""
    n = call.world_size
    first = chunks[0]
    meta = [dtype_code(first.dtype), dim, first.ndim, *first.shape]

    def describe(v):
        return f"chunks {_shape_text(v[0], v[3 : 3 + v[2]])} cut along dim {v[1]}"

    box = []

    def program(schedule):
        box.append(_Assembler(schedule, dim, consumer, n, key=lambda x: x.source))
        sizes = split_sizes(first.shape[dim], schedule.pieces)

        def recv_shape(source, x):
            s = list(first.shape)
            s[dim] = sizes[schedule.piece(x)]
            return s

        return AllToAllProgram(schedule, call.be, chunks, dim, recv_shape, box[0], keep=True, meta=meta,
                               describe=describe)

    _run(Collective.ALL_TO_ALL, call.name, call.parts, call.chunks, call.be, program, call.timeout, call.check, label)
    return box[0].results
