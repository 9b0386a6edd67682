"""The pipelined primitives: a collective's ring steps with the caller's compute on each arriving piece.

These are the level of torch's ``_pipelined_all_gather_and_consume`` /
``_pipelined_produce_and_all2all`` helpers (``torch.distributed._symmetric_memory``):
the public ops (``commfuse.ops``), their backward passes
(``commfuse.autograd``) and the layers (``commfuse.nn``) are all built from
them, given a resolved :class:`~commfuse.planning.calls.Call`. Exports:

* by spans along a dim: :func:`gather_spans` (all-gather a shard, call
  ``consume(spans)`` once per step, ``spans`` being ``(start, size, tensor)``)
  and :func:`scatter_spans` (reduce-scatter partials made by ``produce(spans)``);
* the same with the plan kept by the caller: :func:`prepare_gather` /
  :func:`prepare_scatter` give a :class:`SignaturePlan` that :func:`run_gather`,
  :func:`run_scatter`, :func:`run_gather_one_by_one`,
  :func:`run_scatter_one_by_one` (a ring, one slice per step, no program) and
  :func:`run_scatter_whole` (vanilla straight into the result, where
  :func:`scatters_whole`; :func:`scatter_runners` gives the two as a plan of
  half partials takes them) run calls on;
* per shard: :func:`all_gather_consume_core`, :func:`produce_reduce_scatter_core`,
  :func:`all_to_all_consume_core`, :func:`produce_all_to_all_core`
  (:func:`a2a_layout` for an uneven call's layout), :func:`all_reduce_core`,
  :func:`exchange_sizes`; :class:`StandIn` and :data:`collect` are consumers;
* planning: :func:`capped`, :func:`configured` / :func:`layer_config`,
  :func:`compiled_for`, :func:`schedule_for`;
* rows: :func:`join`, :func:`consecutive`, :func:`rows_of`,
  :func:`write_rows`, :func:`matmul_rows`;
* fingerprints: :func:`gather_matmul_meta` (an all-gather + matmul's, for
  its forward and its backward rings).

Plan once: the first call of a signature (call, op label, shapes, dtype,
dim, sizes) builds the runtime's :class:`~commfuse.runtime.compiled.Plan`
and the program's layout, kept in ``commfuse.planning.table``; later calls
find both in one look-up. What the first call also decides, once: how many
slices a shard is really cut into (:func:`capped`: never fewer than one row
each), the layer options that join the fingerprint (:func:`configured`), and
which slices a user's consumer must get a private copy of (``private=True``,
the public consume ops).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from commfuse.errors import CommfuseTypeError, CommfuseValueError
from commfuse.planning.calls import Call, resolve_call
from commfuse.runtime.compiled import Compiled, Plan
from commfuse.runtime.admission import enter_call
from commfuse.runtime.walks import (
    execute,
    execute_into,
    execute_one_by_one,
    may_skip_program,
    ring_walk,
)
from commfuse.runtime.observe import unmeasured
from commfuse.runtime.programs import (
    AllToAllLayout,
    AllToAllProgram,
    GatherLayout,
    GatherProgram,
    ProduceAllToAllProgram,
    ReduceScatterProgram,
    BufferPool,
    ScatterLayout,
    config_values,
    dtype_code,
    held_slots,
    register_described,
    shape_text,
)
from commfuse.planning import table
from commfuse.schedule import AlgorithmSpec, Collective, Schedule, SliceId, build, split_sizes

__all__ = [
    "StandIn", "a2a_layout", "all_gather_consume_core", "all_reduce_core", "group_sum", "all_to_all_consume_core", "capped",
    "collect", "compiled_for", "gather_matmul_meta", "gather_walk",
    "configured", "consecutive", "exchange_sizes", "layer_config", "produce_all_to_all_core",
    "gather_spans", "join", "matmul_rows", "prepare_gather", "prepare_scatter", "produce_reduce_scatter_core",
    "SignaturePlan", "rows_of", "run_gather", "run_gather_one_by_one", "run_scatter", "run_scatter_one_by_one",
    "run_scatter_whole", "schedule_for",
    "scatter_runners", "scatter_spans", "scatters_whole", "write_rows",
]

log = logging.getLogger("commfuse")

def _plan_for(key: tuple, make: Callable[[], tuple]) -> tuple:
    """The (plan, layout, pool, ...) kept in the planning table for ``key``, made on its first look-up: the
    entry holds the plan (its calls mark it used) and claims its layout's receive buffers in the pool (an
    uneven all-to-all's, whose layout is made per call, are never pooled)."""
    return table.find(("plan", *key), make, held=_held)


def _held(value: tuple) -> dict:
    """What a plan entry ``(plan, layout or None, pool, ...)`` holds, as ``table.remember`` takes it."""
    plan, layout, pool = value[0], value[1], value[2]
    return {"plan": plan, "pool": pool, "keys": () if layout is None else layout.pool_keys()}


