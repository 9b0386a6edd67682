"""The all-to-all with the caller's compute on each arriving chunk, and its produce form.

* :func:`all_to_all_consume_core` (``commfuse.all_to_all_consume``, Ulysses, MoE): this rank's chunk for
  every rank sent, ``consumer(chunk, source)`` on each chunk that arrives; even (one shape) or uneven
  (rows per peer, the layout made per call by :func:`a2a_layout`).
* :func:`produce_all_to_all_core` (``commfuse.produce_all_to_all``, MoE's way back): the block for each
  rank made as the step that sends it comes.
* :func:`exchange_sizes`: the rows an uneven call will send, exchanged first by a small all-to-all.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from commfuse.errors import CommfuseTypeError, CommfuseValueError
from commfuse.planning.calls import Call
from commfuse.planning.consumers import Assembler, BySlice, Private, collect, handed_over
from commfuse.planning.derive import capped, config_of
from commfuse.planning.plans import keep_plan, kept_plan, new_plan
from commfuse.runtime.admission import enter_call
from commfuse.runtime.compiled import Plan
from commfuse.runtime.fingerprints import dtype_code
from commfuse.runtime.observe import unmeasured
from commfuse.runtime.programs import AllToAllLayout, AllToAllProgram, BufferPool, ProduceAllToAllProgram
from commfuse.runtime.walks import execute
from commfuse.schedule import Collective

__all__ = ["a2a_layout", "all_to_all_consume_core", "exchange_sizes", "produce_all_to_all_core"]


def _a2a_plan(call: Call, collective: Collective, label: str, shape, dtype, dim: int, uneven: bool, meta):
    """The plan of an all-to-all signature, and (even blocks) its layout. An uneven signature leaves the
    rows along ``dim`` out of its key and fingerprint: they differ per rank and per call (the layout is made
    per call, :func:`a2a_layout`); ``meta`` (ints, or None for the blocks' dtype and shape) is the
    fingerprint's op-specific part."""
    key_shape = _shape_less(shape, dim) if uneven else tuple(shape)
    key = ("a2a", collective, call, label, key_shape, dtype, dim, uneven, None if meta is None else tuple(meta))
    found = kept_plan(key)
    if found is None:
        plan = new_plan(call if uneven else capped(call, shape[dim], label), collective, label)
        layout = None if uneven else AllToAllLayout(plan.compiled, dim, shape, dtype)
        values = list(meta) if meta is not None else [dtype_code(dtype), dim, len(shape), *key_shape]
        found = keep_plan(key, (plan, layout, BufferPool.of(call.be), values + config_of(call)))
    return found


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


def all_to_all_consume_core(call: Call, chunks: Sequence[torch.Tensor], consumer: Callable, dim: int, *,
                            recv_sizes: Sequence[int] | None = None, label: str = "all_to_all_consume",
                            meta: Sequence[int] | None = None, by_slice: bool = False,
                            private: bool = False) -> list[Any]:
    """``commfuse.all_to_all_consume`` on a resolved ``call``.

    Even (``recv_sizes`` None): every rank's chunks have one shape. Uneven:
    ``chunks[d]`` has its own rows along ``dim`` and the chunk from rank q
    ``recv_sizes[q]`` (see :func:`exchange_sizes`); the consumer gets empty
    tensors for empty chunks, which cost no transfer. ``private`` (the public
    op's, as for ``gather.all_gather_consume_core``): the consumer gets a copy of
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
        execute(plan, AllToAllProgram(layout, pool, chunks, BySlice(layout, consumer, layout.source), keep=True,
                                      meta=values))
        return None
    pieces = plan.schedule.pieces
    assembler = Assembler(layout, consumer, call.be.world_size, layout.source, pieces)
    consume = assembler
    if private and pieces == 1:  # several slices: the assembler joins them with torch.cat, already fresh
        consume = Private.around(assembler, handed_over(plan.compiled, layout.outgoing[plan.rank], plan.overlap))
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
