"""The reduce-scatter of partials the caller makes as each step needs them: one reduce-scatter, entered at
four layers.

Its meaning, as the plain code it pipelines::

    partials = [produce(rows of rank d's shard) for d in range(world size)]
    mine = reduce_scatter(partials)                  # the sum over the ranks of each rank's shard

From the top down:

* :func:`produce_reduce_scatter_core` (``commfuse.produce_reduce_scatter``, the layers, the all-reduce):
  ``producer(dest)`` makes the whole partial for ``dest`` (or with ``slices`` each slice of it) as the
  step that sends it comes.
* :func:`scatter_spans` (callers that make one call of a signature now and then): the plan looked up
  (:func:`prepare_scatter`) and run (:func:`run_scatter`) in one.
* :func:`prepare_scatter` then :func:`run_scatter` (the fused ops, which keep the
  :class:`~commfuse.planning.plans.SignaturePlan`): ``produce(spans)`` per step, or ``produce_whole()``
  for a whole collective.
* :func:`scatter_runners` (a signature the ranks agreed, ``may_skip_program``): the two walks with no
  program, :func:`run_scatter_one_by_one` (a ring, one slice per step) and :func:`run_scatter_whole`
  (vanilla straight into the result, where :func:`scatters_whole`), as a plan of half partials takes them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from commfuse.errors import CommfuseTypeError, CommfuseValueError
from commfuse.planning.calls import Call
from commfuse.planning.derive import capped, config_of
from commfuse.planning.plans import SignaturePlan, keep_plan, kept_plan, new_plan
from commfuse.runtime.admission import enter_call
from commfuse.runtime.fingerprints import dtype_code
from commfuse.runtime.programs import BufferPool, ReduceScatterProgram, ScatterLayout
from commfuse.runtime.walks import execute, execute_into, execute_one_by_one, may_skip_program, ring_walk
from commfuse.schedule import Collective, split_sizes

__all__ = [
    "prepare_scatter", "produce_reduce_scatter_core", "run_scatter", "run_scatter_one_by_one", "run_scatter_whole",
    "scatter_runners", "scatter_spans", "scatters_whole",
]


def _scatter_plan(call: Call, shape, dim: int, dtype, label: str, meta, *, whole: bool = True) -> tuple:
    """``shape`` is the whole tensor's (split over the ranks along ``dim``), or with ``whole=False`` one
    rank's shard (every shard alike)."""
    key = ("scatter", call, label, tuple(shape), dim, dtype, whole)
    found = kept_plan(key)
    if found is None:
        n = call.be.world_size
        sizes = split_sizes(shape[dim], n) if whole else [shape[dim]] * n
        plan = new_plan(capped(call, min(sizes), label), Collective.REDUCE_SCATTER, label)
        layout = ScatterLayout(plan.compiled, sizes, dim, shape, dtype)
        layout.meta = (meta() if callable(meta) else list(meta)) + config_of(call)
        found = keep_plan(key, (plan, layout, BufferPool.of(call.be)))
    return found


def prepare_scatter(call: Call, out_shape: Sequence[int], dim: int, dtype: torch.dtype, label: str,
                    meta) -> SignaturePlan:
    """The plan of a :func:`scatter_spans` signature, for callers that keep it (see :func:`run_scatter`)."""
    plan, layout, pool = _scatter_plan(call, tuple(out_shape), dim, dtype, label, meta)
    return SignaturePlan(plan, layout, pool, dim)


def scatters_whole(planned: SignaturePlan) -> bool:
    """Whether the plan from :func:`prepare_scatter` is one whole reduce-scatter over dim 0 straight from one
    tensor (vanilla over even shards, on a backend with ``collective_into``): then, while
    ``may_skip_program(plan)``, :func:`run_scatter_whole` runs a call with no program."""
    return (planned.dim == 0 and planned.plan.whole is not None and planned.layout.into
            and planned.pool.into)


def run_scatter_whole(planned: SignaturePlan, whole) -> torch.Tensor:
    """This rank's summed shard of ``whole`` (every rank's partial, the whole tensor's shape), reduce-scattered
    along dim 0 straight into the result (see :func:`scatters_whole`). ``whole`` may be a function making it,
    called once the call has its number (so that a failure in it is told to the peers, see
    ``walks.execute_into``). ``whole`` is in the layout's sum dtype: :func:`scatter_runners` gives the form
    that takes any plan's partials."""
    plan, layout, pool = planned.plan, planned.layout, planned.pool
    out = pool.get(layout.key[layout.own[0]])
    stacked = layout.whole_key[0]
    if callable(whole):
        make = whole

        def whole():
            t = make()
            return t if t.shape == stacked else t.view(stacked)

        execute_into(plan, whole, out)
    else:
        execute_into(plan, whole if whole.shape == stacked else whole.view(stacked), out)
    return out


