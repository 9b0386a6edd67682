"""Consumers: what a gather's or an all-to-all's program calls as each piece arrives.

A user's consumer takes one whole shard or chunk and its source; the programs hand over slots and
tensors as the steps complete them. Between the two:

* :class:`Assembler` joins a shard's slices and calls the consumer once per shard;
* :class:`BySlice` calls the library's own consumers on every slice as it arrives;
* :class:`Private` hands over copies of the slices a later transfer still reads (:func:`handed_over`
  says which, once per plan), for the public ops whose consumer may write to what it gets;
* :class:`StandIn` gives a consumer its stand-in for ``measure("comm_only")`` runs, and :data:`collect`
  is the consumer that only collects.

Shared by ``planning.gather`` and ``planning.all_to_all``, below both.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from commfuse.runtime.compiled import Compiled
from commfuse.schedule import SliceId

__all__ = ["Assembler", "BySlice", "Private", "StandIn", "collect", "handed_over"]


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


class Assembler:
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


class BySlice:
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


def handed_over(compiled: Compiled, inputs: tuple[int, ...], overlap: bool) -> frozenset[int]:
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


class Private:
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