def _remember(key: tuple, make: Callable[[], Call]) -> Call:
    """The call :func:`capped` or :func:`configured` derived, by (call, what was added): one object per
    derivation, so that the plans keyed by it are made once."""
    return table.find(("derived", *key), make)


def schedule_for(collective: Collective, world_size: int, spec: AlgorithmSpec) -> Schedule:
    """The schedule an algorithm runs at a world size, built once and kept in the planning table."""
    key = ("schedule", collective, world_size, spec.schedule_algorithm, spec.parts, spec.chunks)
    return table.find(key, lambda: build(collective.value, world_size, algorithm=spec.schedule_algorithm,
                                         parts=spec.parts, chunks=spec.chunks))


def compiled_for(schedule: Schedule, rank: int) -> Compiled:
    """One rank's compiled steps of a schedule, made once and kept in the planning table."""
    return table.find(("compiled", schedule, rank), lambda: Compiled(schedule, rank))


class _Configured(Call):
    """A :class:`Call` that carries a layer's options (``config``: the integers :func:`configured` adds to the
    fingerprint of every op run with it)."""

    __slots__ = ("config",)

    def __init__(self, be, spec: AlgorithmSpec, timeout: float, check: str, reason: str = "asked for",
                 config: tuple[int, ...] = ()) -> None:
        super().__init__(be, spec, timeout, check, reason)
        self.config = config


def _derive(call: Call, spec: AlgorithmSpec, reason: str) -> Call:
    """``call`` with another algorithm (its backend, timeout, check and layer options kept)."""
    config = getattr(call, "config", None)
    if config is None:
        return Call(call.be, spec, call.timeout, call.check, reason)
    return _Configured(call.be, spec, call.timeout, call.check, reason, config)


def layer_config(layer: str, **options) -> tuple:
    """A layer's options that every rank must share, as the hashable value :func:`configured` and the ops'
    ``config=`` take: the options that change what the ranks compute or send but not the shapes that the
    fingerprint already compares (a causal mask, a bias, how many heads a width is cut into). Values are
    bools, ints, floats (compared by their bits) or strings (by their CRC-32; ``programs.config_words`` lets a
    rank read another rank's back by name)."""
    return (layer, tuple(options.items()))


def configured(call: Call | None, config: tuple | None) -> Call | None:
    """``call`` carrying a layer's options (:func:`layer_config`): every op run with it adds them to its
    fingerprint, which the ranks compare on the first call of each signature, so a rank whose layer was built
    with other options is named on every rank (``MismatchError``, the options in words) before anything is
    sent. Remembered per (call, options): a layer that configures on every forward pays a dict look-up, and
    its plans are made once."""
    if call is None or config is None:
        return call

    def make() -> Call:
        values = config_values(config[0], config[1])
        return _Configured(call.be, call.spec, call.timeout, call.check, call.reason,
                           getattr(call, "config", ()) + values)

    return _remember((call, config), make)


def _config_of(call: Call) -> list[int]:
    """The layer options ``call`` adds to a fingerprint (none for a plain call)."""
    return list(getattr(call, "config", ()))