def run_scatter_one_by_one(planned: SignaturePlan, on_slice) -> torch.Tensor:
    """A call of a ring plan from :func:`prepare_scatter` (``plan.one_by_one``; the caller has seen
    ``may_skip_program(plan)``), its steps walked with no program: ``on_slice(start, size, None)`` makes this
    rank's partial of each slice (a fresh contiguous tensor, added into in place, in the layout's sum dtype:
    :func:`scatter_runners` gives the form that takes any plan's partials). Returns this rank's summed
    shard."""
    plan, layout, dim = planned.plan, planned.layout, planned.dim
    walk = layout.walk
    if walk is None:
        walk = layout.walk = ring_walk(plan, layout.start, layout.size, layout.key, layout.own_set)
    held: list = [None] * len(layout.size)
    execute_one_by_one(plan, walk, held, on_slice, planned.pool, [None] * len(layout.size))
    own = layout.own
    return held[own[0]] if len(own) == 1 else torch.cat([held[s] for s in own], dim=dim)


def scatter_runners(planned: SignaturePlan) -> tuple[Callable, Callable]:
    """``(one_by_one, whole)``: :func:`run_scatter_one_by_one` and :func:`run_scatter_whole` as a call on
    ``planned`` must take them. Where its layout widens (half partials, ``programs.sum_dtype``), each partial
    is cast to float32 as it is made, sums and transfers stay float32, and the result is cast back once;
    otherwise the two themselves. Taken once per signature, so a float32 call pays nothing for it."""
    layout = planned.layout
    wide, made = layout.widen, layout.made
    if wide is None:
        return run_scatter_one_by_one, run_scatter_whole

    def one_by_one(planned: SignaturePlan, on_slice) -> torch.Tensor:
        return run_scatter_one_by_one(planned, lambda start, size, t: on_slice(start, size, t).to(wide)).to(made)

    def whole(planned: SignaturePlan, whole) -> torch.Tensor:
        make = whole if callable(whole) else (lambda: whole)
        return run_scatter_whole(planned, lambda: make().to(wide)).to(made)

    return one_by_one, whole


def run_scatter(planned: SignaturePlan, produce, inplace: bool = True, check_shapes: bool = False,
                produce_whole=None) -> torch.Tensor:
    """:func:`scatter_spans` on a plan from :func:`prepare_scatter` (no look-up). ``produce_whole()``, when
    given, makes the whole tensor's partial at once (its dim ``dim`` must be dim 0), for ``vanilla``."""
    plan, layout, pool, dim = planned.plan, planned.layout, planned.pool, planned.dim
    if produce_whole is not None and scatters_whole(planned) and may_skip_program(plan):
        return scatter_runners(planned)[1](planned, produce_whole)
    spans = layout.spans
    program = ReduceScatterProgram(layout, pool, lambda slots: produce(spans[slots]), inplace=inplace,
                                   meta=layout.meta, check_shapes=check_shapes,
                                   produce_whole=produce_whole if dim == 0 else None)
    execute(plan, program)
    pieces = program.result()
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)


def scatter_spans(call: Call, out_shape: Sequence[int], dim: int, dtype: torch.dtype,
                  produce: Callable[[list[tuple[int, int]]], list[torch.Tensor]], *, label: str, meta,
                  inplace: bool = True, check_shapes: bool = False) -> torch.Tensor:
    """Reduce-scatter partials of a tensor of ``out_shape`` along ``dim``; return this rank's summed shard.

    ``produce(spans)`` gets the ``(start, size)`` ranges along ``dim`` that a
    step computes and returns this rank's partial for each (fresh tensors when
    ``inplace``, which lets the running sums be added into them).
    """
    return run_scatter(prepare_scatter(call, out_shape, dim, dtype, label, meta), produce, inplace, check_shapes)


