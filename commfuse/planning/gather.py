"""The all-gather with the caller's compute on each arriving piece: one gather, entered at four layers.

Its meaning, as the plain code it pipelines (``sizes[q]``: rank q's shard along ``dim``)::

    shards = all_gather(shard)                       # every rank's shard, by rank
    for q in ring order, starting with this rank:    # one step per slice in the pipelined form
        consume(q's rows of the gathered tensor)

From the top down, each entry built on the one below it:

* :func:`all_gather_consume_core` (``commfuse.all_gather_consume``, the layers, the all-reduce):
  ``consumer(shard, source)`` once per whole shard, results returned by source; ``by_slice`` calls the
  library's own consumers on each slice instead. Plans with the table entry :func:`prepare_gather` finds,
  and runs a program with a consumer from ``planning.consumers``.
* :func:`gather_spans` (callers that make one call of a signature now and then): the plan looked up
  (:func:`prepare_gather`) and run (:func:`run_gather`) in one.
* :func:`prepare_gather` then :func:`run_gather` (the fused ops, which keep the
  :class:`~commfuse.planning.plans.SignaturePlan` per signature and run every later call on it with no
  look-up): ``consume(spans)`` once per step, or ``consume_one(start, size, tensor)`` for a step of one
  slice.
* :func:`run_gather_one_by_one` (a ring whose signature the ranks agreed, ``may_skip_program``): the
  steps walked with no program, one call per slice. :func:`run_gather` takes it by itself when it can.

The all-gather matmul's one-weight ring (``commfuse.fused.matmul``) walks ``execute_one_by_one`` itself on
a plan from :func:`prepare_gather`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from commfuse.planning.calls import Call
from commfuse.planning.consumers import Assembler, BySlice, Private, handed_over
from commfuse.planning.derive import capped, config_of
from commfuse.planning.plans import SignaturePlan, keep_plan, kept_plan, new_plan
from commfuse.runtime.fingerprints import dtype_code
from commfuse.runtime.programs import BufferPool, GatherLayout, GatherProgram, held_slots
from commfuse.runtime.walks import execute, execute_into, execute_one_by_one, may_skip_program, ring_walk
from commfuse.schedule import Collective

__all__ = ["all_gather_consume_core", "gather_spans", "gather_walk", "prepare_gather", "run_gather",
           "run_gather_one_by_one"]


def _gather_plan(call: Call, shape, dtype, dim: int, sizes: tuple, label: str, meta) -> tuple:
    key = ("gather", call, label, shape, dtype, dim, sizes)
    found = kept_plan(key)
    if found is None:
        plan = new_plan(capped(call, min(sizes), label), Collective.ALL_GATHER, label)
        layout = GatherLayout(plan.compiled, sizes, dim, shape, dtype)
        layout.meta = (meta() if callable(meta) else list(meta)) + config_of(call)
        found = keep_plan(key, (plan, layout, BufferPool.of(call.be)))
    return found


def prepare_gather(call: Call, shape, dtype, dim: int, sizes: tuple, label: str, meta) -> SignaturePlan:
    """The plan of a :func:`gather_spans` signature, for callers that keep it (see :func:`run_gather`)."""
    plan, layout, pool = _gather_plan(call, shape, dtype, dim, sizes, label, meta)
    return SignaturePlan(plan, layout, pool, dim)


def run_gather_one_by_one(planned: SignaturePlan, shard: torch.Tensor, on_slice) -> None:
    """A call of a ring plan from :func:`prepare_gather` (``plan.one_by_one``; the caller has seen
    ``may_skip_program(plan)``), its steps walked with no program: ``on_slice(start, size, tensor)`` for
    each slice, this rank's first; it returns None."""
    layout = planned.layout
    execute_one_by_one(planned.plan, layout.walk or gather_walk(planned), held_slots(layout, shard), on_slice,
                       planned.pool)


def gather_walk(planned: SignaturePlan) -> tuple:
    """The walk :func:`run_gather_one_by_one` takes on a ring plan from :func:`prepare_gather`, made once and
    kept on its layout; a caller that walks the plan on every call makes it at planning (so that the table's
    estimate of an entry counts it)."""
    layout = planned.layout
    if layout.walk is None:
        layout.walk = ring_walk(planned.plan, layout.start, layout.size, layout.key, layout.own_set)
    return layout.walk


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


def _shards_meta(t: torch.Tensor, dim: int):
    return lambda: [dtype_code(t.dtype), dim, t.ndim, *t.shape]


def all_gather_consume_core(call: Call, shard: torch.Tensor, consumer: Callable, dim: int, *, keep: bool = True,
                            label: str = "all_gather_consume", private: bool = False,
                            by_slice: bool = False) -> list[Any] | None:
    """``commfuse.all_gather_consume`` on a resolved ``call``; ``keep=False`` lets buffers be reused (the
    consumer then must not keep what it is given). ``by_slice`` (the library's own consumers):
    ``consumer(slice, source, start)`` runs on each slice as it arrives (:class:`BySlice`), and
    nothing is returned.

    ``private`` (the public op sets it; the library's own consumers, which
    never write to what they are given, do not) hands the consumer tensors
    that are its own: a copy of a slice that a transfer of the same step or a
    later one still reads (the ring forwards what it computes on) or that is
    the caller's ``shard``, nothing else (see :func:`handed_over`). The
    consumer may then change them in place.
    """
    n = call.be.world_size
    plan, layout, pool = _gather_plan(call, shard.shape, shard.dtype, dim, (shard.shape[dim],) * n, label,
                                      _shards_meta(shard, dim))
    pieces = plan.schedule.pieces
    if by_slice:  # each slice as it arrives: under ring:m its compute runs while the next slice flies
        execute(plan, GatherProgram(layout, pool, shard, BySlice(layout, consumer, layout.shard), keep=keep,
                                    meta=layout.meta))
        return None
    assembler = Assembler(layout, consumer, n, layout.shard, pieces)
    consume = assembler
    if private and pieces == 1:  # several slices: the assembler joins them with torch.cat, already fresh
        # a whole collective into one tensor (vanilla) leaves views of that tensor in place of the caller's shard
        copied = layout.private
        if copied is None:
            into = layout.into and pool.into
            copied = layout.private = handed_over(plan.compiled, () if into else layout.own, plan.overlap)
        consume = Private.around(assembler, copied)
    # with several slices per shard the assembler holds early slices until the last one arrives
    execute(plan, GatherProgram(layout, pool, shard, consume, keep=keep or pieces > 1, meta=layout.meta))
    return assembler.results