def capped(call: Call, rows: int, label: str) -> Call:
    """``call`` with no more slices per shard than the smallest shard has rows along the dim.

    ``ring:m``, ``serial:m`` and ``bidirectional:m`` (m parts of two halves
    each) cut every shard into slices of ``torch.tensor_split`` sizes; past
    one row per slice the rest are empty, and each still costs a step
    (``ring:10000`` on 4-row shards: 10000 slices, seconds per call). So m is
    capped at what gives every slice at least one row (never below 1: a
    one-row shard under ``bidirectional`` keeps an empty half). ``rows`` is the
    smallest shard of the tensor_split layout, the same on every rank, so
    every rank caps alike. Said once per (call, cap) at WARNING on the
    ``commfuse`` logger; the ops' ``report=`` shows the algorithm taken. Every
    plan is made through this (:func:`_gather_plan`, :func:`_scatter_plan`,
    :func:`_a2a_plan`), except an uneven all-to-all's, whose blocks change per
    call and whose empty slices cost no transfer. ``sliced:c`` (the
    data-slicing baseline, one whole collective per chunk) runs as asked.
    """
    spec = call.spec
    parts = spec.parts
    if parts == 1:
        return call
    halves = 2 if spec.name == "bidirectional" else 1
    most = max(1, rows // halves)
    if parts <= most:
        return call

    def make() -> Call:
        new = AlgorithmSpec(spec.name, most, spec.chunks)
        cut = f"{parts} slices" if halves == 1 else f"{parts} parts of {halves} halves"
        why = (f"algorithm {spec.shown!r} would cut shards of {rows} rows (the smallest shard of the layout) into "
               f"{cut}, {'some' if parts * halves < 2 * rows else 'most'} of them empty: capped to {new.shown!r} "
               "(at least one row per slice), alike on every rank")
        log.warning("rank %d: %s: %s", call.rank, label, why)
        return _derive(call, new, f"{call.reason}; {why}")

    return _remember((call, "capped", most), make)


def _new_plan(call: Call, collective: Collective, label: str) -> Plan:
    spec = call.spec
    schedule = schedule_for(collective, call.be.world_size, spec)
    return Plan(schedule, call.be, label=label, timeout=call.timeout, check=call.check, overlap=spec.overlap,
                compiled=compiled_for(schedule, call.be.rank))


# -- span helpers (shared by the ops, their backward passes and the layers) ------------------------------------


def join(spans, dim: int, pick=lambda span: span[2]) -> torch.Tensor:
    """The spans' tensors concatenated along ``dim`` (no copy for one span)."""
    return pick(spans[0]) if len(spans) == 1 else torch.cat([pick(span) for span in spans], dim=dim)


def consecutive(spans) -> bool:
    return all(spans[i][0] + spans[i][1] == spans[i + 1][0] for i in range(len(spans) - 1))


def rows_of(t: torch.Tensor, spans, dim: int) -> torch.Tensor:
    """The rows of ``t`` along ``dim`` that ``spans`` cover, in span order."""
    if len(spans) == 1 or consecutive(spans):
        return t.narrow(dim, spans[0][0], sum(span[1] for span in spans))
    return torch.cat([t.narrow(dim, span[0], span[1]) for span in spans], dim=dim)


def write_rows(out: torch.Tensor, spans, dim: int, value: torch.Tensor) -> None:
    """Write ``value`` (the spans' rows, concatenated along ``dim``) into ``out``."""
    if len(spans) == 1 or consecutive(spans):
        out.narrow(dim, spans[0][0], value.shape[dim]).copy_(value)
        return
    for (start, size, *_), part in zip(spans, torch.split(value, [span[1] for span in spans], dim=dim)):
        out.narrow(dim, start, size).copy_(part)


def matmul_rows(out: torch.Tensor, spans, dim: int, a: torch.Tensor, b: torch.Tensor, direct: bool = False) -> None:
    """``out[rows of spans] = a @ b``, straight into ``out`` when the rows are one contiguous block
    (``direct``: the caller knows every block of rows along ``dim`` of ``out`` is contiguous)."""
    if len(spans) == 1 or consecutive(spans):
        region = out.narrow(dim, spans[0][0], a.shape[dim])
        if direct or region.is_contiguous():
            torch.matmul(a, b, out=region)
            return
    write_rows(out, spans, dim, torch.matmul(a, b))


# -- gather / scatter by spans ---------------------------------------------------------------------------------


def _gather_plan(call: Call, shape, dtype, dim: int, sizes: tuple, label: str, meta) -> tuple:
    def make():
        plan = _new_plan(capped(call, min(sizes), label), Collective.ALL_GATHER, label)
        layout = GatherLayout(plan.compiled, sizes, dim, shape, dtype)
        layout.meta = (meta() if callable(meta) else list(meta)) + _config_of(call)
        return plan, layout, BufferPool.of(call.be)

    return _plan_for(("gather", call, label, shape, dtype, dim, sizes), make)


class SignaturePlan:
    """What :func:`prepare_gather` or :func:`prepare_scatter` found for one call signature: the runtime's
    ``plan``, the program's ``layout``, the backend's receive-buffer ``pool`` and the ``dim`` the shards
    are cut along. Callers keep it and run calls on it with no look-up."""

    __slots__ = ("plan", "layout", "pool", "dim")

    def __init__(self, plan: Plan, layout, pool: BufferPool, dim: int) -> None:
        self.plan, self.layout, self.pool, self.dim = plan, layout, pool, dim


def prepare_gather(call: Call, shape, dtype, dim: int, sizes: tuple, label: str, meta) -> SignaturePlan:
    """The plan of a :func:`gather_spans` signature, for callers that keep it (see :func:`run_gather`)."""
    plan, layout, pool = _gather_plan(call, shape, dtype, dim, sizes, label, meta)
    return SignaturePlan(plan, layout, pool, dim)


def run_gather(planned: SignaturePlan, shard: torch.Tensor, consume, keep: bool = False,
               consume_one=None) -> None:
    """:func:`gather_spans` on a plan from :func:`prepare_gather` (no look-up). ``consume_one(start, size,
    tensor)``, when given, takes the steps that compute on one slice (every ring step) without a list."""
    plan, layout, pool, dim = planned.plan, planned.layout, planned.pool, planned.dim
    start, size = layout.start, layout.size
    if consume_one is not None and not keep and plan.one_by_one and may_skip_program(plan):
        run_gather_one_by_one(planned, shard, consume_one)
        return

    # on_step must not refer to the program (a reference cycle per call would leave the collection of
    # every call's tensors to the garbage collector's passes, which cost more than the call itself)
    def on_step(slots, tensors):
        if type(tensors) is list:
            if consume_one is not None and len(slots) == 1:
                s = slots[0]
                consume_one(start[s], size[s], tensors[0])
            elif len(slots) == 1:
                s = slots[0]
                consume([(start[s], size[s], tensors[0])])
            else:
                consume([(start[s], size[s], t) for s, t in zip(slots, tensors)])
        else:  # every shard, gathered rank by rank into one tensor (n * rows, ...): the gathered tensor itself
            whole = tensors  # when gathering dim 0
            if dim == 0:
                consume([(0, layout.total, whole)])
            else:
                per_rank = whole.view(layout.stacked)
                consume([(start[s], size[s], per_rank[q]) for q, s in enumerate(slots)])

    if plan.whole is not None and layout.into and pool.into and may_skip_program(plan):
        # vanilla, signature agreed: the collective straight into one tensor, then the one compute on it
        whole = pool.get(layout.whole_key)
        execute_into(plan, shard if shard.is_contiguous() else shard.contiguous(), whole)
        on_step(plan.whole_compute, whole)
        if not keep:
            pool.put(whole, layout.whole_key)
        return
    program = GatherProgram(layout, pool, shard, on_step, keep=keep, meta=layout.meta, whole_ok=True)
    execute(plan, program)


def run_gather_one_by_one(planned: SignaturePlan, shard: torch.Tensor, on_slice) -> None:
    """A call of a ring plan from :func:`prepare_gather` (``plan.one_by_one``; the caller has seen
    ``may_skip_program(plan)``), its steps walked with no program: ``on_slice(start, size, tensor)`` for
    each slice, this rank's first; it returns None."""
    plan, layout = planned.plan, planned.layout
    walk = layout.walk
    if walk is None:
        walk = layout.walk = ring_walk(plan, layout.start, layout.size, layout.key, layout.own_set)
    execute_one_by_one(plan, walk, held_slots(layout, shard), on_slice, planned.pool)


def gather_walk(planned: SignaturePlan) -> tuple:
    """The walk :func:`run_gather_one_by_one` takes on a ring plan from :func:`prepare_gather`, made now (at
    planning, for a caller that walks the plan on every call) and kept on its layout."""
    layout = planned.layout
    if layout.walk is None:
        layout.walk = ring_walk(planned.plan, layout.start, layout.size, layout.key, layout.own_set)
    return layout.walk


def gather_spans(call: Call, shard: torch.Tensor, dim: int, sizes: Sequence[int],
                 consume: Callable[[list[tuple[int, int, torch.Tensor]]], None], *, label: str, meta,
                 keep: bool = False) -> None:
    """All-gather ``shard`` along ``dim`` and call ``consume(spans)`` once per step.

    ``spans`` lists ``(start, size, tensor)`` of the slices the step computes
    on, sorted by ``start`` (their offset along ``dim`` of the gathered
    tensor). Ranks' shards have ``sizes`` along ``dim``. ``consume`` must not
    keep the tensors unless ``keep``. ``meta`` (a list of ints, or a function
    making one on the first call) goes into the fingerprint; ``label`` names
    the op and how its fingerprint reads back (``register_format``).
    """
    run_gather(prepare_gather(call, shard.shape, shard.dtype, dim, tuple(sizes), label, meta), shard, consume, keep)


def _scatter_plan(call: Call, shape, dim: int, dtype, label: str, meta, *, whole: bool = True) -> tuple:
    """``shape`` is the whole tensor's (split over the ranks along ``dim``), or with ``whole=False`` one
    rank's shard (every shard alike)."""
    def make():
        n = call.be.world_size
        sizes = split_sizes(shape[dim], n) if whole else [shape[dim]] * n
        plan = _new_plan(capped(call, min(sizes), label), Collective.REDUCE_SCATTER, label)
        layout = ScatterLayout(plan.compiled, sizes, dim, shape, dtype)
        layout.meta = (meta() if callable(meta) else list(meta)) + _config_of(call)
        return plan, layout, BufferPool.of(call.be)

    return _plan_for(("scatter", call, label, tuple(shape), dim, dtype, whole), make)


def scatter_spans(call: Call, out_shape: Sequence[int], dim: int, dtype: torch.dtype,
                  produce: Callable[[list[tuple[int, int]]], list[torch.Tensor]], *, label: str, meta,
                  inplace: bool = True, check_shapes: bool = False) -> torch.Tensor:
    """Reduce-scatter partials of a tensor of ``out_shape`` along ``dim``; return this rank's summed shard.

    ``produce(spans)`` gets the ``(start, size)`` ranges along ``dim`` that a
    step computes and returns this rank's partial for each (fresh tensors when
    ``inplace``, which lets the running sums be added into them).
    """
    return run_scatter(prepare_scatter(call, out_shape, dim, dtype, label, meta), produce, inplace, check_shapes)


def prepare_scatter(call: Call, out_shape: Sequence[int], dim: int, dtype: torch.dtype, label: str,
                    meta) -> SignaturePlan:
    """The plan of a :func:`scatter_spans` signature, for callers that keep it (see :func:`run_scatter`)."""
    plan, layout, pool = _scatter_plan(call, tuple(out_shape), dim, dtype, label, meta)
    return SignaturePlan(plan, layout, pool, dim)


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


# -- consume / produce forms -----------------------------------------------------------------------------------


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

    def __call__(self, tensor: torch.Tensor, source: int, *more) -> Any:
        return self.consumer(tensor, source, *more)


def _identity(tensor: torch.Tensor, source: int) -> torch.Tensor:
    return tensor


#: The consumer that only collects what arrives: results are the shards
#: themselves, in ``comm_only`` runs too (collecting is not compute).
collect = StandIn(_identity, _identity)


class _Assembler:
    """Calls ``consumer(shard, source)`` once per shard, once all of its slices are there."""

    def __init__(self, layout, consumer: Callable, n: int, owners: Sequence[int], pieces: int) -> None:
        self.layout, self.consumer, self.owners, self.pieces = layout, consumer, owners, pieces
        self.pending: dict[int, dict[int, torch.Tensor]] = {}
        self.results: list[Any] = [None] * n

    def __call__(self, slots, tensors) -> None:
        self._feed(slots, tensors, self.consumer)

    def skip(self, slots, tensors) -> None:
        """The ``comm_only`` stand-in for ``__call__``: the consumer's stand-in, if it has one, else nothing."""
        stand_in = getattr(self.consumer, "stand_in", None)
        if stand_in is not None:
            self._feed(slots, tensors, stand_in)

    def _feed(self, slots, tensors, consumer: Callable) -> None:
        owners = self.owners
        if self.pieces == 1:
            for s, t in zip(slots, tensors):
                self.results[owners[s]] = consumer(t, owners[s])
            return
        piece = self.layout.piece
        for s, t in zip(slots, tensors):
            source = owners[s]
            got = self.pending.setdefault(source, {})
            got[piece[s]] = t
            if len(got) == self.pieces:
                whole = torch.cat([got[i] for i in range(self.pieces)], dim=self.layout.dim)
                del self.pending[source]
                self.results[source] = consumer(whole, source)


def _shards_meta(t: torch.Tensor, dim: int):
    return lambda: [dtype_code(t.dtype), dim, t.ndim, *t.shape]


def all_gather_consume_core(call: Call, shard: torch.Tensor, consumer: Callable, dim: int, *, keep: bool = True,
                            label: str = "all_gather_consume", private: bool = False,
                            by_slice: bool = False) -> list[Any] | None:
    """``commfuse.all_gather_consume`` on a resolved ``call``; ``keep=False`` lets buffers be reused (the
    consumer then must not keep what it is given). ``by_slice`` (the library's own consumers):
    ``consumer(slice, source, start)`` runs on each slice as it arrives (:class:`_BySlice`), and
    nothing is returned.

    ``private`` (the public op sets it; the library's own consumers, which
    never write to what they are given, do not) hands the consumer tensors
    that are its own: a copy of a slice that a transfer of the same step or a
    later one still reads (the ring forwards what it computes on) or that is
    the caller's ``shard``, nothing else (see :func:`_handed_over`). The
    consumer may then change them in place.
    """
    n = call.be.world_size
    plan, layout, pool = _gather_plan(call, shard.shape, shard.dtype, dim, (shard.shape[dim],) * n, label,
                                      _shards_meta(shard, dim))
    pieces = plan.schedule.pieces
    if by_slice:  # each slice as it arrives: under ring:m its compute runs while the next slice flies
        execute(plan, GatherProgram(layout, pool, shard, _BySlice(layout, consumer, layout.shard), keep=keep,
                                    meta=layout.meta))
        return None
    assembler = _Assembler(layout, consumer, n, layout.shard, pieces)
    consume = assembler
    if private and pieces == 1:  # several slices: the assembler joins them with torch.cat, already fresh
        # a whole collective into one tensor (vanilla) leaves views of that tensor in place of the caller's shard
        copied = layout.private
        if copied is None:
            into = layout.into and pool.into
            copied = layout.private = _handed_over(plan.compiled, () if into else layout.own, plan.overlap)
        consume = _Private.around(assembler, copied)
    # with several slices per shard the assembler holds early slices until the last one arrives
    execute(plan, GatherProgram(layout, pool, shard, consume, keep=keep or pieces > 1, meta=layout.meta))
    return assembler.results


def _handed_over(compiled: Compiled, inputs: tuple[int, ...], overlap: bool) -> frozenset[int]:
    """The slots whose tensor a user's consumer gets a private copy of, from one plan's compiled steps (once
    per plan, kept in its layout): those that a transfer reads in a later step, or in the same step when the
    compute runs while it flies (``overlap``), and ``inputs``, the slots that hold the caller's own tensors
    when computed on.

    A received slice that no later transfer reads (the last step of a ring, every chunk of the pairwise
    all-to-all) is handed over as it is."""
    schedule = compiled.schedule
    rank, slot, n = compiled.rank, compiled.slot, schedule.world_size
    read: dict[int, int] = {}  # slot -> the last step whose transfers read it
    for st in compiled.steps:
        for _, s in st.sends:
            read[s] = st.index
        for whole in st.collectives:  # what this rank puts into the whole collective
            if schedule.collective.blocks:
                out = [SliceId(d, whole.part, 0, rank) for d in range(n)]
            else:
                out = [SliceId(rank, whole.part, h) for h in range(schedule.halves)]
            for x in out:
                if x in slot:
                    read[slot[x]] = st.index
    copies = set(inputs)
    for st in compiled.steps:
        for s in st.compute:
            last = read.get(s, -1)
            if last > st.index or (overlap and last == st.index):
                copies.add(s)
    return frozenset(copies)


class _Private:
    """A program's ``consume(slots, tensors)`` that hands the slots in ``copies`` over as copies."""

    __slots__ = ("consume", "copies")

    def __init__(self, consume: Callable, copies: frozenset[int]) -> None:
        self.consume, self.copies = consume, copies

    @classmethod
    def around(cls, consume: Callable, copies: frozenset[int]) -> Callable:
        return cls(consume, copies) if copies else consume

    def _own(self, slots, tensors) -> list[torch.Tensor]:
        copies = self.copies
        return [t.clone() if s in copies else t for s, t in zip(slots, tensors)]

    def __call__(self, slots, tensors) -> None:
        self.consume(slots, self._own(slots, tensors))

    def skip(self, slots, tensors) -> None:
        skip = getattr(self.consume, "skip", None)
        if skip is not None:
            skip(slots, self._own(slots, tensors))


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


def _a2a_plan(call: Call, collective: Collective, label: str, shape, dtype, dim: int, uneven: bool, meta):
    """The plan of an all-to-all signature, and (even blocks) its layout. An uneven signature leaves the
    rows along ``dim`` out of its key and fingerprint: they differ per rank and per call (the layout is made
    per call, :func:`a2a_layout`); ``meta`` (ints, or None for the blocks' dtype and shape) is the
    fingerprint's op-specific part."""
    key_shape = _shape_less(shape, dim) if uneven else tuple(shape)

    def make():
        plan = _new_plan(call if uneven else capped(call, shape[dim], label), collective, label)
        layout = None if uneven else AllToAllLayout(plan.compiled, dim, shape, dtype)
        values = list(meta) if meta is not None else [dtype_code(dtype), dim, len(shape), *key_shape]
        return plan, layout, BufferPool.of(call.be), values + _config_of(call)

    return _plan_for(("a2a", collective, call, label, key_shape, dtype, dim, uneven,
                      None if meta is None else tuple(meta)), make)


def _shape_less(shape, dim: int) -> tuple:
    """``shape`` with the size along ``dim`` written -1 (an uneven all-to-all's signature)."""
    out = list(shape)
    out[dim] = -1
    return tuple(out)


def _refuse_traced_uneven(be, label: str) -> None:
    """An uneven all-to-all's sizes change every call; a traced backend's graph has fixed shapes."""
    if getattr(getattr(be, "capabilities", None), "execution", "eager") == "traced":
        raise CommfuseValueError(
            f"rank {be.rank}: {label} is an uneven all-to-all, whose sizes change every call; the "
            f"{getattr(be, 'name', 'traced')} backend traces a graph of fixed shapes: pad every block to "
            "one capacity and call the even form"
        )


def a2a_layout(plan: Plan, dim: int, shape, dtype, send_sizes, recv_sizes) -> AllToAllLayout:
    """One uneven call's layout (every slice's size), on its plan's compiled steps."""
    if plan.traced:
        _refuse_traced_uneven(plan.backend, plan.label)
    return AllToAllLayout(plan.compiled, dim, shape, dtype, send_sizes, recv_sizes)


class _BySlice:
    """Calls ``consumer(slice, source, start)`` for every slice as it arrives, never joining a block's slices
    (``start``: its first row within the source's block or shard; ``owners``: each slot's source, the
    all-to-all's ``layout.source`` or the all-gather's ``layout.shard``); in ``comm_only`` runs its
    ``stand_in``, if it has one."""

    def __init__(self, layout, consumer: Callable, owners: Sequence[int]) -> None:
        self.layout, self.consumer, self.owners = layout, consumer, owners

    def __call__(self, slots, tensors, consumer=None) -> None:
        owners, offset = self.owners, self.layout.offset
        consumer = consumer or self.consumer
        for s, t in zip(slots, tensors):
            consumer(t, owners[s], offset[s])

    def skip(self, slots, tensors) -> None:
        stand_in = getattr(self.consumer, "stand_in", None)
        if stand_in is not None:
            self(slots, tensors, stand_in)


def all_to_all_consume_core(call: Call, chunks: Sequence[torch.Tensor], consumer: Callable, dim: int, *,
                            recv_sizes: Sequence[int] | None = None, label: str = "all_to_all_consume",
                            meta: Sequence[int] | None = None, by_slice: bool = False,
                            private: bool = False) -> list[Any]:
    """``commfuse.all_to_all_consume`` on a resolved ``call``.

    Even (``recv_sizes`` None): every rank's chunks have one shape. Uneven:
    ``chunks[d]`` has its own rows along ``dim`` and the chunk from rank q
    ``recv_sizes[q]`` (see :func:`exchange_sizes`); the consumer gets empty
    tensors for empty chunks, which cost no transfer. ``private`` (the public
    op's, as for :func:`all_gather_consume_core`): the consumer gets a copy of
    this rank's own chunk (the caller's tensor) when it would get that chunk
    itself; chunks that arrived are never sent on, and are handed over as
    they are.
    """
    first = chunks[0]
    uneven = recv_sizes is not None
    plan, layout, pool, values = _a2a_plan(call, Collective.ALL_TO_ALL, label, first.shape, first.dtype, dim,
                                           uneven, meta)
    if uneven:
        layout = a2a_layout(plan, dim, first.shape, first.dtype, [c.shape[dim] for c in chunks], recv_sizes)
    if by_slice:
        execute(plan, AllToAllProgram(layout, pool, chunks, _BySlice(layout, consumer, layout.source), keep=True,
                                      meta=values))
        return None
    pieces = plan.schedule.pieces
    assembler = _Assembler(layout, consumer, call.be.world_size, layout.source, pieces)
    consume = assembler
    if private and pieces == 1:  # several slices: the assembler joins them with torch.cat, already fresh
        consume = _Private.around(assembler, _handed_over(plan.compiled, layout.outgoing[plan.rank], plan.overlap))
    execute(plan, AllToAllProgram(layout, pool, chunks, consume, keep=True, meta=values))
    return assembler.results


def produce_all_to_all_core(call: Call, producer: Callable[[int], torch.Tensor], dim: int, *,
                            recv_sizes: Sequence[int] | None = None, send_sizes: Sequence[int] | None = None,
                            label: str = "produce_all_to_all", meta: Sequence[int] | None = None,
                            first: torch.Tensor | None = None, like: torch.Tensor | None = None,
                            by_slice: bool = False) -> list[torch.Tensor]:
    """``commfuse.produce_all_to_all`` on a resolved ``call``: every rank's block for this rank, by source.

    The block for the ring's first destination (rank + 1) is made before the
    steps start: its dtype and its other dims are every block's. Even
    (``recv_sizes`` None): its shape is every block's. Uneven: the block from
    rank q has ``recv_sizes[q]`` rows along ``dim``; this rank's block for d
    ``send_sizes[d]`` (when not given, the rows each ``producer(d)`` returns,
    which then must all be made before the first transfer: give them to keep
    the overlap). ``first``: the block for rank + 1, made already. ``like``
    (uneven, with ``send_sizes``): a tensor with the blocks' dtype and other
    dims, so that no block is made before the steps start. ``by_slice``
    (with ``like`` and both sizes): ``producer(d, start, rows)`` makes each
    slice of the block for d in the step that the schedule says.
    """
    rank, n = call.be.rank, call.be.world_size
    first_dest = (rank + 1) % n
    # the call's number first: a producer that raises on the block it makes first (which fixes the call's
    # layout) leaves this call on every peer's board, never an unnumbered gap (admission.Ticket)
    with enter_call(call.be, label) as ticket:
        if like is not None and recv_sizes is not None and send_sizes is not None:
            made, first = {}, like
        else:
            made = {first_dest: producer(first_dest) if first is None else first}
            first = made[first_dest]
        if not isinstance(first, torch.Tensor):
            raise CommfuseTypeError(f"rank {rank}: producer({first_dest}) must return a torch.Tensor, "
                                    f"got {type(first).__name__}")
        if first.ndim == 0:
            raise CommfuseValueError(f"rank {rank}: producer({first_dest}) returned a 0-d tensor; blocks need a dim")
        if not -first.ndim <= dim < first.ndim:
            raise CommfuseValueError(f"dim={dim} is out of range for blocks of shape {list(first.shape)}")
        dim %= first.ndim
        uneven = recv_sizes is not None
        plan, layout, pool, values = _a2a_plan(call, Collective.PRODUCE_ALL_TO_ALL, label, first.shape,
                                               first.dtype, dim, uneven, meta)
        if uneven:
            if send_sizes is None:
                for d in range(n):
                    if d not in made:
                        made[d] = producer(d)
                send_sizes = [made[d].shape[dim] if isinstance(made[d], torch.Tensor) else -1 for d in range(n)]
            layout = a2a_layout(plan, dim, first.shape, first.dtype, send_sizes, recv_sizes)
        program = ProduceAllToAllProgram(layout, pool, producer, meta=values, made=made, by_slice=by_slice)
        execute(plan, program, ticket=ticket)
    return program.result()


def all_reduce_core(call: Call, t: torch.Tensor, *, label: str = "all_reduce") -> torch.Tensor:
    """The sum of ``t`` over the group's ranks, as two calls through the runtime: a reduce-scatter of its flat
    pieces, then an all-gather of the sums (``call``'s algorithm, ``vanilla`` for two whole collectives). So an
    all-reduce a layer needs (a replicated parameter's gradient) is numbered, bounded by commfuse's timeout,
    interruptible, and told to every rank like any call, never a raw collective bounded only by the group's
    own timeout."""
    n = call.be.world_size
    flat = t.reshape(-1)
    k = -(-flat.numel() // n) or 1
    if flat.numel() != n * k:
        flat = torch.cat([flat, flat.new_zeros(n * k - flat.numel())])
    pieces = flat.view(n, k)
    mine = produce_reduce_scatter_core(call, lambda d: pieces[d].clone(), 0, label=f"{label}.reduce", inplace=True)
    whole = all_gather_consume_core(call, mine, collect, 0, label=f"{label}.gather")
    return torch.cat(whole)[: t.numel()].view(t.shape)


def group_sum(t: torch.Tensor, group, *, label: str = "all_reduce") -> torch.Tensor:
    """``t`` summed over ``group``'s ranks by :func:`all_reduce_core` on the group's ``vanilla`` call (two whole
    collectives through the runtime: numbered, bounded by commfuse's timeout, told to every rank); a copy of
    ``t`` where the group has no call to make (one rank)."""
    call = resolve_call(Collective.REDUCE_SCATTER, "vanilla", group=group, device=t.device)
    if call is None:
        return t.clone()
    return all_reduce_core(call, t.contiguous(), label=label)


def exchange_sizes(call: Call, counts: torch.Tensor, *, label: str = "all_to_all.sizes",
                   meta: Sequence[int] | None = None) -> torch.Tensor:
    """Every rank's ``counts[d]`` for this rank, by source: ``counts`` is an integer tensor (n, k) of what
    this rank sends each rank (rows, or rows per expert); returns (n, k), row q what rank q sends here.

    One small whole all-to-all (``vanilla``, whatever the data's algorithm), through the runtime like any
    call: bounded, numbered, and checked once per signature, so ranks that disagree on ``k`` or on ``meta``
    (an MoE layer's expert count and sizes) are named on every rank before anything is sent. It runs in
    ``compute_only`` measurements too: the sizes are what the data's buffers are made of.
    """
    n = call.be.world_size
    _refuse_traced_uneven(call.be, label.rsplit(".", 1)[0])  # before any size travels
    if counts.ndim != 2 or counts.shape[0] != n:
        raise CommfuseValueError(f"rank {call.be.rank}: counts must be (world size {n}, k), got {list(counts.shape)}")
    sizes_call = call.vanilla()
    chunks = list(counts.to(torch.int64).unbind(0))
    with unmeasured():
        got = all_to_all_consume_core(sizes_call, chunks, collect, 0, label=label,
                                      meta=None if meta is None else [counts.shape[1], *meta])
    return torch.stack(got)


# -- how the internal ops' fingerprints read back ---------------------------------------------------------------


def gather_matmul_meta(a: torch.Tensor, bs, gd: int, total: int):
    """The fingerprint integers of an all-gather + matmul (of ``a`` gathered along ``gd`` to ``total`` rows,
    times each of ``bs``), as :func:`_describe_gather_matmul` reads them back: a function of no argument, as
    the ``meta`` of :func:`prepare_gather` and :func:`gather_spans`, called only when a signature is first
    planned (a repeated call's backward ring finds its plan and builds nothing)."""
    def meta():
        full = list(a.shape)
        full[gd] = total
        return [dtype_code(a.dtype), gd, a.ndim, *full, len(bs)] + [d for bi in bs for d in bi.shape]

    return meta


def _describe_gather_matmul(v):
    ndim = v[2]
    shape, rest = v[3 : 3 + ndim], v[3 + ndim :]
    ws = [rest[1 + 2 * i : 3 + 2 * i] for i in range(rest[0])] if rest else []
    return f"a gathered along dim {v[1]} to {shape_text(v[0], shape)} times weights {ws}"


def _describe_matmul_scatter(v):
    ndim = v[2]
    return f"a {shape_text(v[0], v[3 : 3 + ndim])} times b {v[3 + ndim :]} scattered along dim {v[1]}"


def _describe_dgrad(v):
    return f"dgrad of {shape_text(v[0], v[2:])} along dim {v[1]}"


for _label in ("all_gather_matmul", "all_gather_matmul.wgrad", "matmul_reduce_scatter.dgrad"):
    register_described(_label, _describe_gather_matmul)
register_described("matmul_reduce_scatter", _describe_matmul_scatter)
register_described("all_gather_matmul.dgrad", _describe_dgrad)
register_described("all_to_all.sizes", lambda v: f"{v[3]} row counts per rank")