def produce_reduce_scatter_core(call: Call, producer: Callable[[int], torch.Tensor], dim: int,
                                early: dict[int, torch.Tensor] | None = None,
                                label: str = "produce_reduce_scatter", inplace: bool = False,
                                slices: tuple[tuple[int, ...], torch.dtype] | None = None) -> torch.Tensor:
    """``commfuse.produce_reduce_scatter`` on a resolved ``call``; ``early`` holds partials already produced.

    The layout comes from the first partial, which is produced before the
    ring starts (the partial for the previous rank, the ring's first). Every
    later partial must have its shape and dtype. ``inplace`` lets the running
    sums be added into the partials, for producers that return fresh tensors
    nobody else holds (saves one buffer).

    ``slices`` (the library's own producers): the partials' (shape, dtype), known before any is made; then
    ``producer(dest, start, rows)`` makes each slice of the partial for ``dest`` in the step that sends it
    (rows ``start:start + rows`` along the dim), so that under ``ring:m`` the first slice leaves while the
    next is made, instead of after the whole partial.
    """
    if slices is not None:
        return _produce_slices(call, producer, dim, slices, label, inplace)
    rank, n = call.be.rank, call.be.world_size
    # the call's number first: a producer that raises on its first partial (which fixes the call's layout)
    # leaves this call on every peer's board, never an unnumbered gap (admission.Ticket)
    with enter_call(call.be, label) as ticket:
        early = dict(early or {})
        if not early:
            src = (rank - 1) % n
            early[src] = _partial(producer, src, rank)
        first = next(iter(early.values()))
        if first.ndim == 0:
            raise CommfuseValueError(f"rank {rank}: producer returned a 0-d tensor; partials need a dim")
        if isinstance(dim, bool) or not isinstance(dim, int) or not -first.ndim <= dim < first.ndim:
            raise CommfuseValueError(f"dim={dim!r} is out of range for partials of shape {list(first.shape)}")
        d = dim % first.ndim
        shape, dtype = tuple(first.shape), first.dtype
        plan, layout, pool = _scatter_plan(call, shape, d, dtype, label,
                                           lambda: [dtype_code(dtype), d, len(shape), *shape], whole=False)
        pieces = plan.schedule.pieces
        cache: dict[int, list[torch.Tensor]] = {}

        def get(dest: int) -> list[torch.Tensor]:
            got = cache.get(dest)
            if got is None:
                t = early.pop(dest) if dest in early else _partial(producer, dest, rank)
                if tuple(t.shape) != shape or t.dtype != dtype:
                    raise CommfuseValueError(
                        f"rank {rank}: producer({dest}) returned {t.dtype}{list(t.shape)} but an earlier call "
                        f"returned {dtype}{list(shape)}; every partial must have the same shape and dtype"
                    )
                got = cache[dest] = [t] if pieces == 1 else list(torch.tensor_split(t, pieces, dim=d))
            return got

        owner, piece = layout.shard, layout.piece
        program = ReduceScatterProgram(layout, pool, lambda slots: [get(owner[s])[piece[s]] for s in slots],
                                       inplace=inplace, meta=layout.meta)
        execute(plan, program, ticket=ticket)
    out = program.result()
    return out[0] if len(out) == 1 else torch.cat(out, dim=d)


def _produce_slices(call: Call, producer: Callable, dim: int, slices: tuple, label: str,
                    inplace: bool) -> torch.Tensor:
    """:func:`produce_reduce_scatter_core` with ``slices``: each slice of each partial made in its own step."""
    shape, dtype = tuple(slices[0]), slices[1]
    d = dim % len(shape)
    with enter_call(call.be, label) as ticket:
        plan, layout, pool = _scatter_plan(call, shape, d, dtype, label,
                                           lambda: [dtype_code(dtype), d, len(shape), *shape], whole=False)
        owner, size, offset = layout.shard, layout.size, layout.offset

        def produce(slots):
            return [producer(owner[s], offset[s], size[s]) for s in slots]

        program = ReduceScatterProgram(layout, pool, produce, inplace=inplace, meta=layout.meta, check_shapes=True)
        execute(plan, program, ticket=ticket)
    out = program.result()
    return out[0] if len(out) == 1 else torch.cat(out, dim=d)


def _partial(producer: Callable, dest: int, rank: int) -> torch.Tensor:
    t = producer(dest)
    if not isinstance(t, torch.Tensor):
        raise CommfuseTypeError(f"rank {rank}: producer({dest}) must return a torch.Tensor, got {type(t).__name__}")
    return t
